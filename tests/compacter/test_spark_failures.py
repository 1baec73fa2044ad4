"""Spark failures under the real daemon on a standalone cluster (master and worker on
127.0.0.1): a task that raises, a Python worker killed mid-task, and the whole worker
(its JVM, the executor JVM and their Python workers) killed mid-job and replaced by a new
one.

Fail points reach the executors' Python workers through the worker's environment, and
``LAMINA_FAILPOINTS_SHARED`` counts their passes across processes, so each fires exactly
once however many worker processes a retry starts:

1. ``fs.before_rename=error@1``: the first file a task publishes fails with EIO, the task
   fails, and with ``spark.task.maxFailures=1`` so does the job: JobError, and the
   daemon's pipeline retries the conversion (a fresh plan, a fresh batch id).
2. ``fs.after_rename=sleep:30@1``: the next attempt's first published part is durable and
   then the task sleeps: the test SIGKILLs the executor's Python workers. The job fails
   and is retried again.
3. After more writes, the sleep is re-armed (the shared count file emptied) and the next
   conversion's task sleeps again: the test SIGKILLs the worker JVM and everything it
   started (executor JVM, Python daemon and workers), then starts a new worker. Spark
   reruns the lost task on the new executor (an executor lost with its worker does not
   count as a task failure), or the job fails and lamina retries it; either way the
   conversion is committed once the new worker serves it.

Throughout, the part the killed attempt had already published is never named by any
state version (it is garbage), every kept version's files pass their checksums and row
counts, and every snapshot equals the oracle of the acknowledged writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lamina.datadir import DataDir
from lamina.drill.oracle import Oracle
from lamina.drill.procs import DaemonProcess, start_workload
from lamina.objstore.local import LocalObjectStore
from lamina.schema import RelationMeta
from lamina.store import Store
from lamina.trace.invariants import check_data, check_state
from lamina.trace.state import StateStore
from lamina.verify import verify_store
from tests import spark_jvm
from tests.compacter.cluster import StandaloneCluster, standalone_cluster, start_worker

pytestmark = [pytest.mark.slow, pytest.mark.spark]

SPARK_DEFAULTS = """\
spark.task.maxFailures 1
spark.executor.memory 512m
"""


def _wait_for(what: str, cond: Callable[[], bool], timeout: float,
              alive: Callable[[], None]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        alive()
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _session_procs(sid: int) -> dict[int, tuple[int, str]]:
    """Processes of session ``sid``: pid -> (parent pid, command line). A Spark worker
    started in a session of its own holds its executors and their Python daemons and
    workers there (pyspark.daemon moves to a process group of its own, not a session)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid:
            out[int(d.name)] = (int(fields[1]), cmd)
    return out


def _kill_python_workers(worker: int) -> list[int]:
    """SIGKILL the Python worker processes under the Spark worker ``worker`` (the ones
    pyspark.daemon forked; the daemon itself is spared)."""
    procs = _session_procs(worker)
    daemons = {pid for pid, (_, cmd) in procs.items() if "pyspark.daemon" in cmd}
    victims = [pid for pid in daemons if procs[pid][0] in daemons]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    return victims


def _kill_worker(worker: int) -> None:
    """SIGKILL the worker JVM and everything it started: the executor JVM, its Python
    daemon and workers."""
    for pid in _session_procs(worker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _events(log: Path) -> Iterator[dict[str, object]]:
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                yield json.loads(line)
            except ValueError:
                continue


def _metric(body: str, name: str, **labels: str) -> float:
    for line in body.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line
                                               for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample of {name} {labels}")


def _check(data: Path, oracle: Oracle) -> None:
    """Snapshots equal the oracle; every kept state version names only whole files."""
    with Store.open(data) as store:
        rel = store.relation("drill")
        assert (rel.upper, rel.since) == (oracle.upper, oracle.since)
        for as_of in range(rel.since, rel.upper):
            got = sorted((r["id"], r["val"], r["_diff"]) for r in rel.snapshot(as_of).to_pylist())
            assert got == oracle.snapshot(as_of), f"snapshot at {as_of}"
        layout = DataDir(data)
        meta_path = layout.wal_dir("drill") / "relation.json"
        meta = RelationMeta.from_json(meta_path.read_bytes(), meta_path)
        states = StateStore(layout.trace_store("drill", store.fs))
        versions = states.versions()
        assert versions
        for v in versions:
            state = states.load(v)
            check_state(state)
            check_data(layout.trace_store("drill"), state, meta)
        assert all(r.ok for r in verify_store(layout)), [r.problems for r in verify_store(layout)]


def _parts(data: Path) -> set[str]:
    root = data / "trace" / "drill"
    return {p.relative_to(root).as_posix() for p in (root / "batches").glob("*/*.parquet")}


def test_task_worker_and_executor_failures_are_retried(tmp_path: Path) -> None:
    """See the module docstring."""
    data, ack, log = tmp_path / "data", tmp_path / "ack.jsonl", tmp_path / "daemon.log"
    shared = tmp_path / "failpoints"
    shared.mkdir()
    sleeping = shared / "fs.after_rename.hits"
    worker_env = {"LAMINA_FAILPOINTS": "fs.before_rename=error@1,fs.after_rename=sleep:30@1",
                  "LAMINA_FAILPOINTS_SHARED": str(shared)}
    properties = tmp_path / "spark-defaults.conf"  # the suite's JVM options, and this test's
    properties.write_text(spark_jvm.properties_text(spark_jvm.current_archive(), SPARK_DEFAULTS))
    writer = start_workload(data, ack, seed=11, ops=120, quiet=True)

    with standalone_cluster(tmp_path / "spark", workers=0) as cluster, \
            DaemonProcess(data, log, master=cluster.master_url,
                          extra_env={"PYSPARK_SUBMIT_ARGS": spark_jvm.submit_args(properties)}
                          ) as daemon:
        def alive() -> None:
            if daemon.proc.poll() is not None:
                raise AssertionError("daemon died:\n" + log.read_text()[-4000:])

        worker = start_worker(cluster, env=worker_env)  # while the daemon starts
        assert writer.wait(120) == 0
        oracle = Oracle.load(ack)
        # 1 and 2: the injected error fails attempt 1; attempt 2 sleeps after its first
        # part is published, and its Python workers are killed.
        _wait_for("a task to sleep after publishing a part", sleeping.exists, 240, alive)
        orphans = _parts(data)
        assert orphans, "the sleeping task published no part"
        assert _kill_python_workers(worker.pid), "no Python worker found to kill"
        daemon.wait_caught_up("drill", oracle.upper, timeout=180)
        _check(data, oracle)

        # 3: more writes; the next conversion's task sleeps; the whole worker is killed
        # and a new one started.
        sleeping.write_bytes(b"")  # re-arm: the shared count starts over
        assert start_workload(data, ack, seed=12, ops=60, quiet=True).wait(120) == 0
        oracle = Oracle.load(ack)
        _wait_for("a task to sleep again", lambda: sleeping.stat().st_size > 0, 180, alive)
        _kill_worker(worker.pid)
        worker.wait(30)
        cluster.procs.remove(worker)
        _replace_worker(cluster, worker_env)
        daemon.wait_caught_up("drill", oracle.upper, timeout=240)

        code, body = daemon.get("/metrics")
        assert code == 200
        text = body.decode()
        retries = _metric(text, "lamina_job_retries_total", kind="conversion")
        failures = _metric(text, "lamina_jobs_total", kind="conversion", outcome="failure")
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(90) == 0

    failed = [str(e.get("error")) for e in _events(log)
              if e.get("event") == "conversion.retrying"]
    assert any("fail point fs.before_rename" in f for f in failed), failed
    assert any("Python worker exited unexpectedly" in f for f in failed), failed
    assert retries >= len(failed) >= 2
    assert failures >= len(failed)
    _check(data, oracle)
    states = StateStore(LocalObjectStore(data / "trace" / "drill"))
    named = set().union(*(states.load(v).files() for v in states.versions()))
    assert not orphans & named, "a part of a failed attempt became visible"


def _replace_worker(cluster: StandaloneCluster, env: dict[str, str]) -> None:
    """Wait until the master has noticed the dead worker, then start a new one."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not any(w.get("state") == "ALIVE" for w in cluster.status().get("workers", [])):
            break
        time.sleep(0.2)
    start_worker(cluster, env=env)
