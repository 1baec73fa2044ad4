"""End to end: a coordinator process writes while the daemon (real Spark) compacts.

The oracle is lamina.drill.oracle: plain Python over the coordinator's ack log, sharing no
code with the store. Snapshots are compared at every time in [since, upper).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest

from lamina.compacter.spark import DAEMON_JAVA_OPTIONS
from lamina.drill.oracle import Oracle
from lamina.drill.procs import DaemonProcess, start_workload
from lamina.forkserver import ChildProcess
from lamina.store import Store
from lamina.verify import verify_store
from tests import spark_jvm
from tests.compacter.backlog import backlog
from tests.compacter.scrape import metric, wait_some_work

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def run_workload(data_dir: Path, ack: Path, *, seed: int, ops: int,
                 pause: float = 0.0) -> ChildProcess:
    return start_workload(data_dir, ack, seed=seed, ops=ops, pause=pause)


def check_against_oracle(data_dir: Path, ack: Path) -> Oracle:
    """Every snapshot in [since, upper) equals the oracle's; verify finds no problem."""
    oracle = Oracle.load(ack)
    assert not oracle.in_doubt
    with Store.open(data_dir) as store:
        rel = store.relation("drill")
        assert (rel.upper, rel.since) == (oracle.upper, oracle.since)
        for as_of in range(rel.since, rel.upper):
            got = sorted((r["id"], r["val"], r["_diff"]) for r in rel.snapshot(as_of).to_pylist())
            assert got == oracle.snapshot(as_of), f"snapshot at {as_of} differs"
    reports = verify_store(store.layout)
    assert all(r.ok for r in reports), [r.problems for r in reports]
    return oracle


def check_java_options(log: Path) -> None:
    """The daemon's driver JVM got the daemon's options (``spark.driver.defaultJavaOptions``)
    and, after them, the test run's (``extraJavaOptions``, tests/spark_jvm.py), as its
    ``spark.started`` event reports."""
    started = [json.loads(line) for line in log.read_text().splitlines()
               if line.startswith("{") and '"spark.started"' in line]
    assert len(started) == 1, log.read_text()[-3000:]
    options = started[0]["java_options"]
    for flag in DAEMON_JAVA_OPTIONS.split():
        assert options.count(flag) == 1 + spark_jvm.FLAGS.count(flag), options
        assert options.index(flag) < options.index(spark_jvm.SERIAL), options


def test_daemon_compacts_a_live_workload(tmp_path: Path) -> None:
    """While the coordinator writes, the daemon converts and merges; at the end every
    snapshot equals the oracle, the WAL backlog is gone and the trace is merged."""
    data, ack = tmp_path / "data", tmp_path / "ack.jsonl"
    with DaemonProcess(data, tmp_path / "daemon.log") as daemon:
        daemon.wait_ready()
        check_java_options(tmp_path / "daemon.log")
        wl = run_workload(data, ack, seed=1, ops=400, pause=0.005)
        assert wl.wait(120) == 0
        oracle = Oracle.load(ack)
        daemon.wait_caught_up("drill", oracle.upper)
        status = next(r for r in daemon.relations() if r["name"] == "drill")
        levels = [int(k) for k in status["batches_by_level"]]
        assert len(levels) == len(set(levels)), "adjacent equal levels left unmerged"
        check_against_oracle(data, ack)
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_daemon_restart_loses_nothing(tmp_path: Path, sig: signal.Signals) -> None:
    """The daemon is stopped (SIGTERM: exit 0) or killed (SIGKILL) while it converts, and
    restarted: nothing lost, nothing doubled. The kill runs Spark (a JVM and its Python
    workers killed amid a job); the stop runs the in-process executor, since what it is
    about, a graceful stop and a restart, is the same for both and a stop with Spark is
    test_daemon_lifecycle's (no second JVM start-up here)."""
    data, ack = tmp_path / "data", tmp_path / "ack.jsonl"
    wl = run_workload(data, ack, seed=2, ops=500, pause=0.004)
    env = {"LAMINA_EXECUTOR": "inprocess"} if sig == signal.SIGTERM else {}
    with DaemonProcess(data, tmp_path / "daemon1.log", extra_env=env) as first:
        first.wait_ready()
        wait_some_work(first, "drill")
        first.signal(sig)
        code = first.wait()
        assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
    assert wl.wait(120) == 0
    oracle = check_against_oracle(data, ack)  # correct even with the daemon down
    with DaemonProcess(data, tmp_path / "daemon2.log", extra_env=env) as second:
        second.wait_ready()
        second.wait_caught_up("drill", oracle.upper)
        check_against_oracle(data, ack)
        second.signal(signal.SIGTERM)
        assert second.wait() == 0


def test_reader_always_sees_the_oracle(tmp_path: Path) -> None:
    """A reader snapshotting over and over while the daemon converts, merges and collects
    garbage always gets the oracle's answer for the frontier it read. (The in-process
    executor: the reader races the commits and deletions, which both executors make
    through the same trace code, and no JVM start-up is needed for that.)"""
    data, ack = tmp_path / "data", tmp_path / "ack.jsonl"
    wl = run_workload(data, ack, seed=3, ops=300)
    assert wl.wait(120) == 0
    oracle = Oracle.load(ack)
    expected = {t: oracle.snapshot(t) for t in range(oracle.since, oracle.upper)}
    errors: list[str] = []
    reads = 0
    stop = threading.Event()

    def reader() -> None:
        nonlocal reads
        with Store.open(data) as store:
            rel = store.relation("drill")
            i = 0
            while not stop.is_set():
                as_of = oracle.since + i % (oracle.upper - oracle.since)
                got = sorted((r["id"], r["val"], r["_diff"])
                             for r in rel.snapshot(as_of).to_pylist())
                if got != expected[as_of]:
                    errors.append(f"as_of {as_of}")
                reads += 1
                i += 7

    thread = threading.Thread(target=reader)
    with DaemonProcess(data, tmp_path / "daemon.log",
                       extra_env={"LAMINA_GC_GRACE_SECONDS": "0.5",
                                  "LAMINA_EXECUTOR": "inprocess"}) as daemon:
        thread.start()
        try:
            daemon.wait_ready()
            daemon.wait_caught_up("drill", oracle.upper)
            time.sleep(3)  # a few garbage collections with the reader still going
        finally:
            stop.set()
            thread.join()
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0
    assert reads > 10
    assert errors == []


def test_two_hundred_relations_are_compacted_in_packs(tmp_path: Path) -> None:
    """200 relations, written before and while ``lamina serve`` runs: every relation
    catches up and reads back its oracle, every one of the 400 segments was converted
    exactly once, and the work ran as packs of many relations (far fewer Spark jobs than
    conversions, none of them a step alone).

    How many conversions that takes depends on timing (a conversion takes every finished
    segment of its relation: when the second round lands before the daemon reached the
    first, one conversion takes both), so the counts come from the daemon's own log after it
    exited, which names each committed conversion's segments, not from a /metrics scrape
    that may run a moment before the last step is counted."""
    data = tmp_path / "data"
    names = [f"t{i:03d}" for i in range(200)]
    oracles = {n: backlog(data, n, rounds=2, rows=4) for n in names}
    log = tmp_path / "daemon.log"
    with DaemonProcess(data, log, extra_env={"LAMINA_PACK_MAX_STEPS": "64"}) as daemon:
        daemon.wait_ready()
        for n in names:  # a second round while it runs (one more segment each)
            backlog(data, n, rounds=2, rows=4, oracle=oracles[n])
        deadline = time.monotonic() + 600
        while True:
            rows = {r["name"]: r for r in daemon.relations()}
            behind = [n for n in names if rows[n]["wal_segments_pending"]
                      or rows[n]["trace_upper"] != oracles[n].upper]
            if not behind:
                break
            assert time.monotonic() < deadline, f"{len(behind)} behind, e.g. {behind[:3]}"
            time.sleep(0.5)
        code, body = daemon.get("/metrics")  # a large step counts its job before it settles
        assert code == 200
        assert metric(body.decode(), "lamina_spark_jobs_total", shape="step") == 0
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0
    events = [json.loads(line) for line in log.read_text().splitlines()
              if line.startswith("{")]
    converted: dict[str, list[int]] = {n: [] for n in names}
    for e in events:
        if e["event"] == "conversion.committed":
            first, last = (int(x) for x in e["segments"].split(".."))
            converted[e["relation"]].extend(range(first, last + 1))
    assert {n: sorted(seqs) for n, seqs in converted.items()} == {n: [1, 2] for n in names}
    conversions = sum(e["event"] == "conversion.committed" for e in events)
    sizes = [e["steps"] for e in events if e["event"] == "pack.finished"]
    assert len(sizes) <= conversions / 5, (len(sizes), conversions)
    assert sum(sizes) >= conversions
    assert max(sizes) > 10
    with Store.open(data) as store:
        for n in names:
            rel = store.relation(n)
            for as_of in oracles[n].as_of_points(2):
                assert rel.snapshot(as_of).to_pylist() == oracles[n].snapshot(as_of), n
