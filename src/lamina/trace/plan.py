"""What a conversion or merge step will do, decided before any data moves.

A plan is pure: it depends only on the trace state and the WAL segments' frontiers, so
the in-process reference executor (lamina.compacter.executors.reference) and the Spark executor
(lamina.compacter.step) carry out the same plan and are compared row for row in tests.

Conversion of consecutive finished segments ``s_i..s_j`` (``s_i.lower`` must equal the
trace upper): the new batch is ``[trace upper, s_j.upper)``; since becomes the largest
since recorded in the trace or the segments; pending parts whose range starts below the new
upper are consumed (all of them when more than ``pending.MAX_PARTS`` would remain).

Merge: the oldest adjacent pair of batches with equal level ``L``. The merged batch covers
both intervals, takes the trace's since (times below it are forwarded) and level ``L+1``
if it holds more rows than both parents, else ``L`` (docs/architecture.md, trace invariants).
Because a level-``L+1``
batch is built from at least ``2**(L+1)`` converted batches and no two adjacent batches
share a level once merging is done, the batch count stays at most ``log2(conversions)+1``
whether or not since advances.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lamina.errors import CorruptionError
from lamina.trace import pending
from lamina.trace.batch import BatchDesc, new_id
from lamina.trace.state import PendingPart, TraceState
from lamina.wal.reader import SegmentSpan


@dataclass(frozen=True)
class ConversionPlan:
    segments: tuple[SegmentSpan, ...]
    lower: int
    upper: int
    since: int
    consume: tuple[PendingPart, ...]
    keep: tuple[PendingPart, ...]
    batch_id: str

    @property
    def converted_through(self) -> int:
        return self.segments[-1].seq


@dataclass(frozen=True)
class MergePlan:
    index: int
    left: BatchDesc
    right: BatchDesc
    since: int
    batch_id: str

    @property
    def lower(self) -> int:
        return self.left.lower

    @property
    def upper(self) -> int:
        return self.right.upper


def plan_conversion(state: TraceState, segments: Sequence[SegmentSpan]) -> ConversionPlan:
    """Plan converting ``segments`` (consecutive, first one right after the state's)."""
    if not segments:
        raise ValueError("a conversion needs at least one segment")
    expected_seq, expected_lower = state.converted_through + 1, state.upper
    for s in segments:
        if s.seq != expected_seq or s.lower != expected_lower:
            raise CorruptionError(
                f"WAL segment {s.seq} covers [{s.lower}, {s.upper}) but the trace expects "
                f"segment {expected_seq} starting at {expected_lower} (a segment is missing "
                "or out of order)", path=s.path)
        expected_seq, expected_lower = s.seq + 1, s.upper
    upper = segments[-1].upper
    since = max(state.since, *(s.since for s in segments))
    consume = tuple(p for p in state.pending if p.lower < upper)
    keep = tuple(p for p in state.pending if p.lower >= upper)
    if len(keep) > pending.MAX_PARTS:
        consume, keep = state.pending, ()
    return ConversionPlan(segments=tuple(segments), lower=state.upper, upper=upper,
                          since=since, consume=consume, keep=keep, batch_id=new_id("b"))


def plan_merge(state: TraceState) -> MergePlan | None:
    """The oldest adjacent pair of batches at one level, or None when there is none."""
    for i in range(len(state.batches) - 1):
        left, right = state.batches[i], state.batches[i + 1]
        if left.level == right.level:
            return MergePlan(index=i, left=left, right=right, since=state.since,
                             batch_id=new_id("b"))
    return None


def merged_level(plan: MergePlan, rows: int) -> int:
    level = plan.left.level
    return level + 1 if rows > max(plan.left.rows, plan.right.rows) else level
