"""Conversion throughput: finished WAL segments to a trace batch, lamina against baselines.

    .venv/bin/python -m bench.convert [--scale 1.0] [--rounds 5] [--master 'local[*]']
                                      [--verify]

The input (:func:`bench.dataset.conversion_input`): ``10M * scale`` updates over
``1M * scale`` distinct rows, 20% retractions, 5% future times, in finished segments.
Three contenders convert it, each in a child process of its own (:mod:`bench.procs`),
warmed up (once on a tenth of the input, :func:`bench.dataset.warm_scale`, and once on the
input itself: a first full-size run grows memory pools), then run ``--rounds`` times,
interleaved:

- **lamina**: ``step.driver.spark_convert`` on the plan the daemon would make, then
  ``Trace.commit_conversion`` (the plan's segment scan, done by the daemon's pipeline before
  a job, is measured once apart as ``plan_seconds``);
- **duckdb**: the segments decoded with lamina's reader (checksums verified), then in one
  DuckDB process: rows below the new upper grouped by row and time, diffs summed, zero sums
  dropped, ordered, written as one zstd Parquet file; the future rows likewise to a second;
- **naive**: the same decoded Arrow table handed to ``spark.createDataFrame`` and
  consolidated with ``groupBy(future, row, time).agg(sum)``, filter, ``orderBy``,
  ``write.partitionBy("future").parquet`` (zstd), in a session with lamina's settings.

Every time includes reading the segments. lamina's scratch runs use the daemon's
``scratch_compression`` as ``LAMINA_SCRATCH_COMPRESSION`` gives it (default ``auto``),
recorded in the result with the codec it comes to on this disk (``scratch_codec``).
Reported: median seconds, updates/s and the ratios of lamina's throughput to each
baseline's (targets: >= 0.5x DuckDB, >= 3x naive), peak RSS by process role during the
measured runs (:class:`bench.procs.MemorySampler`), and with ``--verify`` a check that
lamina's batch and pending buckets equal the reference executor's. Writes
bench/results/convert.json and convert.png.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from bench import procs, report
from bench.dataset import CACHE, Input, conversion_input, warm_scale
from bench.procs import SparkContender, compare
from lamina.objstore.local import LocalObjectStore
from lamina.wal.reader import SegmentSpan

NAME = "convert"
CONTENDERS = ("lamina", "duckdb", "naive")
TARGETS = {"duckdb": 0.5, "naive": 3.0}


# --- the contenders (child side) -----------------------------------------------------------------

def tuning() -> Any:
    """The daemon's tuning of a conversion, ``scratch_compression`` taken from
    ``LAMINA_SCRATCH_COMPRESSION`` as the daemon takes it (default ``auto``), so that
    ``LAMINA_SCRATCH_COMPRESSION=lz4 python -m bench.convert`` measures that setting."""
    from lamina.compacter.step.work import JobTuning

    return JobTuning(run_compression=scratch_compression())


def scratch_compression() -> Any:
    """The daemon's ``scratch_compression`` as ``LAMINA_SCRATCH_COMPRESSION`` gives it
    (default ``auto``), read by the daemon's own settings (a bad value is refused naming
    the key)."""
    from lamina.compacter.settings import load_settings

    key = "LAMINA_SCRATCH_COMPRESSION"
    return load_settings(env={key: os.environ[key]} if key in os.environ else {}
                         ).scratch_compression


def scratch_codec(inp: Input) -> str:
    """The codec the setting comes to for this input on this disk (``auto`` resolved as
    the driver resolves it: :func:`lamina.compacter.step.runs.run_codec`)."""
    from lamina.compacter.step.runs import run_codec

    return run_codec(scratch_compression(), sum(s.decoded_bytes for s in inp.spans()),
                     LocalObjectStore(CACHE).free_bytes(""))


def decode(inp: Input, spans: list[SegmentSpan]) -> pa.Table:
    """Every update of the segments, through lamina's reader (checksums verified)."""
    from lamina.wal.reader import segment_updates
    from lamina.wal.segment import SegmentFile

    tables = []
    for s in spans:
        seg = SegmentFile(Path(s.path), s.seq, finished=True)
        tables.extend(segment_updates(seg, inp.meta.name, inp.meta.update_schema))
    return pa.concat_tables(tables)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*.parquet"))


def lamina_run(spark: Any, inp: Input, spans: list[SegmentSpan], work: Path,
               keep: bool = False) -> dict[str, Any]:
    from lamina.compacter.step.driver import spark_convert
    from lamina.trace.plan import plan_conversion
    from lamina.trace.trace import Trace

    trace_dir = work / f"trace-{uuid.uuid4().hex[:8]}"
    trace = Trace.open(LocalObjectStore(trace_dir), inp.meta)
    plan = plan_conversion(trace.state, spans)
    started = time.monotonic()
    result = spark_convert(spark, trace, plan, tuning=tuning())
    parts, pending = result.parts, result.pending
    state = trace.commit_conversion(plan, parts, pending)
    seconds = time.monotonic() - started
    out: dict[str, Any] = {"seconds": seconds, "rows_out": sum(p.rows for p in parts),
           "bytes_out": sum(p.bytes for p in parts), "parts": len(parts),
           "pending_rows": sum(p.part.rows for p in pending), "pending_parts": len(pending),
           "state_version": state.version, "input_rows": result.input_rows}
    if keep:
        out["trace_dir"] = str(trace_dir)
    else:
        shutil.rmtree(trace_dir)
    return out


def duckdb_run(inp: Input, spans: list[SegmentSpan], work: Path) -> dict[str, Any]:
    import duckdb

    out = work / f"duckdb-{uuid.uuid4().hex[:8]}"
    out.mkdir(parents=True)
    started = time.monotonic()
    updates = decode(inp, spans)
    decoded = time.monotonic() - started
    upper = spans[-1].upper
    rows = ", ".join(inp.meta.row_columns)
    order = ", ".join([*inp.meta.sort_columns, "_time"])
    con = duckdb.connect()
    con.register("updates", updates)
    for name, where in (("batch", f"_time < {upper}"), ("future", f"_time >= {upper}")):
        # built from the relation's column names and the plan's upper only
        sql = (f"COPY (SELECT {rows}, _time, CAST(SUM(_diff) AS BIGINT) AS _diff "  # noqa: S608
               f"FROM updates WHERE {where} GROUP BY {rows}, _time "
               f"HAVING SUM(_diff) <> 0 ORDER BY {order}) "
               f"TO '{out / name}.parquet' (FORMAT parquet, COMPRESSION zstd)")
        con.execute(sql)
    con.close()
    seconds = time.monotonic() - started
    batch = con_rows(out / "batch.parquet")
    result = {"seconds": seconds, "decode_seconds": decoded, "rows_out": batch,
              "bytes_out": (out / "batch.parquet").stat().st_size}
    shutil.rmtree(out)
    return result


def con_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return int(pq.ParquetFile(path).metadata.num_rows)


def naive_run(spark: Any, inp: Input, spans: list[SegmentSpan], work: Path) -> dict[str, Any]:
    from pyspark.sql import functions as F

    out = work / f"naive-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    updates = decode(inp, spans)
    decoded = time.monotonic() - started
    # Spark has no uint64: the times (all below 2**63 here) become longs
    updates = updates.set_column(updates.schema.get_field_index("_time"), "_time",
                                 pc.cast(updates.column("_time"), pa.int64()))
    df = spark.createDataFrame(updates)
    rows = inp.meta.row_columns
    (df.withColumn("future", F.col("_time") >= F.lit(spans[-1].upper))
       .groupBy("future", *rows, "_time").agg(F.sum("_diff").alias("_diff"))
       .filter(F.col("_diff") != 0)
       .orderBy("future", *inp.meta.sort_columns, "_time")
       .write.partitionBy("future").option("compression", "zstd").parquet(str(out)))
    seconds = time.monotonic() - started
    result = {"seconds": seconds, "decode_seconds": decoded,
              "bytes_out": dir_bytes(out / "future=false")}
    shutil.rmtree(out)
    return result


class Contender(SparkContender):
    """A child's state: its session (if any), the input and a scratch directory."""

    def __init__(self, name: str, scale: float, master: str) -> None:
        super().__init__(NAME, name, master, CACHE)
        self.inp = conversion_input(scale, log=False)
        self.spans = self.inp.spans()
        warm = conversion_input(warm_scale(scale), log=False)
        self.run(warm, warm.spans())  # Python workers, JIT, code paths
        self.run(self.inp, self.spans)  # memory pools at full size, page cache

    def run(self, inp: Input, spans: list[SegmentSpan], keep: bool = False) -> dict[str, Any]:
        if self.name == "lamina":
            return lamina_run(self.spark, inp, spans, self.work, keep)
        if self.name == "duckdb":
            return duckdb_run(inp, spans, self.work)
        return naive_run(self.spark, inp, spans, self.work)

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        if command["command"] == "ready":
            return {"ok": True}
        return self.run(self.inp, self.spans, bool(command.get("keep")))


def child_main(name: str, scale: float, master: str) -> int:
    return procs.child_main(lambda: Contender(name, scale, master))


# --- the parent ---------------------------------------------------------------------------------

def plan_seconds(inp: Input) -> float:
    """What the daemon's pipeline spends describing the segments before a job (a scan with
    checksums, one segment at a time)."""
    started = time.monotonic()
    inp.spans()
    return time.monotonic() - started


def verify(scale: float, answer: dict[str, Any]) -> str:
    """Lamina's kept output (and the updates it counted) against the reference executor on
    the same plan."""
    from tests.compacter.workload import assert_same_conversion

    from lamina.compacter.executors import ConversionResult, reference
    from lamina.trace.plan import plan_conversion
    from lamina.trace.trace import Trace

    inp = conversion_input(scale, log=False)
    trace_dir = Path(answer["trace_dir"])
    got_trace = Trace.open(LocalObjectStore(trace_dir), inp.meta)
    st = got_trace.state
    ref_dir = trace_dir.with_name(trace_dir.name + "-ref")
    ref = Trace.open(LocalObjectStore(ref_dir), inp.meta)
    plan = plan_conversion(ref.state, inp.spans())
    want = reference.run_conversion(ref, plan)
    got = ConversionResult(parts=list(st.batches[0].parts) if st.batches else [],
                           pending=list(st.pending), input_rows=int(answer["input_rows"]))
    assert_same_conversion(got_trace, got, ref, want, plan=plan)
    shutil.rmtree(ref_dir)
    return (f"identical to the reference: {sum(p.rows for p in got.parts)} batch rows; "
            f"{got.input_rows} updates counted")


def main(argv: list[str] | None = None) -> int:
    args = procs.comparison_args("python -m bench.convert", __doc__, CONTENDERS, argv)
    if args.child:
        return child_main(args.child, args.scale, args.master)
    run = report.Run(NAME, argv)
    inp = conversion_input(args.scale)
    doc: dict[str, Any] = {
        "scale": args.scale, "master": args.master, "rounds": args.rounds,
        "input": {"updates": inp.updates, "keys": inp.keys, "wal_bytes": inp.wal_bytes(),
                  "segments": len(inp.spans())},
        "plan_seconds": round(plan_seconds(inp), 3),
        "scratch_compression": scratch_compression(), "scratch_codec": scratch_codec(inp)}
    child = ["--scale", str(args.scale), "--master", args.master]
    contenders = {c: ["--child", c, *child] for c in args.contenders.split(",")}
    doc.update(compare(NAME, "bench.convert", scale=args.scale, rounds=args.rounds,
                       contenders=contenders, updates=inp.updates, targets=TARGETS,
                       verify=verify if args.verify else None))
    doc = run.document(doc)
    report.write_result(NAME, doc)
    report.plot_comparison(NAME, f"Conversion of {inp.updates:,} updates ({args.master})",
                           doc)
    procs.print_comparison(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
