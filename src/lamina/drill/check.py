"""The drill's checks against the oracle, each returning the violations it found.

- :func:`check_live` runs between two coordinator lives (no workload running; the daemon
  may be converting, merging or collecting garbage meanwhile, or be dead): it settles the
  operations the last kill left in doubt and compares the relation's frontiers, its
  markers and two snapshots with the oracle.
- :func:`check` runs at the end, with every process stopped: every acknowledged append
  present exactly once, ``snapshot(as_of)`` equal to the oracle at every sealed time at or
  after since, ``lamina verify`` clean, and no file left that no state names after a
  garbage collection without grace period.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from lamina.drill.oracle import MARKER, Oracle
from lamina.drill.workload import RELATION
from lamina.errors import RelationNotFoundError
from lamina.store import Relation, Store


@dataclass
class CheckStats:
    """What the checks looked at (for the report)."""

    live_checks: int = 0
    snapshots_checked: int = 0
    notes: list[str] = field(default_factory=list)


def _rows(table: pa.Table) -> list[tuple[int, str, int]]:
    ids = table.column("id").to_pylist()
    vals = table.column("val").to_pylist()
    diffs = table.column("_diff").to_pylist()
    return sorted(zip(ids, vals, diffs, strict=True))


def _markers(rows: list[tuple[int, str, int]]) -> dict[int, int]:
    return {-i: d for i, v, d in rows if v == MARKER}


def _compare_markers(oracle: Oracle, found: dict[int, int], upper: int) -> list[str]:
    """Every applied append whose marker is readable (time < upper) has diff exactly 1;
    no marker is there that the oracle does not know."""
    problems = []
    for op, t in oracle.markers.items():
        if t < upper and found.get(op) != 1:
            problems.append(f"acknowledged append {op} (time {t}): marker diff "
                            f"{found.get(op)}, expected exactly 1"
                            + (" (lost)" if op not in found else " (applied twice or more)"
                               if found[op] > 1 else ""))
    for op, diff in sorted(found.items()):
        if op not in oracle.markers:
            problems.append(f"append {op} is present (diff {diff}) but was never "
                            "acknowledged and is not in doubt")
    return problems


def _compare_snapshot(rel: Relation, oracle: Oracle, as_of: int,
                      got: list[tuple[int, str, int]] | None = None) -> list[str]:
    if got is None:
        got = _rows(rel.snapshot(as_of))
    want = oracle.snapshot(as_of)
    if got == want:
        return []
    gs, ws = set(got), set(want)
    extra, missing = sorted(gs - ws)[:5], sorted(ws - gs)[:5]
    return [f"snapshot at {as_of} differs from the oracle: {len(gs - ws)} rows extra "
            f"(e.g. {extra}), {len(ws - gs)} missing (e.g. {missing})"]


def _frontiers(oracle: Oracle, upper: int, since: int) -> list[str]:
    if (upper, since) != (oracle.upper, oracle.since):
        return [f"frontiers (upper, since) = {(upper, since)}, the oracle says "
                f"{(oracle.upper, oracle.since)}"]
    return []


def check_live(data_dir: Path, oracle: Oracle, ack: Path, rng: random.Random, *,
               stats: CheckStats, relation: str = RELATION) -> list[str]:
    """Between coordinator lives: settle what is in doubt, compare frontiers, markers and
    the snapshots at ``upper - 1`` and one random sealed time."""
    oracle.feed(ack)
    with Store.open(data_dir) as store:
        try:
            rel = store.relation(relation)
        except RelationNotFoundError:
            return [] if not oracle.ops else [f"relation {relation} vanished"]
        upper, since = rel.upper, rel.since
        stats.live_checks += 1
        if upper <= since:  # no time is readable: settle frontiers, appends stay in doubt
            oracle.resolve(None, upper, since)
            return _frontiers(oracle, upper, since)
        last = _rows(rel.snapshot(upper - 1))
        found = _markers(last)
        oracle.resolve(set(found), upper, since)
        problems = _frontiers(oracle, upper, since)
        if problems:
            return problems
        problems += _compare_markers(oracle, found, upper)
        problems += _compare_snapshot(rel, oracle, upper - 1, last)
        stats.snapshots_checked += 1
        if upper - 1 > since:
            problems += _compare_snapshot(rel, oracle, rng.randrange(since, upper - 1))
            stats.snapshots_checked += 1
    return problems


def check(data_dir: Path, oracle: Oracle, stats: CheckStats | None = None, *,
          relation: str = RELATION) -> list[str]:
    """The final checks (the module docstring); every process must be stopped."""
    from lamina.datadir import DataDir
    from lamina.fs import TMP_SUFFIX
    from lamina.layout import TraceLayout
    from lamina.objstore.local import LocalObjectStore
    from lamina.trace.trace import Trace
    from lamina.verify import verify_relation

    stats = stats if stats is not None else CheckStats()
    problems: list[str] = []
    with Store.open(data_dir) as store:
        rel = store.relation(relation)
        upper, since = rel.upper, rel.since
        last = _rows(rel.snapshot(upper - 1)) if upper > since else []
        found = _markers(last)
        oracle.resolve(set(found) if upper > since else None, upper, since)
        if oracle.in_doubt:
            problems.append(f"operations still in doubt at the end: {sorted(oracle.in_doubt)}"
                            " (the final seal should have made them readable)")
        problems += _frontiers(oracle, upper, since)
        problems += _compare_markers(oracle, found, upper)
        for as_of in range(since, upper):
            stats.snapshots_checked += 1
            diff = _compare_snapshot(rel, oracle, as_of, last if as_of == upper - 1 else None)
            if diff:
                problems += diff
                break
        meta = rel.meta
    layout = DataDir(data_dir)
    r = verify_relation(layout, relation)
    problems.extend(f"verify: {r.name}: {p}" for p in r.problems)
    stats.notes.extend(f"verify: {r.name}: {n}" for n in r.notes)
    traces = layout.trace_store(relation)
    trace = Trace.open(traces, meta)
    trace.collect_garbage(keep_versions=1, grace_seconds=0)
    # what GC kept: the newest version, and any a reader's lease still held
    named = set().union(*(trace.states.load(v).files() for v in trace.states.versions()))
    for obj in traces.list(""):
        if obj.key.split("/")[0] in TraceLayout.DATA_DIRS and obj.key not in named:
            problems.append(f"orphan file after garbage collection: {traces.location(obj.key)}")
    if isinstance(traces, LocalObjectStore):  # temp files are not objects: look at the files
        problems.extend(f"temp file left after garbage collection: {path}"
                        for path in sorted(traces.root.rglob(f"*{TMP_SUFFIX}")))
    for path in sorted(layout.wal.glob(f".create-{relation}-*")):
        stats.notes.append(f"staging directory of an interrupted create_relation left: "
                           f"{path.name}")
    return problems
