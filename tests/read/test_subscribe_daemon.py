"""A subscription against the oracle while the real daemon (real Spark) converts, merges
and collects underneath (GC grace 2 s, so files named by old states really vanish)."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pytest

from lamina import CLOSED, Progress, Store
from lamina.drill.procs import DaemonProcess
from tests.read.data import random_rows
from tests.read.test_subscribe import Acc, accumulate, state_at
from tests.trace.helpers import KEY, NAME, SCHEMA, Oracle

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def test_subscription_under_the_daemon(tmp_path: Path) -> None:
    data = tmp_path / "data"
    rng = random.Random(3)
    with DaemonProcess(data, tmp_path / "daemon.log") as daemon:
        daemon.wait_ready()
        with Store.open(data, segment_bytes=4096, fsync="never") as store:
            rel = store.create_relation(NAME, SCHEMA, KEY)
            oracle = Oracle()
            oracle.append(rel, random_rows(rng, 0, 10, 40))
            oracle.seal(rel, 2)
            items: list[pa.Table | Progress] = []
            sub = Store.open(data).relation(NAME).subscribe(0, max_wait=0.05)
            consumer = threading.Thread(target=lambda: items.extend(sub), daemon=True)
            consumer.start()
            deadline = time.monotonic() + 25  # the daemon converts while this writes
            i = 0
            while time.monotonic() < deadline:
                oracle.append(rel, random_rows(rng, oracle.upper, rng.randrange(1, 20), 40))
                oracle.seal(rel, oracle.upper + rng.randrange(1, 4))
                if i % 10 == 9:
                    oracle.allow_compaction(rel, max(oracle.since, oracle.upper - 10))
                i += 1
                time.sleep(0.01)
            last = oracle.upper
            daemon.wait_caught_up(NAME, last)
            status = next(r for r in daemon.relations() if r["name"] == NAME)
            oracle.seal(rel, CLOSED)
            consumer.join(60)
            assert not consumer.is_alive()
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0
    assert sum(status["batches_by_level"].values()) >= 1  # the daemon really converted
    acc: Acc = defaultdict(int)
    uppers = []
    for item in items:
        if isinstance(item, Progress):
            uppers.append(item.upper)
            if item.upper != CLOSED and item.upper - 1 >= oracle.since:
                assert state_at(acc, item.upper - 1) == oracle.snapshot(item.upper - 1)
        else:
            accumulate(acc, item)
    assert uppers[-1] == CLOSED
    assert uppers == sorted(uppers)
    assert len(uppers) > 10
    for t in range(oracle.since, last):
        assert state_at(acc, t) == oracle.snapshot(t), t
