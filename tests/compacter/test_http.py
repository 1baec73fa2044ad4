"""The compacter's HTTP endpoints over a real socket on 127.0.0.1 (no test client, no mocks)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

import lamina.compacter.metrics as metrics_module
from lamina.compacter.http import build_app, start_http, stop_http
from lamina.compacter.metrics import Metrics, RelationGauges
from lamina.errors import ConfigError
from tests.deploy.tools import promtool_check_metrics

STATUS_ROWS: list[dict[str, Any]] = [
    {"name": "orders", "sealed_upper": 120, "since": 10, "trace_upper": 100,
     "wal_segments_pending": 2, "wal_bytes_pending": 4096, "batches_by_level": {"0": 2, "1": 1},
     "trace_bytes": 65536, "quarantined": False},
    {"name": "users", "sealed_upper": None, "since": 0, "trace_upper": None,
     "wal_segments_pending": 0, "wal_bytes_pending": 0, "batches_by_level": {},
     "trace_bytes": 0, "quarantined": True},
]


def documented_metric_names() -> list[str]:
    """The names in the table of lamina.compacter.metrics' docstring (the source of truth)."""
    doc = metrics_module.__doc__ or ""
    names = re.findall(r"^\| (lamina_[a-z0-9_]+) \|", doc, flags=re.MULTILINE)
    assert len(names) >= 19, f"metrics table not found or shorter than expected: {names}"
    return names


@dataclass
class Daemon:
    """Stands in for the daemon's callables: real functions that record which thread ran."""

    ready: tuple[bool, str] = (True, "ready")
    rows: list[dict[str, Any]] = field(default_factory=lambda: list(STATUS_ROWS))
    threads: list[int] = field(default_factory=list)
    fail_status: bool = False

    def status(self) -> list[dict[str, Any]]:
        self.threads.append(threading.get_ident())
        if self.fail_status:
            raise OSError("disk on fire")
        return self.rows

    def readiness(self) -> tuple[bool, str]:
        self.threads.append(threading.get_ident())
        return self.ready


@dataclass
class Server:
    daemon: Daemon
    metrics: Metrics
    runner: web.AppRunner
    base: str
    session: aiohttp.ClientSession

    async def get(self, path: str, **kw: Any) -> tuple[int, str, str]:
        async with self.session.get(self.base + path, **kw) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), await resp.text()


@pytest_asyncio.fixture
async def server() -> AsyncIterator[Server]:
    daemon = Daemon()
    metrics = Metrics()
    runner = await start_http(build_app(metrics, daemon.status, daemon.readiness),
                              "127.0.0.1", 0)
    host, port = runner.addresses[0][:2]
    async with aiohttp.ClientSession() as session:
        yield Server(daemon, metrics, runner, f"http://{host}:{port}", session)
    await stop_http(runner)


def populate(m: Metrics) -> None:
    """One series for every labelled metric, as a running daemon would have."""
    m.watch_relations(lambda: [RelationGauges(
        "orders", wal_pending_bytes=4096, wal_pending_segments=2, conversion_lag_seconds=3.5,
        trace_bytes=65536, trace_rows=8, frontier_lag=20, quarantined=False,
        batches_by_level={0: 2, 1: 1})])
    for outcome in ("success", "failure", "cancelled"):
        m.jobs.labels(kind="conversion", outcome=outcome).inc()
    m.job_seconds.labels(kind="conversion").observe(1.5)
    m.job_retries.labels(kind="merge").inc()
    m.rows_in.labels(kind="conversion").inc(10)
    m.rows_out.labels(kind="conversion").inc(8)
    m.bytes_in.labels(kind="conversion").inc(4096)
    m.bytes_out.labels(kind="conversion").inc(2048)
    m.spark_jobs.labels(shape="pack").inc()
    m.pack_steps.observe(12)
    m.steps_waiting.set(3)
    m.relations.set(1)
    m.gc_files.inc()
    m.gc_bytes.inc(100)
    m.recovery_seconds.set(0.25)


@pytest.mark.asyncio
async def test_metrics_exposes_every_documented_name(server: Server) -> None:
    populate(server.metrics)
    status, ctype, body = await server.get("/metrics")
    assert status == 200
    assert ctype.startswith("text/plain")
    assert "version=0.0.4" in ctype
    families = list(text_string_to_metric_families(body))
    exported = {f.name for f in families} | {s.name for f in families for s in f.samples}
    missing = [n for n in documented_metric_names() if n not in exported]
    assert not missing, f"documented but not served: {missing}"
    by_name = {s.name: s for f in families for s in f.samples if not s.labels}
    # readiness() is asked at scrape time, so lamina_ready is current.
    assert by_name["lamina_ready"].value == 1.0
    assert by_name["lamina_relations"].value == 1.0
    # Process collector present (the daemon's RSS and fds are worth watching).
    assert "process_resident_memory_bytes" in exported
    buckets = [s for f in families for s in f.samples
               if s.name == "lamina_job_duration_seconds_bucket"]
    # Every kind's series exists from the start (so increase() sees a first failure);
    # only the conversion populate() observed has counts.
    assert {s.labels["kind"] for s in buckets} == {"conversion", "merge", "gc"}
    assert all(s.value == 0 for s in buckets if s.labels["kind"] != "conversion")
    assert any(s.value > 0 for s in buckets if s.labels["kind"] == "conversion")


@pytest.mark.asyncio
async def test_metrics_fresh_registry_names_all_families(server: Server) -> None:
    """Even before any job ran, every documented family is declared (HELP/TYPE)."""
    status, _, body = await server.get("/metrics")
    assert status == 200
    declared = set(re.findall(r"^# TYPE (\S+) ", body, flags=re.MULTILINE))
    for name in documented_metric_names():
        assert name in declared or f"{name}_total" in declared or name.removesuffix(
            "_total") in declared, name


@pytest.mark.asyncio
async def test_metrics_openmetrics_negotiation(server: Server) -> None:
    """Prometheus asks for OpenMetrics first; the exposition must honour it."""
    status, ctype, body = await server.get(
        "/metrics", headers={"Accept": "application/openmetrics-text;version=1.0.0,"
                             "text/plain;version=0.0.4;q=0.5"})
    assert status == 200
    assert ctype.startswith("application/openmetrics-text")
    assert body.rstrip().endswith("# EOF")


@pytest.mark.asyncio
async def test_served_exposition_passes_promtool(server: Server) -> None:
    populate(server.metrics)
    _, _, body = await server.get("/metrics")
    result = promtool_check_metrics(body)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.asyncio
async def test_healthz(server: Server) -> None:
    server.daemon.ready = (False, "recovering")
    status, ctype, body = await server.get("/healthz")
    assert (status, body) == (200, "ok\n")
    assert ctype.startswith("text/plain")
    async with server.session.head(server.base + "/healthz") as resp:
        assert resp.status == 200


@pytest.mark.asyncio
async def test_readyz_follows_readiness(server: Server) -> None:
    status, _, body = await server.get("/readyz")
    assert (status, body) == (200, "ready\n")
    assert server.metrics.registry.get_sample_value("lamina_ready") == 1

    server.daemon.ready = (False, "WAL backlog 5368709120 bytes exceeds 4294967296")
    status, _, body = await server.get("/readyz")
    assert status == 503
    assert body == "WAL backlog 5368709120 bytes exceeds 4294967296\n"
    assert server.metrics.registry.get_sample_value("lamina_ready") == 0

    server.daemon.ready = (True, "ready")
    status, _, _ = await server.get("/readyz")
    assert status == 200


@pytest.mark.asyncio
async def test_relations_json_from_status_off_loop(server: Server) -> None:
    status, ctype, _ = await server.get("/v1/relations")
    assert status == 200
    assert ctype.startswith("application/json")
    async with server.session.get(server.base + "/v1/relations") as resp:
        assert await resp.json() == STATUS_ROWS
    # status() and readiness() ran on a worker thread, never on the event loop's thread.
    assert server.daemon.threads
    assert threading.get_ident() not in server.daemon.threads


@pytest.mark.asyncio
async def test_relations_error_is_500_with_reason(server: Server) -> None:
    server.daemon.fail_status = True
    async with server.session.get(server.base + "/v1/relations") as resp:
        assert resp.status == 500
        assert "disk on fire" in (await resp.json())["error"]
    # the server keeps serving
    status, _, _ = await server.get("/healthz")
    assert status == 200


@pytest.mark.asyncio
async def test_slow_status_does_not_block_health(server: Server) -> None:
    release = threading.Event()
    rows = server.daemon.rows

    def slow() -> list[dict[str, Any]]:
        release.wait(10)
        return rows

    runner = await start_http(build_app(Metrics(), slow, server.daemon.readiness),
                              "127.0.0.1", 0)
    host, port = runner.addresses[0][:2]
    base = f"http://{host}:{port}"
    try:
        pending = asyncio.ensure_future(server.session.get(base + "/v1/relations"))
        await asyncio.sleep(0.05)
        async with server.session.get(base + "/healthz",
                                      timeout=aiohttp.ClientTimeout(total=2)) as resp:
            assert resp.status == 200
        assert not pending.done()
        release.set()
        async with await pending as resp:
            assert resp.status == 200
    finally:
        release.set()
        await stop_http(runner)


@pytest.mark.asyncio
async def test_port_taken_is_config_error() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = Daemon()
        with pytest.raises(ConfigError, match=rf"127\.0\.0\.1:{port}.*already in use"):
            await start_http(build_app(Metrics(), daemon.status, daemon.readiness),
                             "127.0.0.1", port)


@pytest.mark.asyncio
async def test_stop_closes_the_port() -> None:
    daemon = Daemon()
    runner = await start_http(build_app(Metrics(), daemon.status, daemon.readiness),
                              "127.0.0.1", 0)
    host, port = runner.addresses[0][:2]
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://{host}:{port}/healthz") as resp:
            assert resp.status == 200
        await stop_http(runner)
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.get(f"http://{host}:{port}/healthz")
    # and the port can be bound again at once (a quick restart must not fail)
    runner2 = await start_http(build_app(Metrics(), daemon.status, daemon.readiness), host,
                               port)
    await stop_http(runner2)


@pytest.mark.asyncio
async def test_a_refused_request_is_a_warning_not_an_error(server: Server) -> None:
    """A request with a 1 MB header is refused with 400; the daemon logs one
    ``http.bad_request`` warning, never an error-level traceback (operators alert on
    level == "error"), and goes on serving."""
    host, port = server.base.removeprefix("http://").rsplit(":", 1)
    with capture_logs() as logs:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20)
                     + b"\r\n\r\n")
        with contextlib.suppress(ConnectionResetError):
            await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
        with contextlib.suppress(ConnectionResetError):
            await writer.wait_closed()
    assert status.split()[1].startswith(b"4"), status
    bad = [e for e in logs if e["event"] == "http.bad_request"]
    assert len(bad) == 1
    assert bad[0]["log_level"] == "warning"
    assert 400 <= bad[0]["status"] < 500
    assert not [e for e in logs if e["log_level"] == "error"]
    code, _, body = await server.get("/healthz")
    assert (code, body) == (200, "ok\n")


def test_relation_metrics_off_exports_each_gauge_once() -> None:
    """relation_metrics = false bounds the series whatever the number of relations: each
    per-relation gauge once, without the relation label, as the sum (bytes, segments,
    rows, batches per level, quarantined relations) or the maximum (the two lags)."""
    def gauges() -> list[RelationGauges]:
        return [RelationGauges(f"r{i}", wal_pending_bytes=100, wal_pending_segments=1,
                               conversion_lag_seconds=float(i), trace_bytes=10, trace_rows=2,
                               frontier_lag=i * 10, quarantined=i == 3,
                               batches_by_level={0: 1, **({2: 1} if i % 2 else {})})
                for i in range(1000)]

    per, total = Metrics(), Metrics(relation_metrics=False)
    for m in (per, total):
        m.watch_relations(gauges)
    per_text, total_text = (m.exposition().decode() for m in (per, total))
    assert per_text.count('relation="') == 1000 * 7 + 1000 + 500  # 7 + L per relation
    assert 'relation="' not in total_text
    families = {s.name: s for f in text_string_to_metric_families(total_text)
                for s in f.samples if s.name.startswith(("lamina_wal", "lamina_conv",
                                                        "lamina_trace", "lamina_frontier",
                                                        "lamina_relation_q"))}
    assert families["lamina_wal_pending_bytes"].value == 100_000
    assert families["lamina_wal_pending_segments"].value == 1000
    assert families["lamina_conversion_lag_seconds"].value == 999
    assert families["lamina_frontier_lag"].value == 9990
    assert families["lamina_relation_quarantined"].value == 1
    assert families["lamina_trace_rows"].value == 2000
    levels = {s.labels["level"]: s.value for f in text_string_to_metric_families(total_text)
              for s in f.samples if s.name == "lamina_trace_batches"}
    assert levels == {"0": 1000, "2": 500}
