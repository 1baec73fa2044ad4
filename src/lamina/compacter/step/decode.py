"""Decode tasks: job 1 of a partitioned step, and the reading half of a single task.

A decode task reads its group of work items (:func:`read_group`), verifying what it reads
the way the readers do: WAL ranges through :func:`lamina.wal.ranges.range_updates` (every
frame's CRC32C, the segment header, the planned first and last PROGRESS, each update
record's schema), Parquet parts through :func:`lamina.trace.batch.read_part` (size,
CRC32C, row count). Then (:func:`prepare`) rows at or past the plan's upper become future
rows, with the bucket column, the lower end of their pending bucket
(:func:`lamina.trace.pending.bucket_lows`); the other rows' times below ``since`` are
forwarded to it; both get the prefix column, an int64 non-decreasing in the first sort
column (:func:`lamina.trace.order.order_prefix`).

The task orders its batch rows by prefix and its future rows by bucket (stable numpy
sorts; the write tasks sort each chunk and bucket fully), writes each as a run
(:mod:`lamina.compacter.step.runs`), and returns a
:class:`~lamina.compacter.step.wire.Decoded` record: where the runs are, the future rows'
bucket ranges, how many updates it decoded, and every ``chunk_rows / 32``-th batch row's
key (the sample; more often in a small step, so that every part it will write has 32
sampled keys). Per decode task, memory is its input share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lamina.compacter.step.context import StepContext
from lamina.compacter.step.failures import guarded
from lamina.compacter.step.runs import bucket_runs, run_batch_rows, write_run
from lamina.compacter.step.wire import RUN_FIELDS, Decoded, batch_of, task_ids
from lamina.compacter.step.work import WalRange, WorkItem
from lamina.consolidate import forward
from lamina.schema import TIME
from lamina.trace.batch import read_part
from lamina.trace.order import by_lead, order_prefix
from lamina.trace.pending import bucket_lows
from lamina.wal.ranges import range_updates


def read_group(group: Sequence[WorkItem], ctx: StepContext) -> pa.Table:
    """Every update of one task group, verified (update schema)."""
    tables: list[pa.Table] = []
    for item in group:
        if isinstance(item, WalRange):
            tables.extend(range_updates(item.range, ctx.relation, ctx.update_schema,
                                        ctx.store))
        else:
            tables.append(read_part(ctx.store, item.part))
    if not tables:
        return ctx.update_schema.empty_table()
    return pa.concat_tables(tables)


def prepare(table: pa.Table, ctx: StepContext) -> tuple[pa.Table, pa.Table]:
    """Split updates into batch rows (times below ``since`` forwarded) and future rows (at
    or past the upper), and add the prefix column to both and the bucket column (the lower
    end of the pending bucket, uint64) to the future rows."""
    future = ctx.update_schema.empty_table()
    past = table
    if ctx.upper is not None and table.num_rows:
        mask = pc.greater_equal(table.column(TIME), pa.scalar(ctx.upper, pa.uint64()))
        if pc.any(mask).as_py():
            future = table.filter(mask)
            past = table.filter(pc.invert(mask))
    past = forward(past, ctx.since)
    first = ctx.sort_columns[0]
    past = past.append_column(ctx.prefix, order_prefix(past.column(first)))
    lows: Any = pa.array([], pa.uint64())
    if future.num_rows:
        assert ctx.upper is not None
        lows = bucket_lows(future.column(TIME), ctx.upper)
    future = future.append_column(ctx.prefix, order_prefix(future.column(first)))
    future = future.append_column(ctx.bucket, lows)
    return past, future


def prepared(gid: int, ctx: StepContext) -> tuple[pa.Table, pa.Table, int]:
    """A group's batch rows and future rows (:func:`prepare`), and how many updates it
    decoded (the input rows the step reports)."""
    decoded = read_group(ctx.groups[gid], ctx)
    past, future = prepare(decoded, ctx)
    return past, future, decoded.num_rows


def _decoded_group(gid: int, ctx: StepContext) -> tuple[pa.Table, pa.Table, int]:
    """A group's batch rows ordered by prefix, its future rows ordered by bucket, and how
    many updates it decoded. Where distinct rows have distinct sort keys
    (:attr:`StepContext.distinct_keys`), rows of equal prefix (or bucket) may come in any
    order (a faster, unstable sort): a cut compares their full keys
    (:mod:`lamina.compacter.step.cuts`) and the write tasks sort each chunk and bucket by
    the full key. Otherwise WAL order is kept among them, which the write tasks' stable
    sorts keep among equal keys, as the reference executor does."""
    past, future, decoded = prepared(gid, ctx)
    stable = not ctx.distinct_keys
    return (by_lead(past, ctx.prefix, stable=stable),
            by_lead(future, ctx.bucket, stable=stable), decoded)


def decoder(ctx: StepContext) -> Callable[[Iterator[pa.RecordBatch]],
                                          Iterator[pa.RecordBatch]]:
    """The decode job's task function (``mapInArrow``, :data:`~.wire.RUN_DDL` rows)."""
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for gid in task_ids(batches):
            past, future, decoded = _decoded_group(gid, ctx)
            past_run = future_run = None
            if past.num_rows:
                past_run = write_run(ctx.store, f"{ctx.scratch}/run-{gid:05d}.arrow", past,
                                     ctx.prefix, run_batch_rows(past.num_rows, ctx.parts),
                                     compression=ctx.run_compression)
            if future.num_rows:
                future_run = write_run(ctx.store, f"{ctx.scratch}/future-{gid:05d}.arrow",
                                       future, ctx.bucket, compression=ctx.run_compression)
            step = max(1, min(ctx.sample_every, past.num_rows // ctx.min_samples))
            sample = past.select(ctx.key_columns).take(
                pa.array(np.arange(step // 2, past.num_rows, step)))
            out = Decoded(group=gid, rows=past.num_rows, input_rows=decoded, past=past_run,
                          future=future_run,
                          buckets=tuple(bucket_runs(future, ctx.bucket)), sample=sample)
            yield batch_of([out.row()], RUN_FIELDS)
    return guarded(run)
