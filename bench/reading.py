"""Reading benchmarks: subscription latency, key lookups, the Spark reader.

    .venv/bin/python -m bench.reading [--scale 1.0] [--rounds 5] [--seals 200]
        [--spark-scale 0.1]

- *Subscribe latency*: a writer appends 1,000 updates and seals, ``--seals`` times, 20 ms
  apart (fsync "always"); a subscription in another thread (default ``max_wait`` 0.05 s)
  records when each ``Progress`` arrives. Latency of a seal = arrival of the first
  ``Progress`` at or beyond it - return of ``seal`` (seals between two reads share one
  ``Progress``); p50, p99.
- *Lookup*: bench/lookup.py (100 keys in ``10M * scale`` rows vs snapshot + filter).
- *Spark reader*: ``lamina.spark.read_snapshot`` vs ``Relation.snapshot`` +
  ``spark.createDataFrame``, each run to completion with Spark's ``noop`` sink, on the
  lookup relation at ``--spark-scale`` (local[2]); median of ``--rounds``.

- *CLI output*: ``lamina snapshot --format jsonl`` and ``csv`` of the ``--spark-scale``
  relation (whole process, to /dev/null) against ``snapshot`` and ``snapshot_reader`` in
  process, and the former JSON lines encoding of the same rows.

Writes bench/results/reading.json and reading.png.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa

from bench import report
from bench.dataset import CACHE
from bench.lookup import RELATION, lookup_input, lookup_race
from lamina import CLOSED, Progress, Store

NAME = "reading"
SCHEMA = pa.schema([("id", pa.int64()), ("v", pa.int64())])


def subscribe_latency(seals: int) -> dict[str, Any]:
    work = CACHE / "work" / NAME
    shutil.rmtree(work, ignore_errors=True)
    arrived: dict[int, float] = {}
    sealed: dict[int, float] = {}
    try:
        with Store.open(work) as store:
            rel = store.create_relation("s", SCHEMA, ["id"])
            rel.seal(1)
            sub = Store.open(work).relation("s").subscribe(0)

            def consume() -> None:
                for item in sub:
                    if isinstance(item, Progress):
                        arrived[item.upper] = time.perf_counter()

            t = threading.Thread(target=consume, daemon=True)
            t.start()
            rng = np.random.default_rng(1)
            for i in range(seals):
                ids = rng.integers(0, 100_000, 1000)
                rel.append(pa.table({"id": ids, "v": ids, "_time": pa.array(
                    np.full(1000, i + 1, np.uint64)), "_diff": np.ones(1000, np.int64)}))
                rel.seal(i + 2)
                sealed[i + 2] = time.perf_counter()
                time.sleep(0.02)
            rel.seal(CLOSED)
            t.join(60)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # one Progress covers every seal up to it (seals between two reads coalesce)
    marks = sorted(arrived.items())
    lat = []
    for u, s in sealed.items():
        first = next((at for v, at in marks if v >= u), None)
        if first is None:
            raise SystemExit(f"no progress at or beyond {u} arrived")
        lat.append(first - s)
    lat.sort()
    return {"seals": seals, "updates_per_seal": 1000, "progress_markers": len(arrived),
            "p50_ms": round(
        1000 * statistics.median(lat), 2), "p99_ms": round(1000 * lat[int(0.99 * len(lat))], 2),
        "max_ms": round(1000 * lat[-1], 2)}


def spark_race(scale: float, rounds: int) -> dict[str, Any]:
    from lamina.compacter.spark import build_session
    from lamina.spark import read_snapshot

    root = lookup_input(scale)
    spark = build_session("local[2]", app_name="bench-reading")
    ours, theirs = [], []
    with Store.open(root) as store:
        rel = store.relation(RELATION)
        for r in range(rounds):
            t0 = time.perf_counter()
            read_snapshot(spark, root, RELATION, 2000).write.format("noop").mode(
                "overwrite").save()
            ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            spark.createDataFrame(rel.snapshot(2000)).write.format("noop").mode(
                "overwrite").save()
            theirs.append(time.perf_counter() - t0)
            print(f"  round {r + 1}/{rounds}: read_snapshot {ours[-1]:.2f} s, snapshot + "
                  f"createDataFrame {theirs[-1]:.2f} s", file=sys.stderr, flush=True)
        rows = rel.snapshot(2000).num_rows
    spark.stop()
    a, b = statistics.median(ours), statistics.median(theirs)
    return {"rows": rows, "read_snapshot_seconds": round(a, 3),
            "snapshot_create_dataframe_seconds": round(b, 3), "ratio": round(b / a, 2)}


def cli_output(scale: float, rounds: int) -> dict[str, Any]:
    """``lamina snapshot --format jsonl|csv`` (whole process, to /dev/null) against the
    snapshot it prints, in process; and the old JSON lines encoding (``json.dumps`` of
    every row of ``to_pylist``) of the same table."""
    import json
    import subprocess
    from pathlib import Path

    root = lookup_input(scale)
    lamina = str(Path(sys.executable).with_name("lamina"))

    def timed(fn: Any) -> float:
        ts = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return round(statistics.median(ts), 3)

    def cli(fmt: str) -> Any:
        return lambda: subprocess.run(
            [lamina, "snapshot", RELATION, "--as-of", "2000", "--data-dir", str(root),
             "--format", fmt], stdout=subprocess.DEVNULL, check=True)

    with Store.open(root) as store:
        rel = store.relation(RELATION)
        table = rel.snapshot(2000)
        return {"rows": table.num_rows,
                "snapshot_seconds": timed(lambda: rel.snapshot(2000)),
                "snapshot_reader_seconds": timed(lambda: rel.snapshot_reader(2000).read_all()),
                "old_jsonl_encoding_seconds": timed(lambda: "".join(
                    json.dumps(r, default=str) + "\n" for r in table.to_pylist()).encode()),
                "cli_jsonl_seconds": timed(cli("jsonl")), "cli_csv_seconds": timed(cli("csv"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reading",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seals", type=int, default=200)
    parser.add_argument("--spark-scale", type=float, default=0.1)
    args = parser.parse_args(argv)
    run = report.Run(NAME, argv)
    sub = subscribe_latency(args.seals)
    print(f"subscribe: seal -> progress p50 {sub['p50_ms']} ms, p99 {sub['p99_ms']} ms",
          flush=True)
    look = lookup_race(args.scale, args.rounds, 100)
    print(f"lookup: {look['lookup_seconds']} s vs snapshot + filter "
          f"{look['snapshot_filter_seconds']} s: {look['ratio']}x (target >= "
          f"{look['target']}): {'met' if look['met'] else 'MISSED'}", flush=True)
    sp = spark_race(args.spark_scale, max(1, min(args.rounds, 3)))
    print(f"spark: read_snapshot {sp['read_snapshot_seconds']} s vs snapshot + "
          f"createDataFrame {sp['snapshot_create_dataframe_seconds']} s ({sp['rows']:,} "
          "rows)", flush=True)
    out = cli_output(args.spark_scale, 3)
    print(f"lamina snapshot of {out['rows']:,} rows: jsonl {out['cli_jsonl_seconds']} s, csv "
          f"{out['cli_csv_seconds']} s; the snapshot {out['snapshot_seconds']} s", flush=True)
    doc = run.document({"scale": args.scale, "subscribe": sub, "lookup": look, "spark": sp,
                        "cli_output": out})
    report.write_result(NAME, doc)
    chart(doc)
    return 0


def chart(doc: dict[str, Any]) -> None:
    sub, look, sp = doc["subscribe"], doc["lookup"], doc["spark"]
    report.bar_chart(NAME, "Reading", [
        ("subscribe latency (ms)", {"p50": sub["p50_ms"], "p99": sub["p99_ms"]}),
        (f"{look['keys']} keys in {look['rows']:,} rows (s)",
         {"lookup": look["lookup_seconds"],
          "snapshot + filter": look["snapshot_filter_seconds"]}),
        (f"Spark, {sp['rows']:,} rows (s)",
         {"read_snapshot": sp["read_snapshot_seconds"],
          "snapshot + createDataFrame": sp["snapshot_create_dataframe_seconds"]}),
    ], ylabel="ms / s")


if __name__ == "__main__":
    sys.exit(main())
