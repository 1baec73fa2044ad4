"""lamina.consolidate: forwarding, consolidation with checked sums, order, snapshots.

The reference is a plain-Python oracle: a dict from (row, time) to the exact integer sum of
diffs, with Python's unbounded ints, so an int64 wrap in pyarrow would show up as a
mismatch. A sum outside int64 must surface as DiffOverflowError (with the other rows and
the exact offending sums attached) where the result must be int64, and as a carry (exact,
the canonical rows of :func:`lamina.consolidate.carry_pieces`) in the stored form.
"""

from __future__ import annotations

from collections import defaultdict
from decimal import Decimal
from itertools import pairwise

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lamina.consolidate import (
    INT64_MAX,
    INT64_MIN,
    carries_only,
    carry_pieces,
    consolidate,
    consolidate_updates,
    forward,
    merge_runs,
    snapshot_of,
    sort,
    sum_adjacent,
)
from lamina.errors import DiffOverflowError
from lamina.frontier import CLOSED, MAX_TIME
from lamina.schema import DIFF, TIME, RelationMeta
from tests.strategies import batches, schemas

Row = tuple[int | None, str | None, int, int]  # k, s, _time, _diff


def _table(rows: list[Row]) -> pa.Table:
    return pa.table({
        "k": pa.array([r[0] for r in rows], pa.int64()),
        "s": pa.array([r[1] for r in rows], pa.string()),
        TIME: pa.array([r[2] for r in rows], pa.uint64()),
        DIFF: pa.array([r[3] for r in rows], pa.int64()),
    })


def _order_key(row: tuple[object, ...]) -> tuple[object, ...]:
    """Ascending, nulls first: the order consolidate() promises."""
    out: list[object] = []
    for v in row:
        out.extend((v is not None, v if v is not None else 0))
    return tuple(out)


def _oracle(rows: list[Row], *, since: int = 0, as_of: int | None = None,
            keep_time: bool = True) -> list[tuple[object, ...]] | None:
    """Consolidated rows (sorted), or None when some sum leaves int64."""
    sums: dict[tuple[object, ...], int] = defaultdict(int)
    for k, s, time, d in rows:
        t = max(time, since)
        if as_of is not None and t > as_of:
            continue
        sums[(k, s, t) if keep_time else (k, s)] += d
    if any(not INT64_MIN <= v <= INT64_MAX for v in sums.values()):
        return None
    return sorted(((*key, v) for key, v in sums.items() if v != 0),
                  key=lambda r: _order_key(r[:-1]))


def _rows_of(table: pa.Table) -> list[tuple[object, ...]]:
    cols = [table.column(c).to_pylist() for c in table.column_names]
    return list(zip(*cols, strict=True))


diffs = st.one_of(
    st.integers(-3, 3),
    st.sampled_from([INT64_MAX, INT64_MIN, 2**62, -(2**62), INT64_MAX - 1]),
    st.integers(INT64_MIN, INT64_MAX),
)
rows_strategy = st.lists(
    st.tuples(
        st.one_of(st.none(), st.integers(-3, 3)),
        st.one_of(st.none(), st.sampled_from(["", "a", "b", "\u00e9", "\U0001f600", "ab"])),
        st.one_of(st.integers(0, 5), st.just(MAX_TIME)),
        diffs,
    ),
    max_size=40,
)


def _exact(rows: list[Row]) -> list[tuple[object, ...]]:
    """(k, s, _time, exact sum) per (k, s, _time) with a non-zero sum, in order."""
    sums: dict[tuple[object, ...], int] = defaultdict(int)
    for k, s, time, d in rows:
        sums[(k, s, time)] += d
    return sorted(((*key, v) for key, v in sums.items() if v != 0),
                  key=lambda r: _order_key(r[:-1]))


@settings(max_examples=300, deadline=None)
@given(rows_strategy)
def test_consolidate_matches_the_oracle(rows: list[Row]) -> None:
    """Rows equal in (k, s, _time) add their diffs exactly, zero sums vanish, the result is
    ordered by k, s, _time with nulls first; a sum outside int64 is stored as its carry
    (never a wrapped value, never an error), and consolidating again changes nothing."""
    table = _table(rows)
    out = consolidate_updates(table, ["k", "s"], ["k", "s"], context="t")
    assert out.column_names == ["k", "s", TIME, DIFF]
    assert out.schema.field(DIFF).type == pa.int64()
    assert _rows_of(out) == [(*r[:-1], piece) for r in _exact(rows)
                             for piece in carry_pieces(int(r[-1]))]  # type: ignore[call-overload]
    assert carries_only(out, ["k", "s", TIME])
    again = consolidate_updates(out, ["k", "s"], ["k", "s"], context="t")
    assert _rows_of(again) == _rows_of(out)
    if _oracle(rows) is not None:
        assert _rows_of(out) == _oracle(rows)


@settings(max_examples=300, deadline=None)
@given(rows_strategy)
def test_overflow_error_carries_the_rest_and_the_exact_sums(rows: list[Row]) -> None:
    """Where the result must be int64, a sum outside it raises DiffOverflowError naming the
    first such row; ``rest`` is exactly the result without the offending rows and
    ``overflows`` those rows with their exact sums, both in order."""
    exact = _exact(rows)
    fits = [r for r in exact if INT64_MIN <= r[-1] <= INT64_MAX]  # type: ignore[operator]
    table = _table(rows)
    if len(fits) == len(exact):
        out = consolidate(table, ["k", "s", TIME], ["k", "s", TIME])
        assert _rows_of(out) == exact
        return
    with pytest.raises(DiffOverflowError, match="outside the int64 range") as info:
        consolidate(table, ["k", "s", TIME], ["k", "s", TIME], context="t")
    err = info.value
    assert err.rest is not None
    assert err.overflows is not None
    assert _rows_of(err.rest) == fits
    assert err.rest.schema.field(DIFF).type == pa.int64()
    assert _rows_of(err.overflows) == [(*r[:-1], Decimal(r[-1]))  # type: ignore[arg-type]
                                       for r in exact if r not in fits]
    first = exact[[r in fits for r in exact].index(False)]
    assert f"sum to {first[-1]}," in str(err)


def test_carry_pieces() -> None:
    assert carry_pieces(2**63) == [INT64_MAX, 1]
    assert carry_pieces(-(2**63)) == [INT64_MIN]  # fits int64: one row
    assert carry_pieces(-(2**63) - 1) == [-INT64_MAX, -2]
    assert carry_pieces(2 * INT64_MAX) == [INT64_MAX, INT64_MAX]
    assert carry_pieces(5) == [5]
    assert carry_pieces(-(3 * 2**62)) == [-INT64_MAX, -(2**62) - 1]
    assert sum(carry_pieces(10**22)) == 10**22
    assert len(carry_pieces(10**22)) == 10**22 // INT64_MAX + 1


@settings(max_examples=200, deadline=None)
@given(rows_strategy, st.integers(0, 6), st.integers(0, 6))
def test_forward_then_snapshot_matches_the_oracle(rows: list[Row], since: int,
                                                  as_of: int) -> None:
    """Logical compaction: times below ``since`` read as ``since``; a snapshot at ``as_of``
    sums every update with time <= as_of per row and drops the time column."""
    forwarded = forward(_table(rows), since)
    assert all(t >= since for t in forwarded.column(TIME).to_pylist())
    assert forwarded.column(TIME).to_pylist() == [max(r[2], since) for r in rows]
    expected = _oracle(rows, since=since, as_of=as_of, keep_time=False)
    if expected is None:
        with pytest.raises(DiffOverflowError):
            snapshot_of(forwarded, as_of, ["k", "s"], ["k", "s"], context="t")
        return
    out = snapshot_of(forwarded, as_of, ["k", "s"], ["k", "s"], context="t")
    assert out.column_names == ["k", "s", DIFF]
    assert _rows_of(out) == expected


def test_forward_edges() -> None:
    """since=0 changes nothing; since=CLOSED forwards every time to the largest time;
    times at or above since are kept."""
    t = _table([(1, "a", 0, 1), (1, "a", 5, 1), (1, "a", MAX_TIME, 1)])
    assert forward(t, 0) is t
    assert forward(t, 5).column(TIME).to_pylist() == [5, 5, MAX_TIME]
    assert forward(t, CLOSED).column(TIME).to_pylist() == [MAX_TIME] * 3
    empty = _table([])
    assert forward(empty, 3).num_rows == 0


@pytest.mark.parametrize(("diffs_in", "overflows"), [
    ([2**62, 2**62], True),                    # exactly 2**63: one past INT64_MAX
    ([INT64_MAX, 1], True),
    ([INT64_MIN, -1], True),
    ([INT64_MAX, INT64_MAX, INT64_MAX], True),
    ([2**62, 2**62, -(2**62)], False),         # the running sum leaves int64, the total not
    ([INT64_MAX, 1, -1], False),
    ([INT64_MIN], False),
    ([INT64_MAX, INT64_MIN], False),           # -1
])
def test_checked_sums(diffs_in: list[int], overflows: bool) -> None:
    """Only the final sum per row and time must fit int64; when it does not, the error is
    DiffOverflowError (also an ArithmeticError) carrying the offending sum."""
    table = _table([(1, "x", 0, d) for d in diffs_in])
    if overflows:
        with pytest.raises(DiffOverflowError, match=str(sum(diffs_in))) as info:
            consolidate(table, ["k", "s", TIME], ["k"], context="ctx")
        assert isinstance(info.value, ArithmeticError)
        assert "ctx" in str(info.value)
    else:
        out = consolidate(table, ["k", "s", TIME], ["k"], context="ctx")
        assert out.column(DIFF).to_pylist() == ([sum(diffs_in)] if sum(diffs_in) else [])


def test_consolidate_empty_table_keeps_columns() -> None:
    """An empty input gives an empty output with the group columns and _diff."""
    out = consolidate(_table([]), ["k", TIME], ["k"])
    assert out.num_rows == 0
    assert out.column_names == ["k", TIME, DIFF]


def test_order_follows_the_given_columns() -> None:
    """The result is sorted by ``order`` (here s before k), nulls first, and only the
    columns in ``group_columns`` survive, in the table's column order."""
    rows: list[Row] = [(2, "a", 0, 1), (1, "b", 0, 1), (None, "b", 0, 1), (3, None, 0, 1)]
    out = consolidate(_table(rows), ["s", "k"], ["s", "k"])
    assert out.column_names == ["k", "s", DIFF]
    assert _rows_of(out) == [(3, None, 1), (2, "a", 1), (None, "b", 1), (1, "b", 1)]


@settings(max_examples=300, deadline=None)
@given(rows_strategy)
def test_sum_adjacent_equals_consolidate_on_sorted_rows(rows: list[Row]) -> None:
    """On rows sorted by every group column, summing runs of equal neighbours gives the
    rows :func:`consolidate` gives (same values, order and types), or declines (None) when
    int64 sums could wrap, never a wrong sum."""
    table = sort(_table(rows), ["k", "s", TIME])
    out = sum_adjacent(table, ["k", "s", TIME])
    diffs_in = [r[3] for r in rows]
    if out is None:
        assert max(map(abs, diffs_in)) * len(diffs_in) > INT64_MAX
        return
    expected = consolidate(table, ["k", "s", TIME], ["k", "s", TIME])
    assert out.equals(expected)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_sum_adjacent_over_every_row_type(data: st.DataObject) -> None:
    """Every supported row type, nulls included: equal to consolidate() on sorted input,
    and None (left to consolidate()) exactly when a group column is floating."""
    schema = data.draw(schemas(max_columns=3))
    meta = RelationMeta.new("r", schema, key=None)
    table = data.draw(batches(meta, max_rows=30, times=st.integers(0, 3)))
    small = pa.array(data.draw(st.lists(st.integers(-2, 2), min_size=table.num_rows,
                                        max_size=table.num_rows)), pa.int64())
    table = table.set_column(table.num_columns - 1, DIFF, small)
    # duplicate rows so that runs exist
    table = sort(pa.concat_tables([table, table]), [*meta.sort_columns, TIME])
    group = [*meta.row_columns, TIME]
    out = sum_adjacent(table, group)
    if any(pa.types.is_floating(f.type) for f in schema):
        assert out is None
        return
    assert out is not None
    assert out.equals(consolidate(table, group, [*meta.sort_columns, TIME]))


def test_sum_adjacent_over_chunks_distinct_rows_and_zero_diffs() -> None:
    """The shortcuts: integer columns compared in numpy across chunk boundaries (a run may
    straddle two chunks), rows all distinct (nothing summed, a zero diff still dropped) and
    nothing to drop (the input's rows as they are), each equal to consolidate()."""
    rows: list[Row] = [(1, "a", 0, 1), (1, "a", 0, 2), (1, "a", 1, -1), (2, "b", 1, 1),
                       (2, "b", 1, -1), (3, None, 2, 4), (None, "c", 2, 1)]

    def in_chunks_of_two(t: pa.Table) -> pa.Table:
        return pa.Table.from_batches([b for i in range(0, t.num_rows, 2)
                                      for b in t.slice(i, 2).to_batches()])

    table = sort(_table(rows), ["k", "s", TIME])
    chunked = in_chunks_of_two(table)
    no_null_keys = in_chunks_of_two(sort(_table(rows[:-1]), ["k", "s", TIME]))
    assert no_null_keys.column("k").null_count == 0  # so k is compared in numpy
    assert chunked.column("k").num_chunks > 1
    distinct = sort(_table([(1, "a", 0, 1), (2, "a", 0, 0), (3, "b", 1, -2)]), ["k"])
    plain = sort(_table([(1, "a", 0, 1), (2, "a", 0, 3)]), ["k"])
    for t in (table, chunked, no_null_keys, distinct, plain):
        out = sum_adjacent(t, ["k", "s", TIME])
        assert out is not None
        assert out.equals(consolidate(t, ["k", "s", TIME], ["k", "s", TIME]))
    assert _rows_of(sum_adjacent(chunked, ["k", "s", TIME])) == [
        (None, "c", 2, 1), (1, "a", 0, 3), (1, "a", 1, -1), (3, None, 2, 4)]


def _split_into_runs(table: pa.Table, cuts: list[int], order: list[str]) -> list[pa.Table]:
    """``table`` cut at ``cuts`` into pieces, each sorted by ``order``: runs as trace parts
    hold them (any rows, each run sorted)."""
    edges = sorted({0, table.num_rows, *(c % (table.num_rows + 1) for c in cuts)})
    return [sort(table.slice(a, b - a), order) for a, b in pairwise(edges)]


@settings(max_examples=300, deadline=None)
@given(rows_strategy, st.lists(st.integers(0, 40), max_size=4), st.integers(1, 4),
       st.integers(0, 40))
def test_merge_runs_equals_consolidate(rows: list[Row], cuts: list[int], workers: int,
                                       tail: int) -> None:
    """Sorted runs plus an unsorted tail merged on 1 to 4 key ranges (one row per worker is
    enough to split, so small inputs split too; nulls and repeated values of the first
    sort column sit on the cut points) give the rows of :func:`consolidate` over all of
    them, in the same order, or decline (None) exactly when int64 sums could wrap."""
    table = _table(rows).drop_columns([TIME])
    tail = min(tail, table.num_rows)
    runs = _split_into_runs(table.slice(tail), cuts, ["k", "s"])
    out = merge_runs(runs, [table.slice(0, tail)], ["k", "s"], ["k", "s"], workers=workers,
                     min_rows_per_worker=1)
    if out is None:
        assert not rows or max(abs(r[3]) for r in rows) * len(rows) > INT64_MAX
        return
    expected = consolidate(table, ["k", "s"], ["k", "s"])
    assert _rows_of(out) == _rows_of(expected)
    assert out.schema == expected.schema


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_merge_runs_over_every_row_type(data: st.DataObject) -> None:
    """Every supported row type as the first sort column, cut into ranges: equal to
    consolidate(); None (left to consolidate()) exactly when a row column is floating."""
    schema = data.draw(schemas(max_columns=3))
    meta = RelationMeta.new("r", schema, key=None)
    table = data.draw(batches(meta, max_rows=40, times=st.integers(0, 3)))
    small = pa.array(data.draw(st.lists(st.integers(-2, 2), min_size=table.num_rows,
                                        max_size=table.num_rows)), pa.int64())
    table = pa.concat_tables([table, table]).drop_columns([TIME])
    table = table.set_column(table.num_columns - 1, DIFF, pa.concat_arrays([small, small]))
    runs = _split_into_runs(table, data.draw(st.lists(st.integers(0, 80), max_size=3)),
                            list(meta.sort_columns))
    out = merge_runs(runs, [], meta.row_columns, meta.sort_columns,
                     workers=data.draw(st.integers(1, 3)), min_rows_per_worker=1)
    if any(pa.types.is_floating(f.type) for f in schema):
        assert out is None
        return
    if table.num_rows == 0:
        assert out is None  # nothing to merge: the caller consolidates the empty table
        return
    assert out is not None
    expected = consolidate(table, meta.row_columns, meta.sort_columns)
    assert out.equals(expected)


def test_merge_runs_splits_a_large_input() -> None:
    """A million rows in three sorted runs on two workers (the default threshold splits
    them): equal to consolidate(), with few distinct first-column values, so many equal
    rows sit at the cut (a run straddling two ranges would show as a duplicate row)."""
    rng = np.random.default_rng(3)
    n = 1_000_000
    table = pa.table({"k": rng.integers(0, 7, n), "s": rng.integers(0, 5, n).astype(str),
                      DIFF: rng.choice([-1, 1, 2], n)})
    runs = _split_into_runs(table, [300_000, 700_000], ["k", "s"])
    out = merge_runs(runs, [], ["k", "s"], ["k", "s"], workers=2)
    assert out is not None
    assert out.equals(consolidate(table, ["k", "s"], ["k", "s"]))
