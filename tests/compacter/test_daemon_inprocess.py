"""The daemon with the in-process executor (no JVM): discovery, quarantine beside a healthy
relation, a relation dropped while its job runs, and shutdown on real signals, in process
(``Daemon.run`` on this test's event loop, SIGTERM sent to this process) and as a real
``lamina serve`` subprocess (a second SIGTERM cancels the job still running)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from lamina import failpoints
from lamina.compacter.daemon import Daemon
from lamina.compacter.executors.inprocess import InProcessExecutor
from lamina.datadir import DataDir
from lamina.drill.procs import DaemonProcess, free_port
from lamina.store import Store
from lamina.trace.state import StateStore
from lamina.wal.reader import finished_segments
from tests.compacter.backlog import (
    backlog,
    corrupt_payload,
    sample,
    settings,
    snapshot,
    until,
    writing,
)
from tests.trace.helpers import KEY, SCHEMA


def _daemon(root: Path, **overrides: Any) -> Daemon:
    return Daemon(settings(root, http=f"127.0.0.1:{free_port()}", **overrides))


def _caught_up(root: Path, name: str) -> bool:
    layout = DataDir(root)
    states = StateStore(layout.trace_store(name))
    state = states.load_latest()
    if state is None:
        return False
    return not any(s.seq > state.converted_through
                   for s in finished_segments(layout.wal_dir(name)))


def _versions(root: Path, name: str) -> list[int]:
    states = StateStore(DataDir(root).trace_store(name))
    return states.versions()


def test_converts_beside_a_quarantined_relation_and_stops_on_sigterm(tmp_path: Path) -> None:
    """Two relations: one has a corrupt segment and is quarantined (readiness says so),
    the other is converted; SIGTERM ends the daemon with 0."""
    good = backlog(tmp_path, "good", rounds=8)
    backlog(tmp_path, "bad", rounds=6)
    corrupt_payload(finished_segments(DataDir(tmp_path).wal_dir("bad"))[0].path)
    daemon = _daemon(tmp_path)

    async def run() -> int:
        task = asyncio.create_task(daemon.run())
        await until("the good relation", lambda: _caught_up(tmp_path, "good"))
        await until("the quarantine", lambda: DataDir(tmp_path).quarantine_reason("bad")
                    is not None)
        ok, why = daemon.readiness()
        assert not ok
        assert why == "quarantined relations: bad"
        await until("the ready gauge (set at each scan)",
                    lambda: sample(daemon.metrics, "lamina_ready") == 0)
        os.kill(os.getpid(), signal.SIGTERM)
        return await asyncio.wait_for(task, 10)

    with capture_logs() as logs:
        assert asyncio.run(run()) == 0
    events = [e["event"] for e in logs]
    assert "daemon.starting" in events
    assert events[-1] == "daemon.stopped"
    assert "daemon.ready" in events
    assert "shutdown.requested" in events
    assert "shutdown.grace_expired" not in events
    assert sample(daemon.metrics, "lamina_relation_quarantined", relation="bad") == 1
    for as_of in good.as_of_points():
        assert snapshot(tmp_path, "good", as_of) == good.snapshot(as_of)


def test_the_running_daemon_takes_a_repaired_relation_back(tmp_path: Path) -> None:
    """The quarantine runbook without a restart: a damaged segment quarantines ``bad``;
    removing the marker while the file is still damaged quarantines it again (with what
    verify found); restoring the file and removing the marker again has the running daemon
    verify it, take it back (``relation.unquarantined``), convert its WAL and turn ready."""
    oracle = backlog(tmp_path, "bad", rounds=6)
    layout = DataDir(tmp_path)
    seg = finished_segments(layout.wal_dir("bad"))[0].path
    original = seg.read_bytes()
    corrupt_payload(seg)
    marker = layout.wal_dir("bad") / "QUARANTINED"
    daemon = _daemon(tmp_path)

    async def run() -> int:
        task = asyncio.create_task(daemon.run())
        # the marker is written first, the pipeline's state a moment later (the order
        # Pipeline.quarantine keeps): wait for both, as a loaded machine widens the gap
        await until("the quarantine", lambda: marker.exists() and daemon.readiness() == (
            False, "quarantined relations: bad"))
        marker.unlink()  # too early: the segment is still damaged
        await until("the quarantine again", lambda: marker.exists()
                    and daemon.pipelines["bad"].quarantined is not None)
        assert str(seg) in json.loads(marker.read_bytes())["reason"]
        seg.write_bytes(original)  # the runbook: restore the named file, remove the marker
        marker.unlink()
        await until("the relation to be taken back and converted",
                    lambda: _caught_up(tmp_path, "bad") and daemon.readiness()[0])
        assert daemon.pipelines["bad"].quarantined is None
        assert sample(daemon.metrics, "lamina_relation_quarantined", relation="bad") == 0
        os.kill(os.getpid(), signal.SIGTERM)
        return await asyncio.wait_for(task, 10)

    with capture_logs() as logs:
        assert asyncio.run(run()) == 0
    events = [e["event"] for e in logs]
    assert events.count("relation.quarantined") == 2
    assert events.count("relation.unquarantined") == 1
    assert events.index("relation.unquarantined") < events.index("conversion.committed")
    assert not marker.exists()
    for as_of in oracle.as_of_points():
        assert snapshot(tmp_path, "bad", as_of) == oracle.snapshot(as_of)


def test_dropping_a_relation_cancels_its_running_job(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The relation's conversion is in flight (its thread sleeps before publishing its
    first file) when the relation is dropped: the daemon cancels the job at its next scan,
    commits nothing, removes the trace, and the name can be used again."""
    backlog(tmp_path, rounds=6)
    # 12 s: on a busy machine (CI) the job once finished a 6 s sleep before the drop
    sleep = 12.0
    monkeypatch.setattr(failpoints, "ACTIVE",
                        failpoints.parse(f"fs.before_rename=sleep:{sleep}"))
    daemon = _daemon(tmp_path)
    trace_dir = DataDir(tmp_path).trace_dir("orders")
    woken = 0.0

    async def run() -> float:
        nonlocal woken
        task = asyncio.create_task(daemon.run())
        ex: Any = None

        def in_flight() -> bool:
            nonlocal ex
            ex = daemon.executor
            return (isinstance(ex, InProcessExecutor) and ex.running().get("orders") == 1
                    and writing(trace_dir) and failpoints.ACTIVE["fs.before_rename"].hits == 1)

        await until("the conversion to sleep in its first rename", in_flight)
        woken = time.monotonic() + sleep
        with Store.open(tmp_path) as store:
            store.drop_relation("orders")
        dropped = time.monotonic()
        await until("the relation to be forgotten", lambda: "orders" not in daemon.pipelines)
        forgotten = time.monotonic() - dropped
        assert ex.running() == {}
        await until("the trace to be removed", lambda: not trace_dir.exists())
        daemon.stop.set()
        assert await asyncio.wait_for(task, 10) == 0
        return forgotten

    with capture_logs() as logs:
        forgotten = asyncio.run(run())
    assert forgotten < 3.0, "the drop waited for the job instead of cancelling it"
    [gone] = [e for e in logs if e["event"] == "relation.forgotten"]
    assert gone["jobs_cancelled"] == 1
    assert not any(e["event"] == "conversion.committed" for e in logs)
    assert sample(daemon.metrics, "lamina_jobs_total", kind="conversion",
                  outcome="cancelled") == 1
    assert daemon.metrics.registry.get_sample_value(
        "lamina_wal_pending_bytes", {"relation": "orders"}) is None
    time.sleep(max(0.0, woken + 1 - time.monotonic()))  # the abandoned thread wakes and
    # fails; nothing of it becomes visible
    assert not trace_dir.exists() or _versions(tmp_path, "orders") == []


def test_in_flight_job_finishes_within_the_grace_period(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    oracle = backlog(tmp_path, rounds=4)
    monkeypatch.setattr(failpoints, "ACTIVE", failpoints.parse("fs.before_rename=sleep:0.5"))
    daemon = _daemon(tmp_path, shutdown_grace_seconds=10)

    async def run() -> int:
        task = asyncio.create_task(daemon.run())
        await until("the conversion to start", lambda: isinstance(
            daemon.executor, InProcessExecutor) and bool(daemon.executor.running()))
        os.kill(os.getpid(), signal.SIGTERM)
        return await asyncio.wait_for(task, 10)

    with capture_logs() as logs:
        assert asyncio.run(run()) == 0
    events = [e["event"] for e in logs]
    assert events.index("shutdown.requested") < events.index("conversion.committed")
    assert "shutdown.grace_expired" not in events
    assert _caught_up(tmp_path, "orders")
    for as_of in oracle.as_of_points():
        assert snapshot(tmp_path, "orders", as_of) == oracle.snapshot(as_of)


@pytest.mark.parametrize("second_signal", [False, True])
def test_grace_period_then_cancel_or_a_second_signal_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, second_signal: bool) -> None:
    """A job that outlasts the grace period is cancelled when it ends; a second SIGTERM
    cancels it at once (the grace period here is far longer than the test)."""
    backlog(tmp_path, rounds=4)
    monkeypatch.setattr(failpoints, "ACTIVE", failpoints.parse("fs.before_rename=sleep:5"))
    grace = 60.0 if second_signal else 0.5
    daemon = _daemon(tmp_path, shutdown_grace_seconds=grace)

    async def run() -> float:
        task = asyncio.create_task(daemon.run())
        await until("the conversion to start", lambda: isinstance(
            daemon.executor, InProcessExecutor) and bool(daemon.executor.running()))
        os.kill(os.getpid(), signal.SIGTERM)
        started = time.monotonic()
        if second_signal:
            await asyncio.sleep(0.3)
            assert not task.done()
            os.kill(os.getpid(), signal.SIGTERM)
        assert await asyncio.wait_for(task, 10) == 0
        return time.monotonic() - started

    with capture_logs() as logs:
        took = asyncio.run(run())
    events = [e["event"] for e in logs]
    assert took < 3.5  # the job sleeps 5 s
    assert ("shutdown.escalated" in events) is second_signal
    assert ("shutdown.grace_expired" in events) is not second_signal
    assert "conversion.committed" not in events
    assert "conversion.cancelled" in events
    assert not [e for e in logs if e["log_level"] == "error"]
    assert sample(daemon.metrics, "lamina_jobs_total", kind="conversion",
                  outcome="cancelled") == 1
    assert _versions(tmp_path, "orders") == []


@pytest.mark.slow
def test_second_sigterm_to_lamina_serve_cancels_and_exits(tmp_path: Path) -> None:
    """A real ``lamina serve`` (in-process executor) whose conversion sleeps for a minute:
    the first SIGTERM leaves it running (grace 60 s), the second ends it at once with exit
    code 0, and nothing was committed."""
    data = tmp_path / "data"
    backlog(data, rounds=4)
    log_path = tmp_path / "daemon.log"
    env = {"LAMINA_EXECUTOR": "inprocess", "LAMINA_SHUTDOWN_GRACE_SECONDS": "60",
           "LAMINA_FAILPOINTS": "fs.before_rename=sleep:60"}
    with DaemonProcess(data, log_path, extra_env=env) as daemon:
        daemon.wait_ready(30)
        deadline = time.monotonic() + 30
        while "conversion.started" not in _events(log_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "conversion.started" in _events(log_path)
        daemon.signal(signal.SIGTERM)
        time.sleep(1.0)
        assert daemon.proc.poll() is None, "the first SIGTERM did not wait for the job"
        assert "shutdown.requested" in _events(log_path)
        daemon.signal(signal.SIGTERM)
        started = time.monotonic()
        assert daemon.wait(20) == 0
        assert time.monotonic() - started < 5
    events = _events(log_path)
    assert events.index("shutdown.escalated") < events.index("daemon.stopped")
    assert "conversion.committed" not in events
    assert "conversion.cancelled" in events
    text = log_path.read_text()
    assert '"level": "error"' not in text
    assert "Task exception was never retrieved" not in text
    assert _versions(data, "orders") == []


def _events(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            try:
                out.append(str(json.loads(line).get("event")))
            except ValueError:
                continue
    return out


def test_a_trace_url_other_than_the_recorded_one_stops_the_start(tmp_path: Path,
                                                                  s3_bucket: str) -> None:
    """The data directory records s3://bucket/a; a daemon configured for another URL stops
    at start-up with a ConfigError naming both (``lamina serve`` exits 2) and changes
    nothing but its lock file. (Store.open probes a URL before recording it: the bucket is
    real.)"""
    from lamina.errors import ConfigError
    from tests.conftest import tree_digest

    a, b = f"s3://{s3_bucket}/a", f"s3://{s3_bucket}/b"
    Store.open(tmp_path, trace_url=a).close()
    before = tree_digest(tmp_path)
    with pytest.raises(ConfigError, match=f"{a}, not {b}"):
        asyncio.run(_daemon(tmp_path, trace_url=b).run())
    after = tree_digest(tmp_path)
    after.pop("compacter.lock")  # the daemon's lock file, taken before the check
    assert after == before
    assert DataDir(tmp_path).trace_url() == a


def test_only_traces_of_dropped_relations_are_removed(tmp_path: Path) -> None:
    """Under the trace root, a leftover trace with no relation is removed; a name that
    holds no trace (someone else's files under a shared prefix) is left alone."""
    backlog(tmp_path, "live", rounds=4)
    root = DataDir(tmp_path).trace
    (root / "gone" / "state").mkdir(parents=True)
    (root / "gone" / "state" / "00000000000000000001.json").write_bytes(b"{}")
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "readme.txt").write_text("not lamina's")
    daemon = _daemon(tmp_path)

    async def run() -> None:
        task = asyncio.create_task(daemon.run())
        await until("the live relation", lambda: _caught_up(tmp_path, "live"))
        await until("the leftover trace to go", lambda: not (root / "gone").exists())
        daemon.stop.set()
        assert await asyncio.wait_for(task, 10) == 0

    asyncio.run(run())
    assert (root / "notes" / "readme.txt").read_text() == "not lamina's"
    assert (root / "live" / "state").is_dir()


def test_a_relation_dropped_and_created_again_is_taken_up_anew(tmp_path: Path) -> None:
    """What `lamina ingest --resync` does under a running daemon when a table's columns
    changed: drop the relation, create it again under its name at once, write to it. The
    old relation's pipeline stops without touching the new one's segments, the daemon takes
    the new relation up and compacts it from its first segment, and every acknowledged
    update of it reads back (before, the old pipeline converted the new relation's segments
    into the old trace and deleted them as its own)."""
    backlog(tmp_path, rounds=4)
    daemon = _daemon(tmp_path)

    async def run() -> Any:
        task = asyncio.create_task(daemon.run())
        await until("the first relation to catch up",
                    lambda: daemon.recovered and _caught_up(tmp_path, "orders"))
        old_id = daemon.pipelines["orders"].meta.relation_id
        with Store.open(tmp_path) as store:  # back to back, as the resync does: no poll
            store.drop_relation("orders")  # of the daemon (every 0.05 s) falls in between
            store.create_relation("orders", SCHEMA, key=KEY)
        oracle = await asyncio.to_thread(backlog, tmp_path, rounds=12)

        def taken_up_anew() -> bool:
            pipe = daemon.pipelines.get("orders")
            return (pipe is not None and pipe.meta.relation_id != old_id
                    and pipe.trace is not None and pipe.trace.state.upper == oracle.upper
                    and _caught_up(tmp_path, "orders"))

        await until("the new relation to be taken up and caught up", taken_up_anew, 60)
        daemon.stop.set()
        assert await asyncio.wait_for(task, 30) == 0
        return oracle

    with capture_logs() as logs:
        oracle = asyncio.run(run())
    assert not [e for e in logs if e["log_level"] == "error"], logs
    assert [e["relation"] for e in logs if e["event"] == "relation.forgotten"] == ["orders"]
    for as_of in oracle.as_of_points():
        assert snapshot(tmp_path, "orders", as_of) == oracle.snapshot(as_of)
