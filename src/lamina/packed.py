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

Sums are exact or the merge declines: when the largest diff magnitude times the number of
diffs could leave int64, :func:`merge_packed` returns None, as it does for any other input
it does not cover (a float, string or temporal column, a null, spans too wide), and the
caller merges the general way. The result is row for row, and field for field, what
:func:`lamina.consolidate.consolidate` returns over the same rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from lamina import columns
from lamina.schema import DIFF

_WORD = 1 << 64
_INT64_MAX = (1 << 63) - 1


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

    def encode(self, values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """``(value - low) * radix`` as uint64 (exact: the offsets fit by construction, and
        wrapping arithmetic modulo 2**64 gives them for any signed ``low``)."""
        if self.span == 1:
            return np.zeros(len(values), dtype=np.uint64)
        if values.dtype == np.bool_:
            digits = values.astype(np.uint64)
        elif values.dtype.kind == "i":
            digits = values.astype(np.int64, copy=False).view(np.uint64)
        else:
            digits = values.astype(np.uint64, copy=False)
        digits = digits - np.uint64(self.low % _WORD)
        if self.radix != 1:
            digits *= np.uint64(self.radix)
        return digits

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


def merge_packed(pieces: Sequence[pa.Table], row_columns: Sequence[str],
                 sort_columns: Sequence[str]) -> pa.Table | None:
    """Consolidate ``pieces`` (row columns and ``_diff``; each sorted or not) by packed
    keys: the rows of :func:`lamina.consolidate.consolidate` over all of them, in
    ``sort_columns`` order, with the same fields; or None where packing does not apply
    (module docstring), including when there are no rows."""
    pieces = [t for t in pieces if t.num_rows]
    if not pieces or sorted(row_columns) != sorted(sort_columns):
        return None
    digits = _digits(pieces, sort_columns)
    if digits is None:
        return None
    diffs = np.concatenate([columns.numpy(t.column(DIFF)) for t in pieces])
    largest = max(abs(int(diffs.min())), abs(int(diffs.max())))
    if largest * len(diffs) > _INT64_MAX:
        return None
    keys = np.empty(len(diffs), dtype=np.uint64)
    for i, digit in enumerate(digits):
        column = np.concatenate([columns.numpy(t.column(digit.name)) for t in pieces])
        if i == 0:
            keys[:] = digit.encode(column)
        else:
            keys += digit.encode(column)
        del column
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    diffs = diffs[order]
    del order
    starts_mask = np.empty(len(keys), dtype=np.bool_)
    starts_mask[0] = True
    np.not_equal(keys[1:], keys[:-1], out=starts_mask[1:])
    starts = np.flatnonzero(starts_mask)
    del starts_mask
    sums = np.add.reduceat(diffs, starts)
    keep = sums != 0
    live = keys[starts[keep]]
    del keys, diffs
    decoded = {d.name: d.decode(live) for d in digits}
    names = pieces[0].column_names
    return pa.Table.from_arrays(
        [columns.array(sums[keep]) if name == DIFF else decoded[name] for name in names],
        names=names)
