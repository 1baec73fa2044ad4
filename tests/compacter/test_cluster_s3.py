"""A Spark standalone cluster that shares no directory with the daemon, the trace on S3.

The worker (and so its executors and their Python workers) runs in a mount namespace of
its own in which an empty tmpfs covers the directory holding the daemon's data directory
(tests/compacter/cluster.py, ``hide``): the tasks cannot read a WAL segment or write a
part by path, as on a machine of its own. The trace is on the real S3 server of the tests,
which the executors reach with credentials from their environment. The daemon stages each
conversion's segments in the trace store (``stage_segments = "auto"``: a cluster master
and an ``s3://`` trace), the decode tasks read the staged copies with ranged gets, and the
staged copies are deleted once the state that converted them is published.

Checked: the workload's every snapshot equals the oracle's, ``lamina verify`` is clean,
the executor finished the steps' tasks, the worker really could not see the data
directory, and no staged segment outlives its conversion.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from lamina.drill.oracle import Oracle
from lamina.drill.procs import DaemonProcess, start_workload
from lamina.layout import TraceLayout
from lamina.objstore.base import open_store
from tests.compacter.cluster import can_hide_directories, standalone_cluster
from tests.compacter.scrape import metric, scrape_after_jobs
from tests.compacter.test_e2e import check_against_oracle

pytestmark = [pytest.mark.slow, pytest.mark.spark]

APP = "lamina-compacter"


def test_cluster_with_no_shared_directory_compacts_into_s3(tmp_path: Path,
                                                            s3_bucket: str) -> None:
    if not can_hide_directories():
        message = "needs unshare --mount (util-linux, as root) to hide a directory"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI runs as root with util-linux installed")
        pytest.skip(message)
    daemon_side = tmp_path / "daemon-machine"
    daemon_side.mkdir()
    data, ack = daemon_side / "data", daemon_side / "ack.jsonl"
    url = f"s3://{s3_bucket}/cluster/traces"
    with standalone_cluster(tmp_path / "spark-cluster", hide=daemon_side) as cluster:
        worker = cluster.procs[-1]
        seen_by_worker = Path(f"/proc/{worker.pid}/root") / daemon_side.relative_to("/")
        (daemon_side / "marker").write_text("visible on the daemon's machine only")
        assert not (seen_by_worker / "marker").exists(), "the worker sees the data directory"
        with DaemonProcess(data, tmp_path / "daemon.log", master=cluster.master_url,
                           extra_env={"LAMINA_TRACE_URL": url}) as daemon:
            daemon.wait_ready(timeout=180)
            for seed in (31, 32):  # two conversions at least, so that their batches merge
                workload = start_workload(data, ack, seed=seed, ops=150, pause=0.02,
                                          quiet=True)
                assert workload.wait(180) == 0
                oracle = Oracle.load(ack)
                daemon.wait_caught_up("drill", oracle.upper, timeout=300)
            # the merge follows the second conversion's commit in the same pass
            text = scrape_after_jobs(daemon, 1, kind="merge", timeout=60.0)
            conversions = metric(text, "lamina_jobs_total", kind="conversion",
                                 outcome="success")
            merges = metric(text, "lamina_jobs_total", kind="merge", outcome="success")
            assert conversions >= 2
            assert merges >= 1
            steps = conversions + merges
            daemon.signal(signal.SIGTERM)
            assert daemon.wait() == 0
        apps = [a for a in cluster.status().get("completedapps", []) if a["name"] == APP]
        assert len(apps) == 1, cluster.status()
        logs = [p.read_text(errors="replace")
                for p in (cluster.work / "worker" / apps[0]["id"]).glob("*/stderr")]
        finished = sum(log.count("Finished task") for log in logs)
        assert finished >= steps, f"the executor finished {finished} tasks for {steps} steps"
    log = (tmp_path / "daemon.log").read_text()
    assert '"stage_segments": true' in log or "stage_segments=True" in log, log[-3000:]
    check_against_oracle(data, ack)
    traces = open_store(url).child("drill")
    assert not traces.list(TraceLayout.STAGING), "staged segments outlived their conversion"
    assert not list((data / "trace").glob("*/*")), "trace files under the data directory"

