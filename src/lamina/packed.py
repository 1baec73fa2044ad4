"""Packed row keys: consolidating integer rows with one numpy sort.

A read consolidates sorted runs (trace parts) and an unsorted WAL tail
(:func:`lamina.consolidate.merge_runs`). When every row column is an integer or boolean
column without nulls, and the columns' value ranges over all the pieces are small enough,
each row maps one-to-one, and in the sort order, onto a single uint64, its *packed key*:
the sort columns are the digits of a mixed-radix number, the first the most significant::

    span(c)  = high(c) - low(c) + 1            over every piece
    radix(c) = product of span(d) for the sort columns d after c
    key      = sum over sort columns c of (value(c) - low(c)) * radix(c)

which applies when the product of all spans is at most 2**64 (checked with Python
integers). Comparing two keys compares the rows column by column in the sort order
(ascending; there are no nulls to place), and equal keys are equal rows. So the merge of
every piece becomes:

1. the keys of all pieces, concatenated in any order;
2. one stable ``argsort``: numpy's stable sort of integers is a timsort, which finds the
   sorted runs and merges them, so presorted runs cost about a pass each, and only the
   WAL tail is really sorted;
3. the diffs, in that order, summed over runs of equal keys (``np.add.reduceat``), zero
   sums dropped;
4. the output columns decoded from the surviving keys (``(key // radix(c)) % span(c) +
   low(c)``): the live rows are written once, and no input column is gathered by a take.

A sorted piece that holds many rows more than once (a trace part keeps a row once per
time it changed) is summed over its runs of equal keys before step 2, so the sort and its
gathers see each of its rows once (:func:`_sum_sorted`). Pieces already in key order one
after the other (a trace of one batch, read part after part) skip the sort, and when no
two of their rows are equal and no diff is zero they are the result as they are. With
``workers`` the key space is cut into ranges merged on threads (:func:`merge_packed`).

Sums are exact or the merge declines: when the largest diff magnitude times the number of
diffs could leave int64, :func:`merge_packed` returns None, as it does for any other input
it does not cover (a float, string or temporal column, a null, spans too wide), and the
caller merges the general way. The result is row for row, and field for field, what
:func:`lamina.consolidate.consolidate` returns over the same rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import pyarrow as pa

from lamina import columns
from lamina.schema import DIFF
from lamina.threads import map_on_threads

_WORD = 1 << 64
_INT64_MAX = (1 << 63) - 1
MIN_ROWS_PER_RANGE = 500_000
"""The fewest rows :func:`merge_packed` gives a thread's key range (``min_rows_per_worker``
None): below it, one numpy sort on one thread beats cutting the keys and merging the
ranges apart. (The unpacked merge has its own, lamina.consolidate.MIN_ROWS_PER_RANGE.)"""


def _packable(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_boolean(t))


@dataclass(frozen=True)
class _Digit:
    """One sort column as a digit of the packed key."""

    name: str
    type: pa.DataType
    dtype: Any
    low: int
    span: int
    radix: int

    def add_to(self, values: np.ndarray[Any, Any], out: np.ndarray[Any, Any], *,
               first: bool) -> None:
        """Write (``first``) or add ``(value - low) * radix`` to the uint64 keys ``out``
        (exact: the offsets fit by construction, and wrapping arithmetic modulo 2**64
        gives them for any signed ``low``)."""
        if self.span == 1:
            if first:
                out[:] = 0
            return
        if values.dtype == np.bool_:
            digits = values.astype(np.uint64)
        elif values.dtype.kind == "i":
            digits = values.astype(np.int64, copy=False).view(np.uint64)
        else:
            digits = values.astype(np.uint64, copy=False)
        low = np.uint64(self.low % _WORD)
        if first:
            np.subtract(digits, low, out=out)
            if self.radix != 1:
                np.multiply(out, np.uint64(self.radix), out=out)
            return
        digits = digits - low
        if self.radix != 1:
            digits *= np.uint64(self.radix)
        out += digits

    def decode(self, keys: np.ndarray[Any, Any]) -> pa.Array:
        """This column's values of packed ``keys``, as an Arrow array of its type."""
        if self.span == 1:
            offsets = np.zeros(len(keys), dtype=np.uint64)
        else:
            offsets = keys // np.uint64(self.radix) if self.radix != 1 else keys
            if self.span * self.radix < _WORD:  # not the most significant digit
                offsets = offsets % np.uint64(self.span)
        values = offsets + np.uint64(self.low % _WORD)
        if self.dtype == np.bool_:
            return columns.array(values.astype(np.bool_))
        if np.dtype(self.dtype).kind == "i":
            return columns.array(values.view(np.int64).astype(self.dtype, copy=False),
                                 self.type)
        return columns.array(values.astype(self.dtype, copy=False), self.type)


def _digits(pieces: Sequence[pa.Table], sort_columns: Sequence[str]) -> list[_Digit] | None:
    """The sort columns as digits, least significant last, or None where packing does not
    apply (module docstring)."""
    schema = pieces[0].schema
    lows: list[int] = []
    spans: list[int] = []
    dtypes: list[Any] = []
    for name in sort_columns:
        type_ = schema.field(name).type
        if not _packable(type_) or any(t.column(name).null_count for t in pieces):
            return None
        low = high = None
        dtype: Any = None
        for t in pieces:
            values = columns.numpy(t.column(name))
            dtype = values.dtype
            if len(values):
                lo, hi = int(values.min()), int(values.max())
                low = lo if low is None else min(low, lo)
                high = hi if high is None else max(high, hi)
        if low is None or high is None:
            return None
        lows.append(low)
        spans.append(high - low + 1)
        dtypes.append(dtype)
    total = 1
    for span in spans:
        total *= span
    if total > _WORD:
        return None
    out: list[_Digit] = []
    radix = 1
    for name, low, span, dtype in reversed(list(zip(sort_columns, lows, spans, dtypes,
                                                    strict=True))):
        out.append(_Digit(name, schema.field(name).type, dtype, low, span, radix))
        radix *= span
    return out[::-1]


def merge_packed(runs: Sequence[pa.Table], unsorted: Sequence[pa.Table],
                 row_columns: Sequence[str], sort_columns: Sequence[str], *,
                 workers: int = 1, min_rows_per_worker: int | None = None
                 ) -> pa.Table | None:
    """Consolidate ``runs`` (each sorted by ``sort_columns``) and ``unsorted`` tables (row
    columns and ``_diff``) by packed keys: the rows of
    :func:`lamina.consolidate.consolidate` over all of them, in ``sort_columns`` order,
    with the same fields; or None where packing does not apply (module docstring),
    including when there are no rows.

    With ``workers > 1`` and enough rows the key space is cut into that many ranges at
    quantiles of the largest run's keys and each range is merged on a thread of its own
    (numpy's sort, gathers and arithmetic release the GIL); the ranges' tables, in order,
    are the result. A range gets at least ``min_rows_per_worker`` rows (None:
    :data:`MIN_ROWS_PER_RANGE`)."""
    sorted_pieces = [t for t in runs if t.num_rows]
    pieces = [*sorted_pieces, *(t for t in unsorted if t.num_rows)]
    if not pieces or sorted(row_columns) != sorted(sort_columns):
        return None
    digits = _digits(pieces, sort_columns)
    if digits is None:
        return None
    diffs = [columns.numpy(t.column(DIFF)) for t in pieces]
    n = sum(len(d) for d in diffs)
    largest = max(max(abs(int(d.min())), abs(int(d.max()))) for d in diffs)
    if largest * n > _INT64_MAX:
        return None
    every_key = np.empty(n, dtype=np.uint64)  # all pieces' keys, in the pieces' order
    keys, at = [], 0
    for t in pieces:
        keys.append(every_key[at:at + t.num_rows])
        at += t.num_rows
        for i, digit in enumerate(digits):
            digit.add_to(columns.numpy(t.column(digit.name)), keys[-1], first=i == 0)
    names = pieces[0].column_names
    if all(len(k) < 2 or bool(np.all(k[1:] >= k[:-1])) for k in keys[len(sorted_pieces):]) \
            and all(a[-1] <= b[0] for a, b in pairwise(keys)):
        return _in_order(pieces, every_key, np.concatenate(diffs), digits)
    least = MIN_ROWS_PER_RANGE if min_rows_per_worker is None else min_rows_per_worker
    ranges = max(1, min(workers, n // max(1, least)))
    bounds: list[int] = []
    if ranges > 1 and sorted_pieces:
        biggest = max(range(len(sorted_pieces)), key=lambda i: len(keys[i]))
        for j in range(1, ranges):
            b = int(keys[biggest][len(keys[biggest]) * j // ranges])
            if b > (bounds[-1] if bounds else 0):
                bounds.append(b)
    if not bounds:  # one range: every row, the sorted runs summed first where it pays
        summed = [_sum_sorted(k, d) if i < len(sorted_pieces) else (k, d)
                  for i, (k, d) in enumerate(zip(keys, diffs, strict=True))]
        if all(k is s_k for k, (s_k, _) in zip(keys, summed, strict=True)):
            return _merged(every_key, np.concatenate(diffs), digits, names)
        return _merged(np.concatenate([k for k, _ in summed]),
                       np.concatenate([d for _, d in summed]), digits, names)
    cuts = np.array(bounds, dtype=np.uint64)
    # per piece, the rows of each range: slices of a sorted run, a range id per row else
    where: list[list[int] | np.ndarray[Any, Any]] = [
        [0, *np.searchsorted(k, cuts, "left").tolist(), len(k)] if i < len(sorted_pieces)
        else np.searchsorted(cuts, k, "right") for i, k in enumerate(keys)]

    def merge(r: int) -> pa.Table:
        ks, ds = [], []
        for k, d, rows in zip(keys, diffs, where, strict=True):
            if isinstance(rows, list):  # a sorted run's slice: equal keys all inside
                k_r, d_r = _sum_sorted(k[rows[r]:rows[r + 1]], d[rows[r]:rows[r + 1]])
                ks.append(k_r)
                ds.append(d_r)
            else:
                mask = rows == r
                ks.append(k[mask])
                ds.append(d[mask])
        return _merged(np.concatenate(ks), np.concatenate(ds), digits, names)

    return pa.concat_tables(map_on_threads(merge, range(len(bounds) + 1), name="packed"))


def _run_starts(keys: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """For sorted ``keys``, True where a run of equal keys starts."""
    starts_mask = np.empty(len(keys), dtype=np.bool_)
    if len(keys):
        starts_mask[0] = True
        np.not_equal(keys[1:], keys[:-1], out=starts_mask[1:])
    return starts_mask


SUM_FIRST_BELOW = 0.75
"""A sorted run whose sampled neighbour pairs differ less often than this is summed over
its runs of equal rows before a merge sorts it (:func:`worth_summing`,
:func:`repeats_often`): here (:func:`_sum_sorted`), in the Spark merge tasks
(:func:`lamina.compacter.step.merge.forwarded_run`) and in a conversion's decode tasks
(:func:`lamina.compacter.step.decode.summed_repeats`)."""
_PROBES = 4096


def worth_summing(differ: np.ndarray[Any, Any]) -> bool:
    """Whether a sorted run is worth summing before a merge's sort, given whether each of
    its sampled neighbour pairs differs (:data:`SUM_FIRST_BELOW`)."""
    return bool(np.count_nonzero(differ) < SUM_FIRST_BELOW * len(differ))


def repeats_often(*keys: np.ndarray[Any, Any]) -> bool:
    """:func:`worth_summing` of about ``_PROBES`` neighbour pairs spread over sorted rows
    given by their key columns (numpy arrays of one length, at least 2): a pair differs
    where any column does."""
    n = len(keys[0])
    probe = np.arange(0, n - 1, max(1, (n - 1) // _PROBES))
    differ = np.zeros(len(probe), dtype=bool)
    for key in keys:
        differ |= key[probe] != key[probe + 1]
    return worth_summing(differ)


def _sum_sorted(keys: np.ndarray[Any, Any],
                diffs: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """A sorted run's keys and diffs, with each run of equal keys summed into one row when
    that leaves fewer than ``SUM_FIRST_BELOW`` of its rows (zero sums are kept: the final
    sum drops them); else the run as it is. A trace part holds a row once per time it
    changed, and a read drops the times: in ``10m-churn`` of the peers benchmark a part of
    1.83M rows holds 480,000 distinct rows, and summing it first (one comparison pass and
    a ``reduceat``) spares the sort, its gathers and their memory two thirds of the rows.
    Whether it pays is judged first from 4,096 neighbour pairs spread over the run, so a
    run of mostly distinct rows (``10m-k200-50k``: 83%) costs no pass at all."""
    if len(keys) < 2:
        return keys, diffs
    if not repeats_often(keys):
        return keys, diffs
    starts = np.flatnonzero(_run_starts(keys))
    return keys[starts], np.add.reduceat(diffs, starts)


def _in_order(pieces: Sequence[pa.Table], keys: np.ndarray[Any, Any],
              diffs: np.ndarray[Any, Any], digits: Sequence[_Digit]) -> pa.Table:
    """The merge of pieces whose rows, in the pieces' order, are already in key order (a
    batch's parts one after the other, as a snapshot of a compacted trace reads them): no
    sort; when no two rows are equal and no diff is zero, the pieces' own columns are the
    result, and nothing is copied."""
    names = pieces[0].column_names
    starts_mask = _run_starts(keys)
    if bool(starts_mask.all()) and bool(np.all(diffs != 0)):
        return pa.Table.from_arrays(  # fields as consolidate() makes them
            [pa.chunked_array([c for t in pieces for c in t.column(name).chunks],
                              type=pieces[0].schema.field(name).type) for name in names],
            names=names)
    return _summed(keys, diffs, starts_mask, digits, names)


def _merged(keys: np.ndarray[Any, Any], diffs: np.ndarray[Any, Any],
            digits: Sequence[_Digit], names: Sequence[str]) -> pa.Table:
    """Rows of ``keys`` (any order) with their ``diffs`` summed per key, zero sums
    dropped, ordered by key and decoded into columns ``names``."""
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    diffs = diffs[order]
    del order
    return _summed(keys, diffs, _run_starts(keys), digits, names)


def _summed(keys: np.ndarray[Any, Any], diffs: np.ndarray[Any, Any],
            starts_mask: np.ndarray[Any, Any], digits: Sequence[_Digit],
            names: Sequence[str]) -> pa.Table:
    """Sorted ``keys`` with their ``diffs`` summed over the runs that ``starts_mask``
    starts, zero sums dropped, decoded into columns ``names``."""
    starts = np.flatnonzero(starts_mask)
    sums = np.add.reduceat(diffs, starts) if len(starts) else diffs[:0]
    keep = sums != 0
    live, sums = keys[starts[keep]], sums[keep]
    decoded = {d.name: d.decode(live) for d in digits}
    return pa.Table.from_arrays(
        [columns.array(sums, pa.int64()) if name == DIFF else decoded[name]
         for name in names], names=list(names))
