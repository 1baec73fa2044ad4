"""lamina.spark.read_snapshot on a real Spark standalone cluster (master + worker on
127.0.0.1): the executor, a JVM of its own with its own Python workers, reads the parts;
the rows equal Relation.snapshot's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.compacter.cluster import standalone_cluster
from tests.read.data import relation
from tests.read.spark_cluster_child import RESULT_PREFIX

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def test_read_snapshot_on_a_standalone_cluster(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with relation(data, 17) as (rel, oracle):
        as_of = oracle.upper - 1
        want = rel.snapshot(as_of).to_pylist()
        assert want == oracle.snapshot(as_of)
    with standalone_cluster(tmp_path / "cluster") as cluster:
        root = Path(__file__).resolve().parents[2]
        proc = subprocess.run(
            [sys.executable, "-m", "tests.read.spark_cluster_child", "--master",
             cluster.master_url, "--data-dir", str(data), "--relation", rel.name,
             "--as-of", str(as_of)], cwd=root, capture_output=True, timeout=300,
            check=False, env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})
    out = proc.stdout.decode(errors="replace")
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT_PREFIX)]
    err = proc.stderr.decode(errors="replace")[-4000:]
    assert proc.returncode == 0, err
    assert lines, err
    doc = json.loads(lines[-1][len(RESULT_PREFIX):])
    assert doc["block_managers"] >= 2, "no executor joined the application"
    assert doc["rows"] == want
