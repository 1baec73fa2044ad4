"""PostgresSource against a real server: snapshot, streaming, stalls, resumption, slots."""

from __future__ import annotations

import random
import string
import threading
import time
from collections.abc import Iterator

import pytest

from lamina.errors import SourceStalledError, SourceTransientError
from lamina.ingest.postgres import PostgresSource
from lamina.ingest.postgres.pgoutput import parse_lsn
from lamina.ingest.postgres.slot import wait_inactive
from lamina.ingest.source import Source, Transaction
from tests.ingest.postgres.helpers import Collector, arrow, check_uppers
from tests.ingest.postgres.server import PgServer

T = "public.items"


def make(pg: PgServer, *tables: str, **kw: object) -> PostgresSource:
    return PostgresSource("shop", pg.dsn, list(tables or [T]), catalog_check_seconds=0.3,
                          slot_wait_seconds=1.0, **kw)  # type: ignore[arg-type]


@pytest.fixture
def items(pg: PgServer) -> PgServer:
    pg.execute("CREATE TABLE items (id int PRIMARY KEY, name text, qty int)",
               "ALTER TABLE items REPLICA IDENTITY FULL",
               "INSERT INTO items VALUES (1, 'a', 10), (2, 'b', 20)")
    return pg


@pytest.fixture
def src(items: PgServer) -> Iterator[PostgresSource]:
    s = make(items)
    yield s
    s.close()


def test_is_a_source(src: PostgresSource) -> None:
    assert isinstance(src, Source)
    assert src.decode_offset(src.encode_offset(0x16B374D848)) == 0x16B374D848
    assert src.encode_offset(0x16B374D848) == "16/B374D848"
    with pytest.raises(SourceStalledError, match="not an LSN"):
        src.decode_offset("12")


def test_snapshot_then_streaming(items: PgServer, src: PostgresSource) -> None:
    specs = src.open(None)
    assert list(specs) == [T]
    assert specs[T].key == ("id",)
    assert specs[T].schema.names == ["id", "name", "qty"]
    c = Collector(src)
    c.poll_until(lambda c: c.upper > 0)
    snap = c.transactions
    (point,) = {t.offset for t in snap}
    assert c.upper == point + 1  # the snapshot sits right below the slot's consistent point
    assert c.contents(T) == {(1, "a", 10): 1, (2, "b", 20): 1}
    # one upstream transaction of several statements = one Transaction, never split
    items.execute("INSERT INTO items VALUES (3, 'c', 30)",
                  "UPDATE items SET qty = 11 WHERE id = 1",
                  "DELETE FROM items WHERE id = 2")
    c.poll_until(lambda c: len(c.transactions) > len(snap))
    new = c.transactions[len(snap):]
    assert len(new) == 1
    assert c.rows(T)[2:] == [(3, "c", 30, 1), (1, "a", 10, -1), (1, "a", 11, 1),
                             (2, "b", 20, -1)]
    c.poll_until(lambda c: c.upper > new[0].offset)
    check_uppers(c.events)
    assert c.contents(T) == {(1, "a", 11): 1, (3, "c", 30): 1}
    assert dict(items.query("SELECT count(*), 1 FROM pg_publication_tables "
                            "WHERE pubname = 'lamina_shop'")) == {1: 1}


def test_resume_reads_from_the_offset_and_commit_moves_the_slot(
        items: PgServer, src: PostgresSource) -> None:
    src.open(None)
    c = Collector(src)
    c.poll_until(lambda c: c.upper > 0)
    items.execute("INSERT INTO items VALUES (3, 'c', 30)")
    c.poll_until(lambda c: len(c.rows(T)) == 3)
    c.poll_until(lambda c: c.upper > c.transactions[-1].offset)
    after_3 = c.upper
    items.execute("INSERT INTO items VALUES (4, 'd', 40)")
    c.poll_until(lambda c: len(c.rows(T)) == 4)
    src.commit(after_3)
    flushed = items.query("SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                          "WHERE slot_name = 'lamina_shop'")[0][0]
    deadline = time.monotonic() + 10
    while parse_lsn(flushed) < after_3 and time.monotonic() < deadline:
        src.poll(0.1)
        flushed = items.query("SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                              "WHERE slot_name = 'lamina_shop'")[0][0]
    assert parse_lsn(flushed) == after_3
    src.close()
    # re-open at after_3: row 4 again (not durable), nothing older, no snapshot
    src.open(after_3)
    c2 = Collector(src)
    c2.poll_until(lambda c: len(c.rows(T)) >= 1)
    assert c2.rows(T) == [(4, "d", 40, 1)]
    assert all(t.offset >= after_3 for t in c2.transactions)


def test_slot_moved_past_the_resume_point_is_definite(items: PgServer,
                                                       src: PostgresSource) -> None:
    src.open(None)
    c = Collector(src)
    c.poll_until(lambda c: c.upper > 0)
    start = c.upper
    items.execute("INSERT INTO items VALUES (3, 'c', 30)")
    c.poll_until(lambda c: c.upper > start)
    src.commit(c.upper)
    src.close()
    with pytest.raises(SourceStalledError, match=r"lamina_shop.*beyond the resume point"):
        src.open(start)


def test_lost_slot_is_definite(items: PgServer, src: PostgresSource) -> None:
    src.open(None)
    Collector(src).poll_until(lambda c: c.upper > 0)
    src.close()
    # the walsender lets the slot go a moment after its connection closed (under load, a
    # drop right away found it still active)
    with items.connect() as conn:
        wait_inactive(conn, "lamina_shop", source="shop", wait_seconds=30)
    items.execute("SELECT pg_drop_replication_slot('lamina_shop')")
    with pytest.raises(SourceStalledError, match="slot 'lamina_shop' does not exist"):
        src.open(1)


def test_slot_held_by_another_backend_is_definite(items: PgServer,
                                                  src: PostgresSource) -> None:
    other = make(items)
    other.open(None)
    Collector(other).poll_until(lambda c: c.upper > 0)
    try:
        with pytest.raises(SourceStalledError, match=r"'lamina_shop' is held by backend pid "
                                                     r"\d+.*pg_terminate_backend"):
            src.open(1)
    finally:
        other.close()


def test_killed_connection_is_transient(items: PgServer, src: PostgresSource) -> None:
    src.open(None)
    c = Collector(src)
    c.poll_until(lambda c: c.upper > 0)
    items.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                  "WHERE slot_name = 'lamina_shop'")
    with pytest.raises(SourceTransientError, match="retrying"):
        c.poll_until(lambda c: False, timeout=10)
    src.close()
    src.open(c.upper)  # and the framework re-opens it
    items.execute("INSERT INTO items VALUES (3, 'c', 30)")
    c2 = Collector(src)
    c2.poll_until(lambda c: len(c.rows(T)) == 1)


def test_missing_replica_identity_full_stalls_only_that_table(pg: PgServer) -> None:
    pg.execute("CREATE TABLE a (id int PRIMARY KEY, v text)",
               "CREATE TABLE b (id int PRIMARY KEY, v text)",
               "ALTER TABLE a REPLICA IDENTITY FULL")
    src = make(pg, "a", "b")
    try:
        specs = src.open(None)
        assert set(specs) == {"public.a", "public.b"}
        pg.execute("INSERT INTO a VALUES (1, 'x')", "INSERT INTO b VALUES (1, 'y')")
        c = Collector(src)
        c.poll_until(lambda c: len(c.rows("public.a")) == 1)
        (stall,) = c.stalls
        assert stall.table == "public.b"
        assert "REPLICA IDENTITY DEFAULT, not FULL" in stall.error
        assert "ALTER TABLE public.b REPLICA IDENTITY FULL" in stall.hint
        assert c.rows("public.b") == []
    finally:
        src.close()


def test_truncate_is_a_transaction_fact_in_stream_order(items: PgServer,
                                                       src: PostgresSource) -> None:
    """A TRUNCATE is reported in its transaction (the runner retracts or stalls), with the
    changes made after it in the same transaction only."""
    src.open(None)
    c = Collector(src)
    c.poll_until(lambda c: c.upper > 0)
    n = len(c.transactions)
    items.execute("INSERT INTO items VALUES (3, 'c', 30)")
    items.execute("INSERT INTO items VALUES (5, 'e', 50)", "TRUNCATE items",
                  "INSERT INTO items VALUES (6, 'f', 60)")
    items.execute("INSERT INTO items VALUES (4, 'd', 40)")
    c.poll_until(lambda c: len(c.transactions) >= n + 3)
    before, trunc, after = c.transactions[n:n + 3]
    assert not before.truncated
    assert trunc.truncated == {T}
    assert not after.truncated
    assert [tuple(r.values()) for r in arrow(trunc.changes[T]).to_pylist()] == [
        (6, "f", 60, 1)]
    assert [tuple(r.values()) for r in arrow(after.changes[T]).to_pylist()] == [
        (4, "d", 40, 1)]
    assert before.offset < trunc.offset < after.offset
    assert not c.stalls


def test_incompatible_column_change_stalls(items: PgServer, src: PostgresSource) -> None:
    src.open(None)
    c = Collector(src)
    c.poll_until(lambda c: c.upper > 0)
    items.execute("ALTER TABLE items ADD COLUMN note text",
                  "INSERT INTO items VALUES (3, 'c', 30, 'n')")
    c.poll_until(lambda c: bool(c.stalls))
    assert "columns of public.items changed" in c.stalls[0].error
    assert c.rows(T)[2:] == []


def test_compatible_type_change_does_not_stall(items: PgServer, src: PostgresSource) -> None:
    items.execute("ALTER TABLE items ALTER COLUMN name TYPE varchar(10)")
    src.open(None)
    c = Collector(src)
    c.poll_until(lambda c: c.upper > 0)
    items.execute("ALTER TABLE items ALTER COLUMN name TYPE varchar(20)",
                  "INSERT INTO items VALUES (3, 'c', 30)")
    c.poll_until(lambda c: len(c.rows(T)) == 3)
    assert c.stalls == []


def test_dropped_table_stalls_after_its_last_changes(pg: PgServer) -> None:
    pg.execute("CREATE TABLE a (id int PRIMARY KEY)", "CREATE TABLE b (id int PRIMARY KEY)",
               "ALTER TABLE a REPLICA IDENTITY FULL", "ALTER TABLE b REPLICA IDENTITY FULL")
    src = make(pg, "a", "b")
    try:
        src.open(None)
        c = Collector(src)
        c.poll_until(lambda c: c.upper > 0)
        pg.execute("INSERT INTO a VALUES (1)")
        pg.execute("DROP TABLE a")
        pg.execute("INSERT INTO b VALUES (1)")
        c.poll_until(lambda c: bool(c.stalls))
        assert c.stalls[0].table == "public.a"
        assert "dropped" in c.stalls[0].error
        assert c.rows("public.a") == [(1, 1)]
        idx = c.events.index(c.stalls[0])
        assert any(isinstance(e, Transaction) and "public.a" in e.changes
                   for e in c.events[:idx])
        c.poll_until(lambda c: len(c.rows("public.b")) == 1)
    finally:
        src.close()


def test_missing_table_stalls_only_it(items: PgServer) -> None:
    src = make(items, T, "public.nope")
    try:
        specs = src.open(None)
        assert list(specs) == [T]
        c = Collector(src)
        c.poll_until(lambda c: c.upper > 0)
        assert [s.table for s in c.stalls] == ["public.nope"]
        assert c.contents(T) == {(1, "a", 10): 1, (2, "b", 20): 1}
    finally:
        src.close()


def test_unchanged_toast_value_comes_from_the_old_row(items: PgServer,
                                                      src: PostgresSource) -> None:
    big = "".join(random.Random(0).choices(string.ascii_letters, k=300_000))  # not compressible
    items.execute(f"INSERT INTO items VALUES (5, '{big}', 1)")  # noqa: S608
    src.open(None)
    c = Collector(src)
    c.poll_until(lambda c: c.upper > 0)
    items.execute("UPDATE items SET qty = 2 WHERE id = 5")
    c.poll_until(lambda c: len(c.rows(T)) == 5)
    assert c.rows(T)[3:] == [(5, big, 1, -1), (5, big, 2, 1)]


def test_idle_source_upper_follows_keepalives_and_slot_moves(
        items: PgServer, src: PostgresSource) -> None:
    items.execute("CREATE TABLE other (id int)")
    src.open(None)
    c = Collector(src)
    c.poll_until(lambda c: c.upper > 0)
    first = c.upper
    stop = threading.Event()

    def churn() -> None:  # WAL of a table outside the publication
        with items.connect() as conn, conn.cursor() as cur:
            while not stop.is_set():
                cur.execute("INSERT INTO other SELECT generate_series(1, 100)")
                time.sleep(0.05)

    t = threading.Thread(target=churn)
    t.start()
    try:
        c.poll_until(lambda c: c.upper > first + 100_000, timeout=30)
    finally:
        stop.set()
        t.join()
    assert c.transactions
    assert all(t.offset < first for t in c.transactions)
    src.commit(c.upper)
    for _ in range(50):
        src.poll(0.1)
        (flushed,) = items.query("SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                                 "WHERE slot_name = 'lamina_shop'")[0]
        if parse_lsn(flushed) >= c.upper:
            break
    assert parse_lsn(flushed) >= c.upper > first


def test_first_start_replaces_a_leftover_slot(items: PgServer, src: PostgresSource) -> None:
    src.open(None)
    Collector(src).poll_until(lambda c: c.upper > 0)
    src.close()
    items.execute("INSERT INTO items VALUES (3, 'c', 30)")
    src.open(None)  # nothing durable: a fresh snapshot, consistent with a fresh slot
    c = Collector(src)
    c.poll_until(lambda c: c.upper > 0)
    assert c.contents(T) == {(1, "a", 10): 1, (2, "b", 20): 1, (3, "c", 30): 1}
    assert len(items.query("SELECT 1 FROM pg_replication_slots")) == 1


def test_url_dsn_and_wrong_wal_level_message(pg: PgServer) -> None:
    pg.execute("CREATE TABLE items (id int PRIMARY KEY)", "ALTER TABLE items REPLICA "
               "IDENTITY FULL")
    src = PostgresSource("shop", pg.url(), [T])
    try:
        assert list(src.open(None)) == [T]
    finally:
        src.close()
    # refused connections are retried (healed once the server side is fixed), saying why
    bad = PostgresSource("shop", pg.dsn + " user=nobody", [T], connect_timeout=2)
    with pytest.raises(SourceTransientError, match=r"nobody.*retrying.*dsn, the role"):
        bad.open(None)
    bad = PostgresSource("shop", pg.dsn + " dbname=nosuchdb", [T], connect_timeout=2)
    with pytest.raises(SourceTransientError, match="nosuchdb"):
        bad.open(None)



def test_slot_confirms_only_what_was_committed(items: PgServer, src: PostgresSource) -> None:
    """psycopg2 would confirm idle keepalive positions by itself; lamina must not, or a crash
    before those positions are durable looks like a slot moved by someone else."""
    items.execute("CREATE TABLE other (id int)")
    src.open(None)
    c = Collector(src)
    c.poll_until(lambda c: c.upper > 0)
    items.execute("INSERT INTO items VALUES (3, 'c', 30)")
    c.poll_until(lambda c: len(c.rows(T)) == 3)
    c.poll_until(lambda c: c.upper > c.transactions[-1].offset)
    committed = c.upper
    src.commit(committed)
    items.execute("INSERT INTO other SELECT generate_series(1, 10000)")
    c.poll_until(lambda c: c.upper > committed + 10_000)
    deadline = time.monotonic() + 2.5  # a few feedback rounds
    while time.monotonic() < deadline:
        c.events.extend(src.poll(0.2))
    (flushed,) = items.query("SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                             "WHERE slot_name = 'lamina_shop'")[0]
    assert parse_lsn(flushed) == committed
    lag = src.lag_offsets()
    assert lag is not None
    assert lag >= 0
    src.close()
    src.open(committed)  # the crash case: resume at what was durable, no "moved past" error
    c2 = Collector(src)
    c2.poll_until(lambda c: c.upper >= committed)
    assert c2.stalls == []


def test_replica_identity_changed_while_streaming_stalls(items: PgServer,
                                                         src: PostgresSource) -> None:
    src.open(None)
    c = Collector(src)
    c.poll_until(lambda c: c.upper > 0)
    items.execute("INSERT INTO items VALUES (3, 'c', 30)")
    items.execute("ALTER TABLE items REPLICA IDENTITY DEFAULT")
    c.poll_until(lambda c: bool(c.stalls))
    assert "no longer has REPLICA IDENTITY FULL" in c.stalls[0].error
    assert (3, "c", 30, 1) in c.rows(T)  # committed before the change: emitted first


def test_built_from_settings() -> None:
    from lamina.ingest.settings import PostgresSourceSettings

    s = PostgresSourceSettings.model_validate({
        "name": "shop-eu", "kind": "postgres", "dsn": "dbname=x",
        "tables": {"orders": "orders", "sales.items": "items"}})
    src = PostgresSource.from_settings(s)
    assert src.tables == ["public.orders", "sales.items"]
    assert (src.publication, src.slot) == ("lamina_shop_eu", "lamina_shop_eu")
    s2 = PostgresSourceSettings.model_validate({
        "name": "x", "kind": "postgres", "dsn": "dbname=x", "tables": ["a"],
        "publication": "pub", "slot": "sl"})
    src2 = PostgresSource.from_settings(s2)
    assert (src2.tables, src2.publication, src2.slot) == (["public.a"], "pub", "sl")
