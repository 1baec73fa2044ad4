"""The driver side of a step: planning the tasks, running the jobs, collecting output.

A plan becomes a :class:`StepSpec` (:func:`conversion_spec`, :func:`merge_spec`): the
inputs, frontiers and batch id of the step, whatever it does. :func:`run_step` runs one
step alone and :func:`run_pack` runs the small steps of many relations as one Spark job
(:mod:`lamina.compacter.step.pack`); :func:`spark_convert` and :func:`spark_merge` are
:func:`run_step` for one plan. The caller commits the written files. The driver never
reads data: it sizes the step from the input bytes, cuts the inputs into work items
(:mod:`lamina.compacter.step.work`) and packs them into G groups, runs job 1 (the decode
tasks, or the single task of a step of at most ``JobTuning.single_task_bytes``), cuts the
decode tasks' samples into chunks and parts (:func:`_plan_writes`,
:mod:`lamina.compacter.step.cuts`), runs job 2 (the write tasks), and collects the written
parts (:func:`_collect_output`).

Every job first checks for a cancel. The driver deletes the step's scratch directory when
the step ends, whether it succeeded or not. Only the attempts whose output the driver
collects are counted in :attr:`StepOutput.input_rows`, so a retried task counts once; two
rows naming the same part (speculative execution) are an error. Everything a step raises is
a LaminaError (:mod:`lamina.compacter.step.failures`).
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa
import structlog

from lamina.compacter.executors import ConversionResult
from lamina.compacter.step.context import StepContext, aux_columns
from lamina.compacter.step.cuts import boundaries
from lamina.compacter.step.decode import decoder
from lamina.compacter.step.failures import TaskError, translate
from lamina.compacter.step.merge import merger, plan_merge
from lamina.compacter.step.pack import (
    PACK_FIELDS,
    TASKS_PER_CORE,
    packed,
    pickled,
    task_groups,
)
from lamina.compacter.step.runs import Run, RunCompression, run_codec
from lamina.compacter.step.wire import META_FIELDS, RUN_FIELDS, Decoded, Written
from lamina.compacter.step.work import (
    DEFAULT_TUNING,
    JobTuning,
    PartInput,
    WalRange,
    WorkItem,
    input_bytes,
    pack,
)
from lamina.compacter.step.write import BucketItem, PartItem, single, writer
from lamina.errors import CorruptionError, JobError, LaminaError
from lamina.frontier import MAX_TIME
from lamina.layout import TraceLayout
from lamina.trace.batch import PartFile
from lamina.trace.order import Key
from lamina.trace.pending import bucket_of
from lamina.trace.plan import ConversionPlan, MergePlan
from lamina.trace.staging import stage
from lamina.trace.state import PendingPart
from lamina.trace.trace import Trace
from lamina.wal.ranges import segment_ranges
from lamina.wal.reader import SegmentSpan

log = structlog.get_logger(__name__)

SAMPLES_PER_CHUNK = 32
"""Decode tasks sample every ``chunk_rows / SAMPLES_PER_CHUNK``-th row for the cuts, and
at least this many rows per part the step will write."""


@dataclass(frozen=True)
class StepOutput:
    """What a step's tasks wrote: batch parts in order and pending parts by bucket, and how
    many updates they read."""

    parts: list[PartFile]
    pending: list[tuple[int, PartFile]]
    """(bucket lower end, file), in increasing bucket order."""
    input_rows: int
    """Updates the step's tasks decoded from its inputs (WAL segments and Parquet parts),
    before forwarding and consolidation; counted by the attempts whose output the driver
    collected, so a retried task is counted once."""
    spark_jobs: int = 0
    """Spark jobs the step ran alone (0 for a step of a pack: the pack is one job)."""


def _parallelism(spark: Any) -> int:
    return max(1, int(spark.sparkContext.defaultParallelism))


TaskFn = Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]


Fields = Sequence[tuple[str, pa.DataType]]


def _run_tasks(spark: Any, n: int, fn: TaskFn, fields: Fields, check: Callable[[], None]
               ) -> list[Any]:
    """Run ``fn`` in ``n`` tasks, task ``i`` receiving the id ``i``; the rows they yield,
    whose columns are ``fields`` (a ``*_FIELDS`` list of :mod:`~lamina.compacter.step.wire`,
    the one the task function builds its batches with).

    The job is a plain RDD of ``n`` partitions (:func:`_rdd_task`), not a DataFrame
    ``mapInArrow`` over ``spark.range``: no data goes through the JVM either way, and the
    DataFrame cost a Catalyst plan per job and two Arrow streams per task for one id and a
    few rows of metadata. A job of 32 tasks that do nothing took 297 ms, now 150 ms; the
    10M-update conversion took 6% less time on average in seven alternating pairs
    (docs/performance.md, "A step's jobs as plain RDDs")."""
    check()
    task = _rdd_task(_gc_frozen(fn), pa.schema(fields))
    rows: list[Any] = spark.sparkContext.parallelize(range(n), n).mapPartitions(task).collect()
    return rows


def _rdd_task(fn: TaskFn, schema: pa.Schema) -> Callable[[Iterator[int]], Iterator[Any]]:
    """``fn`` as an RDD partition function: its ids as the one-column Arrow batch
    ``spark.range`` would give it, the rows it yields, which must have ``schema`` (as
    ``mapInArrow`` held them to the job's schema), as pyspark Rows."""
    def task(ids: Iterator[int]) -> Iterator[Any]:
        from pyspark.sql import Row

        batch = pa.RecordBatch.from_pydict({"id": pa.array(list(ids), pa.int64())})
        for out in fn(iter([batch])):
            if not out.schema.equals(schema):
                raise ValueError(f"a task returned columns ({_columns(out.schema)}), the "
                                 f"job expects ({_columns(schema)})")
            for row in out.to_pylist():
                yield Row(**row)
    return task


def _columns(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name} {f.type}" for f in schema)


def _gc_frozen(fn: TaskFn) -> TaskFn:
    """``fn`` run after ``gc.freeze()`` in the Python worker.

    PySpark's worker daemon runs a full ``gc.collect()`` after every task of a reused
    worker, before the worker takes its next task. With pyarrow, numpy and lamina loaded
    that pass walks every object of the worker: 25 to 28 ms of the worker's CPU per task,
    1.5 to 2.1 ms once frozen (``python -m bench.profile pertask``; docs/performance.md).
    Freezing at the start of each task moves what lives then (modules, caches: the
    previous task's garbage is already collected) out of the collector's reach, so the
    pass after the task walks only what the task made. The worker processes belong to the
    compacter's own session; a cycle that was alive at a freeze and dies later is left to
    the end of the worker."""
    def task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        gc.freeze()
        return fn(batches)
    return task


def _plan_writes(decoded: list[Decoded], samples: pa.Table, ctx: StepContext,
                n_write: int, tuning: JobTuning) -> list[PartItem | BucketItem]:
    """Write tasks for the runs the decode tasks left: ``n_write`` parts at most (fewer
    when there are fewer chunks), each cut into chunks of about ``chunk_rows`` rows, the
    same number of chunks for every part where the samples allow (23 chunks over 15 parts
    made parts of one and two chunks, tasks of 0.16 and 0.30 s), and the pending buckets
    packed into tasks of about ``chunk_rows`` rows. The bucket tasks come first: Spark
    starts tasks in order, and a bucket task, one durable file per bucket, ran longest
    (0.5 s against 0.2 to 0.3 s for a part in the 10M-update conversion) and alone at the
    end of the job when it came last (docs/performance.md, "Forty milliseconds a task")."""
    runs = tuple(d.past for d in decoded if d.past is not None)
    rows = sum(d.rows for d in decoded)
    items: list[PartItem | BucketItem] = []
    if rows:
        chunks = min(max(math.ceil(rows / tuning.chunk_rows), n_write), samples.num_rows + 1)
        parts = max(1, min(n_write, chunks))
        chunks = min(max(math.ceil(chunks / parts) * parts, parts), samples.num_rows + 1)
        cuts: list[Key | None] = [None, *boundaries(samples, chunks, ctx), None]
        cuts += [None] * (chunks + 1 - len(cuts))
        for p in range(parts):
            lo, hi = p * chunks // parts, (p + 1) * chunks // parts
            items.append(PartItem(index=p, runs=runs, bounds=tuple(cuts[lo:hi + 1])))
    by_bucket: dict[int, list[tuple[Run, int, int]]] = {}
    for d in decoded:
        for low, start, length in d.buckets:
            assert d.future is not None
            by_bucket.setdefault(low, []).append((d.future, start, length))
    group: list[tuple[int, tuple[tuple[Run, int, int], ...]]] = []
    size = 0
    for low in sorted(by_bucket):
        pieces = tuple(by_bucket[low])
        n = sum(p[2] for p in pieces)
        if group and size + n > tuning.chunk_rows:
            items.append(BucketItem(tuple(group)))
            group, size = [], 0
        group.append((low, pieces))
        size += n
    if group:
        items.append(BucketItem(tuple(group)))
    return sorted(items, key=lambda item: isinstance(item, PartItem))  # buckets first


@dataclass(frozen=True)
class StepSpec:
    """One step's inputs and frontiers, whatever plan it carries out: read ``segments`` and
    ``parts``, forward batch rows below ``since``, split off rows at or past ``upper`` (None:
    no split) into pending buckets, consolidate, sort and write batch ``batch_id``."""

    segments: tuple[SegmentSpan, ...]
    parts: tuple[PartFile, ...]
    since: int
    upper: int | None
    batch_id: str
    context: str
    """Names the step in errors and in the Spark job's description."""

    @property
    def input_bytes(self) -> int:
        """The bytes the step reads (:func:`~lamina.compacter.step.work.input_bytes`)."""
        return input_bytes(self.segments, self.parts)

    @property
    def is_merge(self) -> bool:
        """Whether the step merges batch parts (no WAL input, no split)."""
        return not self.segments and self.upper is None


def conversion_spec(trace: Trace, plan: ConversionPlan) -> StepSpec:
    return StepSpec(segments=tuple(plan.segments), parts=tuple(p.part for p in plan.consume),
                    since=plan.since, upper=plan.upper, batch_id=plan.batch_id,
                    context=f"conversion of {trace.meta.name!r} to {plan.upper}")


def merge_spec(trace: Trace, plan: MergePlan) -> StepSpec:
    return StepSpec(segments=(), parts=tuple(p for b in (plan.left, plan.right)
                                             for p in b.parts),
                    since=plan.since, upper=None, batch_id=plan.batch_id,
                    context=f"merge of {trace.meta.name!r} [{plan.lower}, {plan.upper})")


def is_small(spec: StepSpec, tuning: JobTuning = DEFAULT_TUNING) -> bool:
    """Whether the step runs as a single task (alone, or in a pack)."""
    return spec.input_bytes <= tuning.single_task_bytes


def _context(trace: Trace, spec: StepSpec, *, share: int, n_write: int, tuning: JobTuning,
             stage_segments: bool) -> StepContext:
    """What every task of the step receives: its inputs cut into groups of about ``share``
    bytes (segments staged first with ``stage_segments``). The codec of runs is set by
    :func:`run_step` for the steps that write them."""
    meta = trace.meta
    items: list[WorkItem] = []
    for span in spec.segments:
        target = share if span.decoded_bytes > share else span.decoded_bytes + 1
        staged = stage(trace.store, span) if stage_segments else None
        items.extend(WalRange(replace(r, staged=staged))
                     for r in segment_ranges(span, meta.name, target))
    items.extend(PartInput(p) for p in spec.parts)
    groups = tuple(pack(items, max(share, 1)))
    bucket, prefix = aux_columns(meta)
    upper = spec.upper
    return StepContext(
        store=trace.store, relation=meta.name, update_schema=meta.update_schema,
        row_columns=tuple(meta.row_columns), sort_columns=tuple(meta.sort_columns),
        prefix=prefix, bucket=bucket, since=spec.since,
        upper=upper if upper is not None and upper <= MAX_TIME else None,
        batch_id=spec.batch_id, context=spec.context, scratch=TraceLayout.scratch(spec.batch_id),
        sample_every=max(1, tuning.chunk_rows // SAMPLES_PER_CHUNK),
        min_samples=max(1, math.ceil(SAMPLES_PER_CHUNK * n_write / len(groups))),
        parts=n_write, groups=groups)


def single_context(trace: Trace, spec: StepSpec, *, tuning: JobTuning = DEFAULT_TUNING,
                   stage_segments: bool = False) -> StepContext:
    """The context of a small step: its whole input in one group, one part."""
    return _context(trace, spec, share=max(spec.input_bytes, 1), n_write=1, tuning=tuning,
                    stage_segments=stage_segments)


def run_step(spark: Any, trace: Trace, spec: StepSpec, *, tuning: JobTuning = DEFAULT_TUNING,
             stage_segments: bool = False) -> StepOutput:
    """Run one step alone: a small step as one task, a large one as the decode and write
    jobs. With ``stage_segments`` the segments are first copied into the trace store and
    the tasks read the copies (:mod:`lamina.trace.staging`: executors that cannot see the
    daemon's disk). Raises LaminaError subclasses only (see the module docstring)."""
    from lamina.compacter.spark import check_cancelled

    decoded = 0  # updates counted by decode tasks (single tasks report theirs in tally rows)
    jobs = 0
    try:
        if is_small(spec, tuning):
            ctx = single_context(trace, spec, tuning=tuning, stage_segments=stage_segments)
            rows = _run_tasks(spark, 1, single(ctx), META_FIELDS, check_cancelled)
            return _collect_output(rows, spec.context, jobs=1)
        total = spec.input_bytes
        share = min(tuning.split_bytes, max(tuning.min_split_bytes,
                                            math.ceil(total / _parallelism(spark))))
        n_write = min(tuning.max_parts, max(1, math.ceil(total / tuning.part_bytes)))
        ctx = _context(trace, spec, share=share, n_write=n_write, tuning=tuning,
                       stage_segments=stage_segments)
        items = (plan_merge(trace.store, spec.parts, ctx, n_write, tuning.chunk_rows)
                 if spec.is_merge else None)
        if items is not None:  # sorted inputs: one job, one write (step/merge.py)
            rows = _run_tasks(spark, len(items), merger(ctx, spec.parts, items),
                              META_FIELDS, check_cancelled)
            out = _collect_output(rows, spec.context, jobs=1)
            check_merge_rows(spec, out)
            return out
        ctx = replace(ctx, run_compression=_scratch_codec(trace, spec, tuning))
        try:
            runs = _run_tasks(spark, len(ctx.groups), decoder(ctx), RUN_FIELDS, check_cancelled)
            jobs += 1
            results = sorted((Decoded.from_row(r) for r in runs), key=lambda d: d.group)
            decoded = sum(d.input_rows for d in results)
            # a group whose times were forwarded has a nullable time column
            samples = pa.concat_tables((d.sample for d in results), promote_options="default")
            writes = _plan_writes(results, samples, ctx, n_write, tuning)
            rows = []
            if writes:
                rows = _run_tasks(spark, len(writes), writer(ctx, writes), META_FIELDS,
                                  check_cancelled)
                jobs += 1
        finally:
            _remove_scratch(trace, ctx.scratch)
    except LaminaError:
        raise
    except Exception as exc:  # Spark, Py4J, or the driver's own reads (OSError)
        raise translate(exc, spec.context) from exc
    return _collect_output(rows, spec.context, decoded, jobs=jobs)


def _scratch_codec(trace: Trace, spec: StepSpec, tuning: JobTuning) -> RunCompression:
    """The codec of a two-job step's runs (``auto`` resolved by the room the trace store has
    free, :func:`lamina.compacter.step.runs.run_codec`), logged when it was a choice."""
    setting = tuning.run_compression
    if setting != "auto":
        return setting
    free = trace.store.free_bytes(TraceLayout.scratch(spec.batch_id))
    codec = run_codec(setting, spec.input_bytes, free)
    log.info("step.scratch", batch=spec.batch_id, scratch_compression=codec,
             input_bytes=spec.input_bytes, free_bytes=free)
    return codec


def check_merge_rows(spec: StepSpec, out: StepOutput) -> None:
    """A one-pass merge read every row of its inputs exactly once: its tasks chose row
    groups by the footers' statistics, which no checksum covers, so a damaged statistic
    would skip rows; the descriptions' row counts catch it (CorruptionError)."""
    want = sum(p.rows for p in spec.parts)
    if out.input_rows != want:
        raise CorruptionError(
            f"{spec.context}: its tasks read {out.input_rows} rows of the {want} its "
            f"{len(spec.parts)} input parts hold (a part's footer statistics are damaged; "
            "`lamina verify` names the file)")


def run_pack(spark: Any, steps: Sequence[tuple[Trace, StepSpec]], *,
             tuning: JobTuning = DEFAULT_TUNING, stage_segments: bool = False
             ) -> list[StepOutput | LaminaError]:
    """Run small steps of any relations as the tasks of one Spark job
    (:mod:`lamina.compacter.step.pack`); each step's output, or the error that fails that
    step alone, in order. A failure of the job itself raises (LaminaError subclasses
    only): then no step of the pack has an output."""
    from lamina.compacter.spark import check_cancelled

    out: list[StepOutput | LaminaError] = []
    try:
        contexts: list[bytes] = []
        for trace, spec in steps:
            if not is_small(spec, tuning):
                raise ValueError(f"{spec.context} is not small enough for a pack "
                                 f"({spec.input_bytes} bytes > {tuning.single_task_bytes})")
            contexts.append(pickled(single_context(trace, spec, tuning=tuning,
                                                   stage_segments=stage_segments)))
        groups = task_groups([spec.input_bytes for _, spec in steps],
                             TASKS_PER_CORE * _parallelism(spark))
        rows = _run_tasks(spark, len(groups), packed(tuple(contexts), groups), PACK_FIELDS,
                          check_cancelled)
    except LaminaError:
        raise
    except Exception as exc:
        raise translate(exc, f"a pack of {len(steps)} steps") from exc
    by_step: dict[int, list[Any]] = {i: [] for i in range(len(steps))}
    for r in rows:
        by_step[int(r["step"])].append(r)
    for i, (_, spec) in enumerate(steps):
        errors = [r["error"] for r in by_step[i] if r["error"] is not None]
        try:
            if errors:
                raise TaskError.decode(errors[0]).rebuild(f"{spec.context} in a Spark task")
            if not by_step[i]:
                raise JobError(f"{spec.context}: its task in the pack returned nothing")
            out.append(_collect_output(by_step[i], spec.context, jobs=0))
        except LaminaError as exc:
            out.append(exc)
    return out


def _remove_scratch(trace: Trace, scratch: str) -> None:
    """Delete the step's runs; one left by an error here is garbage for collection."""
    with contextlib.suppress(OSError):
        trace.store.delete_prefix(scratch)


def _collect_output(rows: list[Any], context: str, decoded: int = 0, *, jobs: int
                    ) -> StepOutput:
    """The step's output from the write (or single) tasks' rows; ``decoded``: the updates
    the decode tasks counted."""
    parts: dict[int, PartFile] = {}
    pending: dict[int, PartFile] = {}
    input_rows = decoded
    for r in rows:
        w = Written.from_row(r)
        input_rows += w.input_rows
        if w.part is None:  # a single task's tally row
            continue
        if w.bucket is None:
            target, key = parts, w.index
        else:
            target, key = pending, w.bucket
        if key in target:
            raise JobError(f"{context}: two tasks wrote the same part ({target[key].path} and "
                           f"{w.part.path}); was speculative execution enabled?")
        target[key] = w.part
    return StepOutput(parts=[parts[i] for i in sorted(parts)],
                      pending=[(lo, pending[lo]) for lo in sorted(pending)],
                      input_rows=input_rows, spark_jobs=jobs)


def conversion_result(plan: ConversionPlan, out: StepOutput) -> ConversionResult:
    """A conversion's result from its step's output (pending parts with their buckets)."""
    pending = []
    for lo, part in out.pending:
        blo, bhi = bucket_of(lo, plan.upper)
        pending.append(PendingPart(blo, bhi, part))
    return ConversionResult(parts=out.parts, pending=pending, input_rows=out.input_rows)


def spark_convert(spark: Any, trace: Trace, plan: ConversionPlan, *,
                  tuning: JobTuning = DEFAULT_TUNING,
                  stage_segments: bool = False) -> ConversionResult:
    """Carry out a conversion plan alone (one or two Spark jobs); return the batch's parts,
    the new pending parts and the number of updates read. Nothing is committed: the caller
    passes ``result.parts`` and ``result.pending`` to ``Trace.commit_conversion``."""
    out = run_step(spark, trace, conversion_spec(trace, plan), tuning=tuning,
                   stage_segments=stage_segments)
    return conversion_result(plan, out)


def spark_merge(spark: Any, trace: Trace, plan: MergePlan, *,
                tuning: JobTuning = DEFAULT_TUNING) -> list[PartFile]:
    """Carry out a merge plan alone; return the merged batch's parts in order."""
    spec = merge_spec(trace, plan)
    if not spec.parts:
        return []
    return run_step(spark, trace, spec, tuning=tuning).parts
