"""The compacter's HTTP endpoints: metrics, health, readiness and relation status.

| path | answer |
|---|---|
| ``GET /metrics`` | Prometheus exposition of ``metrics.registry``; the text format 0.0.4 by |
|  | default, OpenMetrics or text 1.0.0 when the scraper's ``Accept`` asks for it |
| ``GET /healthz`` | ``200 ok`` while the process and its event loop live (a liveness probe) |
| ``GET /readyz`` | ``200`` and the reason when ``readiness()`` says ready, else ``503`` and the |
|  | reason (a readiness probe: e.g. recovery running, a relation quarantined) |
| ``GET /v1/relations`` | the JSON array ``status()`` returns, one object per relation, with the |
|  | keys of ``lamina status --json`` |

Every path also answers ``HEAD``. The daemon owns the callables; this module only serves
them; binding, the probes and ``/metrics`` are :mod:`lamina.service.http`'s::

    app = build_app(metrics, status=daemon.relation_status, readiness=daemon.readiness)
    runner = await start_http(app, settings.http_host, settings.http_port)
    ...
    await stop_http(runner)

``status`` and ``readiness`` may read the disk, so they run on a small thread pool owned by
the application (:func:`lamina.service.http.off_loop`; not the loop's default executor,
which Spark calls may keep busy: a scrape must not queue behind a conversion). They must
therefore be thread-safe, and they get a time limit (:data:`CALL_TIMEOUT_SECONDS`): a
stuck disk turns ``/readyz`` into a 503 rather than a hung probe. ``/metrics`` also asks
``readiness()`` so that ``lamina_ready`` is current at every scrape, and ``/readyz`` sets
it to the answer it gives.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from typing import Any

import structlog
from aiohttp import web

from lamina.compacter.metrics import Metrics
from lamina.service.http import (
    CALL_TIMEOUT_SECONDS,
    ReadinessFn,
    off_loop,
    service_app,
    start_http,
    stop_http,
)

__all__ = [
    "CALL_TIMEOUT_SECONDS",
    "ReadinessFn",
    "StatusFn",
    "build_app",
    "start_http",
    "stop_http",
]

log = structlog.get_logger(__name__)

StatusFn = Callable[[], list[dict[str, Any]]]
"""Returns one JSON-serialisable object per relation (the keys of ``lamina status --json``)."""

_STATUS: web.AppKey[StatusFn] = web.AppKey("lamina_status")


def build_app(metrics: Metrics, status: StatusFn, readiness: ReadinessFn) -> web.Application:
    """The aiohttp application serving ``/metrics``, ``/healthz``, ``/readyz`` and
    ``/v1/relations``. Start it with :func:`start_http`."""
    app = service_app(metrics, readiness)
    app[_STATUS] = status
    app.router.add_get("/v1/relations", _relations)
    return app


async def _relations(request: web.Request) -> web.Response:
    try:
        rows = await off_loop(request.app, request.app[_STATUS])
    except TimeoutError:
        return web.json_response(
            {"error": f"relation status took longer than {CALL_TIMEOUT_SECONDS:g} s"},
            status=503)
    except Exception as exc:
        log.exception("http.status_failed")
        return web.json_response(
            {"error": f"relation status failed: {type(exc).__name__}: {exc}"}, status=500)
    return web.json_response(rows, dumps=partial(json.dumps, default=str))
