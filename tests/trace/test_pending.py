"""lamina.trace.pending: future updates are bucketed by exponentially growing time ranges
relative to the upper, so that a conversion advancing the upper reads only the buckets
below the new upper. Properties of the bucketing and of the split."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lamina.frontier import MAX_TIME
from lamina.trace.pending import bucket_of, split_by_bucket
from tests.trace.helpers import table_of

times = st.one_of(st.integers(0, MAX_TIME), st.integers(0, 1000),
                  st.sampled_from([0, 1, 2**32, 2**63, MAX_TIME - 1, MAX_TIME]))


@st.composite
def upper_and_time(draw: st.DrawFn) -> tuple[int, int]:
    """An upper and a time at or above it, near it or far from it."""
    upper = draw(times)
    t = draw(st.one_of(st.integers(upper, MAX_TIME),
                       st.integers(upper, min(upper + 100, MAX_TIME))))
    return upper, t


@given(upper_and_time())
def test_bucket_contains_t_and_lies_at_or_above_upper(ut: tuple[int, int]) -> None:
    upper, t = ut
    lo, hi = bucket_of(t, upper)
    assert upper <= lo <= t < hi <= 2**64
    size = hi - lo
    assert size & (size - 1) == 0  # a power of two
    assert lo % size == 0  # aligned


@given(upper_and_time(), upper_and_time())
def test_buckets_of_one_upper_are_disjoint_or_equal(a: tuple[int, int],
                                                   b: tuple[int, int]) -> None:
    upper = a[0]
    t1, t2 = a[1], max(b[1], upper)
    b1, b2 = bucket_of(t1, upper), bucket_of(t2, upper)
    assert b1 == b2 or b1[1] <= b2[0] or b2[1] <= b1[0]


@given(upper_and_time(), st.integers(0, MAX_TIME))
def test_bucket_size_grows_with_distance(ut: tuple[int, int], other: int) -> None:
    """A later time never gets a smaller bucket than an earlier one."""
    upper, t1 = ut
    t2 = upper + other % (MAX_TIME - upper + 1)
    lo1, hi1 = bucket_of(t1, upper)
    lo2, hi2 = bucket_of(t2, upper)
    if t1 <= t2:
        assert hi1 - lo1 <= hi2 - lo2
    else:
        assert hi2 - lo2 <= hi1 - lo1


@given(times)
def test_at_most_65_buckets_for_one_upper(upper: int) -> None:
    """Walking bucket by bucket from the upper to the end of time takes at most 65 steps:
    one bucket per bit position plus ``[U, U+1)``."""
    count, t = 0, upper
    while t <= MAX_TIME:
        lo, hi = bucket_of(t, upper)
        assert lo == t
        count += 1
        t = hi
    assert count <= 65


@pytest.mark.parametrize("upper", [0, 1, 5, 8, 1000, 2**40 + 3])
def test_small_uppers_exhaustively(upper: int) -> None:
    """Every time in the first 300 after the upper: buckets tile [upper, ...) in order."""
    seen: list[tuple[int, int]] = []
    for t in range(upper, upper + 300):
        b = bucket_of(t, upper)
        if not seen or seen[-1] != b:
            assert not seen or seen[-1][1] == b[0]
            seen.append(b)
    assert seen[0] == (upper, upper + 1)
    sizes = [hi - lo for lo, hi in seen]
    assert sizes == sorted(sizes)


def test_time_below_upper_is_refused() -> None:
    with pytest.raises(ValueError, match="below the upper"):
        bucket_of(4, 5)


@given(st.integers(0, 2**20), st.lists(st.integers(0, 2**22), min_size=0, max_size=40),
       st.booleans())
def test_split_by_bucket_partitions_in_time_order(upper: int, offsets: list[int],
                                                  near_end: bool) -> None:
    """Every row lands in exactly one piece; each piece's times lie in its bucket, which
    is the bucket of each of them; pieces come in increasing time order."""
    base = MAX_TIME - 2**22 if near_end else upper
    ts = [base + o for o in offsets]
    up = base if near_end else upper
    table = table_of([(i, "x", t, 1) for i, t in enumerate(ts)])
    pieces = list(split_by_bucket(table, up))
    assert sum(p.num_rows for _, _, p in pieces) == table.num_rows
    ids: list[int] = []
    prev_hi = up
    for lo, hi, piece in pieces:
        assert piece.num_rows > 0
        assert prev_hi <= lo
        prev_hi = hi
        for t in piece.column("_time").to_pylist():
            assert lo <= t < hi
            assert bucket_of(t, up) == (lo, hi)
        ids.extend(piece.column("id").to_pylist())
    assert sorted(ids) == list(range(len(ts)))


def test_split_reaching_the_end_of_time() -> None:
    """The last bucket ends at 2**64, past every uint64: it takes everything left."""
    table = table_of([(1, "x", MAX_TIME, 1), (2, "x", 2**63, 1), (3, "x", 5, 1)])
    pieces = list(split_by_bucket(table, 5))
    assert [(lo, hi) for lo, hi, _ in pieces] == [(5, 6), (2**63, 2**64)]
    assert pc.sum(pieces[1][2].column("id")).as_py() == 3
    assert list(split_by_bucket(table.slice(0, 0), 0)) == []
    assert isinstance(pieces[0][2], pa.Table)
