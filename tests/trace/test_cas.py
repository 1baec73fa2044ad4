"""Two writers racing on one trace state (trace invariants and crash-safety rule 7,
docs/architecture.md): the compare-and-set of
state versions is the fence.

Both writers plan from version N and write their data files; both commit. Exactly one
publishes N+1, the other gets StateConflictError and its state stays N. Nothing is lost
or doubled (snapshots equal the oracle after the winner), the loser's files are never
read (they are overwritten with junk and reads still succeed) and garbage collection
deletes them once the grace period has passed, never before. Shown with two Trace objects
in one process and with two compacter processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lamina.compacter.executors import reference
from lamina.errors import StateConflictError
from lamina.objstore.base import ObjectStore
from lamina.store import Relation, Store
from lamina.trace.plan import plan_conversion, plan_merge
from lamina.trace.state import StateStore, TraceState
from lamina.trace.trace import Trace
from tests.trace.helpers import (
    KEY,
    NAME,
    SCHEMA,
    Oracle,
    check_snapshots,
    check_trace,
    convert,
    data_files,
    named_files,
    pending_spans,
)

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("cas_child.py")
GRACE = 600.0


def _rounds(rel: Relation, oracle: Oracle, n: int, seed: int = 0) -> None:
    for i in range(n):
        j = seed + i
        oracle.append(rel, [(j % 5, "ab"[j % 2], oracle.upper + j % 3, 1),
                            (j % 4, "f", oracle.upper + 5 + j % 17, 2 - j % 3)])
        oracle.seal(rel, oracle.upper + 1)


@pytest.fixture
def rel_oracle(tmp_path: Path, trace_url: str | None
               ) -> Iterator[tuple[Store, Relation, Oracle]]:
    """A relation whose trace is at a version > 0, with finished segments to convert; its
    trace on a directory and on S3 (the compare-and-set is the storage's)."""
    oracle = Oracle()
    with Store.open(tmp_path, segment_bytes=4096, fsync="never",
                    trace_url=trace_url) as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        _rounds(rel, oracle, 8)
        trace = Trace.open(store.layout.trace_store(NAME), rel.meta)
        convert(trace, rel.wal_dir, merge=False)
        trace.delete_converted_segments(rel.wal_dir)
        _rounds(rel, oracle, 8, seed=8)
        assert pending_spans(trace, rel.wal_dir)
        yield store, rel, oracle


def _orphans(trace: ObjectStore) -> set[str]:
    return data_files(trace) - named_files(trace)


def _junk(trace: ObjectStore, paths: set[str]) -> None:
    """Overwrite objects with garbage: any read of them would fail its checksum."""
    for p in paths:
        trace.put(p, b"not parquet" * 10)


def _assert_loser_never_read_and_collected(store: Store, rel: Relation, oracle: Oracle,
                                           winner: Trace, loser_files: set[str]) -> None:
    trace_dir = winner.store
    assert loser_files
    assert loser_files <= _orphans(trace_dir)
    _junk(trace_dir, loser_files)
    check_snapshots(rel, oracle)
    check_trace(trace_dir, rel.meta)
    # Inside the grace period the files stay (their writer might still be running) ...
    winner.collect_garbage(grace_seconds=GRACE)
    assert loser_files <= data_files(trace_dir)
    # ... after it they go, and nothing a kept version names goes with them.
    winner.collect_garbage(grace_seconds=GRACE, now=time.time() + GRACE + 1)
    assert not (loser_files & data_files(trace_dir))
    assert named_files(trace_dir) <= data_files(trace_dir)
    check_snapshots(rel, oracle)


@pytest.mark.parametrize("first", ["a", "b"])
def test_racing_conversions_one_wins_each_version(
        rel_oracle: tuple[Store, Relation, Oracle], first: str) -> None:
    """Two Trace objects on one directory plan the same conversion from version N: the
    first commit publishes N+1, the second raises StateConflictError and changes
    nothing; the loser's batch and pending files are orphans, never read, collected
    after the grace period."""
    store, rel, oracle = rel_oracle
    trace_dir = store.layout.trace_store(NAME)
    a, b = Trace.open(trace_dir, rel.meta), Trace.open(trace_dir, rel.meta)
    n = a.state.version
    assert b.state == a.state
    plans = {name: plan_conversion(t.state, pending_spans(t, rel.wal_dir))
             for name, t in (("a", a), ("b", b))}
    written = {name: reference.run_conversion(t, plans[name]) for name, t in (("a", a),
                                                                               ("b", b))}
    winner, loser = (a, b) if first == "a" else (b, a)
    w, lo = first, "b" if first == "a" else "a"
    winner.commit_conversion(plans[w], *written[w])
    with pytest.raises(StateConflictError, match=f"version {n + 1}"):
        loser.commit_conversion(plans[lo], *written[lo])
    assert loser.state.version == n
    assert StateStore(trace_dir).versions()[-1] == n + 1
    assert check_trace(trace_dir, rel.meta) == winner.state
    winner.delete_converted_segments(rel.wal_dir)
    check_snapshots(rel, oracle)

    parts, pending = written[lo]
    loser_files = {p.path for p in parts} | {p.part.path for p in pending}
    _assert_loser_never_read_and_collected(store, rel, oracle, winner, loser_files)

    # The loser stops; a restarted writer reads the winner's state and carries on.
    _rounds(rel, oracle, 8, seed=40)
    again = Trace.open(trace_dir, rel.meta)
    assert again.state == winner.state
    convert(again, rel.wal_dir)
    check_snapshots(rel, oracle)


def test_racing_merges_one_wins(rel_oracle: tuple[Store, Relation, Oracle]) -> None:
    """Two writers plan the same merge from version N: one publishes N+1, the other
    conflicts; the loser's merged batch is never read and is collected after grace."""
    store, rel, oracle = rel_oracle
    trace_dir = store.layout.trace_store(NAME)
    setup = Trace.open(trace_dir, rel.meta)
    convert(setup, rel.wal_dir, merge=False)
    setup.delete_converted_segments(rel.wal_dir)
    a, b = Trace.open(trace_dir, rel.meta), Trace.open(trace_dir, rel.meta)
    plan_a, plan_b = plan_merge(a.state), plan_merge(b.state)
    assert plan_a is not None
    assert plan_b is not None
    parts_b = reference.run_merge(b, plan_b)
    reference.merge(a, plan_a)
    with pytest.raises(StateConflictError):
        b.commit_merge(plan_b, parts_b)
    assert check_trace(trace_dir, rel.meta) == a.state
    check_snapshots(rel, oracle)
    _assert_loser_never_read_and_collected(store, rel, oracle, a, {p.path for p in parts_b})


def test_stale_writer_conflicts_even_after_versions_were_pruned(
        rel_oracle: tuple[Store, Relation, Oracle]) -> None:
    """A writer that planned at version N while the other published N+1, N+2, ... and
    pruned every older version still cannot publish: a newer version exists."""
    store, rel, oracle = rel_oracle
    trace_dir = store.layout.trace_store(NAME)
    stale = Trace.open(trace_dir, rel.meta)
    plan = plan_conversion(stale.state, pending_spans(stale, rel.wal_dir))
    written = reference.run_conversion(stale, plan)
    busy = Trace.open(trace_dir, rel.meta)
    convert(busy, rel.wal_dir)
    busy.delete_converted_segments(rel.wal_dir)
    busy.collect_garbage(keep_versions=1, grace_seconds=GRACE)
    assert StateStore(trace_dir).versions() == [busy.state.version]
    assert busy.state.version > stale.state.version + 1
    with pytest.raises(StateConflictError):
        stale.commit_conversion(plan, *written)
    with pytest.raises(StateConflictError):
        stale.states.publish(stale.state.next())
    assert check_trace(trace_dir, rel.meta) == busy.state
    check_snapshots(rel, oracle)


class Compacter:
    """A cas_child.py process."""

    def __init__(self, root: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(root)], cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, bufsize=1)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")

    def receive(self) -> list[str]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"compacter process exited with {self.proc.poll()}"
        return line.split()

    def close(self) -> None:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0
        self.proc.stdout.close()


def test_two_compacter_processes_race_every_step(tmp_path: Path, trace_url: str | None
                                                 ) -> None:
    """Two processes race through conversions and merges: in every round both plan from
    the same version N and commit at once; exactly one publishes N+1 and the other
    conflicts. After all rounds the trace is sound, equals the oracle, and a collection
    past the grace period removes every loser's orphan and nothing else. On a directory
    and on S3 (the children find the trace URL the data directory records)."""
    oracle = Oracle()
    with Store.open(tmp_path, segment_bytes=4096, fsync="never",
                    trace_url=trace_url) as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        trace_dir = store.layout.trace_store(NAME)
        procs = [Compacter(tmp_path), Compacter(tmp_path)]
        winners: list[int] = []
        try:
            for r, step in enumerate(["convert", "convert", "merge", "convert", "convert",
                                      "merge", "convert", "merge"]):
                view = Trace.open(trace_dir, rel.meta)
                if step == "convert":
                    _rounds(rel, oracle, 7, seed=7 * r)
                    assert pending_spans(view, rel.wal_dir)
                elif plan_merge(view.state) is None:
                    continue
                for p in procs:
                    p.send(step)
                readies = [p.receive() for p in procs]
                assert readies == [["ready", str(view.state.version)]] * 2
                for p in procs if r % 2 else procs[::-1]:  # either may get there first
                    p.send("go")
                outcomes = [p.receive() for p in procs]
                won = [i for i, o in enumerate(outcomes) if o[0] == "won"]
                assert len(won) == 1, outcomes
                assert outcomes[1 - won[0]] == ["lost"]
                assert outcomes[won[0]] == ["won", str(view.state.version + 1)]
                winners.append(won[0])
                state: TraceState | None = check_trace(trace_dir, rel.meta)
                assert state is not None
                assert state.version == view.state.version + 1
                check_snapshots(rel, oracle)
        finally:
            for p in procs:
                p.close()
        assert len(winners) >= 6
        trace = Trace.open(trace_dir, rel.meta)
        orphans = _orphans(trace_dir)
        assert orphans  # every round left the loser's files
        _junk(trace_dir, orphans)
        check_snapshots(rel, oracle)
        trace.collect_garbage(keep_versions=1, grace_seconds=GRACE)
        assert data_files(trace_dir) >= trace.state.files()
        trace.collect_garbage(keep_versions=1, grace_seconds=GRACE,
                              now=time.time() + GRACE + 1)
        assert data_files(trace_dir) == trace.state.files()
        check_trace(trace_dir, rel.meta)
        check_snapshots(rel, oracle)
