"""Daemon lifecycle: one compacter per data directory, and dropped relations removed."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from lamina.drill.procs import LAMINA, DaemonProcess, free_port
from lamina.store import Store
from tests.conftest import ORDERS, updates

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def test_second_daemon_refuses_and_dropped_relations_are_removed(tmp_path: Path) -> None:
    """A second `lamina serve` on the same data dir exits non-zero naming the lock holder;
    a relation dropped while the daemon runs loses its trace, and the name can be reused."""
    data = tmp_path / "data"
    with Store.open(data, segment_bytes=4096) as store:
        rel = store.create_relation("orders", ORDERS, key=["id"])
        for t in range(30):
            rel.append(updates([(i, "x" * 30, t, 1) for i in range(10)]))
            rel.seal(t + 1)
    # the in-process executor: the lock and the drop are the daemon's, not Spark's
    with DaemonProcess(data, tmp_path / "daemon.log",
                       extra_env={"LAMINA_EXECUTOR": "inprocess"}) as daemon:
        daemon.wait_ready()
        second = subprocess.run([LAMINA, "serve", "--data-dir", str(data), "--http",
                                 f"127.0.0.1:{free_port()}"], capture_output=True, text=True,
                                timeout=120, check=False)
        assert second.returncode != 0
        assert "held by another process" in second.stdout + second.stderr
        trace_dir = data / "trace" / "orders"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (trace_dir / "state").exists():
            time.sleep(0.2)
        assert (trace_dir / "state").exists(), "the daemon never converted anything"
        with Store.open(data) as store:
            store.drop_relation("orders")
            assert store.relations() == []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and trace_dir.exists():
            time.sleep(0.2)
        assert not trace_dir.exists(), "the dropped relation's trace was not removed"
        assert not any((data / "wal" / ".dropped").glob("*"))
        with Store.open(data) as store:  # the name is free again, and starts empty
            again = store.create_relation("orders", ORDERS, key=["id"])
            again.append(updates([(1, "a", 0, 1)]))
            again.seal(1)
            assert again.snapshot(0).num_rows == 1
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0


def _log_records(path: Path) -> list[dict[str, object]]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_to_the_whole_process_group_exits_0(tmp_path: Path,
                                                          sig: signal.Signals) -> None:
    """SIGTERM (what ``timeout``, supervisord's ``stopasgroup`` and systemd's default
    ``KillMode=control-group`` send) or SIGINT (Ctrl-C in a terminal) to the daemon's whole
    process group while a pack of conversions runs: the Spark JVM and its Python workers
    get it too and die first. The daemon still exits 0 with ``daemon.stopped``, logs no
    error and no traceback, and committed nothing half done."""
    data = tmp_path / "data"
    with Store.open(data, segment_bytes=4096) as store:
        for r in range(6):
            rel = store.create_relation(f"r{r}", ORDERS, key=["id"])
            for t in range(8):
                rel.append(updates([(i, "x" * 30, t, 1) for i in range(10)]))
                rel.seal(t + 1)
    log = tmp_path / "daemon.log"
    env = {"LAMINA_FAILPOINTS": "fs.after_rename=sleep:5"}  # tasks linger after a part
    with DaemonProcess(data, log, extra_env=env, new_session=True) as daemon:
        daemon.wait_ready()
        deadline = time.monotonic() + 120
        while not any(r.get("event") == "pack.started" for r in _log_records(log)):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(1.0)  # the pack's tasks are in their Python workers
        daemon.signal_group(sig)
        assert daemon.wait(90) == 0, log.read_text()[-4000:]
    records = _log_records(log)
    events = [r.get("event") for r in records]
    assert events[-1] == "daemon.stopped"
    assert "shutdown.requested" in events
    assert not [r for r in records if r.get("level") == "error"]
    assert "Traceback" not in log.read_text()
    with Store.open(data) as store:  # whatever was committed reads back whole
        for r in range(6):
            rel = store.relation(f"r{r}")
            assert rel.snapshot(7).num_rows == 10
