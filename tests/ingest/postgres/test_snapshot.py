"""The initial snapshot against a real server: the exported snapshot's COPY is parsed while
it is still running (lamina.ingest.postgres.spool), and stays exactly the slot's start."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from lamina.errors import SourceTransientError
from lamina.ingest.postgres import PostgresSource
from lamina.ingest.postgres.spool import Spool
from tests.ingest.postgres.helpers import Collector, check_uppers
from tests.ingest.postgres.server import PgServer

T = "public.items"


@pytest.fixture
def items(pg: PgServer) -> PgServer:
    pg.execute("CREATE TABLE items (id int PRIMARY KEY, name text, qty int)",
               "ALTER TABLE items REPLICA IDENTITY FULL",
               "INSERT INTO items VALUES (1, 'a', 10), (2, 'b', 20)")
    return pg


def make(pg: PgServer, *tables: str) -> PostgresSource:
    return PostgresSource("shop", pg.dsn, list(tables or [T]), slot_wait_seconds=1.0)


@contextmanager
def copy_held(pg: PgServer, src: PostgresSource,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, int]]:
    """``src`` opened while another session holds ``items`` locked: its snapshot's COPY
    waits for that session, whose cursor (and the COPY's backend pid) is yielded; the
    session commits on the way out.

    The lock is taken once the slot exists and its snapshot is imported, just before the
    COPY starts (an ACCESS EXCLUSIVE lock is WAL-logged, so its transaction has an xid,
    which the slot's creation would wait for)."""
    with pg.connect() as conn:
        conn.autocommit = False
        cur = conn.cursor()
        start = Spool.start

        def locked_start(self: Spool) -> None:
            cur.execute("LOCK TABLE items IN ACCESS EXCLUSIVE MODE")
            start(self)

        monkeypatch.setattr(Spool, "start", locked_start)
        src.open(None)  # returns without waiting for the COPY
        monkeypatch.setattr(Spool, "start", start)
        deadline = time.monotonic() + 10
        while not (pids := pg.query(
                "SELECT pid FROM pg_stat_activity WHERE application_name = "
                "'lamina-ingest-shop' AND query LIKE 'COPY%%' AND wait_event_type = 'Lock'")):
            assert time.monotonic() < deadline, "the snapshot's COPY never started"
            time.sleep(0.02)
        yield cur, pids[0][0]
        conn.commit()


def _copies(pg: PgServer) -> list[tuple[Any, ...]]:
    return pg.query("SELECT pid FROM pg_stat_activity WHERE application_name = "
                    "'lamina-ingest-shop' AND query LIKE 'COPY%%' AND state = 'active'")


def test_changes_committed_while_the_copy_runs_come_by_the_stream_only(
        items: PgServer, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make(items)
    try:
        with copy_held(items, src, monkeypatch) as (cur, _):
            cur.execute("INSERT INTO items VALUES (3, 'c', 30)")
            cur.execute("UPDATE items SET qty = 11 WHERE id = 1")
            cur.execute("DELETE FROM items WHERE id = 2")
        c = Collector(src)
        c.poll_until(lambda c: c.upper > 0)
        (point,) = {t.offset for t in c.transactions}
        assert c.upper == point + 1
        assert c.contents(T) == {(1, "a", 10): 1, (2, "b", 20): 1}  # as the slot started
        c.poll_until(lambda c: len(c.transactions) > 1)
        check_uppers(c.events)
        assert c.contents(T) == {(1, "a", 11): 1, (3, "c", 30): 1}
    finally:
        src.close()


def test_close_cancels_a_running_copy(items: PgServer,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    src = make(items)
    try:
        with copy_held(items, src, monkeypatch):
            t0 = time.monotonic()
            src.close()
            assert time.monotonic() - t0 < 10
            assert _copies(items) == []
        src.open(None)  # a new snapshot from the start
        c = Collector(src)
        c.poll_until(lambda c: c.upper > 0)
        assert c.contents(T) == {(1, "a", 10): 1, (2, "b", 20): 1}
    finally:
        src.close()


def test_a_killed_copy_is_transient(items: PgServer,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    src = make(items)
    try:
        with copy_held(items, src, monkeypatch) as (_, pid):
            items.execute(f"SELECT pg_terminate_backend({pid})")
        c = Collector(src)
        with pytest.raises(SourceTransientError, match="retrying"):
            c.poll_until(lambda c: False, timeout=10)
        assert c.transactions == []  # never a short table
        with pytest.raises(SourceTransientError, match="not open"):
            src.poll(0.1)  # nor streaming after a snapshot cut short: opened again
    finally:
        src.close()


def test_a_stall_late_in_a_large_table_stops_it_and_the_next_table_is_read(
        pg: PgServer) -> None:
    rows = 30_000  # a few MiB of CSV: parsed in several blocks while the COPY runs
    pg.execute("CREATE TABLE wide (id int PRIMARY KEY, v text, n numeric(5, 2))",
               "CREATE TABLE after (id int PRIMARY KEY)",
               "ALTER TABLE wide REPLICA IDENTITY FULL",
               "ALTER TABLE after REPLICA IDENTITY FULL",
               "INSERT INTO wide SELECT g, repeat('x', 60) || E'\\n\"q\",' || g, 1.5 "
               "FROM generate_series(1, 30000) g",
               "UPDATE wide SET n = 'NaN' WHERE id = 30000",
               "INSERT INTO after VALUES (1), (2), (3)")
    src = make(pg, "wide", "after")
    try:
        src.open(None)
        c = Collector(src)
        c.poll_until(lambda c: c.upper > 0)
        (stall,) = c.stalls
        assert stall.table == "public.wide"
        assert "'NaN'" in stall.error
        got = c.rows("public.wide")
        assert len(got) < rows
        assert got == [(i, "x" * 60 + f'\n"q",{i}', pytest.approx(1.5), 1)
                       for i in range(1, len(got) + 1)]
        assert c.contents("public.after") == {(1,): 1, (2,): 1, (3,): 1}
        pg.execute("INSERT INTO after VALUES (4)")
        c.poll_until(lambda c: (4, 1) in c.rows("public.after"))
    finally:
        src.close()
