"""Running a SourceRunner in a thread of the test until a condition holds."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from lamina import Store
from lamina.ingest.metrics import IngestMetrics
from lamina.ingest.runner import SourceRunner
from lamina.ingest.settings import FilesSourceSettings, PostgresSourceSettings
from lamina.ingest.source import Source


def run_until(store: Store, settings: FilesSourceSettings | PostgresSourceSettings,
              source: Source,
              cond: Callable[[SourceRunner], bool], *, timeout: float = 20.0,
              poll_seconds: float = 0.01, stop_seconds: float = 10.0,
              **runner_options: Any) -> tuple[SourceRunner, dict[str, Any]]:
    """Run ``source`` under a SourceRunner until ``cond(runner)`` holds (failing after
    ``timeout`` seconds with the runner's status, checking every ``poll_seconds``), then
    stop it, within ``stop_seconds``. Returns the runner and its status as it was while it
    ran."""
    runner = SourceRunner(settings, source, store, IngestMetrics(),
                          **{"retry_initial_seconds": 0.01, **runner_options})
    stop = threading.Event()
    t = threading.Thread(target=runner.run, args=(stop,))
    t.start()
    deadline = time.monotonic() + timeout
    try:
        while not cond(runner):
            assert time.monotonic() < deadline, runner.status()
            time.sleep(poll_seconds)
        status = runner.status()
    finally:
        stop.set()
        t.join(stop_seconds)
    assert not t.is_alive()
    return runner, status
