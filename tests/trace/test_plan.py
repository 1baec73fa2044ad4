"""lamina.trace.plan: plans are pure functions of the state and the segments' frontiers.
A conversion only takes consecutive segments starting right at the trace (a gap is
corruption, never skipped); merges take the oldest adjacent equal-level pair and the
level rule is the one of docs/architecture.md."""

from __future__ import annotations

import pytest

from lamina.errors import CorruptionError
from lamina.trace import pending
from lamina.trace.batch import BatchDesc, PartFile
from lamina.trace.plan import (
    MergePlan,
    SegmentSpan,
    merged_level,
    plan_conversion,
    plan_merge,
)
from lamina.trace.state import PendingPart, TraceState


def span(seq: int, lower: int, upper: int, since: int = 0) -> SegmentSpan:
    return SegmentSpan(seq, f"/wal/{seq:016d}.wal", lower, upper, since, 100)


def batch(i: int, lower: int, upper: int, level: int, rows: int = 1) -> BatchDesc:
    return BatchDesc(f"b{i}", lower, upper, 0, level,
                     (PartFile(f"batches/b{i}/part-00000.parquet", rows, 10, 0),))


def ppart(i: int, lower: int, upper: int) -> PendingPart:
    return PendingPart(lower, upper, PartFile(f"pending/p{i}.parquet", 1, 10, 0))


def state(**kw: object) -> TraceState:
    return TraceState(version=3, relation="r", relation_id="x", **kw)  # type: ignore[arg-type]


def test_conversion_of_consecutive_segments() -> None:
    """Several consecutive segments make one batch [trace upper, last upper); since is
    the largest recorded; converted_through is the last sequence number."""
    st = state(upper=10, since=2, converted_through=4, batches=(batch(0, 0, 10, 0),))
    plan = plan_conversion(st, [span(5, 10, 12, 3), span(6, 12, 20, 1), span(7, 20, 21)])
    assert (plan.lower, plan.upper, plan.since, plan.converted_through) == (10, 21, 3, 7)
    assert plan_conversion(st, [span(5, 10, 12)]).since == 2
    assert plan.batch_id != plan_conversion(st, [span(5, 10, 12)]).batch_id


@pytest.mark.parametrize("spans", [
    [span(6, 10, 12)],                    # skips segment 5
    [span(4, 10, 12)],                    # already converted
    [span(5, 9, 12)],                     # starts below the trace upper (overlap)
    [span(5, 11, 12)],                    # starts above it (a gap in time)
    [span(5, 10, 12), span(7, 12, 14)],   # a hole in sequence numbers
    [span(5, 10, 12), span(6, 13, 14)],   # a hole in time
    [span(5, 10, 12), span(5, 10, 12)],   # the same segment twice
], ids=["skip", "old", "overlap", "time-gap", "seq-hole", "time-hole", "repeat"])
def test_conversion_rejects_gaps(spans: list[SegmentSpan]) -> None:
    """A missing or out-of-order segment is corruption naming the segment."""
    st = state(upper=10, converted_through=4, batches=(batch(0, 0, 10, 0),))
    with pytest.raises(CorruptionError, match="segment") as info:
        plan_conversion(st, spans)
    assert info.value.path is not None


def test_conversion_needs_a_segment() -> None:
    with pytest.raises(ValueError, match="at least one segment"):
        plan_conversion(state(), [])


def test_conversion_consumes_pending_parts_below_the_new_upper() -> None:
    """Parts whose range starts below the new upper are read; the rest are kept."""
    parts = (ppart(1, 10, 11), ppart(2, 12, 16), ppart(3, 16, 32), ppart(4, 20, 21))
    st = state(upper=10, converted_through=1, batches=(batch(0, 0, 10, 0),), pending=parts)
    plan = plan_conversion(st, [span(2, 10, 16)])
    assert plan.consume == parts[:2]
    assert plan.keep == parts[2:]
    assert plan_conversion(st, [span(2, 10, 10)]).consume == ()


def test_conversion_rewrites_an_overfull_pending_area() -> None:
    """More than MAX_PARTS kept parts: consume them all (bounded state size)."""
    many = tuple(ppart(i, 100 + i, 101 + i) for i in range(pending.MAX_PARTS + 1))
    st = state(upper=10, converted_through=1, batches=(batch(0, 0, 10, 0),), pending=many)
    plan = plan_conversion(st, [span(2, 10, 11)])
    assert plan.consume == many
    assert plan.keep == ()
    fits = state(upper=10, converted_through=1, batches=(batch(0, 0, 10, 0),),
                 pending=many[:pending.MAX_PARTS])
    assert plan_conversion(fits, [span(2, 10, 11)]).keep == many[:pending.MAX_PARTS]


def test_merge_takes_the_oldest_equal_level_pair() -> None:
    bs = (batch(0, 0, 5, 3), batch(1, 5, 7, 1), batch(2, 7, 8, 1), batch(3, 8, 9, 0),
          batch(4, 9, 10, 0))
    plan = plan_merge(state(upper=10, since=4, batches=bs))
    assert plan is not None
    assert (plan.index, plan.left, plan.right) == (1, bs[1], bs[2])
    assert (plan.lower, plan.upper, plan.since) == (5, 8, 4)
    assert plan_merge(state(upper=10, batches=(bs[0], bs[1], bs[3]))) is None
    assert plan_merge(state()) is None


@pytest.mark.parametrize(("left", "right", "rows", "level"), [
    (5, 5, 6, 3),    # more than both parents: up a level
    (5, 5, 5, 2),    # as many as a parent: stays
    (3, 8, 8, 2),
    (3, 8, 9, 3),
    (8, 3, 4, 2),    # consolidation shrank it
    (0, 0, 0, 2),    # empty batches stay empty and level
    (0, 0, 1, 3),
])
def test_merged_level_rule(left: int, right: int, rows: int, level: int) -> None:
    """docs/architecture.md, merge levels: level L+1 iff the merged batch holds more rows than both
    parents."""
    plan = MergePlan(0, batch(0, 0, 1, 2, left), batch(1, 1, 2, 2, right), 0, "bm")
    assert merged_level(plan, rows) == level
