"""The HTTP endpoints of ``lamina ingest`` (default ``127.0.0.1:9741``).

| path | answer |
|---|---|
| ``GET /metrics`` | Prometheus exposition of the ingest registry (text 0.0.4, or OpenMetrics |
|  | when the scraper's ``Accept`` asks for it) |
| ``GET /healthz`` | ``200 ok`` while the process and its event loop live |
| ``GET /readyz`` | ``200`` when every source is ``running``, else ``503`` and the reason |
| ``GET /v1/sources`` | a JSON array, one object per source: ``name``, ``kind``, ``state``, |
|  | ``error``, ``hint``, ``resume_frontier``, ``binding_time``, ``binding_upper``, |
|  | ``source_upper``, ``committed``, ``transactions``, ``lag_offsets``, |
|  | ``lag_seconds`` and ``outputs`` (``relation``, ``upstream``, ``state``, ``error``, |
|  | ``hint``, ``upper``, ``changes``) |

Binding, ``/metrics``, ``/healthz`` and ``/readyz`` are :mod:`lamina.service.http`'s
(shared with the compacter). Status is kept in memory by the source threads (under their
locks), so ``/v1/sources`` answers on the loop without touching the disk.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any

from aiohttp import web

from lamina.errors import ConfigError
from lamina.ingest.metrics import IngestMetrics
from lamina.service.http import ReadinessFn, service_app, start_http, stop_http

__all__ = ["build_app", "serve", "stop_http"]

SourcesFn = Callable[[], list[dict[str, Any]]]

_SOURCES: web.AppKey[SourcesFn] = web.AppKey("lamina_ingest_sources")


def build_app(metrics: IngestMetrics, sources: SourcesFn,
              readiness: ReadinessFn) -> web.Application:
    app = service_app(metrics, readiness)
    app[_SOURCES] = sources
    app.router.add_get("/v1/sources", _sources)
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
