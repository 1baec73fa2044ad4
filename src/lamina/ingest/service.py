"""``lamina ingest``: the long-running ingestion service (a coordinator of the store).

Start-up: open the store (``data_dir``), serve HTTP (``/healthz`` answers from here on),
start one thread per source (:class:`~lamina.ingest.runner.SourceRunner`: recovery, then
streaming), tell systemd ``READY=1``. The asyncio loop (uvloop under the CLI) only serves
HTTP, signals and the watchdog; sources block in their own threads.

SIGTERM/SIGINT drain: ``STOPPING=1``; every source stops reading, writes what it has read
below its upper at a last binding, seals its outputs and closes; then the store closes
(finishing open segments) and the process exits 0. A source still busy after
``shutdown_grace_seconds`` is abandoned (its thread is a daemon): what it had not sealed
is read again at the next start, exactly once. SIGKILL at any moment is only a delay.

Log events (structlog, dotted): ``ingest.starting``, ``ingest.ready``, ``ingest.stopping``,
``ingest.stopped``, ``source.opening``, ``source.running``, ``source.retrying``,
``source.stalled``, ``output.stalled``, ``source.ceased``.
"""

from __future__ import annotations

import asyncio
import functools
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import structlog

from lamina.ingest.files import FilesSource
from lamina.ingest.http import build_app, serve, stop_http
from lamina.ingest.metrics import IngestMetrics
from lamina.ingest.resync import resolve_table
from lamina.ingest.runner import SourceRunner
from lamina.ingest.settings import FilesSourceSettings, IngestSettings, SourceSettings
from lamina.ingest.source import Source
from lamina.service.systemd import Notifier, watchdog_interval, watchdog_loop
from lamina.store import Store

log = structlog.get_logger("lamina.ingest")

SourceFactory = Callable[[SourceSettings], Source]


def make_source(settings: SourceSettings) -> Source:
    """The source a settings block describes (psycopg2 is imported only for PostgreSQL)."""
    if isinstance(settings, FilesSourceSettings):
        return FilesSource(settings)
    from lamina.ingest.postgres import PostgresSource

    return PostgresSource.from_settings(settings)


class IngestService:
    """``await IngestService(settings).run()`` returns the process exit code."""

    def __init__(self, settings: IngestSettings, *, metrics: IngestMetrics | None = None,
                 source_factory: SourceFactory = make_source) -> None:
        self.settings = settings
        self.metrics = metrics or IngestMetrics()
        self.source_factory = source_factory
        self.runners: list[SourceRunner] = []
        self.threads: list[threading.Thread] = []
        self.stop = asyncio.Event()
        self.halt = threading.Event()

    def readiness(self) -> tuple[bool, str]:
        """Ready when every source is running and no output is stalled."""
        if not self.runners:
            return False, "starting"
        waiting = [f"{r.name}: {r.health.state}" + (f" ({r.health.error})"
                                                    if r.health.error else "")
                   for r in self.runners if r.health.state != "running"]
        stalled = [f"{rel} ({error})" for r in self.runners if r.health.state == "running"
                   for rel, error in r.stalled_outputs()]
        reasons = []
        if waiting:
            reasons.append("sources not running: " + "; ".join(waiting))
        if stalled:
            reasons.append("outputs stalled: " + "; ".join(stalled))
        if reasons:
            return False, "; ".join(reasons)
        return True, "ready"

    def sources(self) -> list[dict[str, Any]]:
        return [r.status() for r in self.runners]

    def resync(self, source: str, table: str) -> Future[dict[str, Any]]:
        """Hand a resync of ``table`` to the runner of ``source`` (see
        :mod:`lamina.ingest.resync`); SourceStalledError when there is no such table."""
        runner = next((r for r in self.runners if r.name == source), None)
        if runner is None:
            raise LookupError(f"no source {source!r} runs here; sources: "
                              f"{sorted(r.name for r in self.runners)}")
        return runner.request_resync(resolve_table(runner.settings, table))

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._request_stop, sig)
        notifier = Notifier()
        store = await asyncio.to_thread(
            functools.partial(Store.open, self.settings.data_dir,
                              segment_max_age_seconds=self.settings.segment_max_age_seconds))
        runner = await serve(build_app(self.metrics, self.sources, self.readiness,
                                       self.resync),
                             self.settings.http_host, self.settings.http_port)
        log.info("ingest.starting", data_dir=str(self.settings.data_dir),
                 http=[f"{a[0]}:{a[1]}" for a in runner.addresses],
                 sources=[s.name for s in self.settings.sources])
        watchdog = asyncio.create_task(watchdog_loop(notifier, watchdog_interval()))
        try:
            for s in self.settings.sources:
                src = self.source_factory(s)
                r = SourceRunner(s, src, store, self.metrics,
                                 retry_initial_seconds=self.settings.retry_initial_seconds,
                                 retry_max_seconds=self.settings.retry_max_seconds)
                self.runners.append(r)
                t = threading.Thread(target=r.run, args=(self.halt,), daemon=True,
                                     name=f"source-{s.name}")
                self.threads.append(t)
                t.start()
            notifier.ready()
            notifier.status(f"ingesting {len(self.runners)} sources")
            log.info("ingest.ready", sources=len(self.runners))
            await self.stop.wait()
            notifier.stopping()
            self.halt.set()
            grace = self.settings.shutdown_grace_seconds
            stuck = await asyncio.to_thread(self._join, grace)
            if stuck:
                log.warning("ingest.grace_expired", sources=stuck, grace_seconds=grace)
            else:
                await asyncio.to_thread(store.close)
            return 0
        finally:
            self.halt.set()
            watchdog.cancel()
            await stop_http(runner)
            log.info("ingest.stopped")

    def _join(self, grace: float) -> list[str]:
        deadline = time.monotonic() + grace
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self.threads if t.is_alive()]

    def _request_stop(self, sig: signal.Signals) -> None:
        if not self.stop.is_set():
            log.info("ingest.stopping", signal=sig.name,
                     grace_seconds=self.settings.shutdown_grace_seconds)
        self.stop.set()
