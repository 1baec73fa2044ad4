"""Packs on real Spark: the small steps of many relations as the tasks of one Spark job
(lamina.compacter.executors.spark, lamina.compacter.step.pack).

- many relations' conversions and merges in one job write what the reference executor
  writes, row for row;
- a corrupt segment in one step of a pack fails that relation only (the daemon quarantines
  it) and the others commit;
- a pack whose Spark job fails (its Python worker SIGKILLed, through the fault-injecting
  file system a task receives) is retried, each relation alone, and nothing is doubled;
- dropping a relation cancels its part of a running pack at once while the pack goes on for
  the others, and cancels the Spark job itself once none of its steps is wanted; a large
  step runs alone under its own tag and is cancelled through it.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from lamina.compacter.daemon import Daemon
from lamina.compacter.executors import ConversionResult, reference
from lamina.compacter.executors.spark import SparkExecutor
from lamina.compacter.metrics import Metrics
from lamina.compacter.spark import relation_tag
from lamina.compacter.step.work import JobTuning
from lamina.datadir import DataDir
from lamina.drill.procs import free_port
from lamina.errors import CorruptionError, JobCancelledError, JobError
from lamina.fs import FileSystem
from lamina.store import Store
from lamina.testing.faults import DelayingFileSystem, KillOnceFileSystem
from lamina.trace.invariants import check_data
from lamina.trace.plan import ConversionPlan, plan_conversion, plan_merge
from lamina.trace.trace import Trace
from tests.compacter.backlog import (
    backlog,
    backlogs,
    corrupt_payload,
    sample,
    settings,
    spans,
    until,
)
from tests.compacter.workload import assert_same_conversion, assert_same_tables, batch_table
from tests.trace.helpers import Oracle

pytestmark = [pytest.mark.spark]


def _fill(root: Path, names: list[str], rounds: int = 3) -> dict[str, Oracle]:
    return {n: backlog(root, n, rounds=rounds) for n in names}


def _fill_once(root: Path, names: list[str]) -> Path:
    """``_fill(root, names)``, kept as a pristine copy the reference can run on."""
    _fill(root, names)
    return root


def _trace(root: Path, name: str, fs: FileSystem | None = None) -> Trace:
    layout = DataDir(root)
    return Trace.open(layout.trace_store(name, fs), layout.read_meta(name), fs)


def _plans(root: Path, traces: dict[str, Trace]) -> dict[str, ConversionPlan]:
    return {n: plan_conversion(t.state, spans(t, DataDir(root).wal_dir(n)))
            for n, t in traces.items()}


def _check(root: Path, oracles: dict[str, Oracle]) -> None:
    with Store.open(root) as store:
        for name, oracle in oracles.items():
            rel = store.relation(name)
            for as_of in oracle.as_of_points():
                assert rel.snapshot(as_of).to_pylist() == oracle.snapshot(as_of), name


def test_many_relations_convert_and_merge_in_one_job_as_the_reference_does(
        tmp_path: Path, spark: Any) -> None:
    names = [f"r{i}" for i in range(12)]
    oracles = _fill(tmp_path / "d", names)
    shutil.copytree(tmp_path / "d", tmp_path / "ref")
    metrics = Metrics()
    ex = SparkExecutor(spark, 1, metrics=metrics)
    traces = {n: _trace(tmp_path / "d", n) for n in names}
    refs = {n: _trace(tmp_path / "ref", n) for n in names}

    async def run() -> None:
        for _ in range(2):  # two conversions each: then every relation has a merge due
            plans = _plans(tmp_path / "d", traces)
            # every relation's segments converted in halves, so the second round has some
            todo = {n: plan_conversion(traces[n].state, p.segments[:max(1, len(p.segments) // 2)])
                    for n, p in plans.items()}
            got = await asyncio.gather(*(ex.convert(n, traces[n], todo[n]) for n in names))
            for n, result in zip(names, got, strict=True):
                want = reference.run_conversion(refs[n], todo[n])
                assert_same_conversion(traces[n], result, refs[n], want, plan=todo[n])
                traces[n].commit_conversion(todo[n], result.parts, result.pending)
                refs[n].commit_conversion(todo[n], *want)
        merges = {n: plan_merge(traces[n].state) for n in names}
        assert all(m is not None for m in merges.values())
        merged = await asyncio.gather(*(ex.merge(n, traces[n], merges[n])  # type: ignore[arg-type]
                                        for n in names))
        for n, parts in zip(names, merged, strict=True):
            plan = merges[n]
            assert plan is not None
            want_parts = reference.run_merge(refs[n], plan)
            assert_same_tables(batch_table(traces[n], parts), batch_table(refs[n], want_parts),
                               f"merge of {n}")
            traces[n].commit_merge(plan, parts)

    asyncio.run(run())
    # three rounds of 12 steps: three Spark jobs, not 36
    assert sample(metrics, "lamina_spark_jobs_total", shape="pack") == 3
    assert sample(metrics, "lamina_spark_jobs_total", shape="step") == 0
    assert sample(metrics, "lamina_pack_steps_sum") == 36
    for n in names:
        traces[n].delete_converted_segments(DataDir(tmp_path / "d").wal_dir(n))
        check_data(traces[n].store, traces[n].state, traces[n].meta)
    partial = {n: o for n, o in oracles.items()}
    # the second halves are still in the WAL: reads take them from there
    _check(tmp_path / "d", partial)


def test_one_corrupt_step_fails_only_its_relation(tmp_path: Path, spark: Any) -> None:
    """In the executor: the corrupt relation's awaiter gets CorruptionError naming its file,
    the others their output, from one Spark job. In the daemon: that relation is
    quarantined (and /readyz says so), the others commit."""
    names = [f"r{i}" for i in range(6)]
    oracles = _fill(tmp_path, names)
    bad = Path(spans(_trace(tmp_path, "r2"), DataDir(tmp_path).wal_dir("r2"))[0].path)
    corrupt_payload(bad)
    metrics = Metrics()
    ex = SparkExecutor(spark, 1, metrics=metrics)
    traces = {n: _trace(tmp_path, n) for n in names}
    plans = _plans(tmp_path, traces)

    async def direct() -> list[ConversionResult | BaseException]:
        return await asyncio.gather(*(ex.convert(n, traces[n], plans[n]) for n in names),
                                    return_exceptions=True)

    results = asyncio.run(direct())
    assert sample(metrics, "lamina_spark_jobs_total", shape="pack") == 1
    for n, r in zip(names, results, strict=True):
        if n == "r2":
            assert isinstance(r, CorruptionError)
            assert r.path == bad
            assert r.offset is not None
        else:
            assert isinstance(r, ConversionResult), (n, r)
            assert r.parts, n
    for t in traces.values():
        assert t.state.version == 0  # the executor commits nothing

    daemon = Daemon(settings(tmp_path, executor="spark", http=f"127.0.0.1:{free_port()}"),
                    executor=SparkExecutor(spark, 1))

    async def run() -> None:
        task = asyncio.create_task(daemon.run())
        try:
            await until("the healthy relations to catch up and r2 to be quarantined",
                        lambda: daemon.recovered and all(
                            (p.quarantined is not None) == (n == "r2")
                            and (n == "r2" or (p.backlog_bytes == 0 and p.trace is not None
                                 and p.trace.state.version > 0))
                            for n, p in daemon.pipelines.items()), 120)
            ok, why = daemon.readiness()
            assert not ok
            assert "r2" in why
        finally:
            daemon.stop.set()
            assert await asyncio.wait_for(task, 60) == 0

    asyncio.run(run())
    assert (DataDir(tmp_path).wal_dir("r2") / "QUARANTINED").exists()
    _check(tmp_path, {n: o for n, o in oracles.items() if n != "r2"})


def test_a_pack_whose_job_fails_is_retried_alone_and_nothing_doubles(tmp_path: Path,
                                                                     spark: Any) -> None:
    """r1's task kills its Python worker once (at its first part's rename): the Spark job
    of the whole pack fails. In the executor (five steps submitted together, so one pack):
    every step of it fails with JobError, and submitted again each runs in a pack of its
    own, r1's too, and writes what the reference writes. In the daemon: the pipelines retry
    what the failed pack held, and every relation reads back its oracle, each update
    once."""
    names = [f"r{i}" for i in range(5)]
    shutil.copytree(_fill_once(tmp_path / "base", names), tmp_path / "e")
    metrics = Metrics()
    ex = SparkExecutor(spark, 1, metrics=metrics)
    fs = KillOnceFileSystem(tmp_path / "killed-e", path_contains="/trace/r1/batches/")
    traces = {n: _trace(tmp_path / "e", n, fs) for n in names}
    plans = _plans(tmp_path / "e", traces)

    async def twice() -> tuple[list[BaseException | ConversionResult], list[ConversionResult]]:
        first = await asyncio.gather(*(ex.convert(n, traces[n], plans[n]) for n in names),
                                     return_exceptions=True)
        again = await asyncio.gather(*(ex.convert(n, traces[n], plans[n]) for n in names))
        return first, again

    first, again = asyncio.run(twice())
    assert all(isinstance(r, JobError) for r in first), first
    assert sample(metrics, "lamina_spark_jobs_total", shape="pack") == 6
    assert sample(metrics, "lamina_pack_steps_sum") == 10  # the failed pack, then five alone
    for n, result in zip(names, again, strict=True):
        ref = _trace(tmp_path / "base", n)
        assert_same_conversion(traces[n], result, ref, reference.run_conversion(ref, plans[n]),
                               plan=plans[n])

    oracles = _fill(tmp_path / "d", names)
    fs = KillOnceFileSystem(tmp_path / "killed", path_contains="/trace/r1/batches/")
    daemon = Daemon(settings(tmp_path / "d", executor="spark",
                             http=f"127.0.0.1:{free_port()}"),
                    fs=fs, executor=SparkExecutor(spark, 1))

    async def run() -> list[dict[str, Any]]:
        with capture_logs() as logs:
            task = asyncio.create_task(daemon.run())
            try:
                await until("every relation to catch up", lambda: daemon.recovered and all(
                    p.trace is not None and p.trace.state.version > 0 and p.backlog_bytes == 0
                    for p in daemon.pipelines.values()) and len(daemon.pipelines) == 5, 180)
            finally:
                daemon.stop.set()
                assert await asyncio.wait_for(task, 60) == 0
        return logs

    logs = asyncio.run(run())
    assert (tmp_path / "killed").exists(), "the worker was never killed"
    failed = [e for e in logs if e["event"] == "pack.failed"]
    assert len(failed) == 1, failed
    in_failed = failed[0]["relations"]  # r1, and whoever shared its pack
    assert sample(daemon.metrics, "lamina_job_retries_total", kind="conversion") == in_failed
    assert not [e for e in logs if e.get("log_level") == "error"]
    for n in names:
        t = _trace(tmp_path / "d", n)
        check_data(t.store, t.state, t.meta)
    _check(tmp_path / "d", oracles)


def test_dropping_a_relation_cancels_its_part_of_a_pack(tmp_path: Path, spark: Any) -> None:
    """a, b and c run in one pack; a's task is slow. Cancelling a fails a's awaiter at once;
    b and c get their output when the pack ends (the job is not cancelled). A pack whose
    every step is cancelled has its Spark job cancelled."""
    _fill(tmp_path, ["a", "b", "c", "d"])
    fs = DelayingFileSystem(3.0, path_contains="/trace/a/batches/")
    traces = {n: _trace(tmp_path, n, fs) for n in "abc"}
    slow_d = DelayingFileSystem(60.0, path_contains="/trace/d/batches/")
    traces["d"] = _trace(tmp_path, "d", slow_d)
    plans = _plans(tmp_path, traces)
    ex = SparkExecutor(spark, 2)
    tracker = spark.sparkContext.statusTracker()

    async def run() -> None:
        tasks = {n: asyncio.create_task(ex.convert(n, traces[n], plans[n])) for n in "abc"}
        await until("the pack to run", lambda: set(ex.running()) == set("abc"), 30)
        [tag] = {t for tags in ex.running().values() for t in tags}
        assert tag.startswith("lamina-pack-")
        await asyncio.sleep(0.5)
        started = time.monotonic()
        assert ex.cancel_relation("a") == 1
        with pytest.raises(JobCancelledError, match="'a'"):
            await tasks["a"]
        assert time.monotonic() - started < 1.0
        b, c = await asyncio.wait_for(asyncio.gather(tasks["b"], tasks["c"]), 60)
        assert b.parts
        assert c.parts
        traces["b"].commit_conversion(plans["b"], b.parts, b.pending)
        assert ex.running() == {}

        # a pack of d alone, sleeping a minute: cancelling d cancels the Spark job
        alone = asyncio.create_task(ex.convert("d", traces["d"], plans["d"]))
        await until("d's pack to run", lambda: "d" in ex.running()
                    and len(tracker.getActiveJobsIds()) == 1, 30)
        await asyncio.sleep(1.0)  # its task is in the slow rename
        cancelled = time.monotonic()
        assert ex.cancel_relation("d") == 1
        with pytest.raises(JobCancelledError):
            await alone
        await until("d's Spark job to end", lambda: not tracker.getActiveJobsIds()
                    and not ex.running(), 30)
        assert time.monotonic() - cancelled < 20

    asyncio.run(run())
    assert traces["a"].state.version == 0


def test_a_large_step_runs_alone_and_is_cancelled_by_its_tag(tmp_path: Path,
                                                             spark: Any) -> None:
    """With every step large (single_task_bytes 0), a's and b's conversions are two jobs
    each, under their relation's tag; cancelling a cancels a's Spark job within seconds
    (its task sleeps a minute) while b's goes on."""
    _fill(tmp_path, ["a", "b"])
    fs = DelayingFileSystem(60.0, path_contains="/batches/", kinds=("rename",))
    traces = {n: _trace(tmp_path, n, fs) for n in "ab"}
    plans = _plans(tmp_path, traces)
    ex = SparkExecutor(spark, 3, tuning=JobTuning(single_task_bytes=0))
    tracker = spark.sparkContext.statusTracker()

    async def run() -> None:
        tasks = {n: asyncio.create_task(ex.convert(n, traces[n], plans[n])) for n in "ab"}
        await until("both write jobs", lambda: set(ex.running()) == {"a", "b"}
                    and len(tracker.getActiveJobsIds()) == 2, 60)
        [tag] = ex.running()["a"]
        assert tag.startswith(relation_tag("a") + "-")
        await asyncio.sleep(1.0)
        cancelled = time.monotonic()
        assert ex.cancel_relation("a") == 1
        with pytest.raises(JobCancelledError):
            await tasks["a"]
        await until("a's job to end", lambda: len(tracker.getActiveJobsIds()) == 1
                    and "a" not in ex.running(), 30)
        assert time.monotonic() - cancelled < 15
        assert ex.cancel_all() == 1
        with pytest.raises(JobCancelledError):
            await tasks["b"]
        await until("b's job to end", lambda: not tracker.getActiveJobsIds(), 30)

    asyncio.run(run())


@pytest.mark.slow
def test_relations_come_and_go_while_it_runs(tmp_path: Path, spark: Any) -> None:
    """A running daemon (packs on Spark) with no relation at first: 120 relations are
    created and written while it runs, twelve at a time (so that a poll finds several
    ready together, however fast the jobs are), and picked up at its next polls; 40 of them are
    dropped while their steps wait or run in packs. The other 80 catch up and read back
    their oracles; the dropped ones leave no pipeline, no trace and no error behind."""
    metrics = Metrics()
    daemon = Daemon(settings(tmp_path, executor="spark", http=f"127.0.0.1:{free_port()}"),
                    metrics=metrics, executor=SparkExecutor(spark, 2, metrics=metrics))
    names = [f"t{i:03d}" for i in range(120)]
    dropped = set(names[::3])
    oracles: dict[str, Oracle] = {}

    async def run() -> list[dict[str, Any]]:
        with capture_logs() as logs:
            task = asyncio.create_task(daemon.run())
            try:
                await until("the daemon", lambda: daemon.recovered, 60)
                for i in range(0, len(names), 12):
                    oracles.update(await asyncio.to_thread(backlogs, tmp_path,
                                                           names[i:i + 12], rounds=3))
                await until("packs to run", lambda: sample(
                    daemon.metrics, "lamina_spark_jobs_total", shape="pack") >= 2, 120)
                with Store.open(tmp_path) as store:
                    for n in sorted(dropped):
                        store.drop_relation(n)
                kept = [n for n in names if n not in dropped]
                await until("the kept relations to catch up and the dropped to go", lambda: (
                    set(daemon.pipelines) == set(kept) and all(
                        p.trace is not None and p.trace.state.upper == oracles[n].upper
                        for n, p in daemon.pipelines.items())
                    and not any((tmp_path / "trace" / n).exists() for n in dropped)), 300)
            finally:
                daemon.stop.set()
                assert await asyncio.wait_for(task, 60) == 0
        return logs

    logs = asyncio.run(run())
    assert not [e for e in logs if e["log_level"] == "error"]
    # a relation dropped before the daemon's poll found it (the last ones created, on a
    # busy machine) has nothing to forget; only dropped ones are forgotten, each once, and
    # every one it had taken up is among them: recovered, or found dropped by its recovery
    # (relation.dropped, no relation.recovered). One forgotten while its recovery still ran
    # logs neither.
    taken_up = {e["relation"] for e in logs
                if e["event"] in ("relation.recovered", "relation.dropped")}
    forgotten = [e["relation"] for e in logs if e["event"] == "relation.forgotten"]
    assert len(forgotten) == len(set(forgotten))
    assert set(forgotten) <= dropped
    assert dropped & taken_up <= set(forgotten)
    assert len(forgotten) >= len(dropped) // 2  # most were dropped under the running daemon
    assert max(e["steps"] for e in logs if e["event"] == "pack.finished") > 1
    _check(tmp_path, {n: o for n, o in oracles.items() if n not in dropped})
