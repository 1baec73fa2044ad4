"""lamina.kernels: each function gives what its pyarrow.compute namesake gives, nulls and
chunked arrays included (the read path calls these; the rest of lamina calls those)."""

from __future__ import annotations

from functools import partial

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from lamina import kernels

A = pa.chunked_array([[3, None, 1], [7, 1, None, -2]], pa.int64())
B = pa.chunked_array([[3, 2, None], [7, 0, None, 5]], pa.int64())
S = pa.array(["b", None, "a", "b", "c", None, "a"])
M = pa.array([True, None, False, True, True, False, None])
N = pa.array([True, False, None, None, True, True, False])
T = pa.table({"k": S, "v": pa.array([5, 4, 3, 2, 1, 0, -1]),
              "w": pa.array([1.5, None, 0.5, 2.5, None, 1.0, 3.0])})


@pytest.mark.parametrize("name", ["less", "less_equal", "greater", "greater_equal",
                                  "not_equal"])
def test_comparisons(name: str) -> None:
    ours, theirs = getattr(kernels, name), getattr(pc, name)
    assert ours(A, B).equals(theirs(A, B))
    assert ours(S, pa.scalar("b")).equals(theirs(S, pa.scalar("b")))


@pytest.mark.parametrize("name", ["and_", "or_", "xor"])
def test_boolean_logic_keeps_nulls_as_arrow_does(name: str) -> None:
    assert getattr(kernels, name)(M, N).equals(getattr(pc, name)(M, N))


def test_unary_and_selection() -> None:
    assert kernels.invert(M).equals(pc.invert(M))
    assert kernels.is_null(S).equals(pc.is_null(S))
    assert kernels.if_else(M, A.combine_chunks(), B.combine_chunks()).equals(
        pc.if_else(M, A.combine_chunks(), B.combine_chunks()))
    assert kernels.filter(T, M).equals(T.filter(M))  # a null in the mask drops the row
    assert kernels.filter(A, pc.is_valid(A)).equals(A.filter(pc.is_valid(A)))
    idx = pa.array([6, 0, 0, 3])
    assert kernels.take(T, idx).equals(T.take(idx))
    with pytest.raises(IndexError):
        kernels.take(T, pa.array([7]))


def test_aggregates() -> None:
    lo, hi = kernels.min_max(A)
    assert (lo, hi) == tuple(pc.min_max(A).values())
    assert (lo.as_py(), hi.as_py()) == (-2, 7)
    empty = pa.array([None, None], pa.int64())
    assert [s.is_valid for s in kernels.min_max(empty)] == [False, False]
    assert kernels.sum(A).equals(pc.sum(A))
    assert not kernels.sum(empty).is_valid  # as pc.sum: min_count 1
    assert kernels.count_distinct(S) == pc.count_distinct(S, mode="all").as_py() == 4
    assert kernels.unique(S).equals(pc.unique(S))
    assert kernels.is_in(S, pa.array(["a", None])).equals(
        pc.is_in(S, value_set=pa.array(["a", None]), skip_nulls=False))


def test_cast_is_safe() -> None:
    assert kernels.cast(A, pa.int32()).equals(pc.cast(A, pa.int32(), safe=True))
    with pytest.raises(pa.ArrowInvalid):
        kernels.cast(pa.array([2**40]), pa.int32())
    with pytest.raises(pa.ArrowInvalid):
        kernels.cast(pa.array([1.5]), pa.int64())


def test_cast_table_is_table_cast() -> None:
    """Types cast where they differ, the target's nullability and metadata taken, the
    same table back where the schemas are equal; names must match; the cast is safe."""
    table = pa.table({"id": pa.array([1, 2, 3], pa.int32()), "s": ["a", "b", None]})
    target = pa.schema([pa.field("id", pa.int64(), nullable=False), ("s", pa.string())],
                       metadata={"k": "v"})
    got = kernels.cast_table(table, target)
    assert got.equals(table.cast(target))
    assert got.schema.equals(target, check_metadata=True)
    assert kernels.cast_table(got, target) is got
    with pytest.raises(ValueError, match="do not match"):
        kernels.cast_table(table.rename_columns(["x", "s"]), target)
    nulls = table.set_column(0, "id", pa.array([1, None, 3], pa.int32()))
    for cast in (nulls.cast, partial(kernels.cast_table, nulls)):
        with pytest.raises(ValueError, match="'id' with null values to non-nullable"):
            cast(target)
    with pytest.raises(pa.ArrowInvalid):
        kernels.cast_table(pa.table({"id": [2**40], "s": ["a"]}),
                           pa.schema([("id", pa.int32()), ("s", pa.string())]))


def test_sort_indices_ascending_nulls_first_and_stable() -> None:
    order = ["k", "w"]
    want = pc.sort_indices(T, sort_keys=[(c, "ascending", "at_start") for c in order])
    got = kernels.sort_indices(T, order)
    assert got.equals(want)
    assert T.take(got).column("k").to_pylist()[:2] == [None, None]
    ties = pa.table({"k": [1, 0, 1, 0]})
    assert kernels.sort_indices(ties, ["k"]).to_pylist() == [1, 3, 0, 2]
