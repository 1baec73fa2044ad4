"""One relation's pipeline, run in process over the in-process executor (no Spark):
conversion, merge and GC; retries with backoff counted by the kind that failed;
quarantine on corruption; stale plans re-planned; cancelled jobs."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from lamina import failpoints
from lamina.compacter.executors import ConversionResult, reference
from lamina.compacter.executors.inprocess import InProcessExecutor
from lamina.compacter.metrics import Metrics
from lamina.compacter.pipeline import RelationPipeline
from lamina.datadir import DataDir
from lamina.store import Store
from lamina.trace.invariants import check_data
from lamina.trace.plan import ConversionPlan, plan_conversion, plan_merge
from lamina.trace.trace import Trace
from lamina.wal.reader import finished_segments
from tests.compacter.backlog import (
    backlog,
    corrupt_payload,
    pipeline,
    sample,
    snapshot,
    until,
    writing,
)
from tests.trace.helpers import Oracle, convert


async def _run_until(pipe: RelationPipeline, cond: Any, timeout: float = 20.0) -> None:
    """Run the pipeline until ``cond()``, then stop it and wait for it to end."""
    stop = asyncio.Event()
    task = asyncio.create_task(pipe.run(stop))
    try:
        await until("the pipeline", lambda: cond() or task.done(), timeout)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def _caught_up(pipe: RelationPipeline) -> Any:
    def cond() -> bool:
        return (pipe.trace is not None and not any(
            s.seq > pipe.trace.state.converted_through for s in finished_segments(pipe.wal_dir)))
    return cond


def _merged(pipe: RelationPipeline) -> bool:
    return pipe.trace is not None and plan_merge(pipe.trace.state) is None


def _check(root: Path, oracle: Oracle) -> None:
    for as_of in oracle.as_of_points():
        assert snapshot(root, "orders", as_of) == oracle.snapshot(as_of)


def test_converts_merges_and_collects(tmp_path: Path) -> None:
    """Many segments become batches (several jobs, per ``max_segments_per_job``), adjacent
    batches of one level merge, GC deletes what merges left; the data reads back."""
    oracle = backlog(tmp_path, rounds=16)
    pipe = pipeline(tmp_path, max_segments_per_job=2, gc_interval_seconds=0.01,
                    gc_grace_seconds=0, keep_versions=1)
    asyncio.run(_run_until(pipe, lambda: _caught_up(pipe)() and _merged(pipe) and sample(
        pipe.metrics, "lamina_gc_deleted_files_total") > 0))
    m = pipe.metrics
    assert sample(m, "lamina_jobs_total", kind="conversion", outcome="success") >= 4
    assert sample(m, "lamina_jobs_total", kind="merge", outcome="success") >= 2
    assert sample(m, "lamina_jobs_total", kind="gc", outcome="success") >= 1
    assert sum(sample(m, "lamina_job_retries_total", kind=k)
               for k in ("conversion", "merge", "gc")) == 0
    assert pipe.trace is not None
    levels = [b.level for b in pipe.trace.state.batches]
    assert all(a != b for a, b in itertools.pairwise(levels))
    _check(tmp_path, oracle)


def test_a_failed_job_is_retried_with_backoff(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The first conversion attempt fails (EIO publishing its first file): the attempt is
    counted as a failure and a conversion retry, the retry waits ``retry_initial_seconds``,
    then succeeds."""
    oracle = backlog(tmp_path, rounds=4)
    monkeypatch.setattr(failpoints, "ACTIVE", failpoints.parse("fs.before_rename=error"))
    pipe = pipeline(tmp_path, retry_initial_seconds=0.3)
    with capture_logs() as logs:
        asyncio.run(_run_until(pipe, _caught_up(pipe)))
    m = pipe.metrics
    assert sample(m, "lamina_jobs_total", kind="conversion", outcome="failure") == 1
    assert sample(m, "lamina_job_retries_total", kind="conversion") == 1
    assert sample(m, "lamina_jobs_total", kind="conversion", outcome="success") == 1
    [retry] = [e for e in logs if e["event"] == "conversion.retrying"]
    assert retry["retry_in_seconds"] == 0.3
    assert "fail point fs.before_rename" in retry["error"]
    [done] = [e for e in logs if e["event"] == "conversion.committed"]
    assert done["duration_seconds"] >= 0.3  # the backoff is part of the step's time
    _check(tmp_path, oracle)


def test_backoff_doubles_up_to_the_maximum(tmp_path: Path) -> None:
    """A failure that persists (the trace's batches directory is a file) is retried at
    0.1, 0.2, 0.4, 0.4 ... seconds; once the cause is gone, the conversion commits."""
    oracle = backlog(tmp_path, rounds=4)
    pipe = pipeline(tmp_path, retry_initial_seconds=0.1, retry_max_seconds=0.4)
    blocker = DataDir(tmp_path).trace_dir("orders") / "batches"
    blocker.parent.mkdir(parents=True)
    blocker.write_bytes(b"not a directory")

    async def run() -> list[dict[str, Any]]:
        with capture_logs() as logs:
            stop = asyncio.Event()
            task = asyncio.create_task(pipe.run(stop))
            await until("four retries", lambda: sum(
                e["event"] == "conversion.retrying" for e in logs) >= 4)
            blocker.unlink()
            await until("the conversion", _caught_up(pipe))
            stop.set()
            await task
        return logs

    logs = asyncio.run(run())
    delays = [e["retry_in_seconds"] for e in logs if e["event"] == "conversion.retrying"]
    assert delays[:4] == [0.1, 0.2, 0.4, 0.4]
    assert sample(pipe.metrics, "lamina_job_retries_total", kind="conversion") == len(delays)
    _check(tmp_path, oracle)


def test_gc_keeps_versions_for_keep_versions_seconds(tmp_path: Path) -> None:
    """The daemon's GC passes ``keep_versions_seconds`` on: with one version kept by count
    and an hour by time, every version the run superseded stays readable."""
    oracle = backlog(tmp_path, rounds=16)
    pipe = pipeline(tmp_path, max_segments_per_job=2, gc_interval_seconds=0.01,
                    gc_grace_seconds=0, keep_versions=1, keep_versions_seconds=3600)
    asyncio.run(_run_until(pipe, lambda: _caught_up(pipe)() and _merged(pipe) and sample(
        pipe.metrics, "lamina_jobs_total", kind="gc", outcome="success") >= 2))
    assert pipe.trace is not None
    states = pipe.trace.states
    assert len(states.versions()) == pipe.trace.state.version > 4
    for v in states.versions():
        check_data(pipe.trace.store, states.load(v), pipe.meta)
    _check(tmp_path, oracle)


@pytest.mark.parametrize(("point", "kind"), [("trace.mid_merge", "merge"),
                                             ("gc.before_delete", "gc")])
def test_a_failed_pass_is_counted_under_its_own_kind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str, kind: str) -> None:
    """A merge whose commit fails, or a GC that fails deleting, is retried on the next
    pass and counted as a retry of a merge or a GC, not of a conversion."""
    oracle = backlog(tmp_path, rounds=12)
    monkeypatch.setattr(failpoints, "ACTIVE", failpoints.parse(f"{point}=error"))
    pipe = pipeline(tmp_path, max_segments_per_job=2, gc_interval_seconds=0.01,
                    gc_grace_seconds=0, keep_versions=1)
    with capture_logs() as logs:
        asyncio.run(_run_until(pipe, lambda: _caught_up(pipe)() and sample(
            pipe.metrics, "lamina_jobs_total", kind=kind, outcome="success") > 0))
    m = pipe.metrics
    assert sample(m, "lamina_job_retries_total", kind=kind) == 1
    assert sample(m, "lamina_job_retries_total", kind="conversion") == 0
    [failed] = [e for e in logs if e["event"] == "pipeline.retrying"]
    assert failed["kind"] == kind
    assert f"fail point {point}" in failed["error"]
    if kind == "gc":
        assert sample(m, "lamina_jobs_total", kind="gc", outcome="failure") == 1
    _check(tmp_path, oracle)


def test_corruption_quarantines_the_relation(tmp_path: Path) -> None:
    backlog(tmp_path, rounds=6)
    seg = finished_segments(DataDir(tmp_path).wal_dir("orders"))[1]
    corrupt_payload(seg.path)
    pipe = pipeline(tmp_path)
    with capture_logs() as logs:
        asyncio.run(_quarantined(pipe))
    assert pipe.quarantined is not None
    assert str(seg.path) in pipe.quarantined
    reason = DataDir(tmp_path).quarantine_reason("orders")
    assert reason is not None
    assert str(seg.path) in reason
    assert sample(pipe.metrics, "lamina_relation_quarantined", relation="orders") == 1
    assert sample(pipe.metrics, "lamina_job_retries_total", kind="conversion") == 0
    [event] = [e for e in logs if e["event"] == "relation.quarantined"]
    assert event["log_level"] == "error"
    assert pipe.trace is not None
    assert pipe.trace.state.version == 0


async def _quarantined(pipe: RelationPipeline) -> None:
    """Run until the pipeline ends by itself (it must: quarantine ends it)."""
    await asyncio.wait_for(pipe.run(asyncio.Event()), 20)


class RacingExecutor(InProcessExecutor):
    """The in-process executor, except that while its first conversion runs another step
    commits a conversion of the first segment through the same trace: the plan the
    pipeline made is stale by the time it commits."""

    raced = False

    async def convert(self, relation: str, trace: Trace, plan: ConversionPlan, *,
                      waiting_since: float | None = None) -> ConversionResult:
        if not self.raced:
            self.raced = True
            await asyncio.to_thread(reference.convert, trace,
                                    plan_conversion(trace.state, plan.segments[:1]))
        return await super().convert(relation, trace, plan)


def test_a_stale_plan_is_planned_again_not_quarantined(tmp_path: Path) -> None:
    oracle = backlog(tmp_path, rounds=8)
    pipe = pipeline(tmp_path, executor=RacingExecutor(1))
    with capture_logs() as logs:
        asyncio.run(_run_until(pipe, _caught_up(pipe)))
    assert pipe.quarantined is None
    assert pipe.stopped is None
    assert DataDir(tmp_path).quarantine_reason("orders") is None
    [stale] = [e for e in logs if e["event"] == "conversion.replanned"]
    assert "plan again" in stale["error"]
    assert sample(pipe.metrics, "lamina_job_retries_total", kind="conversion") == 1
    _check(tmp_path, oracle)


def test_a_cancelled_job_ends_the_pipeline_when_stopping(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stop set and the running job cancelled (what shutdown does): the pipeline ends at
    once, counts the job as cancelled, commits nothing and does not retry."""
    backlog(tmp_path, rounds=4)
    monkeypatch.setattr(failpoints, "ACTIVE", failpoints.parse("fs.before_rename=sleep:2"))
    ex = InProcessExecutor(1)
    pipe = pipeline(tmp_path, executor=ex)

    async def run() -> float:
        stop = asyncio.Event()
        task = asyncio.create_task(pipe.run(stop))
        await until("the job", lambda: bool(ex.running()))
        stop.set()
        started = time.monotonic()
        assert ex.cancel_all() == 1
        await asyncio.wait_for(task, 5)
        return time.monotonic() - started

    assert asyncio.run(run()) < 1.5  # the job sleeps 2 s
    m = pipe.metrics
    assert sample(m, "lamina_jobs_total", kind="conversion", outcome="cancelled") == 1
    assert sample(m, "lamina_jobs_total", kind="conversion", outcome="success") == 0
    assert sample(m, "lamina_job_retries_total", kind="conversion") == 0
    assert pipe.trace is not None
    assert pipe.trace.state.version == 0


def test_a_dropped_relation_stops_its_pipeline(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The WAL directory vanishes while a job runs and the job is cancelled: the pipeline
    notices the drop and ends for good (no retry)."""
    backlog(tmp_path, rounds=4)
    monkeypatch.setattr(failpoints, "ACTIVE", failpoints.parse("fs.before_rename=sleep:2"))
    ex = InProcessExecutor(1)
    pipe = pipeline(tmp_path, executor=ex, metrics=Metrics())
    trace_dir = DataDir(tmp_path).trace_dir("orders")

    async def run() -> None:
        task = asyncio.create_task(pipe.run(asyncio.Event()))
        await until("the job", lambda: bool(ex.running()) and writing(trace_dir))
        shutil.rmtree(pipe.wal_dir)
        assert ex.cancel_relation("orders") == 1
        await asyncio.wait_for(task, 5)

    asyncio.run(run())
    assert pipe.stopped == "relation dropped"
    assert sample(pipe.metrics, "lamina_job_retries_total", kind="conversion") == 0


def test_a_relation_dropped_before_its_recovery_ends_its_pipeline(tmp_path: Path) -> None:
    """The daemon read a new relation's metadata, then the relation was dropped before its
    pipeline recovered (a relation created and dropped within one poll, as CI saw): the
    recovery finds its WAL directory gone and the pipeline ends as dropped, with no error
    (before, the FileNotFoundError ended the task and failed the daemon's next poll)."""
    backlog(tmp_path, rounds=4)
    pipe = pipeline(tmp_path)
    shutil.rmtree(pipe.wal_dir)

    async def run() -> list[dict[str, Any]]:
        with capture_logs() as logs:
            await asyncio.wait_for(pipe.run(asyncio.Event()), 10)
        return logs

    logs = asyncio.run(run())
    assert pipe.stopped == "relation dropped"
    assert [e["event"] for e in logs if e["log_level"] in ("warning", "error")] == []
    assert "relation.dropped" in [e["event"] for e in logs]


@pytest.mark.parametrize("when", ["recovery", "pass"])
def test_a_relation_dropped_while_its_segments_are_deleted_ends_its_pipeline(
        tmp_path: Path, when: str) -> None:
    """The relation is dropped between the unlinks of its converted segments and the sync
    of its WAL directory (in recovery, or after a pass's conversion): the sync fails with
    ENOENT, which the storage layer raises as a PathNotFoundError (a FileNotFoundError).
    The pipeline ends as dropped with no warning or error (before, the error was a plain
    StorageError and the pipeline logged ``pipeline.retrying`` at error level, as a CI run
    of the packs test saw)."""
    from lamina.testing.faults import InjectingFileSystem, Op

    class DropAtWalSync(InjectingFileSystem):
        """Drops the relation when the WAL directory is synced after an unlink in it."""

        def __init__(self, wal_dir: Path) -> None:
            super().__init__()
            self.wal_dir, self.unlinked, self.dropped = wal_dir, False, False

        def before(self, op: Op) -> None:
            if op.kind == "unlink" and op.path.parent == self.wal_dir:
                self.unlinked = True
            elif (op.kind == "fsync_dir" and op.path == self.wal_dir and self.unlinked
                  and not self.dropped):
                self.dropped = True
                with Store.open(tmp_path) as store:
                    store.drop_relation("orders")

    backlog(tmp_path, rounds=6)
    pipe = pipeline(tmp_path)
    if when == "recovery":  # converted, segments not deleted: recovery deletes them
        trace = Trace.open(DataDir(tmp_path).trace_store("orders"), pipe.meta)
        assert convert(trace, pipe.wal_dir, limit=2) == 2
    fs = DropAtWalSync(pipe.wal_dir)
    pipe.fs = fs

    async def run() -> list[dict[str, Any]]:
        with capture_logs() as logs:
            await asyncio.wait_for(pipe.run(asyncio.Event()), 20)
        return logs

    logs = asyncio.run(run())
    assert fs.dropped
    assert pipe.stopped == "relation dropped"
    assert (pipe.trace is None) == (when == "recovery")
    assert [e["event"] for e in logs if e["log_level"] in ("warning", "error")] == []
    assert "relation.dropped" in [e["event"] for e in logs]


def test_a_failed_recovery_is_retried(tmp_path: Path) -> None:
    """Recovery deletes the segments the trace already converted; a disk error there (EIO
    on the first unlink) is logged and the recovery retried after a backoff, like a failed
    pass, and the pipeline then catches up (before, the error ended the pipeline's task)."""
    from lamina.testing.faults import FailingFileSystem

    oracle = backlog(tmp_path, rounds=8)
    layout = DataDir(tmp_path)
    pipe = pipeline(tmp_path)
    trace = Trace.open(layout.trace_store("orders"), pipe.meta)
    assert convert(trace, pipe.wal_dir, limit=2) == 2  # converted, segments not deleted
    fs = FailingFileSystem({"unlink": 1})
    pipe.fs = fs
    with capture_logs() as logs:
        asyncio.run(_run_until(pipe, _caught_up(pipe)))
    assert [op.kind for op in fs.failures] == ["unlink"]
    assert [(e["event"], e["kind"]) for e in logs if e["log_level"] == "error"] == [
        ("pipeline.retrying", "recovery")]
    assert sample(pipe.metrics, "lamina_job_retries_total", kind="conversion") == 0
    assert pipe.trace is not None
    assert pipe.stopped is None
    assert snapshot(tmp_path, "orders", oracle.upper - 1) == oracle.snapshot(oracle.upper - 1)


def test_a_relation_dropped_and_created_again_keeps_the_new_ones_segments(
        tmp_path: Path) -> None:
    """The relation is dropped and created again under its name (what `lamina ingest
    --resync` does when a table's columns changed) while the old relation's pipeline still
    runs. That pipeline must not take the new relation's segments for its own: converted
    into the old trace (which readers of the new relation skip: another relation_id) and
    then deleted as converted, they would be lost. It ends as dropped, having deleted
    nothing of the new relation, which reads back whole."""
    backlog(tmp_path, rounds=4)
    pipe = pipeline(tmp_path)
    asyncio.run(_run_until(pipe, _caught_up(pipe)))
    assert pipe.trace is not None
    old_id, converted = pipe.meta.relation_id, pipe.trace.state.converted_through
    with Store.open(tmp_path) as store:
        store.drop_relation("orders")
    oracle = backlog(tmp_path, rounds=12)  # the new relation: more segments than converted
    new = finished_segments(pipe.wal_dir)
    assert new[-1].seq > converted
    with Store.open(tmp_path) as store:
        assert store.relation("orders").meta.relation_id != old_id

    def done() -> bool:
        assert pipe.trace is not None
        return pipe.stopped is not None or pipe.trace.state.converted_through >= new[-1].seq

    asyncio.run(_run_until(pipe, done))
    assert pipe.stopped == "relation dropped"
    assert [s.seq for s in finished_segments(pipe.wal_dir)] == [s.seq for s in new]
    as_of = oracle.upper - 1
    assert snapshot(tmp_path, "orders", as_of) == oracle.snapshot(as_of)
