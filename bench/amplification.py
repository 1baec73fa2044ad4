"""Write amplification of the merge policy, and trace size against the snapshot.

    .venv/bin/python -m bench.amplification [--scale 1.0] [--appends 1000]

Both parts drive a relation through :class:`lamina.Store` (fsync "never", one finished WAL
segment per append) and run the compacter's steps after every append exactly as its
pipeline does: plan the conversion of the new segment, convert, then merge while
``plan_merge`` finds two adjacent batches of one level. The steps run on the reference
executor (:mod:`lamina.compacter.executors.reference`), in process: the policy
(``trace.plan``) is the one the daemon uses with Spark, and the Spark jobs write the same
rows (one Parquet part per batch here, where Spark may write several for big batches).

1. **Amplification** (since never advances): ``--appends`` equal appends of
   ``1000 * scale`` updates, each of a fresh row (a random key) at a fresh time, so
   nothing consolidates and every merge rewrites all its input. Reported: bytes written by
   all merges over the bytes the conversions wrote (the appended data as Parquet), against
   the bound ``1 + log2(appends)``; the same for rows (Parquet compresses big sorted files
   better, so bytes alone flatter the policy); the WAL bytes appended; the number of merges
   and of live batches.
2. **Trace size** (since follows upper): 100,000 distinct keys are inserted, then
   ``--appends`` appends each update ``500 * scale`` random keys (a retraction of the old
   row and an insertion of the new one), and after every seal ``allow_compaction(upper - 1)``
   (since right behind the upper, the last time a snapshot can read).
   Reported: the trace's bytes (batches and pending parts) over the bytes of the
   consolidated snapshot written as one Parquet part the same way (``write_part``, times
   forwarded to since), every 100 appends and at the end; target <= 1.5. Also the bytes
   the merges wrote over the bytes converted (the price of that compactness).

Writes bench/results/amplification.json and amplification.png.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from bench import report
from bench.dataset import CACHE
from lamina import Store
from lamina.compacter.executors import reference
from lamina.objstore.local import LocalObjectStore
from lamina.schema import RelationMeta
from lamina.store import Relation
from lamina.trace.batch import write_part
from lamina.trace.plan import plan_conversion, plan_merge
from lamina.trace.trace import Trace
from lamina.wal.reader import finished_segments, segment_spans

NAME = "amplification"
SCHEMA = pa.schema([("id", pa.int64()), ("value", pa.int64()), ("tag", pa.string())])
TRACE_TARGET = 1.5
KEYS = 100_000


class Compacter:
    """The pipeline's steps for one relation, on the reference executor, counting bytes."""

    def __init__(self, store: Store, rel: Relation) -> None:
        self.rel = rel
        self.wal_dir = store.layout.wal_dir(rel.name)
        self.trace = Trace.open(store.layout.trace_store(rel.name), rel.meta)
        self.converted_bytes = self.converted_rows = 0
        self.merged_bytes = self.merged_rows = 0
        self.merges = 0
        self.steps = 0

    def step(self) -> None:
        st = self.trace.state
        spans = list(segment_spans(self.wal_dir, self.rel.name, after=st.converted_through))
        if spans:
            plan = plan_conversion(st, spans)
            parts, pending = reference.run_conversion(self.trace, plan)
            self.trace.commit_conversion(plan, parts, pending)
            self.converted_bytes += sum(p.bytes for p in parts)
            self.converted_bytes += sum(p.part.bytes for p in pending)
            self.converted_rows += sum(p.rows for p in parts)
            self.converted_rows += sum(p.part.rows for p in pending)
            self.trace.delete_converted_segments(self.wal_dir)
        while (mplan := plan_merge(self.trace.state)) is not None:
            merged = reference.run_merge(self.trace, mplan)
            self.trace.commit_merge(mplan, merged)
            self.merged_bytes += sum(p.bytes for p in merged)
            self.merged_rows += sum(p.rows for p in merged)
            self.merges += 1
        self.steps += 1
        if self.steps % 50 == 0:  # merged parents: gone once no kept state names them
            self.trace.collect_garbage(keep_versions=1, grace_seconds=0)


def _rows(ids: np.ndarray, values: np.ndarray, time_: np.ndarray, diffs: np.ndarray
          ) -> pa.Table:
    tags = pa.array([f"t{v % 1000:03d}" for v in values.tolist()], pa.string())
    return pa.table({"id": pa.array(ids), "value": pa.array(values), "tag": tags,
                     "_time": pa.array(time_, pa.uint64()), "_diff": pa.array(diffs)})


def amplification(root: Path, appends: int, per: int) -> dict[str, Any]:
    rng = np.random.default_rng(3)
    with Store.open(root, fsync="never", segment_bytes=4096) as store:
        rel = store.create_relation("amp", SCHEMA, key=["id"])
        comp = Compacter(store, rel)
        wal = 0
        for i in range(appends):
            ids = rng.integers(0, 1 << 40, per, dtype=np.int64)  # fresh rows, random keys
            times = rng.integers(10 * i, 10 * i + 10, per).astype(np.uint64)
            table = _rows(ids, ids * 7, times, np.ones(per, dtype=np.int64))
            rel.append(table)
            rel.seal(10 * i + 10)
            wal += sum(s.path.stat().st_size for s in finished_segments(comp.wal_dir)
                       if s.seq > comp.trace.state.converted_through)
            comp.step()
        st = comp.trace.state
    ratio = comp.merged_bytes / comp.converted_bytes
    bound = 1 + math.log2(appends)
    return {"appends": appends, "updates_per_append": per, "wal_bytes_appended": wal,
            "converted_bytes": comp.converted_bytes, "merged_bytes": comp.merged_bytes,
            "merges": comp.merges, "live_batches": len(st.batches),
            "levels": st.batches_by_level(), "ratio": round(ratio, 3),
            "converted_rows": comp.converted_rows, "merged_rows": comp.merged_rows,
            "rows_ratio": round(comp.merged_rows / comp.converted_rows, 3),
            "bound": round(bound, 3), "met": ratio <= bound}


def snapshot_bytes(meta: RelationMeta, rel: Relation, work: Path) -> int:
    """The consolidated snapshot at the last sealed time, as one part written like a batch
    (times forwarded to since)."""
    upper, since = rel.upper, rel.since
    snap = rel.snapshot(upper - 1)
    table = pa.Table.from_arrays(
        [*(snap.column(c) for c in meta.row_columns),
         pa.array(np.full(snap.num_rows, since, dtype=np.uint64)), snap.column("_diff")],
        schema=meta.update_schema)
    part = write_part(LocalObjectStore(work), "snapshot.parquet", meta.update_schema, [table])
    (work / part.path).unlink()
    return part.bytes


def trace_size(root: Path, appends: int, per: int) -> dict[str, Any]:
    rng = np.random.default_rng(5)
    series = []
    with Store.open(root, fsync="never", segment_bytes=4096) as store:
        rel = store.create_relation("upd", SCHEMA, key=["id"])
        comp = Compacter(store, rel)
        current = rng.integers(0, 1 << 30, KEYS)
        ids = np.arange(KEYS, dtype=np.int64)
        rel.append(_rows(ids, current, np.zeros(KEYS, dtype=np.uint64),
                         np.ones(KEYS, dtype=np.int64)))
        rel.seal(1)
        comp.step()
        for i in range(1, appends + 1):
            keys = rng.choice(KEYS, per, replace=False)
            fresh = rng.integers(0, 1 << 30, per)
            both = np.concatenate([keys, keys])
            table = _rows(both, np.concatenate([current[keys], fresh]),
                          np.full(2 * per, i, dtype=np.uint64),
                          np.concatenate([-np.ones(per, dtype=np.int64),
                                          np.ones(per, dtype=np.int64)]))
            current[keys] = fresh
            rel.append(table)
            rel.seal(i + 1)
            rel.allow_compaction(i)  # since follows the upper (snapshots stay readable)
            comp.step()
            if i % 100 == 0 or i == appends:
                st = comp.trace.state
                snap = snapshot_bytes(rel.meta, rel, root)
                series.append({"appends": i, "trace_bytes": st.bytes, "snapshot_bytes": snap,
                               "batches": len(st.batches), "rows": st.rows,
                               "ratio": round(st.bytes / snap, 3)})
                print(f"  trace size: {i} appends, {len(st.batches)} batches, "
                      f"{st.bytes:,} bytes vs snapshot {snap:,}: {st.bytes / snap:.3f}",
                      file=sys.stderr, flush=True)
    last = series[-1]
    worst = max(s["ratio"] for s in series)
    return {"keys": KEYS, "appends": appends, "keys_per_append": per,
            "merges": comp.merges, "converted_bytes": comp.converted_bytes,
            "merged_bytes": comp.merged_bytes,
            "merge_ratio": round(comp.merged_bytes / comp.converted_bytes, 3),
            "series": series, "ratio": last["ratio"],
            "worst_ratio": worst, "target": TRACE_TARGET, "met": worst <= TRACE_TARGET}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.amplification",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--appends", type=int, default=1000)
    args = parser.parse_args(argv)
    run = report.Run(NAME, argv)
    work = CACHE / "work" / NAME
    shutil.rmtree(work, ignore_errors=True)
    try:
        started = time.monotonic()
        amp = amplification(work / "amp", args.appends, max(1, round(1000 * args.scale)))
        amp["seconds"] = round(time.monotonic() - started, 1)
        print(f"amplification: merges wrote {amp['ratio']}x the appended bytes "
              f"(bound {amp['bound']}): {'met' if amp['met'] else 'MISSED'}", flush=True)
        started = time.monotonic()
        size = trace_size(work / "upd", args.appends, max(1, round(500 * args.scale)))
        size["seconds"] = round(time.monotonic() - started, 1)
        print(f"trace size: {size['ratio']}x the snapshot at the end, worst "
              f"{size['worst_ratio']}x (target <= {TRACE_TARGET}): "
              f"{'met' if size['met'] else 'MISSED'}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = run.document({"scale": args.scale,
                        "executor": "reference (lamina.compacter.executors.reference)",
                        "amplification": amp, "trace_size": size})
    report.write_result(NAME, doc)
    report.bar_chart(NAME, "Merge policy: write amplification and trace size", [
        ("merge bytes / appended bytes", {"lamina": amp["ratio"], "bound": amp["bound"]}),
        ("trace bytes / snapshot bytes (worst)",
         {"lamina": size["worst_ratio"], "target": TRACE_TARGET}),
    ], ylabel="ratio", note=f"{args.appends} appends; reference executor; load "
                            f"{doc['load_average']['before'][0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
