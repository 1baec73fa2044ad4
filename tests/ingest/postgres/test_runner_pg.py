"""A SourceRunner over a real PostgreSQL source, in the test's process: retained history
(``since`` follows the upper by the window), a table leaving the publication (stalled
before its output's upper passes the change, then re-added and resynced), and a source
of 300 tables."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from lamina import Store
from lamina.errors import AsOfOutOfRangeError
from lamina.ingest.postgres import PostgresSource
from lamina.ingest.postgres.pgoutput import parse_lsn
from lamina.ingest.resync import resync
from lamina.ingest.runner import SourceRunner
from lamina.ingest.settings import PostgresSourceSettings
from tests.ingest.postgres.helpers import relation_rows, upstream_rows
from tests.ingest.postgres.server import PgServer
from tests.ingest.running import run_until


def settings(pg: PgServer, tables: list[str], **kw: Any) -> PostgresSourceSettings:
    return PostgresSourceSettings.model_validate({
        "name": "shop", "kind": "postgres", "dsn": pg.dsn, "tables": tables,
        "timestamp_interval_seconds": 0.05, **kw})


def source(s: PostgresSourceSettings) -> PostgresSource:
    return PostgresSource(s.name, s.dsn, list(s.outputs()), catalog_check_seconds=0.2,
                          slot_wait_seconds=5.0)


def run(store: Store, s: PostgresSourceSettings, cond: Callable[[SourceRunner], bool],
        timeout: float = 60) -> tuple[SourceRunner, dict[str, Any]]:
    return run_until(store, s, source(s), cond, timeout=timeout, poll_seconds=0.05,
                     stop_seconds=20, retry_initial_seconds=0.05)


def outputs(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["relation"]: o for o in status["outputs"]}


@contextmanager
def writing(pg: PgServer, statements: Callable[[int], list[str]]) -> Iterator[None]:
    """Commit ``statements(i)`` for i = 0, 1, ... in a thread while the block runs."""
    stop = threading.Event()

    def loop() -> None:
        i = 0
        while not stop.is_set():
            pg.execute(*statements(i))
            i += 1
            time.sleep(0.01)

    t = threading.Thread(target=loop)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


def test_history_is_compacted_within_the_window(pg: PgServer, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE t (id int PRIMARY KEY, v int)",
               "ALTER TABLE t REPLICA IDENTITY FULL",
               "INSERT INTO t SELECT g, 0 FROM generate_series(1, 20) g")
    s = settings(pg, ["public.t"], retain_history_seconds=1.0)
    rng = random.Random(3)
    started = time.monotonic()
    with Store.open(tmp_path / "d") as store:
        def settled(r: SourceRunner) -> bool:
            return time.monotonic() - started > 3 and bool(r.outputs) \
                and next(iter(r.outputs.values())).since > 0

        with writing(pg, lambda i: [
                f"UPDATE t SET v = {i} WHERE id = {rng.randint(1, 20)}"]):  # noqa: S608
            run(store, s, settled)
        rel = store.relation("shop.t")
        window, step = 1000, 100
        # since trails the newest binding by the window, never by more than a step
        assert rel.upper - 1 - window - step <= rel.since <= rel.upper - 1 - window
        assert relation_rows(store, "shop.t")  # the newest state reads
        rel.snapshot(rel.since)               # the oldest time kept reads
        with pytest.raises(AsOfOutOfRangeError):
            rel.snapshot(rel.since - 1)       # history before the window is gone
        remap = store.relation("shop.remap")
        assert remap.upper - 1 - window - step <= remap.since <= remap.upper - 1 - window
        # caught up: the output equals the table
        run(store, s, lambda r: relation_rows(store, "shop.t")
            == upstream_rows(pg, "t", "id, v"))


def test_a_table_leaving_the_publication_stalls_before_its_upper_passes_the_change(
        pg: PgServer, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE a (id int PRIMARY KEY)", "CREATE TABLE b (id int PRIMARY KEY)",
               "ALTER TABLE a REPLICA IDENTITY FULL", "ALTER TABLE b REPLICA IDENTITY FULL",
               "INSERT INTO a VALUES (0)", "INSERT INTO b VALUES (0)")
    s = settings(pg, ["public.a", "public.b"])
    dropped: list[int] = []

    def drop_later() -> None:
        time.sleep(1.0)
        pg.execute("ALTER PUBLICATION lamina_shop DROP TABLE b")
        dropped.append(parse_lsn(pg.query("SELECT pg_current_wal_insert_lsn()::text")[0][0]))

    with Store.open(tmp_path / "d") as store:
        d = threading.Thread(target=drop_later)
        d.start()
        try:
            with writing(pg, lambda i: [f"INSERT INTO {t} VALUES ({i + 1})"  # noqa: S608
                                        for t in "ab"]):
                _, status = run(store, s, lambda r: outputs(r.status()).get(
                    "shop.b", {}).get("state") == "stalled" and r.binding is not None
                    and bool(dropped) and r.binding.upper > dropped[0] + 10_000)
        finally:
            d.join()
        b = outputs(status)["shop.b"]
        assert "left publication 'lamina_shop'" in b["error"]
        assert "ALTER PUBLICATION lamina_shop ADD TABLE public.b" in b["hint"]
        assert "lamina ingest resync" in b["hint"]
        assert outputs(status)["shop.a"]["state"] == "running"
        # every binding b is sealed past lies below the ALTER PUBLICATION
        remap = store.relation("shop.remap")
        minted = remap.updates(0, remap.upper).to_pylist()
        b_upper = store.relation("shop.b").upper
        below = [parse_lsn(m["upper"]) for m in minted
                 if m["_diff"] > 0 and m["binding_time"] < b_upper]
        assert below
        assert max(below) <= dropped[0]
        held = relation_rows(store, "shop.b")
        assert held
        assert set(held.values()) == {1}
        # put it back and resync: the changes made while it was out come by snapshot
        pg.execute("ALTER PUBLICATION lamina_shop ADD TABLE b")
        done = resync(store, s, source(s), "public.b")
        assert done["relation"] == "shop.b"
        assert not done["recreated"]
        assert relation_rows(store, "shop.b") == upstream_rows(pg, "b", "id")
        pg.execute("INSERT INTO b VALUES (-1)", "INSERT INTO a VALUES (-1)")
        run(store, s, lambda r: relation_rows(store, "shop.b")
            == upstream_rows(pg, "b", "id") and relation_rows(store, "shop.a")
            == upstream_rows(pg, "a", "id"))


def test_a_source_of_300_tables_starts_snapshots_and_streams(
        pg: PgServer, tmp_path: Path) -> None:
    n = 300
    pg.execute(*[s for i in range(n) for s in (
        f"CREATE TABLE t{i} (id int PRIMARY KEY, v text)",
        f"ALTER TABLE t{i} REPLICA IDENTITY FULL",
        f"INSERT INTO t{i} VALUES (1, 'a{i}'), (2, 'b{i}')")])  # noqa: S608
    s = settings(pg, [f"public.t{i}" for i in range(n)], timestamp_interval_seconds=0.2)
    changed = random.Random(5).sample(range(n), 10)
    with Store.open(tmp_path / "d") as store:
        t0 = time.monotonic()
        run(store, s, lambda r: len(r.outputs) == n and all(
            o.upper > 0 for o in r.outputs.values()), timeout=120)
        snapshot_seconds = time.monotonic() - t0
        assert all(relation_rows(store, f"shop.t{i}") == upstream_rows(pg, f"t{i}", "id, v")
                   for i in range(0, n, 29))
        pg.execute(*[f"INSERT INTO t{i} VALUES (3, 'c')" for i in changed],  # noqa: S608
                   *[f"UPDATE t{i} SET v = 'u' WHERE id = 1" for i in changed])  # noqa: S608

        def streamed(r: SourceRunner) -> bool:
            return all(relation_rows(store, f"shop.t{i}") == upstream_rows(
                pg, f"t{i}", "id, v") for i in changed)

        _, status = run(store, s, streamed, timeout=120)
        assert {o["state"] for o in status["outputs"]} == {"running"}
        uppers = {store.relation(f"shop.t{i}").upper for i in range(n)}
        assert len(uppers) == 1                   # every output sealed to the same time
        print(f"300 tables: snapshot sealed in {snapshot_seconds:.1f} s")
