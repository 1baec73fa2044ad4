"""Daemon lifecycle: one compacter per data directory, and dropped relations removed."""

from __future__ import annotations

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
    with DaemonProcess(data, tmp_path / "daemon.log") as daemon:
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
