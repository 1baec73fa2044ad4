"""Crash-safety of every compacter step (trace invariants and crash-safety rules,
docs/architecture.md): a kill -9 between ANY two file
operations of a conversion (compare-and-append plus deletion of the converted segments),
of a cascade of merges, or of garbage collection loses nothing and counts nothing twice.

For each step a dry run in a child process counts its file operations (N). Then for every
k in 1..N a child process runs the step on its own copy of the data directory with
``CrashingFileSystem(crash_at=k)`` and must die by SIGKILL right before operation k (the
children are forked by a fork server, lamina.forkserver, that imported
tests/trace/crash_child.py, so a crash costs a fork rather than an interpreter start).
The parent then proves, with a normal file system:

- the newest state loads and passes check_state and check_data, and is either the state
  before the step or one the step published (never anything else);
- every snapshot equals the oracle's (the data before the step: no step changes what a
  relation holds);
- recovery (delete segments the state marks converted, convert the rest, merge, collect
  garbage with no grace period) completes, still matches the oracle, and leaves no
  garbage: no temp file, no data file that the state does not name, no converted segment.

k = N + 1 is a run that does not crash and must report the same N (the count is exact).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lamina.compacter.executors import reference
from lamina.forkserver import ForkServer
from lamina.objstore.local import LocalObjectStore
from lamina.schema import RelationMeta
from lamina.store import Store
from lamina.trace.plan import plan_conversion
from lamina.trace.state import StateStore
from lamina.trace.trace import Trace
from lamina.wal.reader import finished_segments
from tests.trace.crash_child import SINGLE_THREAD_ENV
from tests.trace.helpers import (
    KEY,
    NAME,
    SCHEMA,
    Oracle,
    StepBase,
    append_rounds,
    check_snapshots,
    check_trace,
    convert,
    data_files,
    pending_spans,
    recover,
    temp_files,
)

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("crash_child.py")
CHILD_MODULE = "tests.trace.crash_child"  # the same, as the fork server imports it
WORKERS = 2

pytestmark = pytest.mark.slow


def _build(root: Path, step: str, trace_url: str | None = None) -> StepBase:
    oracle = Oracle()
    with Store.open(root, segment_bytes=4096, fsync="never", trace_url=trace_url) as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        trace = Trace.open(store.layout.trace_store(NAME), rel.meta)
        if step == "convert":
            # An existing trace with batches and pending parts, then two segments to convert.
            append_rounds(rel, oracle, 7, 0)
            convert(trace, rel.wal_dir)
            trace.delete_converted_segments(rel.wal_dir)
            oracle.allow_compaction(rel, oracle.upper - 3)
            append_rounds(rel, oracle, 13, 7)
        elif step == "merge":
            # Four level-0 batches (a cascade of three merges), since advanced: merges
            # forward and consolidate.
            append_rounds(rel, oracle, 26, 0)
            oracle.allow_compaction(rel, oracle.upper - 10)
            append_rounds(rel, oracle, 2, 26)
            assert convert(trace, rel.wal_dir, merge=False) == 4
            trace.delete_converted_segments(rel.wal_dir)
        else:
            # Old state versions, merged-away batches, consumed pending parts and the orphan
            # batch of a writer that lost the CAS: all garbage.
            append_rounds(rel, oracle, 20, 0)
            convert(trace, rel.wal_dir)
            loser = Trace.open(trace.store, rel.meta)
            append_rounds(rel, oracle, 7, 20)
            spans = pending_spans(trace, rel.wal_dir)
            reference.run_conversion(loser, plan_conversion(loser.state, spans))
            convert(trace, rel.wal_dir)
            trace.delete_converted_segments(rel.wal_dir)
        # A tail in the open segment, read from the WAL by every snapshot.
        oracle.append(rel, [(1, "tail", oracle.upper, 1), (2, "tail", oracle.upper + 30, 1)])
        oracle.seal(rel, oracle.upper + 1)
        check_snapshots(rel, oracle)
        return StepBase(root, oracle, trace.state.version)


def _env() -> dict[str, str]:
    return {**os.environ, **SINGLE_THREAD_ENV, "PYTHONPATH": str(ROOT)}


def _child(step: str, root: Path, crash_at: int) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter running the step once."""
    return subprocess.run([sys.executable, str(CHILD), step, str(root), str(crash_at)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
                          check=False)


def _dry_run(base: StepBase, step: str, work: Path) -> list[str]:
    """The step's file operations, counted in a child on a copy of the base."""
    shutil.copytree(base.root, work)
    proc = _child(step, work, 0)
    assert proc.returncode == 0, proc.stderr
    log: list[str] = json.loads(proc.stdout)["log"]
    return log


def check_after_crash(base: StepBase, work: Path, newest: int, what: str) -> None:
    """The checks of the module docstring on a crashed copy, whatever storage its trace
    is on (temp files only exist on a directory)."""
    with Store.open(work, fsync="never") as store:
        rel = store.relation(NAME)
        meta: RelationMeta = rel.meta
        trace_dir, wal_dir = store.layout.trace_store(NAME), rel.wal_dir
        state = check_trace(trace_dir, meta)
        version = 0 if state is None else state.version
        assert base.version <= version <= newest, f"{what}: state version {version}"
        check_snapshots(rel, base.oracle)

        trace = recover(trace_dir, wal_dir, meta)
        state = check_trace(trace_dir, meta)
        assert state is not None
        assert state == trace.state
        check_snapshots(rel, base.oracle)
        assert not pending_spans(trace, wal_dir), f"{what}: unconverted segments"
        assert all(s.seq > state.converted_through for s in finished_segments(wal_dir)), \
            f"{what}: converted segments left"
        assert data_files(trace_dir) == state.files(), f"{what}: garbage left"
        if isinstance(trace_dir, LocalObjectStore):
            assert not temp_files(trace_dir.root), f"{what}: temp files left"
        assert StateStore(trace_dir).versions() == [state.version]


def _crash_and_check(base: StepBase, step: str, server: ForkServer, scratch: Path, *,
                     k: int, log: list[str], newest: int) -> None:
    work = scratch / f"k{k:04d}"
    shutil.copytree(base.root, work)
    what = f"{step}: crash before {log[k - 1]}"
    stderr = scratch / f"k{k:04d}.stderr"
    with stderr.open("wb") as err:
        child = server.spawn(f"{CHILD_MODULE}:forked", [step, str(work), str(k)], env=_env(),
                             stdout=subprocess.DEVNULL, stderr=err)
    code = child.wait(120)
    assert code == -signal.SIGKILL, f"{what}: exit {code}\n{stderr.read_text()}"
    check_after_crash(base, work, newest, what)
    shutil.rmtree(work)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("crash-points")


@pytest.mark.parametrize("step", ["convert", "merge", "gc"])
def test_crash_between_any_two_file_operations(step: str, scratch: Path) -> None:
    """See the module docstring: kill -9 before each file operation of ``step``."""
    base = _build(scratch / f"{step}-base", step)
    log = _dry_run(base, step, scratch / f"{step}-dry")
    n = len(log)
    assert n > 0
    kinds = {entry.split()[1] for entry in log}
    if step == "convert":
        assert {"write", "fdatasync", "rename", "link", "unlink", "fsync_dir"} <= kinds
    with Store.open(scratch / f"{step}-dry", fsync="never") as store:
        done = StateStore(LocalObjectStore(store.layout.trace_dir(NAME), Trace.open(
            store.layout.trace_store(NAME), store.relation(NAME).meta).fs)).versions()
    newest = max(done, default=0)
    assert newest > base.version or step == "gc"

    # A run that does not crash does exactly the counted operations.
    complete = scratch / f"{step}-complete"
    shutil.copytree(base.root, complete)
    proc = _child(step, complete, n + 1)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ops"] == n

    with ForkServer([CHILD_MODULE], env=_env()) as server, ThreadPoolExecutor(WORKERS) as pool:
        futures = [pool.submit(_crash_and_check, base, step, server, scratch / step, k=k,
                               log=log, newest=newest) for k in range(1, n + 1)]
        for f in futures:
            f.result()
