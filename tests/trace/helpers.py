"""Shared helpers of the trace suites: an oracle of every update, the reference executor
driven the way the compacter drives it, and whole-trace checks.

Imported by test modules and by the crash-point child script (tests/trace/crash_child.py),
so it must not import pytest: a child process starts faster without it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from lamina.compacter.executors import reference
from lamina.fs import TMP_SUFFIX, FileSystem
from lamina.layout import TraceLayout
from lamina.objstore.base import ObjectStore
from lamina.objstore.local import LocalObjectStore
from lamina.schema import RelationMeta
from lamina.store import Relation
from lamina.trace.invariants import check_data, check_state
from lamina.trace.plan import plan_conversion, plan_merge
from lamina.trace.state import StateStore, TraceState
from lamina.trace.trace import Trace
from lamina.wal.reader import SegmentSpan, segment_spans

SCHEMA = pa.schema([("id", pa.int64()), ("item", pa.string())])
KEY = ["id"]
NAME = "r"

Update = tuple[int, str, int, int]
"""(id, item, _time, _diff)"""


class NoSyncFileSystem(FileSystem):
    """Skips fdatasync and directory fsync: for suites that do not test durability
    against power loss (a killed process loses nothing the kernel has either way), where
    syncs would only cost time."""

    def os_fdatasync(self, fd: int, path: Path) -> None:
        pass

    def os_fsync_dir(self, path: Path) -> None:
        pass


def table_of(rows: Sequence[Update]) -> pa.Table:
    """An update table of the SCHEMA relation."""
    return pa.table({
        "id": pa.array([r[0] for r in rows], pa.int64()),
        "item": pa.array([r[1] for r in rows], pa.string()),
        "_time": pa.array([r[2] for r in rows], pa.uint64()),
        "_diff": pa.array([r[3] for r in rows], pa.int64()),
    })


@dataclass
class Oracle:
    """Every update ever appended, and the frontiers: the truth snapshots are checked
    against. ``snapshot`` follows the model of docs/architecture.md literally."""

    updates: list[Update] = field(default_factory=list)
    upper: int = 0
    since: int = 0

    def append(self, rel: Relation, rows: Sequence[Update]) -> None:
        rel.append(table_of(rows))
        self.updates.extend(rows)

    def seal(self, rel: Relation, upper: int) -> None:
        rel.seal(upper)
        self.upper = upper

    def allow_compaction(self, rel: Relation, since: int) -> None:
        rel.allow_compaction(since)
        self.since = since

    def snapshot(self, as_of: int) -> list[dict[str, Any]]:
        sums: dict[tuple[int, str], int] = {}
        for k, item, t, d in self.updates:
            if t <= as_of:
                sums[(k, item)] = sums.get((k, item), 0) + d
        return [{"id": k, "item": item, "_diff": d}
                for (k, item), d in sorted(sums.items()) if d != 0]

    def as_of_points(self, n: int = 4) -> list[int]:
        """Up to ``n`` readable times spread over ``[since, upper)``, both ends included."""
        if self.upper <= self.since:
            return []
        last = self.upper - 1
        points = {self.since, last}
        for i in range(1, n - 1):
            points.add(self.since + (last - self.since) * i // (n - 1))
        return sorted(points)


@dataclass(frozen=True)
class StepBase:
    """A data directory right before a trace step, and what it must read as."""

    root: Path
    oracle: Oracle
    version: int  # the trace state version before the step


def append_rounds(rel: Relation, oracle: Oracle, n: int, seed: int) -> None:
    """``n`` rounds of append + seal: present, future (pending) and retracting updates."""
    for i in range(n):
        j = seed + i
        rows = [(j % 4, "abc"[j % 3], oracle.upper + (j * 7) % 5, 1 + j % 2),
                (j % 3, "x", oracle.upper + 9 + j % 23, 1)]
        if j % 3 == 0:
            rows.append(((j + 1) % 4, "abc"[(j + 1) % 3], oracle.upper, -1))
        oracle.append(rel, rows)
        oracle.seal(rel, oracle.upper + 2)


def check_snapshots(rel: Relation, oracle: Oracle, points: Iterable[int] | None = None) -> None:
    """rel.snapshot(as_of) equals the oracle's for each point (default: spread over
    [since, upper))."""
    for as_of in oracle.as_of_points() if points is None else points:
        got = rel.snapshot(as_of).to_pylist()
        want = oracle.snapshot(as_of)
        assert got == want, f"snapshot at {as_of}: got {got}, want {want}"


# --- driving the reference executor -----------------------------------------------------

def pending_spans(trace: Trace, wal_dir: Path) -> list[SegmentSpan]:
    """Finished WAL segments the trace has not converted yet, in order."""
    return list(segment_spans(wal_dir, trace.meta.name, after=trace.state.converted_through))


def convert(trace: Trace, wal_dir: Path, *, per_plan: int = 1, limit: int | None = None,
            merge: bool = True) -> int:
    """Convert finished segments ``per_plan`` at a time (at most ``limit`` segments),
    merging to completion after each conversion when ``merge``. Returns the number of
    conversions committed."""
    spans = pending_spans(trace, wal_dir)
    if limit is not None:
        spans = spans[:limit]
    done = 0
    for i in range(0, len(spans), per_plan):
        reference.convert(trace, plan_conversion(trace.state, spans[i:i + per_plan]))
        done += 1
        if merge:
            merge_all(trace)
    return done


def merge_all(trace: Trace) -> int:
    """Run merges until no two adjacent batches share a level; returns how many ran."""
    n = 0
    while (plan := plan_merge(trace.state)) is not None:
        reference.merge(trace, plan)
        n += 1
    return n


def collect_all(trace: Trace, keep_versions: int = 1) -> None:
    """Garbage collection with no grace period (the clock is moved past every file)."""
    trace.collect_garbage(keep_versions=keep_versions, grace_seconds=0.0,
                          now=time.time() + 60.0)


STEPS = ("convert", "merge", "gc")
"""The trace steps the crash and I/O-error suites break: :func:`run_step` runs each."""


def run_step(step: str, trace: Trace, wal_dir: Path) -> None:
    """One trace step as the compacter runs it: convert every finished segment (and
    delete them), merge while a merge is due, or collect all garbage."""
    if step == "convert":
        convert(trace, wal_dir, per_plan=64, merge=False)
        trace.delete_converted_segments(wal_dir)
    elif step == "merge":
        merge_all(trace)
    elif step == "gc":
        collect_all(trace, keep_versions=1)
    else:
        raise ValueError(f"unknown step {step!r}; expected one of {STEPS}")


def as_store(trace: ObjectStore | Path) -> ObjectStore:
    """A trace's store, given the store or a local trace directory."""
    return trace if isinstance(trace, ObjectStore) else LocalObjectStore(trace)


def recover(trace_dir: ObjectStore | Path, wal_dir: Path, meta: RelationMeta) -> Trace:
    """What a restarted compacter does: load the newest state, delete segments it marks
    converted, convert the rest, merge, collect garbage with no grace period."""
    trace = Trace.open(as_store(trace_dir), meta)
    trace.delete_converted_segments(wal_dir)
    convert(trace, wal_dir, per_plan=8)
    trace.delete_converted_segments(wal_dir)
    merge_all(trace)
    collect_all(trace)
    return trace


# --- whole-trace checks -------------------------------------------------------------------

def check_trace(trace_dir: ObjectStore | Path, meta: RelationMeta) -> TraceState | None:
    """Load the newest state from storage and check every state and data invariant."""
    state = StateStore(as_store(trace_dir)).load_latest()
    if state is None:
        return None
    check_state(state)
    check_data(as_store(trace_dir), state, meta)
    return state


def data_files(trace_dir: ObjectStore | Path) -> set[str]:
    """Every object under the data prefixes (batches/, pending/), by key; on a local trace
    every file there (temp files too)."""
    if isinstance(trace_dir, LocalObjectStore):
        trace_dir = trace_dir.root
    if isinstance(trace_dir, ObjectStore):
        return {o.key for sub in TraceLayout.DATA_DIRS for o in trace_dir.list(sub)}
    out: set[str] = set()
    for sub in TraceLayout.DATA_DIRS:
        root = trace_dir / sub
        if root.exists():
            out.update(p.relative_to(trace_dir).as_posix() for p in root.rglob("*")
                       if p.is_file())
    return out


def named_files(trace_dir: ObjectStore | Path) -> set[str]:
    """Files named by any state version in storage."""
    store = StateStore(as_store(trace_dir))
    names: set[str] = set()
    for v in store.versions():
        names |= store.load(v).files()
    return names


def temp_files(root: Path) -> list[Path]:
    """Temp files (``*.tmp``) anywhere under ``root``."""
    return sorted(root.rglob(f"*{TMP_SUFFIX}"))


def batch_bound(conversions: int, c: int = 2) -> int:
    """The batch-count bound checked once merging is done: c*log2(conversions) + c."""
    return c * math.ceil(math.log2(max(conversions, 1))) + c
