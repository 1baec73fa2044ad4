"""The batch order: how the rows of a batch (and of a pending part) are sorted.

The order is (key columns, other row columns, time) ascending, nulls first, NaN right
after the nulls, -0.0 equal to 0.0: Spark's ascending order, and what
:func:`lamina.consolidate.sort` (the reference, behind
:func:`lamina.consolidate.consolidate_updates`) produces. This module holds the pieces the
Spark steps (:mod:`lamina.compacter.step`) use to produce that order fast and to compare
rows against it:

- the *prefix* (:func:`order_prefix`): an int64 per row, non-decreasing in the order of
  the first sort column, which leads every ordering so that sorting and searching is mostly
  integer work (ties are broken by the full keys);
- :func:`argsort_ints`: the stable order of integers in no order, as a radix sort on
  16-bit digits (each a numpy counting sort), several times faster than a comparison sort
  on the narrow ranges that keys and buckets have;
- :func:`by_lead` and :func:`sort_rows`: a stable numpy sort (a timsort) on an integer
  lead column of presorted runs, then Arrow's multi-key sort, which adapts to the
  presorted runs that leaves;
- :data:`Key` and :func:`order_value`: a row's full sort key as Python values that Python
  orders exactly like the batch order; :func:`comparable` gives a column whose Python
  values compare like Arrow sorts it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lamina.consolidate import INT64_MAX, INT64_MIN

Key = tuple[Any, ...]
"""A row's full sort key as Python values: ``(prefix, *sort column values, time)`` where a
sort column value is :func:`order_value` of it. Python orders these tuples exactly like the
batch order (nulls first, then NaN, then numbers)."""


def order_value(v: Any, is_float: bool) -> tuple[Any, ...]:
    """A sort column value as a key component: ``v`` is ``(2, v)``, NaN ``(1,)`` and null
    ``(0,)`` (``v`` as :func:`comparable` gives it; ``is_float``: the column is floating)."""
    if v is None:
        return (0,)
    if is_float and math.isnan(v):
        return (1,)
    return (2, v)


def _view(array: pa.Array, type_: pa.DataType) -> pa.Array:
    """The 8-byte values of ``array`` (float64 or fixed_size_binary(8)) read as ``type_``."""
    return pa.Array.from_buffers(type_, len(array), [None, array.buffers()[1]],
                                 offset=array.offset)


def order_prefix(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """An int64 per value, non-decreasing in the batch order of the column (nulls first,
    then NaN, then values; -0.0 equals 0.0): null is INT64_MIN; integers, dates,
    timestamps and bools are their value; floats and decimals (as float64, which rounds
    monotonically) map their IEEE bits order-preservingly, NaN to INT64_MIN + 1; strings
    and binaries are their first 7 bytes, big-endian. Ties are broken by the full sort
    keys, so only the monotony matters."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    t = column.type
    nulls: pa.Array | None = None  # where INT64_MIN goes: the column's nulls
    if pa.types.is_integer(t) or pa.types.is_date(t) or pa.types.is_timestamp(t) \
            or pa.types.is_boolean(t):
        if pa.types.is_date(t) or pa.types.is_timestamp(t):
            column = column.view(pa.int32() if t == pa.date32() else pa.int64())
        values = pc.cast(column, pa.int64())
        if not column.null_count:
            return values  # for an int64 column its own buffer: no copy
    elif pa.types.is_floating(t) or pa.types.is_decimal(t):
        x = pc.fill_null(pc.cast(column, pa.float64()), 0.0)
        x = pc.if_else(pc.equal(x, 0.0), 0.0, x)  # -0.0 is 0.0; NaN is handled below
        bits = _view(x, pa.int64())
        flipped = pc.bit_wise_xor(bits, pa.scalar(INT64_MAX, pa.int64()))
        values = pc.if_else(pc.less(bits, 0), flipped, bits)
        values = pc.if_else(pc.fill_null(pc.is_nan(x), False),
                            pa.scalar(INT64_MIN + 1, pa.int64()), values)
    elif t in (pa.string(), pa.binary(), pa.large_string(), pa.large_binary()):
        raw = pc.fill_null(column.cast(pa.binary()), b"")
        head = pc.binary_slice(raw, 0, 7)
        padded = pc.binary_join_element_wise(pa.scalar(b"\0", pa.binary()), head,
                                             pa.scalar(b"\0" * 7, pa.binary()), b"")
        eight = pc.binary_reverse(pc.binary_slice(padded, 0, 8)).cast(pa.binary(8))
        values = pc.cast(_view(eight, pa.uint64()), pa.int64())
    else:  # pragma: no cover - schema.py admits no other type
        values = pa.nulls(len(column), pa.int64())
        nulls = pc.is_valid(column)
    if nulls is None:
        nulls = pc.is_null(column)
    return pc.if_else(nulls, pa.scalar(INT64_MIN, pa.int64()), values)


RADIX_MIN_ROWS = 1 << 12
"""Below this many values :func:`argsort_ints` leaves the sort to numpy's timsort."""
RADIX_DIGIT_BITS = 16
"""Bits per digit of :func:`argsort_ints`: numpy sorts 16-bit integers stably with a
counting sort (65,536 counters, which stay in a core's cache)."""


def argsort_ints(values: np.ndarray) -> np.ndarray:
    """The stable order of int64 or uint64 ``values`` in no particular order: equal values
    keep their order, as in ``np.argsort(values, kind="stable")``, which it returns the same.

    A least-significant-digit radix sort: ``values - min`` is cut into 16-bit digits, as
    few as its range needs, and each digit, lowest first, orders the rows by a stable numpy
    sort of 16-bit integers (a counting sort, linear). Measured on 650,000 random int64
    (``python -m bench.profile sorts``, best of 7, CPU, in two hours of one evening): of a
    2^20 range (a decode task's int64 keys) 8.6 to 18.3 ms against 43 to 45 ms for numpy's
    introsort and 53 ms for its timsort; of the full range (a string's 7-byte prefixes)
    27.8 to 44.9 ms. Rows already in presorted runs are another matter: timsort merges
    them in about a pass (11.5 ms for 15 runs), which the radix sort beat in one of those
    hours and lost to in the other (:func:`by_lead`)."""
    n = len(values)
    if n < RADIX_MIN_ROWS:
        return np.argsort(values, kind="stable")
    low = int(values.min())
    span = int(values.max()) - low
    digits = max(1, -(-span.bit_length() // RADIX_DIGIT_BITS))
    # values - low as uint64 (the subtraction wraps, which is exact for int64 values)
    offsets = values.view(np.uint64) - np.uint64(low % (1 << 64))
    order: np.ndarray | None = None
    for digit in range(digits):
        # astype keeps the low 16 bits
        keys = (offsets >> np.uint64(digit * RADIX_DIGIT_BITS)).astype(np.uint16)
        order = (np.argsort(keys, kind="stable") if order is None
                 else order[np.argsort(keys[order], kind="stable")])
    assert order is not None
    return order


def by_lead(table: pa.Table, lead: str) -> pa.Table:
    """``table`` in the order of its integer column ``lead``, rows of equal leads in their
    order (no copy when it is in order already). Its rows are presorted runs (a write
    task's pieces, each ordered by the lead), which numpy's timsort merges in about a pass
    each; the radix sort (:func:`argsort_ints`) is for rows in no order."""
    if table.num_rows <= 1:
        return table
    values = table.column(lead).to_numpy()
    if bool((values[1:] >= values[:-1]).all()):
        return table
    return table.take(np.argsort(values, kind="stable"))


def sort_rows(table: pa.Table, keys: Sequence[Any], lead: str) -> pa.Table:
    """``table`` sorted by ``keys`` (Arrow sort keys) whose first is the integer column
    ``lead``. Ordering by ``lead`` first (a numpy sort) makes Arrow's multi-key sort, which
    adapts to presorted runs, several times faster than on rows in random order."""
    if table.num_rows <= 1:
        return table
    table = by_lead(table, lead)
    return table.take(pc.sort_indices(table, sort_keys=list(keys)))


def comparable(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A column whose Python values (``as_py``) order like Arrow sorts the column: dates and
    timestamps as their integers; other supported types compare correctly as they are."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    t = column.type
    if pa.types.is_date32(t):
        return column.view(pa.int32())
    if pa.types.is_timestamp(t) or pa.types.is_date64(t):
        return column.view(pa.int64())
    return column
