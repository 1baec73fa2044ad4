"""A conversion on a real Spark standalone cluster (master + worker on 127.0.0.1) equals
the reference executor's output for the same plan.

The cluster's executor is a separate JVM with its own Python workers, so this checks what
local mode cannot: that the tasks' code and data reach the executor (PYSPARK_PYTHON is this
venv's interpreter), and that the parts the executor writes are the ones the driver commits.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from lamina.compacter.executors import ConversionResult, reference
from lamina.trace.batch import PartFile
from lamina.trace.plan import plan_conversion
from lamina.trace.state import PendingPart
from tests import spark_jvm
from tests.compacter.cluster import StandaloneCluster, run_child, standalone_cluster
from tests.compacter.workload import (
    STR_KEY,
    assert_same_conversion,
    drive,
    open_workload,
    plan_to_json,
    spans,
)

pytestmark = [pytest.mark.slow, pytest.mark.spark]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    with standalone_cluster(tmp_path_factory.mktemp("spark-cluster")) as c:
        yield c


def test_conversion_on_a_standalone_cluster(cluster: StandaloneCluster, tmp_path: Path) -> None:
    status = cluster.status()
    assert [w["cores"] for w in status["workers"] if w["state"] == "ALIVE"] == [2]

    w = open_workload(tmp_path / "data", STR_KEY, ["name"])
    rng = random.Random(31)
    drive(w, rng, steps=24, rows_per_step=40, keys=30, future=0.25)
    trace = w.trace()
    segs = spans(trace, w.wal_dir)
    reference.convert(trace, plan_conversion(trace.state, segs[:2]))  # leaves pending parts
    plan = plan_conversion(trace.state, segs[2:])
    assert plan.consume
    ref = w.fork(trace, "ref")
    want = reference.run_conversion(ref, plan)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan_to_json(plan)))

    doc = run_child(cluster.master_url, w.root, w.rel.name, plan_file)

    got = ConversionResult(parts=[PartFile.from_dict(p) for p in doc["parts"]],
                           pending=[PendingPart.from_dict(p) for p in doc["pending"]],
                           input_rows=doc["input_rows"])
    assert len(got.parts) > 1, "expected parts from several executor tasks"
    assert doc["block_managers"] >= 2, "no executor joined the application"
    assert_same_conversion(trace, got, ref, want, plan=plan)
    trace.commit_conversion(plan, got.parts, got.pending)
    assert_suite_jvm_options(cluster)


def assert_suite_jvm_options(cluster: StandaloneCluster) -> None:
    """The suite's JVM options and class-data archive (tests/spark_jvm.py,
    tests/test_suite_jvm.py) reached the master and the worker (``SPARK_DAEMON_JAVA_OPTS``:
    their command lines, and the archive in their memory maps) and the application's
    executor (``spark.executor.extraJavaOptions``: the worker writes the command it
    launched at the top of the executor's stderr)."""
    archive = spark_jvm.current_archive()
    groups = {p.pid for p in cluster.procs}
    daemons, maps = [], []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getpgid(int(entry.name)) in groups:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if argv[0].endswith(b"java"):
                    daemons.append(b" ".join(argv).decode())
                    maps.append((entry / "maps").read_text())
        except (OSError, ProcessLookupError):
            continue  # gone meanwhile
    assert sum("deploy.master.Master" in a for a in daemons) == 1, daemons
    assert sum("deploy.worker.Worker" in a for a in daemons) == 1, daemons
    launched = [p.read_text(errors="replace").split("\n", 3)[:3]
                for p in cluster.work.glob("worker/app-*/*/stderr")]
    assert launched, "no executor was launched"
    cds = () if archive is None else (f"-XX:SharedArchiveFile={archive}",)
    for argv in [*daemons, *(" ".join(lines) for lines in launched)]:
        for flag in (*spark_jvm.FLAGS, spark_jvm.SERIAL, *cds):
            assert flag in argv, argv
    if archive is not None:
        for argv, mapped in zip(daemons, maps, strict=True):
            assert str(archive) in mapped, f"{argv[-200:]} did not map {archive}"
