"""The snapshot spool: the exported snapshot's ``COPY`` of each table, written to a
temporary file by a thread of its own and read while it grows.

The server's ``COPY`` and lamina's parsing of it overlap (two cores: the backend producing
the rows, this process parsing the ones already spooled), yet the server never waits for
lamina: the snapshot transaction lasts as long as the ``COPY`` alone, not as long as
lamina takes to parse and write the rows (a pipe would hold the transaction, and with it
the server's xmin horizon, open at lamina's pace), and memory stays bounded whatever the
size of the tables.

Layout: one unlinked temporary file (``tempfile.TemporaryFile`` in ``spool_dir``) per
table, holding exactly the bytes of ``COPY (SELECT ...) TO STDOUT WITH (FORMAT csv)``, in
the order the tables are given. The tables are copied one after the other in the one
transaction that imported the snapshot, which is committed (read-only) and its connection
closed once the last ``COPY`` returned.

Invariants:

- The writer appends whole chunks (``CHUNK_BYTES``, gathered by an ``io.BufferedWriter``
  from psycopg2's row-by-row writes) and publishes ``written`` once a write returned: the
  bytes below ``written`` are in the file and never change. A reader ``pread``\\ s them at
  a position of its own (the writer's file offset is never moved by it).
- ``done`` is set once a table's ``COPY`` returned and its last byte is published. A reader
  asking for ``n`` bytes waits until ``n`` are published or the table is done (so parsed
  blocks are full-sized); end of file is returned only for a done table.
- A failed ``COPY`` (lost connection, cancel, a full disk) sets ``error``: every waiting or
  later read raises it, never an end of file, so a cut ``COPY`` never reads as a short
  table.
- A table whose reader stops early (a stalled table) is still copied to its end: the
  ``COPY``\\ s of the tables after it run in the same transaction, so it is not cut short.
- A file is closed only under the lock, once no read can touch it: by :meth:`Spool.close`
  after the thread ended (or by the thread as it ends, if ``close`` gave up waiting), or by
  its reader once the table is done and read to its end.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import structlog

__all__ = ["CHUNK_BYTES", "Spool", "SpoolClosedError", "SpoolReader"]

log = structlog.get_logger(__name__)

CHUNK_BYTES: Final = 1 << 20
"""What the writer gathers before a write to the file (and a wake-up of the reader)."""

JOIN_SECONDS: Final = 30.0
"""How long :meth:`Spool.close` waits for a cancelled ``COPY`` to return."""


@dataclass(eq=False)
class _Table:
    key: str
    query: str
    file: Any  # an unbuffered tempfile (io.FileIO)
    written: int = 0
    done: bool = False
    closed: bool = False


class _Chunks(io.RawIOBase):
    """The raw file under the writer's ``BufferedWriter``: each write publishes bytes."""

    def __init__(self, spool: Spool, table: _Table) -> None:
        super().__init__()
        self._spool = spool
        self._table = table
        self.discard = False
        """Set once the ``COPY`` returned: a failed one's buffered rest is dropped, not
        written by the ``BufferedWriter``'s finaliser."""

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if self.discard:
            return len(view)
        fd = self._table.file.fileno()
        n = 0
        while n < len(view):
            n += os.write(fd, view[n:])
        with self._spool.cond:
            self._table.written += n
            self._spool.cond.notify_all()
        return n


class Spool:
    """Runs the ``COPY``\\ s of one snapshot in a thread; :meth:`reader` reads a table's."""

    def __init__(self, conn: Any, copies: Sequence[tuple[str, str]],
                 spool_dir: str | None = None, log_to: Any = log) -> None:
        """``conn``: a connection whose open transaction imported the snapshot (the spool
        owns it from here: committed and closed by the thread); ``copies``: ``(key,
        COPY statement)`` per table, in order."""
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self._conn = conn
        self._log = log_to
        self._tables: dict[str, _Table] = {}
        self._closing = False
        try:
            for key, query in copies:
                # closed by _close_files or SpoolReader.release
                f = tempfile.TemporaryFile(dir=spool_dir, prefix="lamina-pg-", buffering=0)  # noqa: SIM115
                self._tables[key] = _Table(key, query, f)
        except BaseException:
            self._close_files()
            raise
        self._thread = threading.Thread(target=self._run, name="lamina-pg-snapshot-copy",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def reader(self, key: str) -> SpoolReader:
        return SpoolReader(self, self._tables[key])

    def wait_started(self, key: str) -> bool:
        """Wait until ``key``'s spool holds a byte or is done; whether it holds any."""
        table = self._tables[key]
        with self.cond:
            while not table.written and not table.done:
                self._check()
                self.cond.wait()
            self._check()
            return table.written > 0

    def finish(self) -> None:
        """Wait for the thread (every ``COPY`` and the commit); raise its error if any."""
        self._thread.join()
        with self.cond:
            self._check()
            self._close_files()

    def close(self) -> None:
        """Stop: cancel a running ``COPY``, wait for the thread, close the files."""
        with self.cond:
            self._closing = True
            self.cond.notify_all()
        if self._thread.ident is None:  # never started: the connection is still ours here
            with contextlib.suppress(Exception):
                self._conn.close()
        elif self._thread.is_alive():
            with contextlib.suppress(Exception):
                self._conn.cancel()
            self._thread.join(JOIN_SECONDS)
        with self.cond:
            if not self._thread.is_alive():
                self._close_files()
            # else: the thread closes them as it ends

    def _check(self) -> None:
        """Under the lock: raise the ``COPY``'s error, or a closed spool's."""
        if self.error is not None:
            raise self.error
        if self._closing:
            raise SpoolClosedError("the snapshot spool was closed")

    def _close_files(self) -> None:
        for t in self._tables.values():
            if not t.closed:
                t.closed = True
                with contextlib.suppress(OSError):
                    t.file.close()

    def _run(self) -> None:
        try:
            with self._conn.cursor() as cur:
                for table in self._tables.values():
                    t0 = time.monotonic()
                    chunks = _Chunks(self, table)
                    out = io.BufferedWriter(chunks, CHUNK_BYTES)
                    try:
                        cur.copy_expert(table.query, out)
                        out.flush()
                    finally:
                        chunks.discard = True
                    with self.cond:
                        table.done = True
                        self.cond.notify_all()
                    self._log.info("postgres.snapshot_copied", table=table.key,
                                   bytes=table.written,
                                   duration_seconds=round(time.monotonic() - t0, 3))
            self._conn.commit()
        except BaseException as e:  # handed to the reader, which raises it
            with self.cond:
                self.error = e
                self.cond.notify_all()
        finally:
            with contextlib.suppress(Exception):
                self._conn.close()
            with self.cond:
                if self._closing:
                    self._close_files()


class SpoolClosedError(Exception):
    """A read of a spool that :meth:`Spool.close` stopped (never seen by a caller that
    closed the spool itself: its reading has ended)."""


class SpoolReader(io.RawIOBase):
    """One table's spool as a growing, read-only stream (for ``pyarrow.csv.open_csv``)."""

    def __init__(self, spool: Spool, table: _Table) -> None:
        super().__init__()
        self._spool = spool
        self._table = table
        self._pos = 0

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        spool, table = self._spool, self._table
        with spool.cond:
            while True:
                spool._check()  # the spool's own lock is held
                avail = table.written - self._pos
                if table.closed:
                    return b""
                if table.done or (size is not None and 0 <= size <= avail):
                    break
                spool.cond.wait()
            n = avail if size is None or size < 0 else min(size, avail)
            if n <= 0:
                return b""
            data = os.pread(table.file.fileno(), n, self._pos)
        self._pos += len(data)
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(memoryview(b)))
        memoryview(b).cast("B")[:len(data)] = data
        return len(data)

    def release(self) -> None:
        """Read to its end: close the table's file now (the disk space is freed)."""
        with self._spool.cond:
            if self._table.done and self._pos >= self._table.written and not self._table.closed:
                self._table.closed = True
                with contextlib.suppress(OSError):
                    self._table.file.close()

