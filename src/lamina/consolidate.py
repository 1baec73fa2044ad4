"""Consolidation and logical compaction of update tables with pyarrow.

- **Forwarding** (logical compaction): a time ``t < since`` is replaced by ``since``.
- **Consolidation**: updates with equal row and time add their diffs; zero sums vanish.
  Sums are exact: diffs are added as decimal128(38, 0), which cannot overflow for fewer
  than 2**64 updates, and a sum outside int64 raises DiffOverflowError instead of wrapping
  (pyarrow's int64 ``sum`` wraps silently).
- **Order**: key columns, then the other row columns, then ``_time``, nulls first
  (Spark's ascending order, so the Spark jobs and this module agree row for row).

This module is the reference the Spark jobs are tested against, and the read path of
snapshots.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def consolidate(table: pa.Table, group_columns: Sequence[str], order: Sequence[str],
                *, context: str = "consolidation") -> pa.Table:
    """Sum ``_diff`` over rows equal in ``group_columns``, drop zero sums, sort by ``order``.

    The result has ``group_columns`` (in the table's column order) and ``_diff``."""
    if table.num_rows == 0:
        cols = [c for c in table.column_names if c in group_columns]
        return table.select([*cols, DIFF])
    wide = table.append_column("__wide", pc.cast(table.column(DIFF), _WIDE))
    grouped = wide.group_by(list(group_columns), use_threads=True).aggregate([("__wide", "sum")])
    diffs = checked_sum_to_int64(grouped.column("__wide_sum"), context)
    cols = [c for c in table.column_names if c in group_columns]
    out = pa.Table.from_arrays([*(grouped.column(c) for c in cols), diffs],
                               names=[*cols, DIFF])
    out = out.filter(pc.not_equal(out.column(DIFF), 0))
    return sort(out, order)


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
