"""End to end with the trace on S3 (a real S3 server on 127.0.0.1): a coordinator writes
while the daemon (real Spark, local mode) converts and merges into ``s3://``; the daemon
is killed while it works (puts in flight) and restarted; readers, ``lamina verify`` and
the snapshots find everything through the URL the data directory records. Nothing of the
trace is written under the data directory."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from lamina.datadir import DataDir
from lamina.drill.procs import DaemonProcess
from lamina.objstore.base import open_store
from tests.compacter.scrape import wait_some_work
from tests.compacter.test_e2e import check_against_oracle, run_workload

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def test_daemon_on_an_s3_trace_survives_kill_9(tmp_path: Path, s3_bucket: str) -> None:
    data, ack = tmp_path / "data", tmp_path / "ack.jsonl"
    url = f"s3://{s3_bucket}/lamina/traces"
    env = {"LAMINA_TRACE_URL": url, "LAMINA_GC_GRACE_SECONDS": "0",
           "LAMINA_GC_INTERVAL_SECONDS": "1"}
    wl = run_workload(data, ack, seed=7, ops=500, pause=0.004)
    with DaemonProcess(data, tmp_path / "daemon1.log", extra_env=env) as first:
        first.wait_ready()
        wait_some_work(first, "drill")
        first.signal(signal.SIGKILL)  # while it converts: puts in flight
        assert first.wait() == -signal.SIGKILL
    assert wl.wait(120) == 0
    assert DataDir(data).trace_url() == url
    check_against_oracle(data, ack)  # correct with the daemon down
    with DaemonProcess(data, tmp_path / "daemon2.log", extra_env=env) as second:
        second.wait_ready()
        oracle = check_against_oracle(data, ack)
        second.wait_caught_up("drill", oracle.upper, timeout=180)
        check_against_oracle(data, ack)
        second.signal(signal.SIGTERM)
        assert second.wait() == 0
    assert not list((data / "trace").glob("*/*")), "trace files under the data directory"
    objects = open_store(url).list("drill")
    assert any(o.key.startswith("drill/state/") for o in objects)
    assert any(o.key.startswith("drill/batches/") for o in objects)
