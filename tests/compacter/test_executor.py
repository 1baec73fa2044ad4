"""The executor seam: the in-process executor (the pyarrow reference in daemon threads),
the error record both executors share, and cancelling jobs by relation."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from lamina import failpoints
from lamina.compacter.executors import reference
from lamina.compacter.executors.inprocess import InProcessExecutor
from lamina.compacter.step.failures import TaskError, task_error, translate
from lamina.datadir import DataDir
from lamina.errors import (
    CorruptionError,
    DiffOverflowError,
    JobCancelledError,
    JobError,
    StalePlanError,
    StateConflictError,
    StorageError,
)
from lamina.store import Store
from lamina.trace.plan import plan_conversion, plan_merge
from lamina.trace.trace import Trace
from tests.compacter.backlog import (
    backlog,
    corrupt_payload,
    snapshot,
    spans,
    until,
    writing,
)


def _open(root: Path, name: str = "orders") -> tuple[Trace, Path]:
    layout = DataDir(root)
    with Store.open(root) as store:
        meta = store.relation(name).meta
    return Trace.open(layout.trace_store(name), meta), layout.wal_dir(name)


def test_convert_and_merge_commit_what_the_wal_holds(tmp_path: Path) -> None:
    oracle = backlog(tmp_path, rounds=10)
    trace, wal = _open(tmp_path)
    todo = spans(trace, wal)
    assert len(todo) >= 4
    ex = InProcessExecutor(2)

    async def run() -> None:
        half = len(todo) // 2
        for chunk in (todo[:half], todo[half:]):
            plan = plan_conversion(trace.state, chunk)
            result = await ex.convert("orders", trace, plan)
            assert result.parts
            trace.commit_conversion(plan, result.parts, result.pending)
        merge = plan_merge(trace.state)
        assert merge is not None
        trace.commit_merge(merge, await ex.merge("orders", trace, merge))
        assert ex.running() == {}

    asyncio.run(run())
    assert len(trace.state.batches) == 1
    trace.delete_converted_segments(wal)
    for as_of in oracle.as_of_points():
        assert snapshot(tmp_path, "orders", as_of) == oracle.snapshot(as_of)


def test_input_rows_count_every_update_read(tmp_path: Path) -> None:
    """A conversion reads its segments' updates, plus the pending rows it brings in."""
    oracle = backlog(tmp_path, rounds=6)
    trace, wal = _open(tmp_path)
    plan = plan_conversion(trace.state, spans(trace, wal))
    result = asyncio.run(InProcessExecutor(1).convert("orders", trace, plan))
    assert result.input_rows == len(oracle.updates)
    assert sum(p.part.rows for p in result.pending) == 6  # one future row per round


def test_errors_are_those_a_spark_task_would_raise(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Corruption keeps its path and offset; a storage error becomes a retryable JobError
    naming the step and the error class."""
    backlog(tmp_path, rounds=4)
    trace, wal = _open(tmp_path)
    todo = spans(trace, wal)
    ex = InProcessExecutor(1)

    monkeypatch.setattr(failpoints, "ACTIVE", failpoints.parse("fs.before_rename=error"))
    plan = plan_conversion(trace.state, todo)
    with pytest.raises(JobError) as err:
        asyncio.run(ex.convert("orders", trace, plan))
    assert not isinstance(err.value, JobCancelledError)
    assert "conversion of 'orders'" in str(err.value)
    assert "StorageError: " in str(err.value)
    assert "fail point fs.before_rename" in str(err.value)
    assert isinstance(err.value.__cause__, StorageError)
    monkeypatch.setattr(failpoints, "ACTIVE", {})

    corrupt_payload(Path(todo[0].path))
    with pytest.raises(CorruptionError) as bad:
        asyncio.run(ex.convert("orders", trace, plan_conversion(trace.state, todo)))
    assert bad.value.path == Path(todo[0].path)
    assert bad.value.offset is not None
    assert trace.state.version == 0  # nothing committed


def test_cancel_relation_returns_at_once_and_spares_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job whose thread sleeps (in the process's first file rename) is cancelled by
    relation: its awaiter raises JobCancelledError at once; the other relation's job, which
    never sleeps, completes."""
    backlog(tmp_path, "a", rounds=4)
    backlog(tmp_path, "b", rounds=4)
    ta, wa = _open(tmp_path, "a")
    tb, wb = _open(tmp_path, "b")
    # Only the process's first rename sleeps (a's), long enough that b's whole conversion
    # fits in it on a busy machine (CI once took more than 3 s for it, and a finished first).
    monkeypatch.setattr(failpoints, "ACTIVE", failpoints.parse("fs.before_rename=sleep:30@1"))
    ex = InProcessExecutor(2)

    async def run() -> tuple[BaseException | None, float]:
        slow = asyncio.create_task(ex.convert("a", ta, plan_conversion(ta.state,
                                                                       spans(ta, wa))))
        await until("a's job to sleep in its first rename",
                    lambda: ex.running().get("a") == 1 and writing(ta.store.root)
                    and failpoints.ACTIVE["fs.before_rename"].hits == 1)
        other = await ex.convert("b", tb, plan_conversion(tb.state, spans(tb, wb)))
        assert other.parts
        started = time.monotonic()
        assert ex.cancel_relation("b") == 0
        assert ex.cancel_relation("a") == 1
        try:
            await slow
        except JobCancelledError as exc:
            return exc, time.monotonic() - started
        return None, 0.0

    exc, waited = asyncio.run(run())
    assert isinstance(exc, JobCancelledError)
    assert "'a'" in str(exc)
    assert waited < 1.5  # a's job sleeps 30 s
    assert ex.running() == {}


def test_jobs_run_at_most_max_concurrent_at_once() -> None:
    ex = InProcessExecutor(2)
    mu = threading.Lock()
    now = peak = 0

    def work() -> int:
        nonlocal now, peak
        with mu:
            now += 1
            peak = max(peak, now)
        time.sleep(0.1)
        with mu:
            now -= 1
        return 1

    async def run() -> list[int]:
        return await asyncio.gather(*(ex._run(f"r{i}", "test", work) for i in range(6)))

    assert asyncio.run(run()) == [1] * 6
    assert peak == 2


def test_cancelling_the_awaiting_task_forgets_the_job(tmp_path: Path) -> None:
    """The job is forgotten at once, but its slot is given back only when its thread has
    ended: a thread that cannot be interrupted still uses memory and a core, and must count
    against max_concurrent_jobs."""
    ex = InProcessExecutor(1)
    gate = threading.Event()

    async def run() -> None:
        task = asyncio.create_task(ex._run("r", "test", gate.wait))
        while not ex.running():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ex.running() == {}
        second = asyncio.create_task(ex._run("r", "test", lambda: 7))
        await asyncio.sleep(0.3)
        assert not second.done()  # the cancelled job's thread still holds the slot
        gate.set()  # the thread ends: the slot is given back
        assert await asyncio.wait_for(second, 10) == 7

    try:
        asyncio.run(run())
    finally:
        gate.set()


# --- the error record ---------------------------------------------------------------------------

def test_task_error_record_round_trips_without_touching_the_message() -> None:
    """A message that itself ends like a location survives: the record carries the reason
    and the location as fields, nothing is cut off a string."""
    exc = CorruptionError("checksum mismatch [seen before]", path="/d/wal/r/0001 [x].seg",
                          offset=4096)
    record = TaskError.decode(TaskError.of(exc).encode())
    assert record == TaskError("CorruptionError", "checksum mismatch [seen before]",
                               "/d/wal/r/0001 [x].seg", 4096)
    back = record.rebuild("conversion of 'r' to 5")
    assert isinstance(back, CorruptionError)
    assert str(back) == str(exc)
    assert (back.path, back.offset, back.reason) == (exc.path, 4096, exc.reason)

    # Steps store an out-of-range sum as a carry and never raise this; if one did, it is
    # a failed step to retry, not a reason to quarantine.
    overflow = task_error(DiffOverflowError("diff sum of row (1) leaves int64"), "merge")
    assert type(overflow) is JobError
    assert "DiffOverflowError: diff sum of row (1) leaves int64" in str(overflow)
    other = task_error(StorageError(28, "No space left on device"), "merge of 'r' [0, 4)")
    assert type(other) is JobError
    assert str(other).startswith("merge of 'r' [0, 4) failed: StorageError: ")


def test_translate_rebuilds_the_error_a_task_raised() -> None:
    """What Spark hands the driver is text (a Py4J error quoting the task's traceback):
    the record inside it is found and the lamina error rebuilt."""
    from lamina.compacter.step.failures import encode_failure

    carried = encode_failure(CorruptionError("bad frame", path="/x/seg", offset=17))
    text = f"py4j.protocol.Py4JJavaError: ... Traceback ...\n{carried}\n\tat org.apache..."
    back = translate(RuntimeError(text), "conversion of 'r' to 9")
    assert isinstance(back, CorruptionError)
    assert str(back) == "bad frame [/x/seg at byte 17]"
    plain = translate(RuntimeError("Connection refused"), "conversion of 'r' to 9")
    assert type(plain) is JobError
    assert "Connection refused" in str(plain)


def test_a_record_of_another_format_is_refused() -> None:
    import base64
    import json

    blob = base64.b64encode(json.dumps({"format": 99, "type": "X", "message": "m"}).encode())
    with pytest.raises(JobError, match="format 99"):
        TaskError.decode(blob.decode())


# --- stale plans ---------------------------------------------------------------------------------

def test_a_stale_plan_is_a_state_conflict_not_corruption(tmp_path: Path) -> None:
    """Two plans from one state: committing the second after the first raises
    StalePlanError (nothing is corrupt, nothing is written), for conversions and merges."""
    backlog(tmp_path, rounds=8)
    trace, wal = _open(tmp_path)
    todo = spans(trace, wal)
    first = plan_conversion(trace.state, todo[:1])
    second = plan_conversion(trace.state, todo[:2])
    reference.convert(trace, first)
    written = reference.run_conversion(trace, second)
    version = trace.state.version
    with pytest.raises(StalePlanError) as err:
        trace.commit_conversion(second, *written)
    assert isinstance(err.value, StateConflictError)
    assert not isinstance(err.value, CorruptionError)
    assert "plan again" in str(err.value)
    assert trace.state.version == version

    reference.convert(trace, plan_conversion(trace.state, spans(trace, wal)[:1]))
    merge = plan_merge(trace.state)
    assert merge is not None
    parts = reference.run_merge(trace, merge)
    reference.merge(trace, plan_merge(trace.state))  # type: ignore[arg-type]
    with pytest.raises(StalePlanError, match="no longer has"):
        trace.commit_merge(merge, parts)
