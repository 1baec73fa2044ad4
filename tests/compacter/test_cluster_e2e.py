"""End to end on a Spark standalone cluster: the daemon (``lamina serve --spark-master
spark://127.0.0.1:PORT``) compacts a live workload with its tasks on a worker's executor,
and every snapshot equals the oracle's and the one of the same workload compacted by a
daemon on ``local[2]``.

The cluster is a master and a worker started with the pyspark package's ``spark-class``
on 127.0.0.1 (tests/compacter/cluster.py). The executor is a JVM of its own, with Python
workers of its own, started by the worker; the data directory is visible to it at the same
path (same machine), as a shared filesystem would make it. The coordinator is the drill
workload (lamina.drill.workload) in a subprocess, appending while the daemon runs; the
oracle (lamina.drill.oracle) is plain Python over its ack log.

That the cluster did the work is checked from the cluster's side: the master lists the
daemon's application as completed, having granted it the worker's cores, and the
executor's own log in the worker's work directory shows the tasks it ran.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from lamina.drill.oracle import Oracle
from lamina.drill.procs import DaemonProcess, start_workload
from lamina.store import Store
from lamina.verify import verify_store
from tests.compacter.cluster import StandaloneCluster, standalone_cluster
from tests.compacter.scrape import metric, scrape_after_jobs

pytestmark = [pytest.mark.slow, pytest.mark.spark]

SEED, OPS, PAUSE = 21, 300, 0.03  # about 10 s of writing: several conversions meanwhile
APP = "lamina-compacter"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    with standalone_cluster(tmp_path_factory.mktemp("spark-cluster")) as c:
        yield c


def compact_live(root: Path, master: str) -> tuple[Oracle, dict[int, pa.Table], float]:
    """The workload (seed SEED) written while a daemon on ``master`` compacts it; the
    oracle, every snapshot in [since, upper) (each checked against the oracle), and how
    many conversions and merges the daemon ran."""
    data, ack = root / "data", root / "ack.jsonl"
    root.mkdir(parents=True)
    with DaemonProcess(data, root / "daemon.log", master=master) as daemon:
        daemon.wait_ready(timeout=180)
        workload = start_workload(data, ack, seed=SEED, ops=OPS, pause=PAUSE, quiet=True)
        assert workload.wait(180) == 0
        oracle = Oracle.load(ack)
        assert not oracle.in_doubt
        daemon.wait_caught_up("drill", oracle.upper, timeout=240)
        text = scrape_after_jobs(daemon, 1)
        conversions = metric(text, "lamina_jobs_total", kind="conversion", outcome="success")
        assert conversions >= 1, f"{master}: nothing converted"
        merges = metric(text, "lamina_jobs_total", kind="merge", outcome="success")
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0
    snapshots = {}
    with Store.open(data) as store:
        rel = store.relation("drill")
        assert (rel.upper, rel.since) == (oracle.upper, oracle.since)
        for as_of in range(rel.since, rel.upper):
            snap = rel.snapshot(as_of)
            got = [(r["id"], r["val"], r["_diff"]) for r in snap.to_pylist()]
            assert sorted(got) == oracle.snapshot(as_of), f"{master}: snapshot at {as_of}"
            snapshots[as_of] = snap
    reports = verify_store(store.layout)
    assert all(r.ok for r in reports), [r.problems for r in reports]
    return oracle, snapshots, conversions + merges


def test_daemon_on_a_standalone_cluster_matches_local_mode(cluster: StandaloneCluster,
                                                           tmp_path: Path) -> None:
    workers = [w for w in cluster.status()["workers"] if w["state"] == "ALIVE"]
    assert [w["cores"] for w in workers] == [2]

    oracle, on_cluster, steps = compact_live(tmp_path / "cluster", cluster.master_url)

    # the cluster ran the daemon's application, on its worker's executor
    apps = [a for a in cluster.status().get("completedapps", []) if a["name"] == APP]
    assert len(apps) == 1, cluster.status()
    assert apps[0]["cores"] == 2, apps[0]
    app_dir = cluster.work / "worker" / apps[0]["id"]
    logs = [p.read_text(errors="replace") for p in app_dir.glob("*/stderr")]
    assert logs, f"no executor log under {app_dir}"
    finished = sum(log.count("Finished task") for log in logs)
    # every conversion and merge is at least one Spark task, and a standalone driver runs
    # none itself: all of them ran on the executor
    assert finished >= steps, f"the executor finished {finished} tasks for {steps} steps"

    local_oracle, in_local_mode, _ = compact_live(tmp_path / "local", "local[2]")
    assert (local_oracle.upper, local_oracle.since) == (oracle.upper, oracle.since)
    assert on_cluster.keys() == in_local_mode.keys()
    for as_of, table in on_cluster.items():
        assert table.equals(in_local_mode[as_of]), f"snapshot at {as_of} differs"
