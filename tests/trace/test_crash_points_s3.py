"""Crash-safety of every compacter step with the trace on S3: a process killed between
ANY two object-store writes of a conversion (compare-and-append plus deletion of the
converted segments), of a cascade of merges, or of garbage collection loses nothing and
counts nothing twice.

On an object store a crash can only fall between two requests (a put is atomic: the
object is there whole or not at all), so the crash points are the step's mutating
requests. :class:`~lamina.testing.unreliable.UnreliableStore` with ``crash_at_mutation=k``
stops the step right before its k-th put, create or delete (and fails everything after, as
if the process were gone). A dry run counts the step's mutations N; then for every k in
1..N the step runs on its own copy of the data directory and of the trace's objects, and
must crash. The checks are those of tests/trace/test_crash_points.py: the newest state
loads, passes every invariant and is the state before the step or one it published; every
snapshot equals the oracle's; recovery completes, still matches it, and leaves no garbage
(no object the state does not name, no converted segment).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lamina.datadir import DataDir, TraceLocation
from lamina.objstore.base import open_store
from lamina.store import Store
from lamina.testing.unreliable import SimulatedCrash, UnreliableStore
from lamina.trace.state import StateStore
from lamina.trace.trace import Trace
from tests.trace import helpers
from tests.trace.helpers import (
    NAME,
    StepBase,
)
from tests.trace.test_crash_points import _build, check_after_crash

pytestmark = pytest.mark.slow


def _copy(base: StepBase, bucket: str, dest: Path) -> None:
    """``base``'s data directory at ``dest``, its traces under a prefix of their own."""
    shutil.copytree(base.root, dest)
    src = open_store(DataDir(base.root).trace_url())
    url = f"s3://{bucket}/{dest.name}"
    copy = open_store(url)
    for obj in src.list(""):
        copy.put(obj.key, src.get(obj.key))
    (dest / "trace.json").write_bytes(TraceLocation(url).to_json())


def _run(root: Path, step: str, crash_at: int | None) -> list[tuple[str, str]]:
    """The step on ``root`` through an UnreliableStore; the mutations it asked for. With
    ``crash_at`` the step must end in the simulated crash."""
    with Store.open(root, fsync="never") as store:
        rel = store.relation(NAME)
        unreliable = UnreliableStore(store.layout.trace_store(NAME),
                                     crash_at_mutation=crash_at)
        try:
            trace = Trace.open(unreliable, rel.meta)
            helpers.run_step(step, trace, rel.wal_dir)
            assert crash_at is None, f"no crash at mutation {crash_at}"
        except SimulatedCrash:
            assert crash_at is not None
            assert len(unreliable.mutations) >= crash_at
        return [(op, key) for op, key in unreliable.mutations]


@pytest.mark.parametrize("step", ["convert", "merge", "gc"])
def test_crash_between_any_two_object_writes(tmp_path: Path, s3_bucket: str,
                                             step: str) -> None:
    base = _build(tmp_path / "base", step, f"s3://{s3_bucket}/base")
    dry = tmp_path / "dry"
    _copy(base, s3_bucket, dry)
    mutations = _run(dry, step, None)
    assert mutations, "the step wrote nothing"
    with Store.open(dry, fsync="never") as store:
        newest = StateStore(store.layout.trace_store(NAME)).versions()[-1]
    if step != "gc":
        assert newest > base.version
        assert any(op == "create" for op, _ in mutations)  # the state's CAS
    for k in range(1, len(mutations) + 1):
        work = tmp_path / f"k{k}"
        _copy(base, s3_bucket, work)
        _run(work, step, k)
        check_after_crash(base, work, newest, f"{step}, crash before {mutations[k - 1]}")
        shutil.rmtree(work)
