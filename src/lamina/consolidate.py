"""Consolidation and logical compaction of update tables with pyarrow.

- **Forwarding** (logical compaction): a time ``t < since`` is replaced by ``since``.
- **Consolidation**: updates with equal row and time add their diffs; zero sums vanish.
  Sums are exact: when the largest diff magnitude times the number of updates is below
  2**63 no sum can leave int64 and pyarrow's int64 ``sum`` (which would wrap silently) is
  exact; otherwise diffs are added as decimal128(38, 0), which cannot overflow for fewer
  than 2**64 updates. (The int64 path is about a fifth faster:
  ``python -m bench.profile sums``.)
- **Sums outside int64** are never wrapped or saturated. What happens depends on who
  asked (``carry``):

  * stored form (:func:`consolidate_updates`: batches and pending parts, written by the
    reference executor and the Spark write tasks alike): the sum is kept exactly as a
    *carry*, the fewest rows with that (row, time) whose diffs all have the sum's sign,
    each ``±INT64_MAX`` but the last, which holds the remainder. Example: 2**63 is stored
    as ``INT64_MAX, 1``. A carry has at most as many rows as the updates it sums, and it
    folds back into one row as soon as later updates (a correction, forwarding by
    ``since``) bring the sum into range. This is the only case where a batch holds two
    rows equal in (row, time) (:func:`carries_only` checks it);
  * results that must be int64 (a snapshot's ``_diff``, :func:`snapshot_of`):
    DiffOverflowError naming the first offending row and its exact sum, with the
    offending rows (``overflows``, exact decimal sums) and every other row (``rest``)
    attached, so a caller can read the rest and nothing is dropped silently.
- **Order**: key columns, then the other row columns, then ``_time``, nulls first
  (Spark's ascending order, so the Spark jobs and this module agree row for row).

This module is the reference the Spark jobs are tested against, and the read path of
snapshots.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from lamina import columns, kernels
from lamina.errors import DiffOverflowError
from lamina.frontier import as_time
from lamina.packed import merge_packed
from lamina.schema import DIFF, TIME
from lamina.threads import map_on_threads

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
_WIDE = pa.decimal128(38, 0)
_SHOWN = 300  # characters of an offending row quoted in an error message
MIN_ROWS_PER_RANGE = 250_000
"""The fewest rows :func:`merge_runs` gives a thread of its own (rows of other than packed
integers). At 500,000, the cold read benchmark's snapshot (999,116 rows of an integer, a
string and an integer in two parts) merged on one thread: its first read in a process took
about 164 ms, against 113 ms on two (docs/performance.md, "Reading without pyarrow's
Python layers")."""


def forward(table: pa.Table, since: int) -> pa.Table:
    """Replace every ``_time`` below ``since`` with ``since``."""
    if since == 0 or table.num_rows == 0:
        return table
    times = table.column(TIME)
    since_s = columns.scalar(as_time(since), pa.uint64())
    forwarded = kernels.if_else(kernels.less(times, since_s), since_s, times)
    return table.set_column(table.schema.get_field_index(TIME), TIME, forwarded)


def _int64_sums_exact(diffs: pa.ChunkedArray | pa.Array) -> bool:
    """Whether int64 sums of any subset of ``diffs`` are exact: the largest magnitude times
    the count stays below 2**63, so no partial sum can wrap."""
    lo, hi = kernels.min_max(diffs)
    if not lo.is_valid:
        return True
    return bool(max(abs(lo.as_py()), abs(hi.as_py())) * len(diffs) <= INT64_MAX)


def consolidate(table: pa.Table, group_columns: Sequence[str], order: Sequence[str],
                *, context: str = "consolidation", carry: bool = False) -> pa.Table:
    """Sum ``_diff`` over rows equal in ``group_columns``, drop zero sums, sort by ``order``.

    The result has ``group_columns`` (in the table's column order) and ``_diff``. A sum
    outside int64 raises DiffOverflowError (with ``overflows`` and ``rest``), or with
    ``carry`` is kept exactly as a carry (see the module docstring)."""
    cols = [c for c in table.column_names if c in group_columns]
    if table.num_rows == 0:
        return table.select([*cols, DIFF])
    if _int64_sums_exact(table.column(DIFF)):
        grouped = table.group_by(list(group_columns), use_threads=True).aggregate(
            [(DIFF, "sum")])
        diffs = grouped.column(f"{DIFF}_sum")
    else:
        wide = table.append_column("__wide", kernels.cast(table.column(DIFF), _WIDE))
        grouped = wide.group_by(list(group_columns), use_threads=True).aggregate(
            [("__wide", "sum")])
        sums = grouped.column("__wide_sum")
        lo, hi = kernels.min_max(sums)
        if lo.as_py() < INT64_MIN or hi.as_py() > INT64_MAX:
            keys = pa.Table.from_arrays([grouped.column(c) for c in cols], names=cols)
            return _out_of_range(keys, sums, order, context=context, carry=carry)
        diffs = kernels.cast(sums, pa.int64())
    out = pa.Table.from_arrays([*(grouped.column(c) for c in cols), diffs],
                               names=[*cols, DIFF])
    out = kernels.filter(out, kernels.not_equal(out.column(DIFF),
                                                 columns.scalar(0, pa.int64())))
    return sort(out, order)


def carry_pieces(total: int) -> list[int]:
    """The diffs a carry stores for ``total``: ``±INT64_MAX`` repeated, then the remainder
    (no zero), all with the sign of ``total``; one value when ``total`` fits int64."""
    if INT64_MIN <= total <= INT64_MAX:
        return [total]
    sign = -1 if total < 0 else 1
    whole, rest = divmod(abs(total), INT64_MAX)
    return [sign * INT64_MAX] * whole + ([sign * rest] if rest else [])


def _out_of_range(keys: pa.Table, sums: pa.ChunkedArray, order: Sequence[str], *,
                  context: str, carry: bool) -> pa.Table:
    """Finish :func:`consolidate` when some exact sum leaves int64: carry, or raise."""
    fits = kernels.and_(kernels.greater_equal(sums, pa.scalar(INT64_MIN, _WIDE)),
                        kernels.less_equal(sums, pa.scalar(INT64_MAX, _WIDE)))
    rest = kernels.filter(keys, fits).append_column(
        DIFF, kernels.cast(kernels.filter(sums, fits), pa.int64()))
    rest = kernels.filter(rest, kernels.not_equal(rest.column(DIFF),
                                                  columns.scalar(0, pa.int64())))
    over = kernels.invert(fits)
    over_keys, over_sums = kernels.filter(keys, over), kernels.filter(sums, over)
    if carry:
        index: list[int] = []
        pieces: list[int] = []
        for i, total in enumerate(over_sums.to_pylist()):
            p = carry_pieces(int(total))
            index.extend([i] * len(p))
            pieces.extend(p)
        carried = kernels.take(over_keys, pa.array(index, pa.int64())).append_column(
            DIFF, pa.array(pieces, pa.int64()))
        # sort_indices is stable: each carry keeps its pieces in carry_pieces order
        return sort(pa.concat_tables([rest, carried]), order)
    overflows = sort(over_keys.append_column(DIFF, over_sums), order)
    first = overflows.slice(0, 1).to_pylist()[0]
    total = first.pop(DIFF)
    shown = repr(first)
    if len(shown) > _SHOWN:
        shown = shown[:_SHOWN] + "...}"
    more = overflows.num_rows - 1
    raise DiffOverflowError(
        f"{context}: the diffs of row {shown} sum to {total}, outside the int64 range"
        + (f" ({more} more rows overflow too)" if more else "")
        + "; an int64 _diff cannot hold it. Nothing was dropped silently: the error's "
        "'rest' holds every other row and 'overflows' the offending ones with their exact "
        "sums. To make the row readable, append a correcting diff for it at a time at or "
        "after the upper (see docs/operations.md, 'Diff overflow')",
        overflows=overflows, rest=sort(rest, order))


def carries_only(table: pa.Table, group_columns: Sequence[str]) -> bool:
    """Whether every set of rows equal in ``group_columns`` is a single row or the carry
    of a sum outside int64 (its diffs all of the sum's sign, and as few as
    :func:`carry_pieces` makes): the only repeats a consolidated batch may hold."""
    if table.num_rows == 0:
        return True
    wide = table.select(list(group_columns)).append_column(
        "__wide", kernels.cast(table.column(DIFF), _WIDE))
    g = wide.group_by(list(group_columns)).aggregate(
        [("__wide", "sum"), ("__wide", "count"), ("__wide", "min"), ("__wide", "max")])
    repeated = kernels.filter(g, kernels.greater(g.column("__wide_count"),
                                                 columns.scalar(1, pa.int64())))
    for total, n, lo, hi in zip(*(repeated.column(f"__wide_{a}").to_pylist()
                                  for a in ("sum", "count", "min", "max")), strict=True):
        s = int(total)
        if INT64_MIN <= s <= INT64_MAX or n != len(carry_pieces(s)):
            return False
        if (s > 0 and lo <= 0) or (s < 0 and hi >= 0):
            return False
    return True


def _changes(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """For each value after the first: whether it differs from the one before (nulls equal
    nulls)."""
    if pa.types.is_integer(column.type) and not column.null_count:
        values = columns.numpy(column)  # a bool per value, not bits to unpack: 3 to 5 times
        changed: np.ndarray = values[1:] != values[:-1]  # the speed of Arrow's not_equal
        return changed
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    a, b = column.slice(1), column.slice(0, len(column) - 1)
    ne = kernels.not_equal(a, b)
    if column.null_count:
        an, bn = kernels.is_null(a), kernels.is_null(b)
        ne = kernels.if_else(kernels.or_(an, bn), kernels.xor(an, bn), ne)
    return columns.numpy(ne)


def neighbour_changes(table: pa.Table, group_columns: Sequence[str]) -> np.ndarray:
    """For each row after the first: whether it differs from the row before in any of
    ``group_columns`` (nulls equal nulls). In sorted rows, the starts of the runs of equal
    rows."""
    changes = np.zeros(max(0, table.num_rows - 1), dtype=bool)
    for name in group_columns:
        changes |= _changes(table.column(name))
    return changes


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
    starts_mask = np.ones(n, dtype=bool)
    starts_mask[1:] = neighbour_changes(table, group_columns)
    starts = np.flatnonzero(starts_mask)
    keys = table.drop_columns([DIFF])  # _diff is replaced, not filtered
    diffs = columns.numpy(column)
    # every run one row (rows with distinct times, merged consolidated runs): no sums
    sums = diffs if len(starts) == n else np.add.reduceat(diffs, starts)
    keep = sums != 0
    if len(starts) < n or not keep.all():  # the kept run starts, as a mask to filter by
        kept = np.zeros(n, dtype=bool)
        kept[starts[keep]] = True
        keys = kernels.filter(keys, columns.array(kept))
        sums = sums[keep]
    # every column in its place, fields as consolidate() makes them (nullable, no metadata)
    out: list[pa.Array | pa.ChunkedArray] = list(keys.columns)
    out.insert(table.column_names.index(DIFF), columns.array(sums))
    return pa.Table.from_arrays(out, names=table.column_names)


def _splittable(t: pa.DataType) -> bool:
    """Whether ``<`` on values of ``t`` is the total order :func:`sort` sorts by (so a
    sorted column can be cut at a value): not floats (NaN), not nested types."""
    return bool(pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
            or pa.types.is_binary(t) or pa.types.is_large_binary(t)
            or pa.types.is_temporal(t) or pa.types.is_decimal(t) or pa.types.is_boolean(t))


def _cuts(run: pa.Table, column: str, bounds: Sequence[pa.Scalar]) -> list[int]:
    """Where each bound falls in ``run``, sorted by ``column`` with nulls first: the number
    of rows whose value is null or below the bound."""
    col = run.column(column)
    nulls = col.null_count
    if pa.types.is_integer(col.type) and not nulls:  # a binary search per sorted chunk
        chunks = [columns.numpy(c) for c in col.chunks]
        return [sum(int(np.searchsorted(c, b.as_py(), "left")) for c in chunks)
                for b in bounds]
    return [nulls + int(kernels.sum(kernels.less(col, b)).as_py() or 0) for b in bounds]


def merge_runs(runs: Sequence[pa.Table], unsorted: Sequence[pa.Table],
               row_columns: Sequence[str], sort_columns: Sequence[str], *,
               workers: int = 1, min_rows_per_worker: int | None = None
               ) -> pa.Table | None:
    """Consolidate ``runs`` (each sorted by ``sort_columns``, nulls first, with ``_diff``)
    and ``unsorted`` tables of the same columns: the rows :func:`consolidate` gives over
    all of them, in ``sort_columns`` order, or None where :func:`sum_adjacent` declines.

    Integer and boolean rows whose values pack into one uint64 are merged by one numpy
    sort of their packed keys (:func:`lamina.packed.merge_packed`), which writes the live
    rows once; the rest as follows.

    Each run is summed run by run, the pieces are merged by one sort (fast on presorted
    runs) and summed again. With ``workers > 1`` and enough rows the key space is cut into
    ``workers`` ranges of the first sort column (its values at the quantiles of the
    largest run), and each range is merged on its own thread: rows equal in every row
    column share that value, so no run of equal rows straddles two ranges, and the ranges'
    results concatenated in order are sorted. (Arrow's sort is single-threaded.) A range
    gets at least ``min_rows_per_worker`` rows (None: :data:`MIN_ROWS_PER_RANGE` here, and
    lamina.packed.MIN_ROWS_PER_RANGE for packed rows)."""
    pieces = [t for t in runs if t.num_rows]
    loose_rows = [t for t in unsorted if t.num_rows]
    packed = merge_packed(pieces, loose_rows, row_columns, sort_columns, workers=workers,
                          min_rows_per_worker=min_rows_per_worker)
    if packed is not None:
        return packed
    if loose_rows:
        pieces.append(sort(pa.concat_tables(loose_rows), sort_columns))
    if not pieces or any(pa.types.is_floating(pieces[0].schema.field(c).type)
                         for c in row_columns):
        return None
    total = sum(t.num_rows for t in pieces)
    least = MIN_ROWS_PER_RANGE if min_rows_per_worker is None else min_rows_per_worker
    workers = min(workers, total // max(1, least))
    bounds: list[pa.Scalar] = []
    cuts = [[0, t.num_rows] for t in pieces]  # per piece, where each range starts and ends
    if workers > 1 and sort_columns and _splittable(pieces[0].schema.field(sort_columns[0]).type):
        first = sort_columns[0]
        largest = max(pieces, key=lambda t: t.num_rows).column(first)
        valid = len(largest) - largest.null_count
        for j in range(1, workers if valid else 1):  # ascending (a sorted run), no repeats
            b = largest[largest.null_count + valid * j // workers]
            if b.is_valid and (not bounds or b.as_py() != bounds[-1].as_py()):
                bounds.append(b)
        cuts = [[0, *_cuts(t, first, bounds), t.num_rows] for t in pieces]

    def merge(i: int) -> pa.Table | None:
        summed = []
        for t, c in zip(pieces, cuts, strict=True):
            if c[i + 1] > c[i]:
                s = sum_adjacent(t.slice(c[i], c[i + 1] - c[i]), row_columns)
                if s is None:
                    return None
                summed.append(s)
        if not summed:
            return pa.Table.from_arrays([c.slice(0, 0) for c in pieces[0].columns],
                                        names=pieces[0].column_names)
        if len(summed) == 1:  # already consolidated: no two neighbours equal, no zero sums
            return summed[0]
        return sum_adjacent(sort(pa.concat_tables(summed), sort_columns), row_columns)

    results = map_on_threads(merge, range(len(bounds) + 1), name="merge")
    if any(r is None for r in results):
        return None
    return pa.concat_tables([r for r in results if r is not None])


def sort(table: pa.Table, order: Sequence[str]) -> pa.Table:
    if table.num_rows <= 1 or not order:
        return table
    return kernels.take(table, kernels.sort_indices(table, order))


def consolidate_updates(table: pa.Table, row_columns: Sequence[str],
                        sort_columns: Sequence[str], *, context: str) -> pa.Table:
    """Consolidate updates keeping ``_time``: the form stored in batches and pending parts,
    where a sum outside int64 is kept as a carry (never an error)."""
    return consolidate(table, [*row_columns, TIME], [*sort_columns, TIME], context=context,
                       carry=True)


def consolidate_sorted(table: pa.Table, columns: Sequence[str], row_columns: Sequence[str],
                       sort_columns: Sequence[str], *, context: str) -> pa.Table:
    """Consolidate updates sorted by full key (row columns in the batch order, then
    ``_time``), keeping ``columns`` (the update columns; any other is dropped): the same
    rows, in the same order, as :func:`consolidate_updates`. Equal rows are adjacent, so
    :func:`sum_adjacent` sums runs of neighbours without hashing or sorting again; where it
    declines (float row columns, sums that might leave int64) :func:`consolidate_updates`
    does it. (The Spark write tasks' consolidation, :mod:`lamina.compacter.step.write`.)"""
    table = table.select(list(columns))
    out = sum_adjacent(table, [*row_columns, TIME])
    if out is not None:
        return out
    return consolidate_updates(table, row_columns, sort_columns, context=context)


def snapshot_of(table: pa.Table, as_of: int, row_columns: Sequence[str],
                sort_columns: Sequence[str], *, context: str) -> pa.Table:
    """Rows whose diffs over updates with ``_time <= as_of`` sum to non-zero."""
    if table.num_rows:
        table = kernels.filter(table, kernels.less_equal(table.column(TIME),
                                                         columns.scalar(as_of, pa.uint64())))
    return consolidate(table.drop_columns([TIME]), row_columns, sort_columns, context=context)
