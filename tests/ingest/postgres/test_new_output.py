"""A table added to a running PostgreSQL source (its output holds nothing while the others
hold data): the new output stalls with what to do, the existing outputs go on and never
get a row twice (the slot is not dropped, no second snapshot is taken); ``lamina ingest
resync`` then fills it."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lamina import Store
from lamina.errors import SourceTransientError
from lamina.ingest.postgres import PostgresSource
from lamina.ingest.resync import resync
from lamina.ingest.runner import SourceRunner
from lamina.ingest.settings import PostgresSourceSettings
from tests.ingest.postgres.helpers import relation_rows, upstream_rows
from tests.ingest.postgres.server import PgServer
from tests.ingest.running import run_until


def _settings(pg: PgServer, tables: list[str]) -> PostgresSourceSettings:
    return PostgresSourceSettings.model_validate({
        "name": "shop", "kind": "postgres", "dsn": pg.dsn, "tables": tables,
        "timestamp_interval_seconds": 0.05})


def _run(store: Store, pg: PgServer, tables: list[str],
         cond: Callable[[SourceRunner], bool]) -> dict[str, Any]:
    settings = _settings(pg, tables)
    src = PostgresSource(settings.name, pg.dsn, list(settings.outputs()),
                         catalog_check_seconds=0.3, slot_wait_seconds=5.0)
    return run_until(store, settings, src, cond, timeout=30, poll_seconds=0.05,
                     stop_seconds=15, retry_initial_seconds=0.05)[1]


def _has(store: Store, relation: str, n: int) -> Callable[[SourceRunner], bool]:
    def cond(_: SourceRunner) -> bool:
        try:
            return sum(relation_rows(store, relation).values()) >= n
        except Exception:  # not created yet
            return False
    return cond


@pytest.mark.slow
def test_added_table_stalls_and_existing_outputs_get_no_row_twice(
        pg: PgServer, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE a (id int PRIMARY KEY)", "CREATE TABLE b (id int PRIMARY KEY)",
               "ALTER TABLE a REPLICA IDENTITY FULL", "ALTER TABLE b REPLICA IDENTITY FULL",
               "INSERT INTO a SELECT g FROM generate_series(1, 50) g",
               "INSERT INTO b SELECT g FROM generate_series(1, 7) g")
    with Store.open(tmp_path / "d") as store:
        _run(store, pg, ["public.a"], _has(store, "shop.a", 50))
        pg.execute("INSERT INTO a SELECT g FROM generate_series(51, 60) g")
        before = store.relation("shop.a").upper

        def a_moved_on(r: SourceRunner) -> bool:
            return r.health.state == "running" and _has(store, "shop.a", 70)(r) \
                and store.relation("shop.a").upper > before

        # the source now also reads b: its output holds nothing, a's holds data
        started = threading.Event()

        def insert_later() -> None:
            started.wait(30)
            pg.execute("INSERT INTO a SELECT g FROM generate_series(61, 70) g")

        t = threading.Thread(target=insert_later)
        t.start()

        def cond(r: SourceRunner) -> bool:
            if r.health.state == "running":
                started.set()
            return a_moved_on(r)

        try:
            status = _run(store, pg, ["public.a", "public.b"], cond)
        finally:
            started.set()
            t.join()
        want = Counter((i,) for i in range(1, 71))
        assert relation_rows(store, "shop.a") == want          # every row once, nothing twice
        outs = {o["relation"]: o for o in status["outputs"]}
        assert outs["shop.a"]["state"] == "running"
        assert outs["shop.b"]["state"] == "stalled"
        assert "holds no data" in outs["shop.b"]["error"]
        assert "lamina ingest resync --config FILE shop public.b" in outs["shop.b"]["hint"]
        assert "shop.b" not in store.relations() or store.relation("shop.b").upper == 0
        # the slot was kept: a restart resumes a, still once each
        pg.execute("INSERT INTO a SELECT g FROM generate_series(71, 80) g")
        _run(store, pg, ["public.a", "public.b"], _has(store, "shop.a", 80))
        assert relation_rows(store, "shop.a") == Counter((i,) for i in range(1, 81))
        # the remedy: a resync fills b; then both follow their tables
        s = _settings(pg, ["public.a", "public.b"])
        done = resync(store, s, PostgresSource.from_settings(s), "b")
        assert done["inserted"] == 7
        pg.execute("INSERT INTO b VALUES (8)", "INSERT INTO a VALUES (81)")
        status = _run(store, pg, ["public.a", "public.b"], _has(store, "shop.b", 8))
        assert {o["state"] for o in status["outputs"]} == {"running"}
        assert relation_rows(store, "shop.b") == upstream_rows(pg, "b", "id")
        assert relation_rows(store, "shop.a") == upstream_rows(pg, "a", "id")


@pytest.mark.slow
def test_commit_translates_a_lost_connection(pg: PgServer) -> None:
    pg.execute("CREATE TABLE a (id int PRIMARY KEY)", "ALTER TABLE a REPLICA IDENTITY FULL",
               "INSERT INTO a VALUES (1)")
    src = PostgresSource("shop", pg.dsn, ["public.a"], catalog_check_seconds=0.3,
                         slot_wait_seconds=5.0)
    try:
        src.open(None)
        deadline = time.monotonic() + 20
        while src._frontier is None:
            assert time.monotonic() < deadline
            src.poll(0.2)
        src._repl.close()                    # the replication connection is gone
        with pytest.raises(SourceTransientError):
            src.commit(src._frontier.stream + 1)
    finally:
        src.close()
