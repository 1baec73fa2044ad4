"""Consolidation and logical compaction of update tables with pyarrow.

- **Forwarding** (logical compaction): a time ``t < since`` is replaced by ``since``.
- **Consolidation**: updates with equal row and time add their diffs; zero sums vanish.
  Sums are exact: when the largest diff magnitude times the number of updates is below
  2**63 no sum can leave int64 and pyarrow's int64 ``sum`` (which would wrap silently) is
  exact; otherwise diffs are added as decimal128(38, 0), which cannot overflow for fewer
  than 2**64 updates, and a sum outside int64 raises DiffOverflowError instead of
  wrapping. (The int64 path is about a fifth faster: ``python -m bench.profile sums``.)
- **Order**: key columns, then the other row columns, then ``_time``, nulls first
  (Spark's ascending order, so the Spark jobs and this module agree row for row).

This module is the reference the Spark jobs are tested against, and the read path of
snapshots.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lamina.errors import DiffOverflowError
from lamina.schema import DIFF, TIME

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
_WIDE = pa.decimal128(38, 0)


def forward(table: pa.Table, since: int) -> pa.Table:
    """Replace every ``_time`` below ``since`` with ``since``."""
    if since == 0 or table.num_rows == 0:
        return table
    times = table.column(TIME)
    since_s = pa.scalar(min(since, 2**64 - 1), pa.uint64())
    forwarded = pc.if_else(pc.less(times, since_s), since_s, times)
    return table.set_column(table.schema.get_field_index(TIME), TIME, forwarded)


def checked_sum_to_int64(sums: pa.ChunkedArray | pa.Array, context: str) -> pa.Array:
    """Cast exact decimal sums to int64, raising DiffOverflowError on any out-of-range value."""
    lo, hi = pc.min_max(sums).values()
    if lo.is_valid and (lo.as_py() < INT64_MIN or hi.as_py() > INT64_MAX):
        bad = hi.as_py() if hi.as_py() > INT64_MAX else lo.as_py()
        raise DiffOverflowError(
            f"{context}: diffs of one row at one time sum to {bad}, outside the int64 range; "
            "the updates were not applied - split or correct the offending diffs")
    return pc.cast(sums, pa.int64())


def _int64_sums_exact(diffs: pa.ChunkedArray | pa.Array) -> bool:
    """Whether int64 sums of any subset of ``diffs`` are exact: the largest magnitude times
    the count stays below 2**63, so no partial sum can wrap."""
    lo, hi = pc.min_max(diffs).values()
    if not lo.is_valid:
        return True
    return bool(max(abs(lo.as_py()), abs(hi.as_py())) * len(diffs) <= INT64_MAX)


def consolidate(table: pa.Table, group_columns: Sequence[str], order: Sequence[str],
                *, context: str = "consolidation") -> pa.Table:
    """Sum ``_diff`` over rows equal in ``group_columns``, drop zero sums, sort by ``order``.

    The result has ``group_columns`` (in the table's column order) and ``_diff``."""
    if table.num_rows == 0:
        cols = [c for c in table.column_names if c in group_columns]
        return table.select([*cols, DIFF])
    if _int64_sums_exact(table.column(DIFF)):
        grouped = table.group_by(list(group_columns), use_threads=True).aggregate(
            [(DIFF, "sum")])
        diffs = grouped.column(f"{DIFF}_sum")
    else:
        wide = table.append_column("__wide", pc.cast(table.column(DIFF), _WIDE))
        grouped = wide.group_by(list(group_columns), use_threads=True).aggregate(
            [("__wide", "sum")])
        diffs = checked_sum_to_int64(grouped.column("__wide_sum"), context)
    cols = [c for c in table.column_names if c in group_columns]
    out = pa.Table.from_arrays([*(grouped.column(c) for c in cols), diffs],
                               names=[*cols, DIFF])
    out = out.filter(pc.not_equal(out.column(DIFF), 0))
    return sort(out, order)


def _changes(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """For each value after the first: whether it differs from the one before (nulls equal
    nulls)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    a, b = column.slice(1), column.slice(0, len(column) - 1)
    ne = pc.not_equal(a, b)
    if column.null_count:
        an, bn = pc.is_null(a), pc.is_null(b)
        ne = pc.if_else(pc.or_(an, bn), pc.xor(an, bn), ne)
    out: np.ndarray = ne.to_numpy(zero_copy_only=False)
    return out


def sum_adjacent(table: pa.Table, group_columns: Sequence[str]) -> pa.Table | None:
    """Consolidate a table whose rows equal in ``group_columns`` are adjacent (sorted
    input): the first row of every run of equal rows with the run's diff sum, zero sums
    dropped, in input order, every column kept. Rows equal under :func:`consolidate`'s
    grouping are exactly the runs, so for sorted input the result equals
    ``consolidate``'s (which hashes and sorts again, several times slower).

    Returns None where that equality is not guaranteed: a floating group column (hash
    grouping and neighbour comparison may treat NaN and -0.0 differently) or diffs whose
    int64 sums could wrap."""
    if any(pa.types.is_floating(table.schema.field(c).type) for c in group_columns):
        return None
    n = table.num_rows
    if n == 0:
        return table
    column = table.column(DIFF)
    if not _int64_sums_exact(column):
        return None
    diffs = column.to_numpy()
    starts_mask = np.zeros(n, dtype=bool)
    starts_mask[0] = True
    for name in group_columns:
        starts_mask[1:] |= _changes(table.column(name))
    starts = np.flatnonzero(starts_mask)
    sums = np.add.reduceat(diffs, starts)
    keep = sums != 0
    rows = table.take(starts[keep])
    return pa.Table.from_arrays(  # fields as consolidate() makes them (nullable, no metadata)
        [pa.array(sums[keep]) if name == DIFF else rows.column(name)
         for name in table.column_names], names=table.column_names)


def sort(table: pa.Table, order: Sequence[str]) -> pa.Table:
    if table.num_rows <= 1 or not order:
        return table
    idx = pc.sort_indices(table, sort_keys=[(c, "ascending", "at_start") for c in order])
    return table.take(idx)


def consolidate_updates(table: pa.Table, row_columns: Sequence[str],
                        sort_columns: Sequence[str], *, context: str) -> pa.Table:
    """Consolidate updates keeping ``_time``: the form stored in batches."""
    return consolidate(table, [*row_columns, TIME], [*sort_columns, TIME], context=context)


def snapshot_of(table: pa.Table, as_of: int, row_columns: Sequence[str],
                sort_columns: Sequence[str], *, context: str) -> pa.Table:
    """Rows whose diffs over updates with ``_time <= as_of`` sum to non-zero."""
    if table.num_rows:
        table = table.filter(pc.less_equal(table.column(TIME),
                                           pa.scalar(as_of, pa.uint64())))
    return consolidate(table.drop_columns([TIME]), row_columns, sort_columns, context=context)
