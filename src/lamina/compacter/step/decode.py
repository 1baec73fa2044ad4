"""Decode tasks: job 1 of a partitioned step, and the reading half of a single task.

A decode task reads its group of work items (:func:`read_group`), verifying what it reads
the way the readers do: WAL ranges through :func:`lamina.wal.ranges.range_updates` (every
frame's CRC32C, the segment header, the planned first and last PROGRESS, each update
record's schema), Parquet parts through :func:`lamina.trace.batch.read_part` (size,
CRC32C, row count). Then (:func:`split`) rows at or past the plan's upper become future
rows, with the bucket column, the lower end of their pending bucket
(:func:`lamina.trace.pending.bucket_lows`); the other rows' times below ``since`` are
forwarded to it; both get the prefix column, an int64 non-decreasing in the first sort
column (:func:`lamina.trace.order.order_prefix`), and each side is gathered once, already
in its order: batch rows by prefix, future rows by bucket (numpy sorts of index arrays;
the write tasks sort each chunk and bucket fully).

The task writes each side as a run (:mod:`lamina.compacter.step.runs`), and returns a
:class:`~lamina.compacter.step.wire.Decoded` record: where the runs are, the future rows'
bucket ranges, how many updates it decoded, and every ``chunk_rows / 32``-th batch row's
key (the sample; more often in a small step, so that every part it will write has 32
sampled keys). Per decode task, memory is its input share.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lamina import columns
from lamina.compacter.step.context import StepContext
from lamina.compacter.step.failures import guarded
from lamina.compacter.step.runs import bucket_runs, run_batch_rows, write_run
from lamina.compacter.step.wire import RUN_FIELDS, Decoded, batch_of, task_ids
from lamina.compacter.step.work import WalRange, WorkItem
from lamina.consolidate import forward, neighbour_changes, sum_adjacent
from lamina.packed import repeats_often, worth_summing
from lamina.schema import TIME
from lamina.trace.batch import read_part
from lamina.trace.order import argsort_ints, order_prefix
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


def split(table: pa.Table, ctx: StepContext) -> tuple[pa.Table, pa.Table]:
    """Split updates into batch rows (times below ``since`` forwarded) ordered by the
    prefix column, and future rows (at or past the upper) ordered by the bucket column
    (the lower end of their pending bucket, uint64), each with the prefix column.

    Each side is gathered once, in its final order: the prefix is computed over all the
    updates, and the order of each side is found on numpy index arrays, so no column is
    copied by a filter and again by a sort (in the conversion benchmark, a copy of 95% of
    every decode task's rows: docs/performance.md, "One gather per side"). Rows of equal
    prefix (or bucket) stay in WAL order: the sorts are :func:`lamina.trace.order.argsort_ints`,
    stable radix sorts."""
    prefix = order_prefix(table.column(ctx.sort_columns[0])).to_numpy()
    is_future: np.ndarray | None = None
    upper = ctx.upper
    if upper is not None and table.num_rows:
        is_future = columns.numpy(table.column(TIME)) >= np.uint64(upper)
        if not is_future.any():
            is_future = None
    if upper is None or is_future is None:
        past_order: np.ndarray | None = None
        if len(prefix) > 1 and not bool((prefix[1:] >= prefix[:-1]).all()):
            past_order = argsort_ints(prefix)
        future = _with(ctx.update_schema.empty_table(), ctx, np.empty(0, np.int64))
        future = future.append_column(ctx.bucket, pa.array([], pa.uint64()))
    else:
        rows = np.flatnonzero(~is_future)
        past_order = rows[argsort_ints(prefix[rows])]
        rows = np.flatnonzero(is_future)
        lows = columns.numpy(bucket_lows(table.column(TIME).take(rows), upper))
        by_bucket = argsort_ints(lows)
        order = rows[by_bucket]
        future = _with(table.take(order), ctx, prefix[order])
        future = future.append_column(ctx.bucket, pa.array(lows[by_bucket], pa.uint64()))
    if past_order is None:
        past = _with(table, ctx, prefix)
    else:
        past = _with(table.take(past_order), ctx, prefix[past_order])
    return forward(past, ctx.since), future


def _with(table: pa.Table, ctx: StepContext, prefix: np.ndarray) -> pa.Table:
    return table.append_column(ctx.prefix, pa.array(prefix, pa.int64()))


def prepared(gid: int, ctx: StepContext) -> tuple[pa.Table, pa.Table, int]:
    """A group's batch rows ordered by prefix and its future rows ordered by bucket
    (:func:`split`), and how many updates it decoded (the input rows the step reports).
    WAL order is kept among equal prefixes, which the write tasks' stable sorts keep among
    equal keys, as the reference executor does (it shows where distinct rows share a full
    sort key: -0.0 and 0.0, or two NaNs, of a float sort column)."""
    decoded = read_group(ctx.groups[gid], ctx)
    past, future = split(decoded, ctx)
    return past, future, decoded.num_rows


PROBE_SLICES = 4
PROBE_SLICE_ROWS = 1024
""":func:`summed_repeats` sorts this many slices of this many neighbouring rows to see
how often the task's rows repeat."""


def _repeats(past: pa.Table, ctx: StepContext) -> bool:
    """Whether a decode task's rows (ordered by prefix) repeat often enough to be summed
    (:func:`lamina.packed.worth_summing`). First 4,096 neighbour pairs
    (:func:`lamina.packed.repeats_often`): a repeated row shows as a pair of equal prefix
    and time, and where few are, that is all this costs.
    Equal prefix and time is not yet a repeat, though (a prefix is a string's first 7
    bytes; a key churning through values has many rows at the forwarded time, which
    cancel in pairs but seldom sit next to each other), so then a few slices of
    neighbouring rows are sorted by the full key and their neighbours compared whole.
    Rows are ordered by prefix, so a slice holds whole prefixes and repeats as the task's
    rows do; a prefix with more rows than a slice is only sampled, which undercounts its
    repeats (a sum missed, never a wrong one)."""
    if not repeats_often(columns.numpy(past.column(ctx.prefix)),
                         columns.numpy(past.column(TIME))):
        return False
    n = past.num_rows
    size = min(n, PROBE_SLICE_ROWS)
    changes = []
    for start in sorted({int(s) for s in np.linspace(0, n - size, PROBE_SLICES)}):
        piece = past.slice(start, size)
        piece = piece.take(pc.sort_indices(piece, sort_keys=ctx.sort_keys))
        changes.append(neighbour_changes(piece, [*ctx.row_columns, TIME]))
    return worth_summing(np.concatenate(changes))


def summed_repeats(past: pa.Table, ctx: StepContext) -> pa.Table:
    """A decode task's batch rows (ordered by prefix), with the updates of a row at one time
    summed into one update where a sample says that rows repeat (:func:`_repeats`, by
    :func:`lamina.packed.worth_summing`, the rule of the merge tasks and of snapshots);
    else as they are.

    Forwarding makes them repeat: a daemon converting a backlog while ``since`` trails the
    upper gives every update of a row older than the frontier the same time, and a key's
    updates that replaced one another cancel there. Summed here, they cost the runs'
    codec, the scratch space and the write task's sort once per row instead of once per
    update: in the peers benchmark's churn cell the daemon wrote 37% fewer bytes
    (docs/performance.md, "Decode tasks sum what forwarding repeats"). Rows of equal prefix are
    neighbours, so a sample tells how often rows repeat (:func:`_repeats`); where they do
    not, the sample is all this costs. Summing needs the full batch order (an Arrow sort
    of the task's rows, which are ordered by prefix already) and is left to the write
    tasks for float rows, and where sums could leave int64
    (:func:`lamina.consolidate.sum_adjacent`). The write tasks consolidate again, which sums
    these partial sums as it would have summed their updates."""
    if past.num_rows < 2 or any(pa.types.is_floating(ctx.update_schema.field(c).type)
                                for c in ctx.row_columns):
        return past
    if not _repeats(past, ctx):
        return past
    summed = sum_adjacent(past.take(pc.sort_indices(past, sort_keys=ctx.sort_keys)),
                          [*ctx.row_columns, TIME])
    if summed is None:
        return past
    return pa.Table.from_arrays(summed.columns, schema=past.schema)  # as the other runs


def decoder(ctx: StepContext) -> Callable[[Iterator[pa.RecordBatch]],
                                          Iterator[pa.RecordBatch]]:
    """The decode job's task function (:data:`~.wire.RUN_FIELDS` rows)."""
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for gid in task_ids(batches):
            past, future, decoded = prepared(gid, ctx)
            past = summed_repeats(past, ctx)
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
