"""The HTTP endpoints of ``lamina ingest`` (default ``127.0.0.1:9741``).

| path | answer |
|---|---|
| ``GET /metrics`` | Prometheus exposition of the ingest registry (text 0.0.4, or OpenMetrics |
|  | when the scraper's ``Accept`` asks for it) |
| ``GET /healthz`` | ``200 ok`` while the process and its event loop live |
| ``GET /readyz`` | ``200`` when every source is ``running`` with no output stalled, else ``503`` |
|  | naming the sources and outputs that are not |
| ``GET /v1/sources`` | a JSON array, one object per source: ``name``, ``kind``, ``state``, |
|  | ``error``, ``hint``, ``resume_frontier``, ``binding_time``, ``binding_upper``, |
|  | ``source_upper``, ``committed``, ``transactions``, ``lag_offsets``, |
|  | ``lag_seconds`` and ``outputs`` (``relation``, ``upstream``, ``state``, ``error``, |
|  | ``hint``, ``upper``, ``since``, ``changes``) |
| ``POST /v1/sources/<name>/resync`` | body ``{"table": "public.orders"}``: resync that table |
|  | (:mod:`lamina.ingest.resync`) and answer with what was done once it is (``200``); |
|  | ``404`` for an unknown source or table, ``409`` with ``error`` and ``hint`` when |
|  | the resync failed (``lamina ingest resync`` is the client) |

Binding, ``/metrics``, ``/healthz`` and ``/readyz`` are :mod:`lamina.service.http`'s
(shared with the compacter). Status is kept in memory by the source threads (under their
locks), so ``/v1/sources`` answers on the loop without touching the disk. A resync runs in
the source's own thread; the request waits for it without blocking the loop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

from aiohttp import web

from lamina.errors import ConfigError, SourceError, SourceStalledError
from lamina.ingest.metrics import IngestMetrics
from lamina.service.http import ReadinessFn, service_app, start_http, stop_http

__all__ = ["build_app", "serve", "stop_http"]

SourcesFn = Callable[[], list[dict[str, Any]]]
ResyncFn = Callable[[str, str], "Future[dict[str, Any]]"]

_SOURCES: web.AppKey[SourcesFn] = web.AppKey("lamina_ingest_sources")
_RESYNC: web.AppKey[ResyncFn] = web.AppKey("lamina_ingest_resync")


def build_app(metrics: IngestMetrics, sources: SourcesFn, readiness: ReadinessFn,
              resync: ResyncFn) -> web.Application:
    app = service_app(metrics, readiness)
    app[_SOURCES] = sources
    app[_RESYNC] = resync
    app.router.add_get("/v1/sources", _sources)
    app.router.add_post("/v1/sources/{name}/resync", _resync)
    return app


async def serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Bind and serve; ConfigError (naming ``--http``) when the address cannot be bound."""
    try:
        return await start_http(app, host, port)
    except ConfigError as exc:
        raise ConfigError(f"lamina ingest cannot serve HTTP on {host}:{port}: "
                          f"{exc.__cause__ or exc}; stop whatever holds it or choose another "
                          "address with --http HOST:PORT / LAMINA_INGEST_HTTP") from exc


async def _sources(request: web.Request) -> web.Response:
    return web.json_response(request.app[_SOURCES](), dumps=partial(json.dumps, default=str))


async def _resync(request: web.Request) -> web.Response:
    try:
        body = await request.json()
        table = body["table"]
        if not isinstance(table, str):
            raise TypeError(table)
    except (ValueError, KeyError, TypeError):
        return web.json_response({"error": 'the body must be {"table": "<upstream table>"}'},
                                 status=400)
    try:
        fut = request.app[_RESYNC](request.match_info["name"], table)
    except (LookupError, SourceStalledError) as exc:
        return web.json_response({"error": getattr(exc, "error", str(exc)),
                                  "hint": getattr(exc, "hint", "")}, status=404)
    try:
        done = await asyncio.wrap_future(fut)
    except SourceError as exc:
        return web.json_response({"error": getattr(exc, "error", str(exc)),
                                  "hint": getattr(exc, "hint", "")}, status=409)
    except Exception as exc:  # storage and other failures: said, never a 500 page
        return web.json_response({"error": f"{type(exc).__name__}: {exc}", "hint": ""},
                                 status=409)
    return web.json_response(done)
