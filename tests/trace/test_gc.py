"""Garbage collection and segment deletion (lamina.trace.trace): files no kept state
version names are deleted only after the grace period; files a kept version names are
never deleted, so readers of any kept version can still read it; only the newest
``keep_versions`` versions stay, and those superseded within ``keep_versions_seconds``;
converted segments (and only those) are deleted."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lamina.compacter.executors import reference
from lamina.store import Relation, Store
from lamina.trace.invariants import check_data
from lamina.trace.plan import plan_conversion
from lamina.trace.state import StateStore
from lamina.trace.trace import Trace
from lamina.wal.segment import encode_header, list_segments
from tests.trace.helpers import (
    KEY,
    NAME,
    SCHEMA,
    Oracle,
    check_snapshots,
    convert,
    data_files,
    named_files,
    pending_spans,
    temp_files,
)

GRACE = 600.0


def _rounds(rel: Relation, oracle: Oracle, n: int, seed: int = 0) -> None:
    for i in range(n):
        j = seed + i
        oracle.append(rel, [(j % 5, "ab"[j % 2], oracle.upper + j % 3, 1),
                            (j % 4, "f", oracle.upper + 4 + j % 19, 1)])
        oracle.seal(rel, oracle.upper + 1)


@pytest.fixture
def setup(tmp_path: Path, trace_url: str | None) -> Iterator[tuple[Relation, Oracle, Trace]]:
    """A trace after several conversions and merges, never collected: many versions,
    merged-away batches and consumed pending parts in storage; on a directory and on S3."""
    yield from _setup(tmp_path, trace_url)


@pytest.fixture
def local_setup(tmp_path: Path) -> Iterator[tuple[Relation, Oracle, Trace]]:
    """``setup`` on a directory, for tests of files (temp files, mtimes, directories)."""
    yield from _setup(tmp_path, None)


def _setup(tmp_path: Path, trace_url: str | None) -> Iterator[tuple[Relation, Oracle, Trace]]:
    oracle = Oracle()
    with Store.open(tmp_path, segment_bytes=4096, fsync="never",
                    trace_url=trace_url) as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        trace = Trace.open(store.layout.trace_store(NAME), rel.meta)
        _rounds(rel, oracle, 40)
        convert(trace, rel.wal_dir)
        trace.delete_converted_segments(rel.wal_dir)
        oracle.allow_compaction(rel, oracle.upper - 5)
        assert trace.state.version >= 8
        yield rel, oracle, trace


def _orphan_batch(rel: Relation, trace: Trace, oracle: Oracle) -> set[str]:
    """The files of a conversion that never committed (a crash, or a lost CAS)."""
    _rounds(rel, oracle, 7, seed=100)
    spans = pending_spans(trace, rel.wal_dir)
    parts, pending = reference.run_conversion(trace, plan_conversion(trace.state, spans))
    return {p.path for p in parts} | {p.part.path for p in pending}


def test_unnamed_files_go_only_after_the_grace_period(
        local_setup: tuple[Relation, Oracle, Trace]) -> None:
    """Young garbage stays (its writer may still be running); old garbage goes; what the
    current state names stays; the report counts what went."""
    rel, oracle, trace = local_setup
    orphans = _orphan_batch(rel, trace, oracle)
    stray_tmp = trace.store.root / "state" / ".00000000000000000099.json.abc.tmp"
    stray_tmp.write_bytes(b"{}")
    before = data_files(trace.store.root)

    report = trace.collect_garbage(keep_versions=100, grace_seconds=GRACE)
    assert report.files_deleted == 0
    assert data_files(trace.store.root) == before
    assert stray_tmp.exists()

    # Age one orphan past the grace period: only that one goes.
    aged = sorted(orphans)[0]
    old = time.time() - GRACE - 10
    os.utime(trace.store.root / aged, (old, old))
    report = trace.collect_garbage(keep_versions=100, grace_seconds=GRACE)
    assert report.files_deleted == 1
    assert data_files(trace.store.root) == before - {aged}

    report = trace.collect_garbage(keep_versions=1, grace_seconds=GRACE,
                                   now=time.time() + GRACE + 1)
    assert report.versions_deleted > 0
    assert report.files_deleted > len(orphans)  # also files only pruned versions named
    assert report.bytes_deleted > 0
    assert data_files(trace.store.root) == trace.state.files()
    assert not stray_tmp.exists()
    assert not temp_files(trace.store.root)
    check_snapshots(rel, oracle)


@pytest.mark.parametrize("keep", [1, 2, 3, 5])
def test_kept_versions_stay_readable(setup: tuple[Relation, Oracle, Trace],
                                     keep: int) -> None:
    """With the clock far past every grace period, GC keeps exactly the newest ``keep``
    versions and every file they name (each kept version still passes check_data, so a
    reader that loaded it can finish), and deletes every other data file."""
    rel, oracle, trace = setup
    states = StateStore(trace.store)
    all_versions = states.versions()
    assert len(all_versions) > keep
    trace.collect_garbage(keep_versions=keep, grace_seconds=GRACE,
                          now=time.time() + 10 * GRACE)
    kept = states.versions()
    assert kept == all_versions[-keep:]
    for v in kept:
        check_data(trace.store, states.load(v), rel.meta)
    assert data_files(trace.store) == named_files(trace.store)
    check_snapshots(rel, oracle)


def test_recently_superseded_versions_stay_until_their_time_is_up(
        setup: tuple[Relation, Oracle, Trace]) -> None:
    """``keep_versions_seconds``: every version superseded within the window stays with
    its files (a reader that loaded it can finish) even beyond ``keep_versions``; once the
    relation has been idle longer than the window, only the newest version and its files
    remain, on a directory and on S3 (the mtimes come from the store's listing)."""
    rel, oracle, trace = setup
    states = StateStore(trace.store)
    all_versions = states.versions()
    hour = 3600.0
    now = time.time()
    report = trace.collect_garbage(keep_versions=1, grace_seconds=0.0,
                                   keep_versions_seconds=hour, now=now)
    assert report.versions_deleted == 0
    assert states.versions() == all_versions
    for v in all_versions:
        check_data(trace.store, states.load(v), rel.meta)
    assert data_files(trace.store) == named_files(trace.store)
    assert data_files(trace.store) != trace.state.files()  # merged-away batches stayed

    report = trace.collect_garbage(keep_versions=1, grace_seconds=0.0,
                                   keep_versions_seconds=hour, now=now + 2 * hour)
    assert report.versions_deleted == len(all_versions) - 1
    assert states.versions() == [trace.state.version]
    assert data_files(trace.store) == trace.state.files()
    check_snapshots(rel, oracle)


def test_the_window_counts_from_when_a_version_was_superseded(
        local_setup: tuple[Relation, Oracle, Trace]) -> None:
    """A version's time runs from its successor's publication, not its own: an old
    version superseded a moment ago stays; versions superseded before the window go."""
    rel, oracle, trace = local_setup
    states = StateStore(trace.store)
    versions = states.versions()
    now = time.time()
    window = 100.0
    # every version published long ago, except the newest, published just now
    for v in versions[:-1]:
        os.utime(trace.store.root / states.key(v), (now - 10 * window, now - 10 * window))
    os.utime(trace.store.root / states.key(versions[-1]), (now - 1, now - 1))
    trace.collect_garbage(keep_versions=1, grace_seconds=0.0, keep_versions_seconds=window,
                          now=now)
    assert states.versions() == versions[-2:]  # the newest, and the one it superseded
    for v in versions[-2:]:
        check_data(trace.store, states.load(v), rel.meta)
    check_snapshots(rel, oracle)


def test_keep_versions_below_one_keeps_one(setup: tuple[Relation, Oracle, Trace]) -> None:
    rel, oracle, trace = setup
    trace.collect_garbage(keep_versions=0, grace_seconds=0.0, now=time.time() + 60)
    assert StateStore(trace.store).versions() == [trace.state.version]
    assert data_files(trace.store) == trace.state.files()
    check_snapshots(rel, oracle)


def test_empty_batch_directories_are_removed(
        local_setup: tuple[Relation, Oracle, Trace]) -> None:
    rel, oracle, trace = local_setup
    trace.collect_garbage(keep_versions=1, grace_seconds=0.0, now=time.time() + 60)
    batch_dirs = {p.name for p in (trace.store.root / "batches").iterdir()}
    assert batch_dirs == {b.id for b in trace.state.batches if b.parts}
    check_snapshots(rel, oracle)


def test_gc_on_a_fresh_trace_does_nothing(tmp_path: Path) -> None:
    with Store.open(tmp_path, fsync="never") as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        trace = Trace.open(store.layout.trace_store(NAME), rel.meta)
        report = trace.collect_garbage(grace_seconds=0.0)
        assert (report.versions_deleted, report.files_deleted) == (0, 0)


def test_only_converted_segments_are_deleted(tmp_path: Path) -> None:
    """delete_converted_segments removes finished segments up to converted_through and
    nothing else: later finished segments and the open one stay."""
    oracle = Oracle()
    with Store.open(tmp_path, segment_bytes=4096, fsync="never") as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        _rounds(rel, oracle, 30)
        trace = Trace.open(store.layout.trace_store(NAME), rel.meta)
        finished = [s.seq for s in list_segments(rel.wal_dir) if s.finished]
        assert len(finished) >= 3
        assert trace.delete_converted_segments(rel.wal_dir) == 0
        convert(trace, rel.wal_dir, limit=2)
        assert trace.state.converted_through == finished[1]
        assert trace.delete_converted_segments(rel.wal_dir) == 2
        left = list_segments(rel.wal_dir)
        assert [s.seq for s in left if s.finished] == finished[2:]
        assert sum(not s.finished for s in left) == 1
        assert trace.delete_converted_segments(rel.wal_dir) == 0
        check_snapshots(rel, oracle)


def _stop_after_finishing_a_segment(root: Path, oracle: Oracle) -> Relation:
    """A relation whose writer stopped right after finishing a segment: seals until a
    segment is finished, then leaves the store (the new open segment holds only its
    opening records)."""
    with Store.open(root, segment_bytes=4096, fsync="never") as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        while not any(s.finished for s in list_segments(rel.wal_dir)):
            oracle.append(rel, [(oracle.upper % 3, "a", oracle.upper, 1),
                                (1, "future", oracle.upper + 50, 1)])
            if oracle.upper == 2:
                oracle.allow_compaction(rel, 1)
            oracle.seal(rel, oracle.upper + 1)
        return rel


@pytest.mark.parametrize("opening", ["missing", "header only", "lower only"])
def test_last_frontier_record_is_kept(tmp_path: Path, opening: str) -> None:
    """Regression: a writer that crashed between finishing a segment and writing the next
    one's opening records leaves no open segment (or one without its PROGRESS and SINCE
    records). Converting and deleting every converted segment then left the relation
    without any record of its upper and since: the writer could not recover (or started
    again from 0) and reads failed. The newest finished segment now stays until a later
    segment records the frontiers, and is deleted after that."""
    oracle = Oracle()
    rel = _stop_after_finishing_a_segment(tmp_path, oracle)
    (open_seg,) = [s for s in list_segments(rel.wal_dir) if not s.finished]
    raw = open_seg.path.read_bytes()
    header = len(encode_header(NAME, open_seg.seq))
    if opening == "missing":
        open_seg.path.unlink()
    elif opening == "header only":
        open_seg.path.write_bytes(raw[:header])
    else:  # the PROGRESS record whole, the SINCE record torn
        open_seg.path.write_bytes(raw[:header + 9 + 9 + 4])

    with Store.open(tmp_path, segment_bytes=4096, fsync="never") as store:
        rel = store.relation(NAME)
        trace = Trace.open(store.layout.trace_store(NAME), rel.meta)
        assert convert(trace, rel.wal_dir) == 1
        assert trace.delete_converted_segments(rel.wal_dir) == 0
        assert [s.seq for s in list_segments(rel.wal_dir) if s.finished] == \
            [trace.state.converted_through]
        check_snapshots(rel, oracle)
        # The writer recovers the frontiers and goes on where it stopped.
        assert (rel.upper, rel.since) == (oracle.upper, oracle.since)
        oracle.append(rel, [(7, "after", oracle.upper, 1)])
        oracle.seal(rel, oracle.upper + 1)
        check_snapshots(rel, oracle)
        # Now a later segment records the frontiers: the converted one goes.
        assert trace.delete_converted_segments(rel.wal_dir) == 1
        assert not [s for s in list_segments(rel.wal_dir) if s.finished]
        check_snapshots(rel, oracle)
