"""Idle relations catch up: the daemon converts what a quiet coordinator left behind.

With the default 64 MiB segments, a coordinator that writes a little and goes quiet used to
leave everything in the open segment, so the trace never reached the sealed upper. Segments
now finish on close and, for a live coordinator, at a seal once older than
``segment_max_age_seconds``.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from lamina.drill.procs import DaemonProcess
from lamina.store import Store
from tests.conftest import ORDERS

pytestmark = pytest.mark.slow


def batch(start: int, n: int, time_: int) -> pa.Table:
    return pa.table({"id": pa.array(range(start, start + n), pa.int64()),
                     "item": pa.array([f"item-{i}" for i in range(start, start + n)]),
                     "_time": pa.array([time_] * n, pa.uint64()),
                     "_diff": pa.array([1] * n, pa.int64())})


def row_of(daemon: DaemonProcess, name: str) -> dict[str, Any] | None:
    return next((r for r in daemon.relations() if r["name"] == name), None)


def wait_trace_at_upper(daemon: DaemonProcess, name: str, upper: int,
                        timeout: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    row = None
    while time.monotonic() < deadline:
        row = row_of(daemon, name)
        if (row is not None and row["trace_upper"] == row["sealed_upper"] == upper
                and row["wal_segments_pending"] == 0):
            return row
        time.sleep(0.3)
    raise AssertionError(f"{name} did not catch up to {upper}: {row}")


def test_closed_and_idle_coordinators_are_caught_up(tmp_path: Path) -> None:
    data = tmp_path / "data"
    # A coordinator that appends a few thousand updates with default segments and closes.
    with Store.open(data) as store:
        rel = store.create_relation("closed", ORDERS, key=["id"])
        for t in range(20):
            rel.append(batch(t * 200, 200, t))
            rel.seal(t + 1)
    # segment ages and catch-up are the pipeline's, not the executor's: no JVM needed
    with DaemonProcess(data, tmp_path / "daemon.log",
                       extra_env={"LAMINA_EXECUTOR": "inprocess"}) as daemon:
        daemon.wait_ready()
        wait_trace_at_upper(daemon, "closed", 20)
        # A live coordinator that goes idle: its next seal after the age finishes the segment.
        with Store.open(data, segment_max_age_seconds=1.0) as store:
            rel = store.create_relation("idle", ORDERS, key=["id"])
            rel.append(batch(0, 500, 0))
            rel.seal(1)
            time.sleep(1.5)
            row = row_of(daemon, "idle")
            assert row is not None
            assert row["trace_upper"] == 0  # nothing finished yet
            rel.seal(2)  # past the age: this seal finishes the segment
            wait_trace_at_upper(daemon, "idle", 2)
            assert rel.snapshot(1).num_rows == 500  # still open: read from the trace
        with Store.open(data) as store:
            assert store.relation("closed").snapshot(19).num_rows == 4000
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0
