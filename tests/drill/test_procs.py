"""lamina.drill.procs against a real daemon: the helpers the end-to-end tests trust."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pytest

from lamina.datadir import DataDir
from lamina.drill.procs import DaemonProcess
from lamina.status import relation_status
from lamina.store import Store

pytestmark = [pytest.mark.slow, pytest.mark.spark]

SCHEMA = pa.schema([("id", pa.int64()), ("val", pa.string())])


def _write(data: Path, first: int, upper: int) -> Store:
    """Append one update per time in [first, upper) and seal ``upper``; the store stays
    open, so its last segment stays open too."""
    store = Store.open(data, segment_bytes=1 << 20)
    rel = (store.relation("r") if "r" in store.relations()
           else store.create_relation("r", SCHEMA, key=["id"]))
    times = list(range(first, upper))
    rel.append(pa.table({"id": times, "val": [f"v{t}" for t in times],
                         "_time": pa.array(times, pa.uint64()),
                         "_diff": pa.array([1] * len(times), pa.int64())}))
    rel.seal(upper)
    return store


def test_wait_caught_up_does_not_trust_a_poll_from_before_the_segment_finished(
        tmp_path: Path) -> None:
    """The daemon answers /v1/relations as of its last poll. Seen while the last segment
    was open, a relation looks caught up (nothing finished waits, the sealed upper is
    reached); once the writer finishes that segment, it is not until the daemon converts
    it. wait_caught_up must wait for that conversion (a slow poll makes the window wide:
    before the fix, it returned at once and a test then found the segment unconverted)."""
    data = tmp_path / "data"
    _write(data, 0, 10).close()
    with DaemonProcess(data, tmp_path / "daemon.log",  # the poll matters, not Spark
                       extra_env={"LAMINA_POLL_INTERVAL": "3",
                                  "LAMINA_EXECUTOR": "inprocess"}) as daemon:
        daemon.wait_ready()
        daemon.wait_caught_up("r", 10)
        store = _write(data, 10, 20)
        deadline = time.monotonic() + 60  # the daemon has seen the open segment's upper
        while not any(r["name"] == "r" and r["sealed_upper"] == 20
                      and r["wal_segments_pending"] == 0 for r in daemon.relations()):
            assert time.monotonic() < deadline, daemon.relations()
            time.sleep(0.1)
        store.close()  # finishes the segment: one more to convert
        daemon.wait_caught_up("r", 20)
        assert relation_status(DataDir(data), "r")["trace_upper"] == 20
