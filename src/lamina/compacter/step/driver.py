"""The driver side of a step: planning the tasks, running the two jobs, collecting output.

:func:`spark_convert` and :func:`spark_merge` carry out a
:class:`~lamina.trace.plan.ConversionPlan` / :class:`~lamina.trace.plan.MergePlan` through
:func:`run_step` and return the written files; the caller commits them. The driver never
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
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from lamina.compacter.step.context import StepContext, aux_columns
from lamina.compacter.step.cuts import boundaries
from lamina.compacter.step.decode import decoder
from lamina.compacter.step.failures import translate
from lamina.compacter.step.runs import Run
from lamina.compacter.step.wire import META_DDL, RUN_DDL, Decoded, Written
from lamina.compacter.step.work import (
    DEFAULT_TUNING,
    PARQUET_EXPANSION,
    JobTuning,
    PartInput,
    WalRange,
    WorkItem,
    pack,
)
from lamina.compacter.step.write import BucketItem, PartItem, single, writer
from lamina.errors import JobError, LaminaError
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


def _parallelism(spark: Any) -> int:
    return max(1, int(spark.sparkContext.defaultParallelism))


def _run_tasks(spark: Any, n: int, fn: Callable[[Iterator[pa.RecordBatch]],
                                                 Iterator[pa.RecordBatch]],
               ddl: str, check: Callable[[], None]) -> list[Any]:
    """Run ``fn`` in ``n`` tasks, task ``i`` receiving the id ``i``; the rows they yield."""
    check()
    rows: list[Any] = spark.range(0, n, 1, n).mapInArrow(fn, ddl).collect()
    return rows


def _plan_writes(decoded: list[Decoded], samples: pa.Table, ctx: StepContext,
                n_write: int, tuning: JobTuning) -> list[PartItem | BucketItem]:
    """Write tasks for the runs the decode tasks left: ``n_write`` parts at most (fewer
    when there are fewer chunks), each cut into chunks of about ``chunk_rows`` rows, and
    the pending buckets packed into tasks of about ``chunk_rows`` rows."""
    runs = tuple(d.past for d in decoded if d.past is not None)
    rows = sum(d.rows for d in decoded)
    items: list[PartItem | BucketItem] = []
    if rows:
        chunks = min(max(math.ceil(rows / tuning.chunk_rows), n_write), samples.num_rows + 1)
        parts = max(1, min(n_write, chunks))
        chunks = max(chunks, parts)
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
    return items


def run_step(spark: Any, trace: Trace, *, segments: Sequence[SegmentSpan],
             parts: Sequence[PartFile], since: int, upper: int | None, batch_id: str,
             context: str, tuning: JobTuning = DEFAULT_TUNING,
             stage_segments: bool = False) -> StepOutput:
    """Run one step: read ``segments`` and ``parts``, forward batch rows below ``since``,
    split off rows at or past ``upper`` (None: no split) into pending buckets, consolidate,
    sort and write. With ``stage_segments`` the segments are first copied into the trace
    store and the tasks read the copies (:mod:`lamina.trace.staging`: executors that
    cannot see the daemon's disk). Raises LaminaError subclasses only (see the module
    docstring)."""
    from lamina.compacter.spark import check_cancelled

    meta = trace.meta
    scratch = TraceLayout.scratch(batch_id)
    decoded = 0  # updates counted by decode tasks (single tasks report theirs in tally rows)
    try:
        sizes = [Path(s.path).stat().st_size for s in segments]
        total = sum(sizes) + sum(p.bytes * PARQUET_EXPANSION for p in parts)
        single_task = total <= tuning.single_task_bytes
        if single_task:
            share = max(total, 1)
            n_write = 1
        else:
            share = min(tuning.split_bytes, max(tuning.min_split_bytes,
                                                math.ceil(total / _parallelism(spark))))
            n_write = min(tuning.max_parts, max(1, math.ceil(total / tuning.part_bytes)))
        items: list[WorkItem] = []
        for span, size in zip(segments, sizes, strict=True):
            target = share if size > share else size + 1
            staged = stage(trace.store, span) if stage_segments else None
            items.extend(WalRange(replace(r, staged=staged))
                         for r in segment_ranges(span, meta.name, target))
        items.extend(PartInput(p) for p in parts)
        groups = tuple(pack(items, max(share, 1)))
        bucket, prefix = aux_columns(meta)
        ctx = StepContext(
            store=trace.store, relation=meta.name, update_schema=meta.update_schema,
            row_columns=tuple(meta.row_columns), sort_columns=tuple(meta.sort_columns),
            prefix=prefix, bucket=bucket, since=since,
            upper=upper if upper is not None and upper <= MAX_TIME else None,
            batch_id=batch_id, context=context, scratch=scratch,
            sample_every=max(1, tuning.chunk_rows // SAMPLES_PER_CHUNK),
            min_samples=max(1, math.ceil(SAMPLES_PER_CHUNK * n_write / len(groups))),
            parts=n_write,
            groups=groups)
        if single_task:
            rows = _run_tasks(spark, len(ctx.groups), single(ctx), META_DDL,
                              check_cancelled)
        else:
            try:
                runs = _run_tasks(spark, len(ctx.groups), decoder(ctx), RUN_DDL,
                                  check_cancelled)
                results = sorted((Decoded.from_row(r) for r in runs), key=lambda d: d.group)
                decoded = sum(d.input_rows for d in results)
                # a group whose times were forwarded has a nullable time column
                samples = pa.concat_tables((d.sample for d in results),
                                           promote_options="default")
                writes = _plan_writes(results, samples, ctx, n_write, tuning)
                rows = _run_tasks(spark, len(writes), writer(ctx, writes), META_DDL,
                                  check_cancelled) if writes else []
            finally:
                _remove_scratch(trace, scratch)
    except LaminaError:
        raise
    except Exception as exc:  # Spark, Py4J, or the driver's own reads (OSError)
        raise translate(exc, context) from exc
    return _collect_output(rows, context, decoded)


def _remove_scratch(trace: Trace, scratch: str) -> None:
    """Delete the step's runs; one left by an error here is garbage for collection."""
    with contextlib.suppress(OSError):
        trace.store.delete_prefix(scratch)


def _collect_output(rows: list[Any], context: str, decoded: int = 0) -> StepOutput:
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
                      input_rows=input_rows)


@dataclass(frozen=True)
class ConversionResult:
    """What :func:`spark_convert` wrote and read (nothing of it committed yet)."""

    parts: list[PartFile]
    """The batch's parts, in order."""
    pending: list[PendingPart]
    """The new pending parts, one per bucket, in time order."""
    input_rows: int
    """Updates decoded: those of the plan's WAL segments plus the rows of the pending
    parts it consumes (future updates are thus counted once when they are first converted
    and again when the conversion that reaches their time brings them in)."""


def spark_convert(spark: Any, trace: Trace, plan: ConversionPlan, *,
                  tuning: JobTuning = DEFAULT_TUNING,
                  stage_segments: bool = False) -> ConversionResult:
    """Carry out a conversion plan as a Spark job; return the batch's parts, the new
    pending parts and the number of updates read. Nothing is committed: the caller passes
    ``result.parts`` and ``result.pending`` to ``Trace.commit_conversion``."""
    out = run_step(spark, trace, segments=plan.segments,
                   parts=[p.part for p in plan.consume], since=plan.since, upper=plan.upper,
                   batch_id=plan.batch_id,
                   context=f"conversion of {trace.meta.name!r} to {plan.upper}", tuning=tuning,
                   stage_segments=stage_segments)
    pending = []
    for lo, part in out.pending:
        blo, bhi = bucket_of(lo, plan.upper)
        pending.append(PendingPart(blo, bhi, part))
    return ConversionResult(parts=out.parts, pending=pending, input_rows=out.input_rows)


def spark_merge(spark: Any, trace: Trace, plan: MergePlan, *,
                tuning: JobTuning = DEFAULT_TUNING) -> list[PartFile]:
    """Carry out a merge plan as a Spark job; return the merged batch's parts in order."""
    parents = [p for b in (plan.left, plan.right) for p in b.parts]
    if not parents:
        return []
    out = run_step(spark, trace, segments=(), parts=parents, since=plan.since, upper=None,
                   batch_id=plan.batch_id,
                   context=f"merge of {trace.meta.name!r} [{plan.lower}, {plan.upper})",
                   tuning=tuning)
    return out.parts
