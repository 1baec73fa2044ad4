"""Cuts: full sort keys that divide a step's batch rows into chunks and parts.

The order of a batch is the batch order (:mod:`lamina.trace.order`): (key columns, other
columns, time) ascending with nulls first, NaN right after the nulls, as
:func:`lamina.consolidate.sort`. The decode tasks sample every so many batch rows' keys;
the driver sorts the samples and cuts them into C chunks of about ``chunk_rows`` rows (at
least P), and the chunks into P consecutive groups, the parts (:func:`boundaries`; P is
sized from the input bytes, ``JobTuning.part_bytes``). A cut is a full key
(:data:`lamina.trace.order.Key`): chunk ``j`` holds the rows above cut ``j - 1`` and at or
below cut ``j``, so rows equal in (row, time) always share a chunk and concatenating the
parts in order gives the globally sorted batch.

A write task finds a cut in a run (ordered by prefix) with a numpy binary search on the
prefix, then a vectorized comparison of the full key for the rows sharing the cut's prefix
(:func:`at_or_below`, :func:`cut`); :func:`chunk_pieces` takes a run's rows between two
cuts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lamina.compacter.step.context import StepContext
from lamina.schema import TIME
from lamina.trace.order import Key, comparable, order_value, sort_rows


def row_keys(table: pa.Table, ctx: StepContext) -> list[Key]:
    """The full sort key of every row of a (small) table."""
    columns = [comparable(table.column(c)).to_pylist() for c in ctx.sort_columns]
    floats = [pa.types.is_floating(table.schema.field(c).type) for c in ctx.sort_columns]
    out: list[Key] = []
    prefixes, times = table.column(ctx.prefix).to_pylist(), table.column(TIME).to_pylist()
    for i, (prefix, t) in enumerate(zip(prefixes, times, strict=True)):
        values: list[Any] = [prefix]
        for column, is_float in zip(columns, floats, strict=True):
            values.append(order_value(column[i], is_float))
        values.append(t)
        out.append(tuple(values))
    return out


def boundaries(samples: pa.Table, chunks: int, ctx: StepContext) -> list[Key]:
    """``chunks - 1`` full keys cutting the sampled rows into ``chunks`` equal shares."""
    if chunks <= 1 or not samples.num_rows:
        return []
    ordered = sort_rows(samples, ctx.sort_keys, ctx.prefix)
    m = ordered.num_rows
    return row_keys(ordered.take([min(m - 1, j * m // chunks) for j in range(1, chunks)]), ctx)


def at_or_below(rows: pa.Table, key: Key, ctx: StepContext) -> np.ndarray:
    """Which of ``rows`` (any order, all with ``key``'s prefix) are at or below ``key`` in
    the batch order: a vectorized lexicographic comparison of the sort columns and time."""
    n = rows.num_rows
    below = np.zeros(n, dtype=bool)
    equal = np.ones(n, dtype=bool)
    names = [*ctx.sort_columns, TIME]
    for name, want in zip(names, (*key[1:-1], (2, key[-1])), strict=True):
        column = comparable(rows.column(name))
        nulls = (pc.is_null(column).to_numpy(zero_copy_only=False) if column.null_count
                 else np.zeros(n, dtype=bool))
        is_float = pa.types.is_floating(column.type)
        nans = (pc.fill_null(pc.is_nan(column), False).to_numpy(zero_copy_only=False)
                if is_float else np.zeros(n, dtype=bool))
        if want[0] == 0:
            less, same = np.zeros(n, dtype=bool), nulls
        elif want[0] == 1:
            less, same = nulls, nans
        else:
            value = pa.scalar(want[1], column.type)
            less = pc.fill_null(pc.less(column, value), False).to_numpy(zero_copy_only=False)
            less = less | nulls | nans
            same = pc.fill_null(pc.equal(column, value), False).to_numpy(zero_copy_only=False)
        below |= equal & less
        equal &= same
        if not equal.any():
            break
    out: np.ndarray = below | equal
    return out


@dataclass(frozen=True)
class Cut:
    """Where a key falls in a run ordered by prefix: rows ``[0, lo)`` have a smaller
    prefix, rows ``[hi, n)`` a greater one, and of the rows ``[lo, hi)`` (the key's prefix,
    in any order) ``mask`` marks those at or below the key."""

    lo: int
    hi: int
    mask: np.ndarray


def cut(run: pa.Table, prefix: np.ndarray, key: Key, ctx: StepContext) -> Cut:
    """Where ``key`` falls in ``run`` (ordered by prefix; ``prefix`` its prefix column)."""
    lo = int(np.searchsorted(prefix, key[0], "left"))
    hi = int(np.searchsorted(prefix, key[0], "right"))
    return Cut(lo, hi, at_or_below(run.slice(lo, hi - lo), key, ctx))


def chunk_pieces(run: pa.Table, lower: Cut | None, upper: Cut | None) -> list[pa.Table]:
    """The rows of a run (ordered by prefix) above ``lower`` and at or below ``upper``
    (None: no bound)."""
    n = run.num_rows
    if lower is not None and upper is not None and lower.lo == upper.lo \
            and lower.hi == upper.hi and lower.hi > lower.lo:  # one prefix for both keys
        return [run.slice(lower.lo, lower.hi - lower.lo).filter(~lower.mask & upper.mask)]
    pieces = []
    if lower is not None and lower.hi > lower.lo:
        pieces.append(run.slice(lower.lo, lower.hi - lower.lo).filter(~lower.mask))
    start = 0 if lower is None else lower.hi
    end = n if upper is None else upper.lo
    if end > start:
        pieces.append(run.slice(start, end - start))
    if upper is not None and upper.hi > upper.lo:
        pieces.append(run.slice(upper.lo, upper.hi - upper.lo).filter(upper.mask))
    return [p for p in pieces if p.num_rows]
