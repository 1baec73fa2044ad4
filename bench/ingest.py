"""Ingestion from PostgreSQL: snapshot and streaming throughput, commit -> sealed freshness.

    .venv/bin/python -m bench.ingest [--scale 1.0] [--rounds 3] [--seconds 20]
        [--rate 5000] [--interval 1.0] [--snapshot-only]

``--snapshot-only``: *COPY*, *source alone* and *snapshot* only, each round's ratio
printed with the load average (nothing written to bench/results): the quick check of the
snapshot target.

Against a real PostgreSQL server started in a temporary directory
(tests/ingest/postgres/server.py: Debian's ``postgresql``, a Unix socket, ``fsync=off``),
a table ``snap`` of ``500,000 * scale`` rows ``(id int, name text, qty int, at timestamptz,
amount numeric(12,2))``:

- *COPY*: PostgreSQL's own ``COPY (SELECT ...) TO STDOUT (FORMAT csv)`` of the same rows
  into a discarding sink (psycopg2's ``copy_expert``), in the same run: the baseline.
- *Snapshot*: a :class:`~lamina.ingest.runner.SourceRunner` (what ``lamina ingest`` runs in
  a thread per source) on a new source, in this process: slot creation, the exported
  snapshot's ``COPY`` into the spool (parsed into Arrow while the ``COPY`` runs, see
  lamina.ingest.postgres.spool), the first binding, the append and fsync'd seal of the
  output relation. Timed from the runner's start until the output's
  upper passes the first binding's time (every row sealed). Target: >= 0.5 of COPY.
  Also the source alone (``PostgresSource.open`` + ``poll`` until its first ``Upper``,
  nothing written), to tell the decoding from the writing.
- *Streaming*: the runner stopped, the same number of rows inserted into a second table
  (100 transactions), a new runner started on the slot: timed until the output's upper
  passes the binding covering the last commit (pgoutput decoding, reclocking, append, seal),
  against COPY of those rows.
- *Freshness*: ``lamina ingest`` as a real process (``timestamp_interval_seconds =
  --interval``), a writer committing ``--rate`` rows/s (transactions of 50 rows on a fixed
  schedule) for ``--seconds``, a reader in this process on ``Relation.subscribe`` recording
  when each ``Progress`` arrives. Freshness of a commit = the first ``Progress`` whose upper
  passes the commit's reclocked time (its rows' ``_time``) - the return of ``COMMIT``; p50,
  p99 (the first 2 s left out). Target: p99 <= 2 x ``--interval``.

Snapshot and streaming are the median of ``--rounds`` (each round a new source, slot and
output). Writes bench/results/ingest.json and ingest.png.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import structlog
from tests.ingest.postgres.server import PgServer, running_server
from tests.ingest.procs import Ingest, write_config

from bench import report
from lamina import CLOSED, Progress, Store
from lamina.ingest.metrics import IngestMetrics
from lamina.ingest.postgres import PostgresSource
from lamina.ingest.runner import SourceRunner
from lamina.ingest.settings import PostgresSourceSettings
from lamina.ingest.source import Transaction, Upper
from lamina.read import updates_at

NAME = "ingest"
COLS = "id, name, qty, at, amount"
TABLE = ("(id int PRIMARY KEY, name text, qty int, at timestamptz, amount numeric(12,2))")
SNAPSHOT_TARGET = 0.5
TXNS = 100
"""Transactions the streamed rows are committed in."""
FRESH_TXN_ROWS = 50
WARMUP_SECONDS = 2.0


class _Sink(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return len(memoryview(b))


def _fill(pg: PgServer, table: str, first: int, rows: int, txns: int = 1) -> None:
    step = -(-rows // txns)
    with pg.connect() as conn:
        conn.autocommit = False
        with conn.cursor() as cur:
            for lo in range(first, first + rows, step):
                hi = min(first + rows, lo + step) - 1
                cur.execute(f"INSERT INTO {table} SELECT g, 'name ' || g, g % 100, now(), "  # noqa: S608
                            f"g / 7.0 FROM generate_series({lo}, {hi}) g")
                conn.commit()


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
        got += sum(e.changes["public.snap"].num_rows for e in evs
                   if isinstance(e, Transaction))
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


class _Runner:
    """A SourceRunner in a thread, as ``lamina ingest`` runs one."""

    def __init__(self, settings: PostgresSourceSettings, store: Store) -> None:
        self.runner = SourceRunner(settings, PostgresSource.from_settings(settings), store,
                                   IngestMetrics())
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.runner.run, args=(self.stop,), daemon=True)

    def start(self) -> None:
        self.thread.start()

    def sealed_past(self, relation: str, offset: int, timeout: float = 600.0) -> None:
        """Wait until a binding covers ``offset`` and ``relation``'s upper passes its time."""
        r = self.runner
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            b = r.binding
            outs = [o for o in r.outputs.values() if o.relation == relation]
            if b is not None and b.upper > offset and outs and outs[0].upper > b.time:
                return
            if r.health.state == "stalled":
                raise AssertionError(f"source stalled: {r.status()}")
            time.sleep(0.005)
        raise AssertionError(f"{relation} not sealed past {offset} in {timeout} s")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)


def _lsn(pg: PgServer) -> int:
    from lamina.ingest.postgres.pgoutput import parse_lsn

    # the insert position: with synchronous_commit = off pg_current_wal_lsn() (the write
    # position) can be behind commits that already returned
    return parse_lsn(pg.query("SELECT pg_current_wal_insert_lsn()::text")[0][0])


def throughput(pg: PgServer, work: Path, rows: int, rounds: int,
               streaming: bool = True) -> dict[str, Any]:
    pg.execute(f"CREATE TABLE snap {TABLE}", "ALTER TABLE snap REPLICA IDENTITY FULL")
    _fill(pg, "snap", 1, rows)
    with pg.connect() as conn:
        conn.cursor().execute("VACUUM ANALYZE snap")
    copy_s, src_s, snap_s, stream_s, copy_stream_s = [], [], [], [], []
    for r in range(rounds):
        copy_s.append(copy_seconds(pg, "snap"))
        src_s.append(source_snapshot_seconds(pg, f"bench_src{r}", rows))
        table = f"stream{r}"
        pg.execute(f"CREATE TABLE {table} {TABLE}", f"ALTER TABLE {table} REPLICA IDENTITY FULL")
        settings = PostgresSourceSettings(name=f"r{r}", kind="postgres", dsn=pg.dsn,
                                          tables=["public.snap", f"public.{table}"],
                                          timestamp_interval_seconds=0.1)
        data = work / f"data{r}"
        with Store.open(data) as store:
            run = _Runner(settings, store)
            t0 = time.perf_counter()
            run.start()
            run.sealed_past(f"r{r}.snap", -1)
            snap_s.append(time.perf_counter() - t0)
            run.close()
            n = store.relation(f"r{r}.snap").snapshot(store.relation(f"r{r}.snap").upper - 1)
            if n.num_rows != rows:
                raise AssertionError(f"snapshot sealed {n.num_rows} rows, not {rows}")
            if not streaming:
                shutil.rmtree(data, ignore_errors=True)
                print(f"  round {r + 1}/{rounds}: load {os.getloadavg()[0]:.2f}, COPY "
                      f"{copy_s[-1]:.3f} s, source alone {src_s[-1]:.3f} s, snapshot "
                      f"{snap_s[-1]:.3f} s: {copy_s[-1] / snap_s[-1]:.3f} of COPY",
                      file=sys.stderr, flush=True)
                continue
            _fill(pg, table, 1, rows, TXNS)   # committed while lamina is stopped
            end = _lsn(pg)
            run = _Runner(settings, store)
            t0 = time.perf_counter()
            run.start()
            run.sealed_past(f"r{r}.{table}", end - 1)
            stream_s.append(time.perf_counter() - t0)
            run.close()
            got = store.relation(f"r{r}.{table}")
            if (m := got.snapshot(got.upper - 1).num_rows) != rows:
                raise AssertionError(f"streaming sealed {m} rows, not {rows}")
        copy_stream_s.append(copy_seconds(pg, table))
        shutil.rmtree(data, ignore_errors=True)
        print(f"  round {r + 1}/{rounds}: COPY {copy_s[-1]:.2f} s, source alone "
              f"{src_s[-1]:.2f} s, snapshot {snap_s[-1]:.2f} s, streaming {stream_s[-1]:.2f} s "
              f"(COPY {copy_stream_s[-1]:.2f} s)", file=sys.stderr, flush=True)
    med = statistics.median
    copy, snap = med(copy_s), med(snap_s)
    ratio = round(copy / snap, 3)
    per_round = sorted(c / n for c, n in zip(copy_s, snap_s, strict=True))
    if not streaming:
        return {"rows": rows, "rounds": rounds, "copy_seconds": round(copy, 3),
                "source_only_seconds": round(med(src_s), 3),
                "snapshot_seconds": round(snap, 3), "snapshot_ratio_to_copy": ratio,
                "snapshot_ratio_per_round": [round(x, 3) for x in per_round],
                "snapshot_met": ratio >= SNAPSHOT_TARGET}
    stream, cstream = med(stream_s), med(copy_stream_s)
    return {"rows": rows, "rounds": rounds, "streamed_transactions": TXNS,
            "copy_rows_per_s": round(rows / copy), "copy_seconds": round(copy, 3),
            "source_only_rows_per_s": round(rows / med(src_s)),
            "snapshot_rows_per_s": round(rows / snap), "snapshot_seconds": round(snap, 3),
            "snapshot_ratio_to_copy": ratio, "snapshot_target": SNAPSHOT_TARGET,
            "snapshot_met": ratio >= SNAPSHOT_TARGET,
            "streaming_rows_per_s": round(rows / stream),
            "streaming_seconds": round(stream, 3),
            "copy_streamed_rows_per_s": round(rows / cstream),
            "streaming_ratio_to_copy": round(cstream / stream, 3),
            "seconds_per_round": {"copy": copy_s, "source_only": src_s, "snapshot": snap_s,
                                  "streaming": stream_s, "copy_streamed": copy_stream_s}}


def freshness(pg: PgServer, work: Path, seconds: float, rate: int,
              interval: float) -> dict[str, Any]:
    pg.execute(f"CREATE TABLE fresh {TABLE[:-1]}, txn int)",
               "ALTER TABLE fresh REPLICA IDENTITY FULL")
    data = work / "fresh-data"
    tables = '"public.fresh"'
    cfg = write_config(work / "ingest.toml", data, [
        f'[[sources]]\nname = "f"\nkind = "postgres"\ndsn = "{pg.dsn}"\n'
        f"tables = [{tables}]\ntimestamp_interval_seconds = {interval}\n"])
    proc = Ingest(cfg, work / "ingest.log")
    progress: list[tuple[float, int]] = []
    commits: list[float] = []
    stop = threading.Event()
    try:
        proc.wait_for(lambda st: st["f"]["state"] == "running"
                      and st["f"]["binding_upper"] is not None, timeout=120)
        with Store.open(data) as store:
            rel = store.relation("f.fresh")
            deadline = time.monotonic() + 30
            while rel.upper == 0 and time.monotonic() < deadline:
                time.sleep(0.01)

            def reader() -> None:
                for ev in rel.subscribe(rel.upper - 1, snapshot=False, stop=stop,
                                        max_wait=0.01):
                    if isinstance(ev, Progress):
                        progress.append((time.time(), ev.upper))
                        if ev.upper == CLOSED:
                            return

            t = threading.Thread(target=reader, daemon=True)
            t.start()
            period = FRESH_TXN_ROWS / rate
            n = int(seconds / period)
            with pg.connect() as conn:
                conn.autocommit = False
                with conn.cursor() as cur:
                    start = time.monotonic()
                    for i in range(n):
                        delay = start + i * period - time.monotonic()
                        if delay > 0:
                            time.sleep(delay)
                        lo = i * FRESH_TXN_ROWS
                        cur.execute("INSERT INTO fresh SELECT g, 'name ' || g, g %% 100, now(), "
                                    "g / 7.0, %s FROM generate_series(%s, %s) g",
                                    (i, lo, lo + FRESH_TXN_ROWS - 1))
                        conn.commit()
                        commits.append(time.time())
                    behind = time.monotonic() - (start + n * period)
            end = _lsn(pg)
            proc.wait_for(lambda st: st["f"]["binding_upper"] is not None and _lsn_text(
                st["f"]["binding_upper"]) > end, timeout=120)
            time.sleep(3 * interval + 0.5)
            stop.set()
            t.join(30)
            ups = updates_at(store.layout, rel.meta, rel.upper - 1)
        assert proc.terminate() == 0
    finally:
        stop.set()
        proc.kill()
    txn_time: dict[int, int] = {}
    for txn, tm in zip(ups.column("txn").to_pylist(), ups.column("_time").to_pylist(),
                       strict=True):
        if txn_time.setdefault(txn, tm) != tm:
            raise AssertionError(f"transaction {txn} split over times {txn_time[txn]}, {tm}")
    if len(txn_time) != len(commits) or ups.num_rows != len(commits) * FRESH_TXN_ROWS:
        raise AssertionError(f"{len(txn_time)} transactions, {ups.num_rows} rows landed; "
                             f"{len(commits)} committed")
    lat: list[float] = []
    for i, committed in enumerate(commits):
        if committed - commits[0] < WARMUP_SECONDS:
            continue
        seen = next((w for w, up in progress if up > txn_time[i]), None)
        if seen is None:
            raise AssertionError(f"transaction {i} never observed sealed")
        lat.append(seen - committed)
    lat.sort()

    def q(p: float) -> float:
        return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1000, 1)

    p99 = q(0.99)
    target = 2 * interval * 1000
    return {"rate_rows_per_s": rate, "rows_per_transaction": FRESH_TXN_ROWS,
            "transactions": len(commits), "measured": len(lat), "seconds": seconds,
            "writer_behind_schedule_s": round(behind, 3),
            "timestamp_interval_seconds": interval, "p50_ms": q(0.5), "p99_ms": p99,
            "max_ms": round(lat[-1] * 1000, 1), "target_p99_ms": target,
            "met": p99 <= target}


def _lsn_text(text: str) -> int:
    from lamina.ingest.postgres.pgoutput import parse_lsn

    return parse_lsn(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ingest",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=int, default=5000)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--snapshot-only", action="store_true",
                        help="COPY, source alone and snapshot only; nothing written")
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    if args.snapshot_only:
        work = Path(tempfile.mkdtemp(prefix="lamina-bench-ingest-"))
        try:
            with running_server() as pg:
                load = os.getloadavg()[0]
                thr = throughput(pg, work, max(1000, int(500_000 * args.scale)), args.rounds,
                                 streaming=False)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        per = thr["snapshot_ratio_per_round"]
        print(f"snapshot: {thr['snapshot_ratio_to_copy']} of COPY (median of "
              f"{args.rounds}; rounds {per[0]}-{per[-1]}; COPY {thr['copy_seconds']} s, "
              f"source alone {thr['source_only_seconds']} s, snapshot "
              f"{thr['snapshot_seconds']} s; target >= {SNAPSHOT_TARGET}: "
              f"{'met' if thr['snapshot_met'] else 'MISSED'}; load average {load:.2f} "
              f"before, {os.getloadavg()[0]:.2f} after)", flush=True)
        return 0
    run = report.Run(NAME, argv)
    work = Path(tempfile.mkdtemp(prefix="lamina-bench-ingest-"))
    try:
        with running_server() as pg:
            thr = throughput(pg, work, max(1000, int(500_000 * args.scale)), args.rounds)
            print(f"snapshot: {thr['snapshot_rows_per_s']:,} rows/s vs COPY "
                  f"{thr['copy_rows_per_s']:,} rows/s: {thr['snapshot_ratio_to_copy']}x "
                  f"(target >= {SNAPSHOT_TARGET}): "
                  f"{'met' if thr['snapshot_met'] else 'MISSED'}; streaming "
                  f"{thr['streaming_rows_per_s']:,} rows/s", flush=True)
            fr = freshness(pg, work, args.seconds, args.rate, args.interval)
            print(f"freshness at {args.rate} rows/s: p50 {fr['p50_ms']} ms, p99 "
                  f"{fr['p99_ms']} ms (target <= {fr['target_p99_ms']} ms): "
                  f"{'met' if fr['met'] else 'MISSED'}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = run.document({"scale": args.scale, "throughput": thr, "freshness": fr})
    report.write_result(NAME, doc)
    chart(doc)
    return 0


def chart(doc: dict[str, Any]) -> None:
    thr, fr = doc["throughput"], doc["freshness"]
    report.bar_chart(NAME, "Ingestion from PostgreSQL", [
        (f"snapshot, {thr['rows']:,} rows (rows/s)",
         {"lamina snapshot": thr["snapshot_rows_per_s"],
          "source alone": thr["source_only_rows_per_s"], "COPY": thr["copy_rows_per_s"]}),
        (f"streaming, {thr['rows']:,} rows (rows/s)",
         {"lamina streaming": thr["streaming_rows_per_s"],
          "COPY": thr["copy_streamed_rows_per_s"]}),
        (f"commit -> sealed at {fr['rate_rows_per_s']:,} rows/s (ms)",
         {"lamina p50": fr["p50_ms"], "lamina p99": fr["p99_ms"],
          "target p99": fr["target_p99_ms"]}),
    ], ylabel="", note=f"load average {doc['load_average']['before'][0]} before, "
                       f"{doc['load_average']['after'][0]} after")


if __name__ == "__main__":
    sys.exit(main())
