"""Ingestion from PostgreSQL: streaming against ``pg_recvlogical``, freshness under an
unthrottled pgbench, the initial snapshot against ``COPY``.

    .venv/bin/python -m bench.ingest [--scale 1.0] [--backlog-seconds 60]
        [--fresh-seconds 30] [--interval 1.0] [--rounds 3] [--snapshot-only]

Against a real PostgreSQL 15 started in a temporary directory
(tests/ingest/postgres/server.py: Debian's ``postgresql``, a Unix socket, ``fsync=off``),
on the machine's two cores shared by the server, pgbench and lamina:

- *Streaming vs pg_recvlogical.* A pgbench database (``pgbench -i -s 10``, times
  ``--scale``; the four tables ``REPLICA IDENTITY FULL``) and a source over its four
  tables. ``lamina ingest`` takes its snapshot and stops; a second pgoutput slot is
  created with ``pg_recvlogical --create-slot``; then ``pgbench -n -c 4 -j 2 -T
  --backlog-seconds`` runs with nothing reading (the backlog). Timed: ``lamina ingest`` (a
  real process, from its start: interpreter, imports, recovery included) until a binding
  covers the WAL position after the backlog and the outputs are sealed past it; then
  ``pg_recvlogical --start -o proto_version=1 -o publication_names=... -f /dev/null -E
  <that position>`` (the same publication's changes, decoded by the same walsender code,
  written nowhere). Both read the same backlog, lamina first (its WAL reads are the colder
  ones). Changes/s = the update rows lamina wrote / seconds; the ratio is
  pg_recvlogical's seconds over lamina's. Target >= 0.5. Also reported: lamina's rate
  from its ``source.running`` log event (start-up left out).
- *Freshness under pgbench.* ``lamina ingest`` running (``timestamp_interval_seconds =
  --interval``), ``pgbench -n -c 4 -j 2 -T --fresh-seconds`` unthrottled. Each pgbench
  transaction inserts one ``pgbench_history`` row whose ``mtime`` is the transaction's
  start (``PGTZ=UTC``); the bench polls ``/v1/sources`` every 20 ms for the output's
  upper. Freshness of a transaction = the first poll that saw the upper pass the row's
  ``_time`` minus its ``mtime`` (so it includes the transaction's own run time); p50, p99
  and max after a 2 s warm-up, with pgbench's tps and ``lag_seconds`` as reported every
  second. Target p99 <= 5 s.
- *Snapshot vs COPY* (as in earlier runs): a table of 500,000 (times ``--scale``) rows ``(id int,
  name text, qty int, at timestamptz, amount numeric(12,2))``; PostgreSQL's own ``COPY
  (SELECT ...) TO STDOUT (FORMAT csv)`` into a discarding sink against a ``SourceRunner``
  (what ``lamina ingest`` runs per source) from its start until the output is sealed past
  the first binding, and the source alone (``open`` + ``poll`` to the first ``Upper``);
  the median of ``--rounds``. Target >= 0.5.

Writes bench/results/ingest.json and ingest.png (``--snapshot-only``: prints the snapshot
rounds, writes nothing).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import structlog
from tests.ingest.postgres.server import PgServer, find_bin, running_server
from tests.ingest.procs import Ingest, write_config

from bench import report
from lamina import Store
from lamina.ingest.metrics import IngestMetrics
from lamina.ingest.postgres import PostgresSource
from lamina.ingest.postgres.pgoutput import format_lsn, parse_lsn
from lamina.ingest.runner import SourceRunner
from lamina.ingest.settings import PostgresSourceSettings
from lamina.ingest.source import Transaction, Upper

NAME = "ingest"
COLS = "id, name, qty, at, amount"
TABLE = "(id int PRIMARY KEY, name text, qty int, at timestamptz, amount numeric(12,2))"
SNAPSHOT_TARGET = 0.5
STREAMING_TARGET = 0.5
FRESHNESS_TARGET_MS = 5000.0
WARMUP_SECONDS = 2.0
PGBENCH_TABLES = ("pgbench_accounts", "pgbench_branches", "pgbench_tellers",
                  "pgbench_history")


class _Sink(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return len(memoryview(b))


def _bin(name: str) -> str:
    found = find_bin()
    if found is None:
        raise SystemExit("no PostgreSQL under /usr/lib/postgresql/*/bin (set LAMINA_PG_BIN)")
    return str(found / name)


def _env(pg: PgServer) -> dict[str, str]:
    return {**os.environ, "PGHOST": str(pg.sock), "PGUSER": "postgres",
            "PGDATABASE": pg.dbname, "PGTZ": "UTC"}


def _run(cmd: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr}")
    return done.stdout


def _insert_lsn(pg: PgServer) -> int:
    # the insert position: with synchronous_commit = off pg_current_wal_lsn() (the write
    # position) can be behind commits that already returned
    return parse_lsn(pg.query("SELECT pg_current_wal_insert_lsn()::text")[0][0])


def _pgbench(pg: PgServer, seconds: float) -> dict[str, Any]:
    out = _run([_bin("pgbench"), "-n", "-c", "4", "-j", "2", "-T", str(int(seconds))],
               _env(pg))
    txns = next(int(line.split(":")[1]) for line in out.splitlines()
                if line.startswith("number of transactions actually processed"))
    tps = next(float(line.split("=")[1].split()[0]) for line in out.splitlines()
               if line.startswith("tps"))
    return {"transactions": txns, "tps": round(tps, 1)}


def _pgbench_source(pg: PgServer, work: Path, interval: float) -> Path:
    tables = ", ".join(f'"public.{t}"' for t in PGBENCH_TABLES)
    return write_config(work / "ingest.toml", work / "data", [
        f'[[sources]]\nname = "bench"\nkind = "postgres"\ndsn = "{pg.dsn}"\n'
        f"tables = [{tables}]\ntimestamp_interval_seconds = {interval}\n"])


def _covered(proc: Ingest, lsn: int, timeout: float = 900.0) -> dict[str, Any]:
    """Wait until a binding covers ``lsn`` (every output sealed past it); the status."""
    def cond(st: dict[str, dict[str, Any]]) -> bool:
        b = st["bench"]["binding_upper"]
        return b is not None and parse_lsn(b) >= lsn
    return proc.wait_for(cond, timeout=timeout)["bench"]


def pgbench_database(pg: PgServer, scale: int) -> None:
    _run([_bin("pgbench"), "-i", "-s", str(scale), "-q"], _env(pg))
    pg.execute(*[f"ALTER TABLE {t} REPLICA IDENTITY FULL" for t in PGBENCH_TABLES])


def streaming(pg: PgServer, work: Path, backlog_seconds: float,
              interval: float) -> dict[str, Any]:
    cfg = _pgbench_source(pg, work, interval)
    proc = Ingest(cfg, work / "ingest.log")
    try:
        proc.wait_for(lambda st: st["bench"]["binding_upper"] is not None, timeout=600)
        assert proc.terminate() == 0
    finally:
        proc.kill()
    env = _env(pg)
    _run([_bin("pg_recvlogical"), "-d", pg.dbname, "--create-slot", "-S", "bench_recv",
          "-P", "pgoutput"], env)
    bench = _pgbench(pg, backlog_seconds)
    end = _insert_lsn(pg)
    pg.execute("SELECT pg_logical_emit_message(false, 'bench', 'end')")  # WAL past the end
    load = report.load_average()
    t0 = time.monotonic()
    wall0 = time.time()
    proc = Ingest(cfg, work / "ingest.log")
    try:
        st = _covered(proc, end)
        lamina_s = time.monotonic() - t0
        assert proc.terminate() == 0
    finally:
        proc.kill()
    changes = sum(o["changes"] for o in st["outputs"])
    running = next(e for e in proc.events() if e.get("event") == "source.running")
    started = datetime.fromisoformat(running["timestamp"].replace("Z", "+00:00"))
    streaming_s = lamina_s - (started.timestamp() - wall0)
    t0 = time.monotonic()
    _run([_bin("pg_recvlogical"), "-d", pg.dbname, "--start", "-S", "bench_recv", "-o",
          "proto_version=1", "-o", "publication_names=lamina_bench", "-f", "/dev/null",
          "-E", format_lsn(end), "--no-loop"], env)
    recv_s = time.monotonic() - t0
    ratio = round(recv_s / lamina_s, 3)
    return {"pgbench_backlog": bench, "changes": changes,
            "lamina_seconds": round(lamina_s, 3),
            "lamina_changes_per_s": round(changes / lamina_s),
            "pg_recvlogical_seconds": round(recv_s, 3),
            "pg_recvlogical_changes_per_s": round(changes / recv_s),
            "ratio": ratio, "target": STREAMING_TARGET, "met": ratio >= STREAMING_TARGET,
            "lamina_streaming_seconds": round(streaming_s, 3),
            "lamina_streaming_changes_per_s": round(changes / streaming_s),
            "load_average_at_start": load}


def freshness(pg: PgServer, work: Path, seconds: float, interval: float) -> dict[str, Any]:
    """Freshness of pgbench transactions (needs the database of :func:`pgbench_database`
    and the slot of :func:`streaming`, which this run drains first)."""
    cfg = _pgbench_source(pg, work, interval)
    proc = Ingest(cfg, work / "ingest.log")
    ups: list[tuple[float, int]] = []
    lags: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        last = -1
        n = 0
        while not stop.is_set():
            st = proc.sources()["bench"]
            now = time.time()
            up = next(o["upper"] for o in st["outputs"]
                      if o["relation"] == "bench.pgbench_history")
            if up != last:
                ups.append((now, up))
                last = up
            if n % 50 == 0:
                lags.append(st["lag_seconds"])
            n += 1
            time.sleep(0.02)

    try:
        _covered(proc, _insert_lsn(pg))
        (first,) = pg.query("SELECT extract(epoch FROM now())::float8")[0]
        t = threading.Thread(target=watch, daemon=True)
        t.start()
        bench = _pgbench(pg, seconds)
        _covered(proc, _insert_lsn(pg), timeout=300)
        time.sleep(0.5)
        stop.set()
        t.join(10)
        assert proc.terminate() == 0
    finally:
        stop.set()
        proc.kill()
    with Store.open(work / "data") as store:
        rel = store.relation("bench.pgbench_history")
        rows = rel.updates(0, rel.upper)
    # mtime: timestamp[us] without a zone, written in UTC (PGTZ): microseconds since 1970
    mtimes = [m / 1e6 for m in rows.column("mtime").cast(pa.int64()).to_pylist()]
    lat: list[float] = []
    for m, tm in zip(mtimes, rows.column("_time").to_pylist(), strict=True):
        if m < first + WARMUP_SECONDS:
            continue
        seen = next((w for w, up in ups if up > tm), None)
        if seen is None:
            raise AssertionError(f"a row at time {tm} was never seen sealed")
        lat.append(seen - m)
    lat.sort()

    def q(p: float) -> float:
        return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 1)

    p99 = q(0.99)
    return {"pgbench": bench, "measured": len(lat), "seconds": seconds,
            "timestamp_interval_seconds": interval, "p50_ms": q(0.5), "p99_ms": p99,
            "max_ms": round(lat[-1] * 1000, 1), "target_p99_ms": FRESHNESS_TARGET_MS,
            "met": p99 <= FRESHNESS_TARGET_MS, "lag_seconds_reported": lags}


def _fill(pg: PgServer, table: str, rows: int) -> None:
    pg.execute(f"INSERT INTO {table} SELECT g, 'name ' || g, g % 100, now(), "  # noqa: S608
               f"g / 7.0 FROM generate_series(1, {rows}) g")


def copy_seconds(pg: PgServer, table: str) -> float:
    with pg.connect() as conn, conn.cursor() as cur:
        t0 = time.perf_counter()
        cur.copy_expert(f"COPY (SELECT {COLS} FROM {table}) TO STDOUT (FORMAT csv)",  # noqa: S608
                        _Sink())
        return time.perf_counter() - t0


def source_snapshot_seconds(pg: PgServer, name: str, rows: int) -> float:
    """The source alone: open (slot, exported snapshot, COPY to the spool) and poll every
    snapshot row as Arrow, up to the first Upper; the slot is dropped afterwards."""
    src = PostgresSource(name, pg.dsn, ["snap"])
    t0 = time.perf_counter()
    src.open(None)
    got = 0
    while True:
        evs = src.poll(1.0)
        got += sum(t.num_rows for e in evs if isinstance(e, Transaction)
                   if isinstance(t := e.changes["public.snap"], pa.Table))  # snapshot: Arrow
        if any(isinstance(e, Upper) for e in evs):
            break
    s = time.perf_counter() - t0
    src.close()
    for _ in range(200):  # the walsender lets go of the slot a moment after close
        if not pg.query("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active",
                        (f"lamina_{name}",)):
            break
        time.sleep(0.05)
    pg.execute(f"SELECT pg_drop_replication_slot('lamina_{name}')")
    if got != rows:
        raise AssertionError(f"source snapshot emitted {got} rows, not {rows}")
    return s


def _runner_snapshot_seconds(pg: PgServer, work: Path, name: str, rows: int) -> float:
    settings = PostgresSourceSettings(name=name, kind="postgres", dsn=pg.dsn,
                                      tables=["public.snap"], timestamp_interval_seconds=0.1)
    with Store.open(work / name) as store:
        runner = SourceRunner(settings, PostgresSource.from_settings(settings), store,
                              IngestMetrics())
        stop = threading.Event()
        thread = threading.Thread(target=runner.run, args=(stop,), daemon=True)
        t0 = time.perf_counter()
        thread.start()
        while not (runner.binding is not None and runner.outputs
                   and all(o.upper > runner.binding.time for o in runner.outputs.values())):
            if runner.health.state == "stalled":
                raise AssertionError(f"source stalled: {runner.status()}")
            time.sleep(0.002)
        s = time.perf_counter() - t0
        stop.set()
        thread.join(60)
        rel = store.relation(f"{name}.snap")
        if (n := rel.snapshot(rel.upper - 1).num_rows) != rows:
            raise AssertionError(f"snapshot sealed {n} rows, not {rows}")
    pg.execute(f"SELECT pg_drop_replication_slot('lamina_{name}')")
    shutil.rmtree(work / name, ignore_errors=True)
    return s


def snapshot(pg: PgServer, work: Path, rows: int, rounds: int) -> dict[str, Any]:
    pg.execute(f"CREATE TABLE snap {TABLE}", "ALTER TABLE snap REPLICA IDENTITY FULL")
    _fill(pg, "snap", rows)
    with pg.connect() as conn:
        conn.cursor().execute("VACUUM ANALYZE snap")
    copy_s, src_s, snap_s = [], [], []
    for r in range(rounds):
        copy_s.append(copy_seconds(pg, "snap"))
        src_s.append(source_snapshot_seconds(pg, f"bench_src{r}", rows))
        snap_s.append(_runner_snapshot_seconds(pg, work, f"r{r}", rows))
        print(f"  snapshot round {r + 1}/{rounds}: load {os.getloadavg()[0]:.2f}, COPY "
              f"{copy_s[-1]:.3f} s, source alone {src_s[-1]:.3f} s, snapshot "
              f"{snap_s[-1]:.3f} s: {copy_s[-1] / snap_s[-1]:.3f} of COPY", file=sys.stderr,
              flush=True)
    med = statistics.median
    copy, snap = med(copy_s), med(snap_s)
    ratio = round(copy / snap, 3)
    return {"rows": rows, "rounds": rounds, "copy_rows_per_s": round(rows / copy),
            "copy_seconds": round(copy, 3), "source_only_rows_per_s": round(rows / med(src_s)),
            "snapshot_rows_per_s": round(rows / snap), "snapshot_seconds": round(snap, 3),
            "ratio": ratio, "target": SNAPSHOT_TARGET, "met": ratio >= SNAPSHOT_TARGET,
            "ratio_per_round": sorted(round(c / n, 3) for c, n in zip(copy_s, snap_s,
                                                                      strict=True))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ingest",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="sizes: pgbench scale 10 and 500,000 snapshot rows, times this")
    parser.add_argument("--backlog-seconds", type=float, default=60.0)
    parser.add_argument("--fresh-seconds", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--snapshot-only", action="store_true",
                        help="the snapshot rounds only; nothing written")
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    run = report.Run(NAME, argv)
    work = Path(tempfile.mkdtemp(prefix="lamina-bench-ingest-"))
    try:
        with running_server() as pg:
            snap = snapshot(pg, work, max(1000, round(500_000 * args.scale)), args.rounds)
            print(f"snapshot: {snap['ratio']} of COPY (median of {args.rounds}; rounds "
                  f"{snap['ratio_per_round']}; target >= {SNAPSHOT_TARGET}: "
                  f"{'met' if snap['met'] else 'MISSED'}; load {report.load_average()})",
                  flush=True)
            if args.snapshot_only:
                return 0
            pgbench_database(pg, max(1, round(10 * args.scale)))
            stream = streaming(pg, work, args.backlog_seconds, args.interval)
            print(f"streaming: lamina {stream['lamina_changes_per_s']:,} changes/s, "
                  f"pg_recvlogical {stream['pg_recvlogical_changes_per_s']:,}: "
                  f"{stream['ratio']} (target >= {STREAMING_TARGET}: "
                  f"{'met' if stream['met'] else 'MISSED'}; {stream['changes']:,} changes "
                  f"of {stream['pgbench_backlog']['transactions']:,} pgbench transactions)",
                  flush=True)
            fresh = freshness(pg, work, args.fresh_seconds, args.interval)
            print(f"freshness under pgbench -n -c 4 -j 2 ({fresh['pgbench']['tps']} tps): "
                  f"p50 {fresh['p50_ms']} ms, p99 {fresh['p99_ms']} ms, max "
                  f"{fresh['max_ms']} ms (target p99 <= {FRESHNESS_TARGET_MS:.0f}: "
                  f"{'met' if fresh['met'] else 'MISSED'})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = run.document({"scale": args.scale, "snapshot": snap, "streaming": stream,
                        "freshness": fresh})
    report.write_result(NAME, doc)
    chart(doc)
    return 0


def chart(doc: dict[str, Any]) -> None:
    snap, stream, fresh = doc["snapshot"], doc["streaming"], doc["freshness"]
    report.bar_chart(NAME, "Ingestion from PostgreSQL", [
        (f"snapshot, {snap['rows']:,} rows (rows/s)",
         {"lamina snapshot": snap["snapshot_rows_per_s"],
          "source alone": snap["source_only_rows_per_s"], "COPY": snap["copy_rows_per_s"]}),
        (f"streaming a pgbench backlog (changes/s, {stream['ratio']}x)",
         {"lamina ingest": stream["lamina_changes_per_s"],
          "pg_recvlogical": stream["pg_recvlogical_changes_per_s"]}),
        (f"commit -> sealed under pgbench, {fresh['pgbench']['tps']} tps (ms)",
         {"lamina p50": fresh["p50_ms"], "lamina p99": fresh["p99_ms"],
          "target p99": fresh["target_p99_ms"]}),
    ], ylabel="", note=f"load average {doc['load_average']['before'][0]} before, "
                       f"{doc['load_average']['after'][0]} after")


if __name__ == "__main__":
    sys.exit(main())
