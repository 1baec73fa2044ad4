"""``lamina ingest`` with a PostgreSQL source, as a real subprocess against a real server:
snapshot then streaming, transactions never split, stalls of one output, keepalives,
kill -9 (at random moments and at the ingest fail points) and restart, exactly once."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from lamina import Store
from lamina.ingest.postgres.pgoutput import parse_lsn
from lamina.layout import Layout
from tests.ingest.postgres.helpers import relation_rows, upstream_rows
from tests.ingest.postgres.server import PgServer
from tests.ingest.procs import Ingest, write_config

pytestmark = pytest.mark.slow


def pg_source_toml(name: str, dsn: str, tables: list[str], interval: float = 0.1) -> str:
    tables_s = ", ".join(f'"{t}"' for t in tables)
    return (f'[[sources]]\nname = "{name}"\nkind = "postgres"\ndsn = "{dsn}"\n'
            f"tables = [{tables_s}]\ntimestamp_interval_seconds = {interval}\n")


def lamina_rows(data: Path, relation: str) -> Counter[tuple[Any, ...]]:
    with Store.open(data) as store:
        return relation_rows(store, relation)


def wait_equal(pg: PgServer, data: Path, relation: str, table: str, cols: str, *,
               proc: Ingest, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    want = upstream_rows(pg, table, cols)
    got: Counter[tuple[Any, ...]] = Counter()
    while time.monotonic() < deadline:
        got = lamina_rows(data, relation)
        if got == want:
            return
        if proc.proc.poll() is not None:
            raise AssertionError(f"lamina ingest exited {proc.proc.returncode}: "
                                 f"{proc.log.read_text()[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"{relation} differs from {table}: missing {want - got}, "
                         f"extra {got - want}")


def test_snapshot_stream_never_split_keepalive_moves_slot(pg: PgServer, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE orders (id int PRIMARY KEY, txn int, item text)",
               "CREATE TABLE noise (id int)",
               "ALTER TABLE orders REPLICA IDENTITY FULL",
               "INSERT INTO orders SELECT g, 0, 'snap' || g FROM generate_series(1, 500) g")
    data = tmp_path / "data"
    cfg = write_config(tmp_path / "ingest.toml", data,
                       [pg_source_toml("shop", pg.dsn, ["public.orders"])])
    proc = Ingest(cfg, tmp_path / "ingest.log")
    try:
        proc.wait_for(lambda st: st["shop"]["state"] == "running"
                      and st["shop"]["binding_upper"] is not None)
        wait_equal(pg, data, "shop.orders", "orders", "id, txn, item", proc=proc)
        for txn in range(1, 21):  # multi-statement transactions, many rows each
            base = 1000 * txn
            pg.execute(f"INSERT INTO orders SELECT g, {txn}, 'new' FROM "  # noqa: S608
                       f"generate_series({base}, {base + 99}) g",
                       f"UPDATE orders SET item = 'upd{txn}', txn = {txn} "  # noqa: S608
                       f"WHERE id BETWEEN {txn * 10} AND {txn * 10 + 4}",
                       f"DELETE FROM orders WHERE id = {txn * 10 + 5}")  # noqa: S608
        wait_equal(pg, data, "shop.orders", "orders", "id, txn, item", proc=proc)
        # an idle source: WAL of other tables moves its upper and, once durable, the slot
        proc.wait_for(lambda st: st["shop"]["committed"] is not None)

        def flushed() -> int:
            return parse_lsn(pg.query("SELECT confirmed_flush_lsn::text FROM "
                                      "pg_replication_slots WHERE slot_name = 'lamina_shop'")[0][0])

        before = flushed()
        pg.execute("INSERT INTO noise SELECT generate_series(1, 20000)")
        (target,) = pg.query("SELECT pg_current_wal_lsn()::text")[0]
        deadline = time.monotonic() + 30
        while flushed() < parse_lsn(target) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert flushed() >= parse_lsn(target) > before
        st = proc.sources()
        assert parse_lsn(st["shop"]["source_upper"]) >= parse_lsn(target)
        assert proc.terminate() == 0
    finally:
        proc.kill()
    with Store.open(data) as store:
        rel = store.relation("shop.orders")
        assert rel.key == ("id",)
        ups = rel.updates(0, rel.upper)
    times: dict[int, set[int]] = {}
    for r in ups.to_pylist():
        # +rows carry their transaction's number; -rows of txn N are ids N*10 .. N*10+5
        n = r["txn"] if r["_diff"] > 0 else (r["id"] // 10 if 10 <= r["id"] < 1000 else -1)
        times.setdefault(n, set()).add(r["_time"])
    # each upstream transaction (and the snapshot, txn 0) landed at exactly one lamina time
    assert -1 not in times
    assert all(len(ts) == 1 for ts in times.values()), times
    assert sorted(times) == list(range(21))


def test_stalls_only_the_broken_outputs_and_readyz_names_them(
        pg: PgServer, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE good (id int PRIMARY KEY, v text)",
               "CREATE TABLE nofull (id int PRIMARY KEY, v text)",
               "CREATE TABLE trunc (id int PRIMARY KEY, v text)",
               "ALTER TABLE good REPLICA IDENTITY FULL",
               "ALTER TABLE trunc REPLICA IDENTITY FULL",
               "INSERT INTO trunc VALUES (1, 'a'), (2, 'b')")
    data = tmp_path / "data"
    cfg = write_config(tmp_path / "ingest.toml", data, [pg_source_toml(
        "s", pg.dsn, ["public.good", "public.nofull", "public.trunc"])])
    proc = Ingest(cfg, tmp_path / "ingest.log")
    try:
        def outputs(st: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
            return {o["relation"]: o for o in st["s"]["outputs"]}

        st = proc.wait_for(lambda st: outputs(st).get("s.nofull", {}).get("state")
                           == "stalled")
        assert "REPLICA IDENTITY FULL" in outputs(st)["s.nofull"]["hint"]
        status, body = proc.get("/readyz")            # the source runs, an output does not
        assert status == 503, body
        assert b"s.nofull" in body
        assert b"s.good" not in body
        pg.execute("INSERT INTO good VALUES (1, 'x')", "TRUNCATE trunc",
                   "INSERT INTO trunc VALUES (3, 'c')")
        pg.execute("INSERT INTO good VALUES (2, 'y')")
        # TRUNCATE retracts (on_truncate = "retract", the default): the output goes on
        wait_equal(pg, data, "s.trunc", "trunc", "id, v", proc=proc)
        wait_equal(pg, data, "s.good", "good", "id, v", proc=proc)
        st = proc.sources()
        assert outputs(st)["s.good"]["state"] == "running"
        assert outputs(st)["s.trunc"]["state"] == "running"
        # a stalled output holds the slot back: nothing below it may be released
        assert st["s"]["committed"] is None
    finally:
        proc.kill()


def test_a_refused_login_is_retried_until_the_role_exists(pg: PgServer,
                                                         tmp_path: Path) -> None:
    """A login the server refuses (here a role not created yet) is a transient error, as
    docs/ingestion.md says: the source stays ``starting`` with the error showing, /readyz
    is 503, ``source.retrying`` is logged; once the role exists the same process snapshots
    and streams, no restart needed."""
    role = f"late_{pg.dbname}"
    pg.execute("CREATE TABLE t (id int PRIMARY KEY)", "ALTER TABLE t REPLICA IDENTITY FULL",
               "INSERT INTO t VALUES (1), (2)")
    data = tmp_path / "data"
    dsn = pg.dsn.replace("user=postgres", f"user={role}")
    cfg = write_config(tmp_path / "ingest.toml", data, [pg_source_toml("s", dsn, ["public.t"])])
    proc = Ingest(cfg, tmp_path / "ingest.log")
    try:
        assert proc.wait_event("source.retrying"), proc.log.read_text()[-3000:]
        st = proc.sources()["s"]
        assert st["state"] == "starting", st
        assert f'role "{role}" does not exist' in (st["error"] or ""), st
        status, body = proc.get("/readyz")
        assert status == 503, body
        pg.execute(f"CREATE ROLE {role} LOGIN REPLICATION SUPERUSER")
        pg.execute("INSERT INTO t VALUES (3)")
        proc.wait_for(lambda st: st["s"]["state"] == "running", timeout=60)
        wait_equal(pg, data, "s.t", "t", "id", proc=proc, timeout=60)
        assert proc.sources()["s"]["error"] is None
    finally:
        proc.kill()
        pg.drop_database()  # its slot and publication, which the role owns
        with pg.connect("postgres") as conn:
            conn.cursor().execute(f"DROP ROLE IF EXISTS {role}")


def test_lag_rises_while_ingest_is_stopped_and_falls_after(pg: PgServer,
                                                           tmp_path: Path) -> None:
    pg.execute("CREATE TABLE t (id int PRIMARY KEY)", "ALTER TABLE t REPLICA IDENTITY FULL")
    data = tmp_path / "data"
    cfg = write_config(tmp_path / "ingest.toml", data,
                       [pg_source_toml("s", pg.dsn, ["public.t"], interval=0.1)])
    proc = Ingest(cfg, tmp_path / "ingest.log")
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            pg.execute(f"INSERT INTO t VALUES ({i})")  # noqa: S608
            i += 1
            time.sleep(0.02)

    def lag_metric() -> float:
        _, body = proc.get("/metrics")
        line = next(x for x in body.decode().splitlines()
                    if x.startswith('lamina_source_lag_seconds{source="s"}'))
        return float(line.split()[-1])

    w = threading.Thread(target=writer)
    try:
        proc.wait_for(lambda st: st["s"]["binding_upper"] is not None)
        w.start()
        proc.wait_for(lambda st: st["s"]["lag_seconds"] < 2)
        os.kill(proc.proc.pid, signal.SIGSTOP)
        time.sleep(6)
        os.kill(proc.proc.pid, signal.SIGCONT)
        # what was committed meanwhile is old and not sealed: the lag says so at once
        assert proc.sources()["s"]["lag_seconds"] >= 4
        assert lag_metric() >= 3.5
        proc.wait_for(lambda st: st["s"]["lag_seconds"] < 2)
        assert lag_metric() < 2.5
    finally:
        stop.set()
        if w.is_alive():
            w.join()
        proc.kill()


ROUNDS = int(os.environ.get("LAMINA_PG_KILL_ROUNDS", "50"))
"""Processes killed by test_kill_9_and_restart_exactly_once (half at fail points)."""
FAILPOINTS = ["ingest.outputs_appended", "ingest.outputs_sealed", "ingest.binding_sealed",
              "ingest.offset_committed"]


def _upper(data: Path, relation: str) -> int:
    """The relation's upper as a reader sees it on disk (0 before it exists)."""
    if not Layout(data).wal_dir(relation).exists():
        return 0
    with Store.open(data) as store:
        return store.relation(relation).upper


def test_kill_9_and_restart_exactly_once(pg: PgServer, tmp_path: Path) -> None:
    """Each round starts ``lamina ingest`` and kills it -9 as soon as it has shown progress
    (a fail point's kill, or a random 0-0.4 s after its source is running); per kill only
    the cheap invariant is checked (the output's upper never goes back), the full
    comparison with the upstream tables once at the end: ``acct`` (updates, deletes) and
    ``hist`` (inserts, and every 50 transactions a TRUNCATE then an insert in one
    transaction: retracted at its binding time, exactly once across the kills)."""
    rng = random.Random(12)
    pg.execute("CREATE TABLE acct (id int PRIMARY KEY, bal bigint, note text)",
               "ALTER TABLE acct REPLICA IDENTITY FULL",
               "INSERT INTO acct SELECT g, 100, 'init' FROM generate_series(1, 200) g",
               "CREATE TABLE hist (n int, note text)",      # no key; truncated now and then
               "ALTER TABLE hist REPLICA IDENTITY FULL")
    data = tmp_path / "data"
    cfg = write_config(tmp_path / "ingest.toml", data, [pg_source_toml(
        "bank", pg.dsn, ["public.acct", "public.hist"], interval=0.05)])
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        wr = random.Random(7)
        n = 1000
        try:
            with pg.connect() as conn:
                conn.autocommit = False
                with conn.cursor() as cur:
                    while not stop.is_set():
                        a, b = wr.randint(1, 200), wr.randint(1, 200)
                        cur.execute("UPDATE acct SET bal = bal - 1 WHERE id = %s", (a,))
                        cur.execute("UPDATE acct SET bal = bal + 1 WHERE id = %s", (b,))
                        cur.execute("INSERT INTO acct VALUES (%s, 0, 'n')", (n,))
                        if n % 3 == 0:
                            cur.execute("DELETE FROM acct WHERE id = %s", (n - 1,))
                        if n % 50 == 0:     # TRUNCATE, then inserts, in one transaction
                            cur.execute("TRUNCATE hist")
                        cur.execute("INSERT INTO hist VALUES (%s, 'h')", (n,))
                        conn.commit()
                        n += 1
                        time.sleep(0.003)
        except BaseException as e:  # reported by the test
            errors.append(e)

    t = threading.Thread(target=writer)
    t.start()
    kills = 0
    uppers = [0]
    try:
        for round_ in range(ROUNDS):
            env = {}
            if round_ % 2 == 1:
                fp = FAILPOINTS[(round_ // 2) % len(FAILPOINTS)]
                env["LAMINA_FAILPOINTS"] = f"{fp}=kill@{rng.randint(1, 6)}"
            proc = Ingest(cfg, tmp_path / "ingest.log", env=env)
            try:
                if env:
                    proc.proc.wait(30)
                else:
                    assert proc.wait_event("source.running"), proc.log.read_text()[-3000:]
                    time.sleep(rng.uniform(0.0, 0.4))
                    if round_ % 8 == 2:  # the connection killed upstream: retried in-process
                        # replication starts at the source's first poll, a moment after
                        # source.running: terminate once the slot is held, not before
                        deadline = time.monotonic() + 30
                        while not pg.query(
                                "SELECT pg_terminate_backend(active_pid) FROM "
                                "pg_replication_slots WHERE slot_name = 'lamina_bank' "
                                "AND active_pid IS NOT NULL"):
                            assert time.monotonic() < deadline, proc.log.read_text()[-3000:]
                            time.sleep(0.05)
                        assert proc.wait_event("source.retrying", timeout=10)
                        time.sleep(rng.uniform(0.5, 1.0))
                    assert proc.proc.poll() is None, proc.log.read_text()[-3000:]
            finally:
                proc.kill()
            kills += 1
            assert proc.proc.returncode == -9, proc.log.read_text()[-3000:]
            uppers.append(_upper(data, "bank.acct"))
            assert uppers[-1] >= uppers[-2], uppers  # a kill never loses sealed data
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    assert kills == ROUNDS
    # one more, undisturbed run: every change exactly once, nothing lost
    proc = Ingest(cfg, tmp_path / "ingest.log")
    try:
        wait_equal(pg, data, "bank.acct", "acct", "id, bal, note", proc=proc, timeout=60)
        wait_equal(pg, data, "bank.hist", "hist", "n, note", proc=proc, timeout=60)
        st = proc.sources()
        assert st["bank"]["state"] == "running", json.dumps(st)
        assert proc.terminate() == 0
    finally:
        proc.kill()
    got = lamina_rows(data, "bank.acct")
    assert set(got.values()) == {1}
    assert sum(bal for (_, bal, _) in got) == 200 * 100
