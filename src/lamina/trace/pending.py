"""The pending area: future updates, kept in exponentially growing time buckets.

Updates may carry times at or beyond the upper of the batch that converts them (future
updates, lamina.wal.segment). A conversion to new upper ``U`` moves such updates into
*pending parts*, each covering one bucket, so a later conversion to ``U' > U`` reads only
the parts whose bucket starts below ``U'``.

Buckets relative to ``U``: time ``U`` is the bucket ``[U, U+1)``; a time ``t > U`` falls in
the aligned block of size ``2**k`` that contains ``t``, where ``k`` is the highest bit in
which ``t`` and ``U`` differ. Those blocks are disjoint, lie above ``U``, and grow with the
distance from ``U``: at most 65 buckets, and a conversion that advances the upper by ``d``
touches only buckets starting below ``U + d``.

Parts from earlier conversions may overlap each other's ranges; each part names its own
range, and readers take every part whose range starts at or below ``as_of``. To keep the
state small, once more than ``MAX_PARTS`` parts would remain, a conversion consumes and
rewrites all of them (an amortized cost, like a merge).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from lamina import columns
from lamina.frontier import MAX_TIME
from lamina.layout import TraceLayout
from lamina.schema import TIME
from lamina.trace.batch import new_id

MAX_PARTS = 64


def bucket_of(t: int, upper: int) -> tuple[int, int]:
    """The bucket ``[lo, hi)`` of time ``t >= upper`` relative to ``upper``."""
    if t < upper:
        raise ValueError(f"time {t} is below the upper {upper}: not a future update")
    if t == upper:
        return upper, upper + 1
    k = (t ^ upper).bit_length() - 1
    lo = (t >> k) << k
    return lo, lo + (1 << k)


def bucket_lows(times: pa.Array | pa.ChunkedArray, upper: int) -> pa.Array | pa.ChunkedArray:
    """``bucket_of(t, upper)[0]`` for every ``t >= upper``, vectorized (uint64 in, uint64
    out): the highest bit ``k`` where ``t`` and ``upper`` differ, found by binary search,
    then ``t`` with its bits below ``k`` cleared (``t == upper`` gives ``k = 0``, i.e.
    ``t``)."""
    u64 = pa.uint64()
    x = pc.bit_wise_xor(times, columns.scalar(upper, u64))
    zero = columns.scalar(0, u64)
    k: Any = zero
    for s in (32, 16, 8, 4, 2, 1):
        shift = columns.scalar(s, u64)
        shifted = pc.shift_right(x, shift)
        moved = pc.not_equal(shifted, zero)
        x = pc.if_else(moved, shifted, x)
        k = pc.add(k, pc.if_else(moved, shift, zero))
    return pc.shift_left(pc.shift_right(times, k), k)


def split_by_bucket(table: pa.Table, upper: int) -> Iterator[tuple[int, int, pa.Table]]:
    """Split future updates (all ``_time >= upper``) into ``(lo, hi, rows)`` per bucket,
    in increasing time order."""
    remaining = table
    while remaining.num_rows:
        lo, hi = bucket_of(int(pc.min(remaining.column(TIME)).as_py()), upper)
        if hi > MAX_TIME:  # the last bucket reaches the end of time: everything left
            yield lo, hi, remaining
            return
        inside = pc.less(remaining.column(TIME), columns.scalar(hi, pa.uint64()))
        yield lo, hi, remaining.filter(inside)
        remaining = remaining.filter(pc.invert(inside))


def new_pending_path() -> str:
    """A fresh pending part's name (fresh per attempt: a re-run writes new files, crash-safety
    rule 4)."""
    return TraceLayout.pending_part(new_id("p"))
