"""The snapshot spool without a server: a COPY written by a thread, read while it grows."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

from lamina.ingest.postgres.spool import CHUNK_BYTES, Spool, SpoolClosedError


class _Cursor:
    def __init__(self, conn: _Conn) -> None:
        self.conn = conn

    def __enter__(self) -> _Cursor:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def copy_expert(self, query: str, f: Any) -> None:
        self.conn.copy(query, f)


class _Conn:
    """Stands in for psycopg2's connection: ``copy`` decides what a COPY writes."""

    def __init__(self, copy: Callable[[str, Any], None]) -> None:
        self.copy = copy
        self.cancelled = threading.Event()
        self.committed = False
        self.closed = False

    def cursor(self) -> _Cursor:
        return _Cursor(self)

    def cancel(self) -> None:
        self.cancelled.set()

    def commit(self) -> None:
        self.committed = True

    def close(self) -> None:
        self.closed = True


def _rows(first: int, n: int) -> bytes:
    return b"".join(b'%d,"line\nbreak ""%d""",%s\n' % (i, i, b"x" * 40) for i in
                    range(first, first + n))


def test_reader_sees_the_copy_as_it_grows_and_the_end_only_when_done() -> None:
    gate = threading.Event()
    first = _rows(0, 30_000)  # more than one chunk

    def copy(query: str, f: Any) -> None:
        for i in range(0, len(first), 1000):  # psycopg2 writes row by row
            f.write(first[i:i + 1000])
        gate.wait(10)
        f.write(b"tail,\n")

    conn = _Conn(copy)
    spool = Spool(conn, [("t", "COPY t")])
    spool.start()
    try:
        assert spool.wait_started("t")
        r = spool.reader("t")
        got = r.read(CHUNK_BYTES // 2)  # a chunk is published long before the gate opens
        assert got == first[:CHUNK_BYTES // 2]
        waiting: list[bytes] = []
        t = threading.Thread(target=lambda: waiting.append(r.read(len(first))))
        t.start()
        t.join(0.3)
        assert t.is_alive()  # waits for the bytes asked for, never a short end of file
        gate.set()
        t.join(10)
        rest = waiting[0] + r.read(-1)
        assert got + rest == first + b"tail,\n"
        assert r.read(10) == b""
        spool.finish()
        assert conn.committed
        assert conn.closed
    finally:
        gate.set()
        spool.close()


def test_pyarrow_parses_a_growing_spool_across_blocks() -> None:
    data = _rows(0, 50_000)

    def copy(query: str, f: Any) -> None:
        for i in range(0, len(data), 777):
            f.write(data[i:i + 777])

    spool = Spool(_Conn(copy), [("t", "COPY t")])
    spool.start()
    try:
        assert spool.wait_started("t")
        reader = pacsv.open_csv(
            spool.reader("t"),
            read_options=pacsv.ReadOptions(column_names=["a", "b", "c"], block_size=1 << 18),
            parse_options=pacsv.ParseOptions(newlines_in_values=True),
            convert_options=pacsv.ConvertOptions(column_types={"a": pa.int64()}))
        table = pa.Table.from_batches(list(reader))
        assert table.column("a").to_pylist() == list(range(50_000))
        assert table.column("b")[49_999].as_py() == 'line\nbreak "49999"'
        spool.finish()
    finally:
        spool.close()


def test_a_failed_copy_is_raised_never_read_as_a_short_table() -> None:
    class Lost(Exception):
        pass

    a_read = threading.Event()

    def copy(query: str, f: Any) -> None:
        if query == "COPY b":
            f.write(b"1,partial")
            f.flush()
            a_read.wait(10)
            raise Lost("server closed the connection")
        f.write(b"1,a\n")

    conn = _Conn(copy)
    spool = Spool(conn, [("a", "COPY a"), ("b", "COPY b"), ("c", "COPY c")])
    spool.start()
    try:
        a = spool.reader("a")
        assert spool.wait_started("a")
        assert a.read(-1) == b"1,a\n"
        a_read.set()
        b = spool.reader("b")
        with pytest.raises(Lost):
            b.read(1 << 20)  # 9 bytes are there, but the table is not done: the error
        with pytest.raises(Lost):
            spool.wait_started("c")
        with pytest.raises(Lost):
            spool.finish()
        assert conn.closed
        assert not conn.committed
    finally:
        spool.close()


def test_an_empty_table_holds_nothing() -> None:
    spool = Spool(_Conn(lambda q, f: None), [("t", "COPY t")])
    spool.start()
    assert not spool.wait_started("t")
    spool.finish()
    spool.close()


def test_close_cancels_a_running_copy_and_stops_readers() -> None:
    started = threading.Event()

    def copy(query: str, f: Any) -> None:
        f.write(b"1,a\n" * 100)
        f.flush()
        started.set()
        if not conn.cancelled.wait(10):
            raise AssertionError("never cancelled")
        raise RuntimeError("canceling statement due to user request")

    conn = _Conn(copy)
    spool = Spool(conn, [("t", "COPY t")])
    spool.start()
    assert started.wait(10)
    r = spool.reader("t")
    errors: list[BaseException] = []

    def read() -> None:
        try:
            r.read(1 << 20)
        except BaseException as e:  # what the reader saw
            errors.append(e)

    t = threading.Thread(target=read)
    t.start()
    spool.close()
    t.join(10)
    assert conn.cancelled.is_set()
    assert conn.closed
    assert len(errors) == 1
    assert isinstance(errors[0], SpoolClosedError | RuntimeError)
    with pytest.raises((SpoolClosedError, RuntimeError)):
        r.read(10)  # never a read of the closed file
