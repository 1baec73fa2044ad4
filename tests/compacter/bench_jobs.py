"""Wall times of Spark conversions against the reference executor (not a test).

    .venv/bin/python -m tests.compacter.bench_jobs --updates 1000000 --master 'local[*]'

1. A typical small conversion: a few finished segments holding ``--small`` updates,
   converted ``--repeat`` times with a warm session (median reported).
2. A big conversion of ``--updates`` updates (10,000 per append, times advancing, half as
   many distinct ids as updates, some retractions), by the reference executor and by Spark
   (first run, which pays the JVM's warm-up, and a second one).

Both executors carry out the same plan; the outputs are compared.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa

from lamina.compacter.executors import reference
from lamina.compacter.spark import build_session
from lamina.compacter.step.driver import spark_convert
from lamina.trace.plan import plan_conversion
from tests.compacter.workload import (
    INT_KEY,
    assert_same_conversion,
    drive,
    open_workload,
    spans,
)

SCHEMA = pa.schema([("id", pa.int64()), ("item", pa.string())])


def big_workload(root: Path, updates: int, per: int = 10_000) -> tuple[object, object]:
    w = open_workload(root, SCHEMA, ["id"], segment_bytes=16 << 20)
    rng = random.Random(0)
    t = 0
    for _ in range(max(1, updates // per)):
        ids = [rng.randrange(max(1, updates // 2)) for _ in range(per)]
        w.rel.append(pa.table({
            "id": pa.array(ids, pa.int64()),
            "item": pa.array([f"item-{x % 1000}" for x in ids]),
            "_time": pa.array([t + rng.randrange(10) for _ in range(per)], pa.uint64()),
            "_diff": pa.array([rng.choice((1, 1, -1, 2)) for _ in range(per)], pa.int64()),
        }))
        t += 10
        w.rel.seal(t)
    w.rel.append(pa.table({"id": [1], "item": ["x"], "_time": pa.array([t + 5], pa.uint64()),
                           "_diff": [1]}))
    w.rel.seal(t + 1)  # finishes the last segment
    return w, w.trace()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--updates", type=int, default=1_000_000)
    parser.add_argument("--small", type=int, default=2_000)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--master", default="local[*]")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lamina-bench-"))
    started = time.monotonic()
    spark = build_session(args.master, app_name="lamina-bench")
    print(f"session start: {time.monotonic() - started:.2f} s", flush=True)

    w = open_workload(root / "small", INT_KEY, ["id"], segment_bytes=16 << 10)
    drive(w, random.Random(1), steps=max(1, args.small // 100), rows_per_step=100, keys=500,
          future=0.05)
    trace = w.trace()
    plan = plan_conversion(trace.state, spans(trace, w.wal_dir))
    ref = w.fork(trace, "ref")
    t0 = time.monotonic()
    want = reference.run_conversion(ref, plan)
    ref_s = time.monotonic() - t0
    times = []
    for _ in range(args.repeat):
        t0 = time.monotonic()
        got = spark_convert(spark, trace, plan)
        times.append(time.monotonic() - t0)
    assert_same_conversion(trace, got, ref, want, plan=plan)
    print(f"small conversion: {sum(s.bytes for s in plan.segments) / 1e3:.0f} kB in "
          f"{len(plan.segments)} segments, {args.small} updates: spark first "
          f"{times[0]:.2f} s, median {statistics.median(times):.2f} s "
          f"(min {min(times):.2f}); reference {ref_s:.3f} s", flush=True)

    big, btrace = big_workload(root / "big", args.updates)
    plan = plan_conversion(btrace.state, spans(btrace, big.wal_dir))  # type: ignore[attr-defined]
    bref = big.fork(btrace, "ref")  # type: ignore[attr-defined]
    t0 = time.monotonic()
    want = reference.run_conversion(bref, plan)
    ref_s = time.monotonic() - t0
    runs = []
    for _ in range(2):
        t0 = time.monotonic()
        got = spark_convert(spark, btrace, plan)
        runs.append(time.monotonic() - t0)
    assert_same_conversion(btrace, got, bref, want, plan=plan)
    print(f"big conversion: {args.updates} updates, "
          f"{sum(s.bytes for s in plan.segments) / 1e6:.1f} MB in {len(plan.segments)} "
          f"segments -> {sum(p.rows for p in got.parts)} rows in {len(got.parts)} parts: "
          f"reference {ref_s:.2f} s; spark {runs[0]:.2f} s, then {runs[1]:.2f} s", flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
