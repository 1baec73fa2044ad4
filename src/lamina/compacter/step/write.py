"""Write tasks: job 2 of a partitioned step, and the single task of a small step.

Two kinds of write item (planned by the driver,
:func:`lamina.compacter.step.driver.plan_writes`):

- :class:`PartItem`, batch part ``index``: the task memory-maps every run, reading only
  the record batches that may hold rows of its key range (:meth:`Run.window
  <lamina.compacter.step.runs.Run.window>`), finds each cut in each run
  (:mod:`lamina.compacter.step.cuts`), and chunk by chunk concatenates the runs' slices,
  sorts them (numpy on the prefix, which merges the presorted slices, then Arrow's
  multi-key sort, which is nearly linear on such input, :func:`lamina.trace.order.sort_rows`),
  consolidates them (:func:`lamina.consolidate.consolidate_sorted`: runs of equal
  neighbours summed, exact int64 sums, the reference's own
  :func:`lamina.consolidate.consolidate_updates` where that cannot be proven) and appends
  them to ``TraceLayout.batch_part(batch_id, index)`` through
  :func:`lamina.trace.batch.write_part` (temp file, fsync, rename, directory fsync);
- :class:`BucketItem`, a group of pending buckets: the same per bucket, one fresh pending
  file each (a bucket never straddles tasks).

Empty parts are not written. A retried write task rewrites the same batch part path (same
content) and new pending files (the lost attempt's are unnamed garbage).

A step whose input is at most ``JobTuning.single_task_bytes`` runs as one task
(:func:`single`) that decodes, sorts, consolidates and writes all of it in memory, with no
runs; it reports the updates it decoded in a tally row
(:meth:`lamina.compacter.step.wire.Written.tally`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa

from lamina.compacter.step.context import StepContext
from lamina.compacter.step.cuts import Cut, chunk_pieces, cut
from lamina.compacter.step.decode import prepared
from lamina.compacter.step.failures import guarded
from lamina.compacter.step.runs import RUN_BATCH_ROWS, Run, bucket_runs, read_run
from lamina.compacter.step.wire import META_FIELDS, Written, batch_of, task_ids
from lamina.consolidate import consolidate_sorted
from lamina.layout import TraceLayout
from lamina.trace.batch import PartFile, write_part
from lamina.trace.order import Key, sort_rows
from lamina.trace.pending import new_pending_path


@dataclass(frozen=True)
class PartItem:
    """Write batch part ``index``: the chunks ``bounds`` delimit, from every run."""

    index: int
    runs: tuple[Run, ...]
    bounds: tuple[Key | None, ...]
    """Full keys delimiting the part's chunks: chunk ``j`` holds the rows above
    ``bounds[j]`` and at or below ``bounds[j + 1]``; None is the end of the order."""


@dataclass(frozen=True)
class BucketItem:
    """Write pending parts: for each bucket, its rows ``(run, start, length)`` of runs."""

    buckets: tuple[tuple[int, tuple[tuple[Run, int, int], ...]], ...]


def consolidated_rows(rows: pa.Table, ctx: StepContext) -> pa.Table:
    """Rows sorted by full key, consolidated, with the update columns only."""
    return consolidate_sorted(rows, ctx.update_schema.names, ctx.row_columns,
                              ctx.sort_columns, context=ctx.context)


def write_nonempty(ctx: StepContext, path: str, tables: Iterable[pa.Table]) -> PartFile | None:
    """Write the non-empty ``tables`` as one part, or nothing when all are empty."""
    rest = (t for t in tables if t.num_rows)
    first = next(rest, None)
    if first is None:
        return None
    return write_part(ctx.store, path, ctx.update_schema, itertools.chain([first], rest))


def _part_chunks(item: PartItem, ctx: StepContext) -> Iterator[pa.Table]:
    runs = []
    for r in item.runs:  # only the batches that may hold rows of this part
        window = r.window(item.bounds[0], item.bounds[-1])
        if window is not None:
            runs.append(read_run(ctx.store, r, *window))
    cuts: list[list[Cut | None]] = []
    for run in runs:
        prefix = run.column(ctx.prefix).to_numpy()
        cuts.append([None if b is None else cut(run, prefix, b, ctx) for b in item.bounds])
    for j in range(len(item.bounds) - 1):
        pieces = [p for run, c in zip(runs, cuts, strict=True)
                  for p in chunk_pieces(run, c[j], c[j + 1])]
        if not pieces:
            continue
        yield consolidated_rows(sort_rows(pa.concat_tables(pieces), ctx.sort_keys, ctx.prefix),
                            ctx)


def _bucket_parts(item: BucketItem, ctx: StepContext) -> Iterator[tuple[int, PartFile]]:
    for low, pieces in item.buckets:
        tables = []
        for run, start, length in pieces:
            first, last = start // RUN_BATCH_ROWS, (start + length - 1) // RUN_BATCH_ROWS
            rows = read_run(ctx.store, run, first, last)
            tables.append(rows.slice(start - first * RUN_BATCH_ROWS, length))
        rows = sort_rows(pa.concat_tables(tables), ctx.sort_keys, ctx.prefix)
        part = write_nonempty(ctx, new_pending_path(), [consolidated_rows(rows, ctx)])
        if part is not None:
            yield low, part


def writer(ctx: StepContext, items: Sequence[PartItem | BucketItem]
           ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The write job's task function: task ``i`` carries out ``items[i]``."""
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for i in task_ids(batches):
            item = items[i]
            rows = []
            if isinstance(item, PartItem):
                part = write_nonempty(ctx, TraceLayout.batch_part(ctx.batch_id, item.index),
                                       _part_chunks(item, ctx))
                if part is not None:
                    rows.append(Written(part, index=item.index).row())
            else:
                rows.extend(Written(part, bucket=low).row()
                            for low, part in _bucket_parts(item, ctx))
            if rows:
                yield batch_of(rows, META_FIELDS)
    return guarded(run)


def single_written(ctx: StepContext) -> list[Written]:
    """The whole step in this process (a small step's one task, or one task of a pack):
    decode, sort, consolidate, write; what it wrote, led by its tally."""
    past, future, decoded = prepared(0, ctx)
    past = sort_rows(past, ctx.sort_keys, ctx.prefix)
    future = sort_rows(future, [(ctx.bucket, "ascending"), *ctx.sort_keys], ctx.bucket)
    out = [Written.tally(decoded)]
    part = write_nonempty(ctx, TraceLayout.batch_part(ctx.batch_id, 0),
                           [consolidated_rows(past, ctx)])
    if part is not None:
        out.append(Written(part, index=0))
    for low, start, length in bucket_runs(future, ctx.bucket):
        pending = write_nonempty(ctx, new_pending_path(),
                                  [consolidated_rows(future.slice(start, length), ctx)])
        if pending is not None:
            out.append(Written(pending, bucket=low))
    return out


def single(ctx: StepContext) -> Callable[[Iterator[pa.RecordBatch]],
                                         Iterator[pa.RecordBatch]]:
    """The whole step in one task (small inputs): :func:`single_written`."""
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for _ in task_ids(batches):
            yield batch_of([w.row() for w in single_written(ctx)], META_FIELDS)
    return guarded(run)
