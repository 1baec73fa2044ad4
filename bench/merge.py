"""Merge throughput: two trace batches into one, lamina against baselines.

    .venv/bin/python -m bench.merge [--scale 1.0] [--rounds 5] [--master 'local[*]']
                                    [--verify]

The input (:func:`bench.dataset.merge_input`): two adjacent level-0 batches of
``5M * scale`` consolidated updates each over ``1M * scale`` rows, 20% retractions, and a
trace ``since`` at the left batch's upper, so the merge forwards the left batch's times and
consolidates. Contenders, each in a child process, warmed up on a tenth of the input and
once on the input itself, then run ``--rounds`` times interleaved
(:func:`bench.procs.compare`):

- **lamina**: ``step.driver.spark_merge`` on the plan the daemon would make (``plan_merge``), then
  ``Trace.commit_merge``, on a fresh copy of the trace (copied before the clock starts);
- **duckdb**: ``read_parquet`` of the parents' files, times below since forwarded, grouped
  by row and time, diffs summed, zero sums dropped, ordered, one zstd Parquet file;
- **naive**: the parents read with pyarrow, ``spark.createDataFrame``, the same forwarding
  with ``when``, ``groupBy().agg(sum)``, filter, ``orderBy``, ``write.parquet`` (zstd).

Targets as for conversions: lamina >= 0.5x DuckDB's throughput and >= 3x the naive job's.
Writes bench/results/merge.json and merge.png; ``--verify`` checks lamina's merged batch
against the reference executor's.
"""

from __future__ import annotations

import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bench import procs, report
from bench.convert import TARGETS, dir_bytes
from bench.dataset import CACHE, Input, merge_input, warm_scale
from bench.procs import SparkContender, compare
from lamina.objstore.local import LocalObjectStore

NAME = "merge"
CONTENDERS = ("lamina", "duckdb", "naive")


def _parents(inp: Input) -> tuple[list[Path], int]:
    """The parents' files and the trace's since."""
    from lamina.trace.state import StateStore

    state = StateStore(LocalObjectStore(inp.trace_dir)).load_latest()
    assert state is not None
    return [inp.trace_dir / p.path for b in state.batches for p in b.parts], state.since


def lamina_run(spark: Any, inp: Input, work: Path, keep: bool = False) -> dict[str, Any]:
    from lamina.compacter.step.driver import spark_merge
    from lamina.trace.plan import plan_merge
    from lamina.trace.trace import Trace

    trace_dir = work / f"trace-{uuid.uuid4().hex[:8]}"
    shutil.copytree(inp.trace_dir, trace_dir)
    trace = Trace.open(LocalObjectStore(trace_dir), inp.meta)
    plan = plan_merge(trace.state)
    assert plan is not None
    started = time.monotonic()
    parts = spark_merge(spark, trace, plan)
    state = trace.commit_merge(plan, parts)
    seconds = time.monotonic() - started
    out: dict[str, Any] = {"seconds": seconds, "rows_out": sum(p.rows for p in parts),
                           "bytes_out": sum(p.bytes for p in parts), "parts": len(parts),
                           "level": state.batches[plan.index].level}
    if keep:
        out["trace_dir"] = str(trace_dir)
    else:
        shutil.rmtree(trace_dir)
    return out


def duckdb_run(inp: Input, work: Path) -> dict[str, Any]:
    import duckdb

    out = work / f"duckdb-{uuid.uuid4().hex[:8]}.parquet"
    files, since = _parents(inp)
    rows = ", ".join(inp.meta.row_columns)
    order = ", ".join([*inp.meta.sort_columns, "_time"])
    sources = ", ".join(f"'{f}'" for f in files)
    started = time.monotonic()
    con = duckdb.connect()
    # built from the relation's column names, the trace's since and its file names only
    sql = (f"COPY (SELECT {rows}, _time, CAST(SUM(_diff) AS BIGINT) AS _diff "  # noqa: S608
           f"FROM (SELECT {rows}, CASE WHEN _time < {since} THEN {since}::UBIGINT "
           f"ELSE _time END AS _time, _diff FROM read_parquet([{sources}])) "
           f"GROUP BY {rows}, _time HAVING SUM(_diff) <> 0 ORDER BY {order}) "
           f"TO '{out}' (FORMAT parquet, COMPRESSION zstd)")
    con.execute(sql)
    con.close()
    seconds = time.monotonic() - started
    result = {"seconds": seconds, "rows_out": int(pq.ParquetFile(out).metadata.num_rows),
              "bytes_out": out.stat().st_size}
    out.unlink()
    return result


def naive_run(spark: Any, inp: Input, work: Path) -> dict[str, Any]:
    from pyspark.sql import functions as F

    out = work / f"naive-{uuid.uuid4().hex[:8]}"
    files, since = _parents(inp)
    started = time.monotonic()
    table = pa.concat_tables(pq.read_table(f) for f in files)
    table = table.set_column(table.schema.get_field_index("_time"), "_time",
                             pc.cast(table.column("_time"), pa.int64()))
    df = spark.createDataFrame(table)
    forwarded = F.when(F.col("_time") < F.lit(since), F.lit(since)).otherwise(F.col("_time"))
    (df.withColumn("_time", forwarded)
       .groupBy(*inp.meta.row_columns, "_time").agg(F.sum("_diff").alias("_diff"))
       .filter(F.col("_diff") != 0)
       .orderBy(*inp.meta.sort_columns, "_time")
       .write.option("compression", "zstd").parquet(str(out)))
    seconds = time.monotonic() - started
    result = {"seconds": seconds, "bytes_out": dir_bytes(out)}
    shutil.rmtree(out)
    return result


class Contender(SparkContender):
    """A child's state: its session (if any), the input and a scratch directory."""

    def __init__(self, name: str, scale: float, master: str) -> None:
        super().__init__(NAME, name, master, CACHE)
        self.inp = merge_input(scale, log=False)
        self.run(merge_input(warm_scale(scale), log=False))  # Python workers, JIT
        self.run(self.inp)  # memory pools at full size, page cache

    def run(self, inp: Input, keep: bool = False) -> dict[str, Any]:
        if self.name == "lamina":
            return lamina_run(self.spark, inp, self.work, keep)
        if self.name == "duckdb":
            return duckdb_run(inp, self.work)
        return naive_run(self.spark, inp, self.work)

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        if command["command"] == "ready":
            return {"ok": True}
        return self.run(self.inp, bool(command.get("keep")))


def child_main(name: str, scale: float, master: str) -> int:
    return procs.child_main(lambda: Contender(name, scale, master))


def verify(scale: float, answer: dict[str, Any]) -> str:
    """Lamina's merged batch against the reference executor's merge of the same parents."""
    from tests.compacter.workload import assert_same_tables, batch_table

    from lamina.compacter.executors import reference
    from lamina.trace.plan import plan_merge
    from lamina.trace.trace import Trace

    inp = merge_input(scale, log=False)
    trace_dir = Path(answer["trace_dir"])
    got = Trace.open(LocalObjectStore(trace_dir), inp.meta)
    ref_dir = trace_dir.with_name(trace_dir.name + "-ref")
    shutil.copytree(inp.trace_dir, ref_dir)
    ref = Trace.open(LocalObjectStore(ref_dir), inp.meta)
    plan = plan_merge(ref.state)
    assert plan is not None
    want = reference.run_merge(ref, plan)
    parts = list(got.state.batches[plan.index].parts)
    assert_same_tables(batch_table(got, parts), batch_table(ref, want), "merged batch")
    shutil.rmtree(ref_dir)
    return f"identical to the reference: {sum(p.rows for p in parts)} rows"


def main(argv: list[str] | None = None) -> int:
    args = procs.comparison_args("python -m bench.merge", __doc__, CONTENDERS, argv)
    if args.child:
        return child_main(args.child, args.scale, args.master)
    run = report.Run(NAME, argv)
    inp = merge_input(args.scale)
    files, since = _parents(inp)
    rows = sum(int(pq.ParquetFile(f).metadata.num_rows) for f in files)
    doc: dict[str, Any] = {
        "scale": args.scale, "master": args.master, "rounds": args.rounds,
        "input": {"rows": rows, "keys": inp.keys, "since": since,
                  "parquet_bytes": sum(f.stat().st_size for f in files)}}
    child = ["--scale", str(args.scale), "--master", args.master]
    contenders = {c: ["--child", c, *child] for c in args.contenders.split(",")}
    doc.update(compare(NAME, "bench.merge", scale=args.scale, rounds=args.rounds,
                       contenders=contenders, updates=rows, targets=TARGETS,
                       verify=verify if args.verify else None))
    doc = run.document(doc)
    report.write_result(NAME, doc)
    report.plot_comparison(NAME, f"Merge of two batches, {rows:,} rows ({args.master})", doc)
    procs.print_comparison(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
