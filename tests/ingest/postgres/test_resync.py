"""``lamina ingest resync`` against a real server and a real ``lamina ingest``: after a
TRUNCATE under ``on_truncate = "stall"`` (through the running service) and after an ADD
COLUMN (on its own, the service stopped), each table's output equals the table again and
follows it, while the other table's relation and the slot are left alone."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from lamina import Store
from lamina.errors import RelationNotFoundError
from tests.ingest.postgres.helpers import relation_rows, upstream_rows
from tests.ingest.postgres.server import PgServer
from tests.ingest.procs import LAMINA, Ingest, write_config


def resync_cli(cfg: Path, table: str, port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LAMINA, "ingest", "resync", "--config", str(cfg), "s", table,
                           "--http", f"127.0.0.1:{port}"], capture_output=True, text=True,
                          timeout=120, check=False)


def outputs(st: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["relation"]: o for o in st["s"]["outputs"]}


def equal(pg: PgServer, data: Path, table: str, cols: str) -> bool:
    with Store.open(data) as store:
        try:
            return relation_rows(store, f"s.{table}") == upstream_rows(pg, table, cols)
        except RelationNotFoundError:
            return False


def test_resync_after_a_stalled_truncate_and_an_added_column(
        pg: PgServer, tmp_path: Path) -> None:
    pg.execute(*[s for t in "abc" for s in (f"CREATE TABLE {t} (id int PRIMARY KEY, v text)",
                                              f"ALTER TABLE {t} REPLICA IDENTITY FULL",
                                              f"INSERT INTO {t} VALUES (1, 'x'), (2, 'y')")])  # noqa: S608
    data = tmp_path / "data"
    cfg = write_config(tmp_path / "ingest.toml", data, [
        f'[[sources]]\nname = "s"\nkind = "postgres"\ndsn = "{pg.dsn}"\n'
        "timestamp_interval_seconds = 0.1\n"
        '[sources.tables]\n"public.a" = { on_truncate = "stall" }\n'
        '"public.b" = "s.b"\n"public.c" = "s.c"\n'])
    proc = Ingest(cfg, tmp_path / "ingest.log")
    try:
        proc.wait_for(lambda st: all(equal(pg, data, t, "id, v") for t in "abc"))
        with Store.open(data) as store:
            c_rel = store.relation("s.c")
            c_id, c_upper = c_rel.meta.relation_id, c_rel.upper
            c_before = c_rel.updates(0, c_upper).to_pylist()
        pg.execute("TRUNCATE a", "INSERT INTO a VALUES (5, 'after')")
        pg.execute("ALTER TABLE b ADD COLUMN extra int DEFAULT 7",
                   "INSERT INTO b VALUES (3, 'z', 8)")
        pg.execute("INSERT INTO c VALUES (3, 'z')")
        st = proc.wait_for(lambda st: outputs(st)["s.a"]["state"] == "stalled"
                           and outputs(st)["s.b"]["state"] == "stalled")
        assert "TRUNCATE" in outputs(st)["s.a"]["error"]
        assert "lamina ingest resync --config FILE s public.a" in outputs(st)["s.a"]["hint"]
        assert "changed upstream" in outputs(st)["s.b"]["error"]
        proc.wait_for(lambda st: equal(pg, data, "c", "id, v"))     # c goes on

        # through the running service
        done = resync_cli(cfg, "public.a", proc.wait_port())
        assert done.returncode == 0, done.stderr
        assert "resynced public.a into s.a" in done.stdout
        assert "2 retracted" in done.stdout
        proc.wait_for(lambda st: outputs(st)["s.a"]["state"] == "running")
        assert equal(pg, data, "a", "id, v")
        pg.execute("INSERT INTO a VALUES (6, 'then')", "UPDATE a SET v = 'u' WHERE id = 5")
        proc.wait_for(lambda st: equal(pg, data, "a", "id, v"))
        port = proc.wait_port()
        assert proc.terminate() == 0
    finally:
        proc.kill()
    # on its own: nothing listens at the address any more
    slots = pg.query("SELECT slot_name, confirmed_flush_lsn FROM pg_replication_slots")
    done = resync_cli(cfg, "b", port)
    assert done.returncode == 0, done.stderr
    assert "created again with the table's columns" in done.stdout
    assert equal(pg, data, "b", "id, v, extra")
    assert pg.query("SELECT slot_name, confirmed_flush_lsn FROM pg_replication_slots") \
        == slots                                   # the slot is not touched
    proc = Ingest(cfg, tmp_path / "ingest.log")
    try:
        pg.execute("INSERT INTO b VALUES (4, 'w', 9)", "INSERT INTO c VALUES (4, 'w')")
        proc.wait_for(lambda st: equal(pg, data, "b", "id, v, extra")
                      and equal(pg, data, "c", "id, v") and equal(pg, data, "a", "id, v"))
        assert {o["state"] for o in outputs(proc.sources()).values()} == {"running"}
        assert proc.terminate() == 0
    finally:
        proc.kill()
    with Store.open(data) as store:   # c: the same relation, its history as it was
        c_rel = store.relation("s.c")
        assert c_rel.meta.relation_id == c_id
        assert c_rel.updates(0, c_upper).to_pylist() == c_before
        assert store.relation("s.a").since > 0    # reads before the resync are refused
