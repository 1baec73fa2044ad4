"""One-pass merges: sorted Parquet batches merged by key range, one job, one write.

A merge's inputs are batch parts, each sorted in the batch order (:mod:`lamina.trace.order`)
and written in row groups of ``ROW_GROUP_ROWS`` rows with min/max statistics
(:mod:`lamina.trace.batch`). So the inputs already know their key ranges, and a merge
needs neither the decode job nor its scratch runs:

1. the driver reads every input part's footer and, for a sample of its row groups
   (:data:`SAMPLES_PER_PART`, :func:`sampled_ranges`), turns the statistics of the first
   sort column into a *prefix range* ``[low, high]`` (:func:`lamina.trace.order.order_prefix`
   of the min and max; ``low`` is the prefix of null when the group has nulls);
2. it cuts the prefix space into chunks of about ``JobTuning.chunk_rows`` rows
   (:func:`cut_values`: each sample's rows counted at its ``high``) and the chunks into
   consecutive parts, one write task each (:func:`plan_merge`, :class:`MergeItem`);
3. a write task, chunk by chunk, finds in every input the row groups that may hold the
   chunk's prefixes ``(lower, upper]`` (:class:`GroupIndex`: a binary search over the
   statistics, which are ordered because the part is), reads just those, takes the slice
   of them inside the range (the rows are sorted by prefix), forwards times below
   ``since``, orders the concatenated sorted runs (Arrow's multi-key sort, on the prefix
   and then the full key), consolidates (:func:`lamina.consolidate.consolidate_sorted`)
   and appends the chunk to its part.

Invariants: a chunk is a range of prefixes, so rows equal in (row, time) (equal prefix)
always share a chunk and the parts concatenated in order are the globally sorted batch,
identical row for row to the reference executor's. Every input row falls in exactly one
chunk, so the tasks' tallies add up to the merge's input rows. A row group straddling
two chunks is decoded by both (at most one per input per cut).

Reads are verified by Parquet's page checksums (written with every part) and the footer's
row count against the part's description; the whole-file CRC32C is not checked here
because no task reads a whole file (the key lookups' rule, :mod:`lamina.read.lookup`).
The footers' statistics, which choose what a task reads, are covered by no checksum: the
driver checks that the tasks read exactly the rows the inputs' descriptions count
(:func:`lamina.compacter.step.driver.check_merge_rows`), so a damaged statistic that would
skip a row group fails the merge as corruption instead of dropping rows.

When the one-pass plan does not apply, :func:`plan_merge` returns None and the driver
runs the general two-job step (:mod:`lamina.compacter.step.driver`): a first sort column
whose ``<`` is not the batch order or whose statistics are not kept (floats, decimals),
a sampled row group without statistics (a task that meets one reads all of that
part's row groups: slower, still right), or a single prefix value holding more than
:data:`MAX_TIE_CHUNKS` chunks' worth of rows (it could not be cut, so one task would hold
it in memory; the two-job step cuts ties on the full key).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lamina.compacter.step.context import StepContext
from lamina.compacter.step.failures import guarded
from lamina.compacter.step.wire import META_FIELDS, Written, batch_of, task_ids
from lamina.compacter.step.write import consolidated_rows, write_nonempty
from lamina.consolidate import INT64_MAX, INT64_MIN, forward, sum_adjacent
from lamina.errors import CorruptionError
from lamina.layout import TraceLayout
from lamina.objstore.base import ObjectStore
from lamina.packed import repeats_often
from lamina.schema import TIME
from lamina.trace.batch import OpenPart, PartFile
from lamina.trace.order import order_prefix

MAX_TIE_CHUNKS = 4
"""A merge whose single most frequent prefix value holds more rows than this many chunks
runs as the two-job step instead (see the module docstring)."""

SAMPLES_PER_PART = 64
"""Row groups per input part whose statistics the driver reads to place the cuts."""

GroupRange = tuple[int, int, int]
"""A row group's (low prefix, high prefix, rows)."""


def _one_pass_type(t: pa.DataType) -> bool:
    """Whether Parquet keeps statistics of ``t`` that bound its prefix: integers, dates,
    timestamps, booleans, strings and binaries (not floats and decimals, whose order has
    NaN and -0.0 the statistics do not follow)."""
    return bool(pa.types.is_integer(t) or pa.types.is_date(t) or pa.types.is_timestamp(t)
                or pa.types.is_boolean(t) or t in (pa.string(), pa.binary(),
                                                  pa.large_string(), pa.large_binary()))


class GroupIndex:
    """The row groups of one sorted part by prefix range of ``column``, read from its
    footer's statistics on demand: a merge looks at few of its thousands of groups (the
    driver at a sample, a task at the ends of its ranges, by binary search)."""

    def __init__(self, meta: pq.FileMetaData, column: str, column_type: pa.DataType) -> None:
        self.meta = meta
        self.groups = meta.num_row_groups
        self._column = meta.schema.to_arrow_schema().get_field_index(column)
        self._type = column_type
        self._null = int(order_prefix(pa.array([None], column_type))[0].as_py())
        self._cache: dict[int, GroupRange | None] = {}

    def range(self, g: int) -> GroupRange | None:
        """Row group ``g``'s prefix range and rows; None without usable statistics."""
        if g not in self._cache:
            rg = self.meta.row_group(g)
            st = rg.column(self._column).statistics
            n = rg.num_rows
            found: GroupRange | None = None
            if n == 0:
                found = (INT64_MAX, INT64_MIN, 0)  # meets no range
            elif st is not None and st.has_null_count and st.null_count == n:
                found = (self._null, self._null, n)
            elif st is not None and st.has_null_count and st.has_min_max:
                lo, hi = order_prefix(pa.array([st.min, st.max], self._type)).to_pylist()
                found = (self._null if st.null_count else int(lo), int(hi), n)
            self._cache[g] = found
        return self._cache[g]

    def wanted(self, lower: int | None, upper: int | None) -> list[int]:
        """The row groups that may hold prefixes in ``(lower, upper]``: consecutive, as the
        part is sorted (every group when one lacks statistics)."""
        try:
            first = 0 if lower is None else self._search(lambda r: r[1] > lower)
            end = self.groups if upper is None else self._search(lambda r: r[0] > upper)
        except LookupError:
            return list(range(self.groups))
        return list(range(first, end))

    def _search(self, past: Callable[[GroupRange], bool]) -> int:
        """The first group for which ``past`` holds (it holds for every later one)."""
        lo, hi = 0, self.groups
        while lo < hi:
            mid = (lo + hi) // 2
            r = self.range(mid)
            if r is None:
                raise LookupError(mid)
            if r[2] and past(r):
                hi = mid
            elif not r[2]:  # an empty group has no place in the order: read every group
                raise LookupError(mid)
            else:
                lo = mid + 1
        return lo


def sampled_ranges(store: ObjectStore, parts: Sequence[PartFile], column: str,
                   column_type: pa.DataType, per_part: int = SAMPLES_PER_PART
                   ) -> list[GroupRange] | None:
    """About ``per_part`` row groups of each part, each weighted with the rows of the
    groups it stands for; None when a sampled group has no usable statistics."""
    out: list[GroupRange] = []
    for part in parts:
        opened = OpenPart(store, part, verify=False)
        try:
            index = GroupIndex(opened.file.metadata, column, column_type)
            stride = max(1, math.ceil(index.groups / per_part))
            for g in range(0, index.groups, stride):
                r = index.range(g)
                if r is None:
                    return None
                share = part.rows * min(stride, index.groups - g) // max(1, index.groups)
                out.append((r[0], r[1], share))
        finally:
            opened.close()
    return out


def cut_values(samples: Sequence[GroupRange], chunks: int) -> list[int]:
    """Up to ``chunks - 1`` increasing prefix values cutting the rows into about equal
    chunks, each sample's rows counted at its high prefix."""
    points = sorted((hi, rows) for _, hi, rows in samples if rows)
    total = sum(rows for _, rows in points)
    if chunks <= 1 or not total:
        return []
    cuts: list[int] = []
    seen = 0
    j = 1
    for hi, rows in points:
        seen += rows
        while j < chunks and seen >= j * total / chunks:
            if not cuts or hi > cuts[-1]:
                cuts.append(hi)
            j += 1
    if cuts and cuts[-1] >= points[-1][0]:  # nothing would be above the last cut
        cuts.pop()
    return cuts


def _largest_tie(samples: Sequence[GroupRange]) -> int:
    """Rows of the most frequent prefix value, from the samples of a single value."""
    ties: dict[int, int] = {}
    for lo, hi, rows in samples:
        if lo == hi:
            ties[lo] = ties.get(lo, 0) + rows
    return max(ties.values(), default=0)


@dataclass(frozen=True)
class MergeItem:
    """Write batch part ``index`` from the chunks ``bounds`` delimit: chunk ``j`` holds the
    rows whose prefix is above ``bounds[j]`` and at or below ``bounds[j + 1]`` (None: no
    bound)."""

    index: int
    bounds: tuple[int | None, ...]


def plan_merge(store: ObjectStore, parts: Sequence[PartFile], ctx: StepContext,
               n_write: int, chunk_rows: int) -> list[MergeItem] | None:
    """The write tasks of a one-pass merge of ``parts`` into at most ``n_write`` parts, or
    None where it does not apply (module docstring)."""
    first = ctx.sort_columns[0] if ctx.sort_columns else None
    if first is None:
        return None
    column_type = ctx.update_schema.field(first).type
    if not _one_pass_type(column_type):
        return None
    samples = sampled_ranges(store, parts, first, column_type)
    if samples is None or _largest_tie(samples) > MAX_TIE_CHUNKS * chunk_rows:
        return None
    rows = sum(p.rows for p in parts)
    chunks = max(n_write, math.ceil(rows / chunk_rows), 1)
    cuts: list[int | None] = [None, *cut_values(samples, chunks), None]
    chunks = len(cuts) - 1
    tasks = max(1, min(n_write, chunks))
    return [MergeItem(index=p, bounds=tuple(cuts[p * chunks // tasks:
                                                 (p + 1) * chunks // tasks + 1]))
            for p in range(tasks)]


class _Inputs:
    """A write task's input parts, opened on first use (footer parsed and row count
    checked once per task)."""

    def __init__(self, store: ObjectStore, parts: Sequence[PartFile], ctx: StepContext
                 ) -> None:
        self._store = store
        self._parts = parts
        self._column = ctx.sort_columns[0]
        self._type = ctx.update_schema.field(self._column).type
        self._open: dict[int, tuple[OpenPart, GroupIndex]] = {}

    def __len__(self) -> int:
        return len(self._parts)

    def _opened(self, i: int) -> tuple[OpenPart, GroupIndex]:
        if i not in self._open:
            part = OpenPart(self._store, self._parts[i], verify=False)
            self._open[i] = (part, GroupIndex(part.file.metadata, self._column, self._type))
        return self._open[i]

    def wanted(self, i: int, lower: int | None, upper: int | None) -> list[int]:
        return self._opened(i)[1].wanted(lower, upper)

    def read(self, i: int, groups: list[int], columns: list[str]) -> pa.Table:
        """Row groups ``groups`` of input ``i``; damage (a page checksum) raises
        CorruptionError naming the part."""
        file = self._opened(i)[0].file
        try:
            return file.read_row_groups(groups, columns=columns)
        except FileNotFoundError:
            raise
        except (pa.ArrowException, OSError) as exc:
            raise CorruptionError(f"batch file is not readable Parquet: {exc}",
                                  path=self._store.location(self._parts[i].path)) from exc

    def close(self) -> None:
        for part, _ in self._open.values():
            part.close()


def _chunk_rows(inputs: _Inputs, ctx: StepContext, lower: int | None, upper: int | None
                ) -> Iterator[pa.Table]:
    """Every input's rows whose prefix is in ``(lower, upper]``, with the prefix column.
    An input's row groups meeting the range are consecutive and sorted, so its rows in
    the range are one slice (a binary search on the prefix, no copy)."""
    first = ctx.sort_columns[0]
    names = ctx.update_schema.names
    for i in range(len(inputs)):
        wanted = inputs.wanted(i, lower, upper)
        if not wanted:
            continue
        rows = inputs.read(i, wanted, names)
        prefix = order_prefix(rows.column(first))
        values = prefix.to_numpy()
        start = 0 if lower is None else int(np.searchsorted(values, lower, "right"))
        end = len(values) if upper is None else int(np.searchsorted(values, upper, "right"))
        if end > start:
            yield rows.append_column(ctx.prefix, prefix).slice(start, end - start)


def forwarded_run(run: pa.Table, ctx: StepContext) -> pa.Table:
    """One input's rows of a chunk (sorted, consolidated) with times below ``since``
    forwarded to it, which keeps them sorted. Forwarding is what makes rows of a batch
    equal: every update of a row older than the frontier gets the same time. Where that
    leaves few of the run's rows distinct (sampled neighbour pairs of equal prefix and
    time, by :func:`lamina.packed.repeats_often`, the rule a snapshot's merge follows too),
    the run is summed here, one comparison pass, so that the chunk's sort, gather and
    consolidation see each such row once: in ``bench.merge`` the left parent, 5M updates
    of 1M rows all below the frontier, comes to a fifth of its rows (docs/performance.md,
    "Summing forwarded runs first")."""
    since = ctx.since
    if since == 0 or run.num_rows == 0 or pc.min(run.column(TIME)).as_py() >= since:
        return run  # nothing forwarded: the run is as consolidated as its batch
    schema = run.schema  # the inputs' fields, which concatenating the pieces needs
    run = forward(run, since)
    if run.num_rows > 1 and repeats_often(run.column(ctx.prefix).to_numpy(),
                                          run.column(TIME).to_numpy()):
        summed = sum_adjacent(run, [*ctx.row_columns, TIME])
        if summed is not None:  # None: float rows or sums that could leave int64,
            run = summed        # left to the chunk's consolidation
    return pa.Table.from_arrays(run.columns, schema=schema)


def merged_chunks(item: MergeItem, inputs: _Inputs, ctx: StepContext, tally: list[int]
                  ) -> Iterator[pa.Table]:
    """The item's chunks merged, forwarded and consolidated, in order; adds the input rows
    it read to ``tally[0]``."""
    for j in range(len(item.bounds) - 1):
        pieces = list(_chunk_rows(inputs, ctx, item.bounds[j], item.bounds[j + 1]))
        if not pieces:
            continue
        tally[0] += sum(p.num_rows for p in pieces)
        rows = pa.concat_tables([forwarded_run(p, ctx) for p in pieces])
        # the runs are sorted: Arrow's multi-key sort of them beats ordering by prefix
        # first (lamina.trace.order.sort_rows), which copies every row once more
        yield consolidated_rows(rows.take(pc.sort_indices(rows, sort_keys=ctx.sort_keys)),
                                ctx)


def merger(ctx: StepContext, parts: Sequence[PartFile], items: Sequence[MergeItem]
           ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The one-pass merge job's task function: task ``i`` writes part ``items[i]`` and
    returns its :class:`~lamina.compacter.step.wire.Written` row and its tally."""
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for i in task_ids(batches):
            item = items[i]
            inputs = _Inputs(ctx.store, parts, ctx)
            tally = [0]
            try:
                part = write_nonempty(ctx, TraceLayout.batch_part(ctx.batch_id, item.index),
                                      merged_chunks(item, inputs, ctx, tally))
            finally:
                inputs.close()
            rows = [Written.tally(tally[0]).row()]
            if part is not None:
                rows.append(Written(part, index=item.index).row())
            yield batch_of(rows, META_FIELDS)
    return guarded(run)
