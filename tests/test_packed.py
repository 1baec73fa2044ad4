"""lamina.packed: consolidation by packed row keys equals consolidate(), or declines.

The reference is :func:`lamina.consolidate.consolidate` (itself tested against a Python
oracle in tests/test_consolidate.py): same rows, same order, same fields. Values are drawn
to reach the edges of every integer type, so the offsets from a negative least value,
the most significant digit and a span of the whole word are all exercised.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lamina.consolidate import INT64_MAX, consolidate, merge_runs, sort
from lamina.packed import merge_packed
from lamina.schema import DIFF

TYPES = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(),
         pa.uint32(), pa.uint64(), pa.bool_()]


def _bounds(t: pa.DataType) -> tuple[int, int]:
    if pa.types.is_boolean(t):
        return 0, 1
    info = np.iinfo(t.to_pandas_dtype())
    return int(info.min), int(info.max)


@st.composite
def _inputs(draw: st.DrawFn) -> tuple[list[pa.Table], list[pa.Table], list[str]]:
    """Sorted runs (sometimes consecutive parts of one sorted table) and an unsorted tail
    of 1 to 3 integer or boolean row columns, and the sort order."""
    types = draw(st.lists(st.sampled_from(TYPES), min_size=1, max_size=3))
    names = [f"c{i}" for i in range(len(types))]
    n = draw(st.integers(1, 60))
    cols: dict[str, pa.Array] = {}
    for name, t in zip(names, types, strict=True):
        lo, hi = _bounds(t)
        # a few distinct values, so that rows repeat; sometimes the type's edges
        pool = draw(st.lists(st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi])),
                             min_size=1, max_size=4))
        values = [pool[draw(st.integers(0, len(pool) - 1))] for _ in range(n)]
        cols[name] = pa.array([bool(v) for v in values] if pa.types.is_boolean(t)
                              else values, t)
    cols[DIFF] = pa.array(draw(st.lists(st.integers(-2, 2), min_size=n, max_size=n)),
                          pa.int64())
    table = pa.table(cols)
    order = draw(st.permutations(names))
    tail = draw(st.integers(0, n))  # the first rows, left unsorted (a WAL tail)
    edges = sorted({tail, n, *draw(st.lists(st.integers(tail, n), max_size=3))})
    runs = [sort(table.slice(a, b - a), order) for a, b in pairwise(edges)]
    if draw(st.booleans()):  # a batch's parts: one sorted table cut in order
        whole = sort(table.slice(tail), order)
        runs = [whole.slice(a - tail, b - a) for a, b in pairwise(edges)]
    return runs, [table.slice(0, tail)], list(order)


@settings(max_examples=400, deadline=None)
@given(_inputs(), st.integers(1, 3))
def test_packed_merge_equals_consolidate(
        case: tuple[list[pa.Table], list[pa.Table], list[str]], workers: int) -> None:
    """On 1 to 3 key ranges (one row per worker is enough to split)."""
    runs, tail, order = case
    names = [c for c in tail[0].column_names if c != DIFF]
    out = merge_packed(runs, tail, names, order, workers=workers, min_rows_per_worker=1)
    whole = pa.concat_tables([*runs, *tail])
    expected = consolidate(whole, names, order)
    spans = 1
    for c in order:
        values = whole.column(c).to_pylist()
        spans *= int(max(values)) - int(min(values)) + 1
    if spans > 2**64:
        assert out is None
        return
    assert out is not None
    assert out.equals(expected)
    assert out.schema == expected.schema


def test_packed_merge_declines_what_it_does_not_cover() -> None:
    ints = pa.table({"k": pa.array([1, 2], pa.int64()), DIFF: pa.array([1, 1], pa.int64())})
    assert merge_packed([ints], [], ["k"], ["k"]) is not None
    with_null = pa.table({"k": pa.array([1, None], pa.int64()),
                          DIFF: pa.array([1, 1], pa.int64())})
    assert merge_packed([with_null], [], ["k"], ["k"]) is None
    strings = pa.table({"k": pa.array(["a"]), DIFF: pa.array([1], pa.int64())})
    assert merge_packed([strings], [], ["k"], ["k"]) is None
    floats = pa.table({"k": pa.array([1.0]), DIFF: pa.array([1], pa.int64())})
    assert merge_packed([floats], [], ["k"], ["k"]) is None
    wide = pa.table({"a": pa.array([0, 2**40], pa.int64()), "b": pa.array([0, 2**40]),
                     DIFF: pa.array([1, 1], pa.int64())})
    assert merge_packed([wide], [], ["a", "b"], ["a", "b"]) is None  # 2**82 rows of key space
    big = pa.table({"k": pa.array([1, 2], pa.int64()),
                    DIFF: pa.array([INT64_MAX, 1], pa.int64())})
    assert merge_packed([big], [], ["k"], ["k"]) is None  # a sum could wrap
    assert merge_packed([ints.slice(0, 0)], [], ["k"], ["k"]) is None


@pytest.mark.parametrize("t", [pa.int64(), pa.uint64()])
def test_a_column_spanning_the_whole_word(t: pa.DataType) -> None:
    """One column whose values span all 2**64 offsets: the key is the offset itself."""
    lo, hi = _bounds(t)
    table = pa.table({"k": pa.array([hi, lo, 0, hi, lo], t),
                      DIFF: pa.array([1, 1, 1, 1, -1], pa.int64())})
    out = merge_packed([], [table], ["k"], ["k"])
    assert out is not None
    assert out.equals(consolidate(table, ["k"], ["k"]))
    assert out.column("k").to_pylist() == [0, hi]


def test_merge_runs_takes_the_packed_path_for_a_large_integer_input() -> None:
    """A million updates of two int64 row columns in three sorted runs and a tail, the
    shape of a snapshot of a compacted trace with its WAL tail: merge_runs' result is the
    packed merge's, and both equal consolidate()."""
    rng = np.random.default_rng(5)
    n = 1_000_000
    table = pa.table({"id": rng.integers(-50_000, 50_000, n), "qty": rng.integers(0, 100, n),
                      DIFF: rng.choice([-1, 1, 2], n)})
    runs = [sort(table.slice(a, 300_000), ["id", "qty"]) for a in (0, 300_000, 600_000)]
    tail = table.slice(900_000)
    out = merge_runs(runs, [tail], ["id", "qty"], ["id", "qty"], workers=2)
    packed = merge_packed(runs, [tail], ["id", "qty"], ["id", "qty"])
    assert packed is not None
    assert out is not None
    assert out.equals(packed)
    assert out.equals(consolidate(table, ["id", "qty"], ["id", "qty"]))


def test_parts_in_key_order_come_back_without_a_copy() -> None:
    """A batch's parts in order, no two rows equal and no zero diff (a compacted trace):
    the result's columns are the parts' own buffers; with a repeated row, it is summed."""
    table = pa.table({"k": pa.array(np.arange(1000), pa.int64()),
                      "v": pa.array(np.arange(1000) % 7, pa.int32()),
                      DIFF: pa.array(np.ones(1000, dtype=np.int64))})
    parts = [table.slice(0, 400), table.slice(400, 600)]
    out = merge_packed(parts, [], ["k", "v"], ["k", "v"])
    assert out is not None
    assert out.equals(consolidate(table, ["k", "v"], ["k", "v"]))
    assert out.column("k").chunk(0).buffers()[1].address == \
        table.column("k").chunk(0).buffers()[1].address
    repeated = [table.slice(0, 400), table.slice(399, 601)]  # row 399 twice
    out = merge_packed(repeated, [], ["k", "v"], ["k", "v"])
    assert out is not None
    assert out.equals(consolidate(pa.concat_tables(repeated), ["k", "v"], ["k", "v"]))
    assert out.column(DIFF).to_pylist()[399] == 2


@pytest.mark.parametrize("workers", [1, 2])
def test_runs_that_repeat_their_rows_are_summed_first_and_the_result_is_the_same(
        workers: int) -> None:
    """Sorted runs holding each row several times (a trace part keeps a row once per time
    it changed; a read drops the times), one of them repeating only in its first half so
    that the sampled decision sees a mix, with a tail: equal to consolidate() on one and
    two key ranges, with sums reaching zero."""
    rng = np.random.default_rng(7)
    rows = 200_000
    ids = rng.integers(0, 60_000, rows)
    table = pa.table({"id": ids, "qty": ids % 3, DIFF: rng.choice([-1, 1], rows)})
    heavy = sort(pa.concat_tables([table.slice(0, 80_000)] * 3), ["id", "qty"])
    mixed = sort(pa.concat_tables([table.slice(80_000, 40_000)] * 4 +
                                  [table.slice(120_000, 60_000)]), ["id", "qty"])
    tail = table.slice(180_000)
    everything = pa.concat_tables([heavy, mixed, tail])
    out = merge_packed([heavy, mixed], [tail], ["id", "qty"], ["id", "qty"],
                       workers=workers, min_rows_per_worker=1)
    assert out is not None
    assert out.equals(consolidate(everything, ["id", "qty"], ["id", "qty"]))
