"""The HTTP plumbing every daemon shares: binding, the probes and the metrics endpoint.

| path | answer |
|---|---|
| ``GET /metrics`` | Prometheus exposition of ``metrics.registry``; the text format 0.0.4 by |
|  | default, OpenMetrics or text 1.0.0 when the scraper's ``Accept`` asks for it |
| ``GET /healthz`` | ``200 ok`` while the process and its event loop live (a liveness probe) |
| ``GET /readyz`` | ``200`` and the reason when ``readiness()`` says ready, else ``503`` and the |
|  | reason (a readiness probe) |

Every path also answers ``HEAD``. A daemon builds its application with
:func:`service_app` and adds its own routes (the compacter ``/v1/relations``, the ingest
service ``/v1/sources``), running anything that may block through :func:`off_loop`::

    app = service_app(metrics, readiness)
    app.router.add_get("/v1/things", handler)
    runner = await start_http(app, settings.http_host, settings.http_port)
    ...
    await stop_http(runner)

``readiness`` (and what a daemon passes to :func:`off_loop`) may read the disk, so it runs
on a small thread pool owned by the application (not the loop's default executor, which
Spark calls may keep busy: a scrape must not queue behind a conversion). It must therefore
be thread-safe, and it gets a time limit (:data:`CALL_TIMEOUT_SECONDS`): a stuck disk turns
``/readyz`` into a 503 rather than a hung probe. ``/metrics`` also asks ``readiness()`` so
that the ``ready`` gauge is current at every scrape, and ``/readyz`` sets it to the answer
it gives.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import structlog
from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client.exposition import choose_encoder

from lamina.errors import ConfigError
from lamina.service.metrics import ServiceMetrics

__all__ = [
    "CALL_TIMEOUT_SECONDS",
    "ReadinessFn",
    "off_loop",
    "service_app",
    "start_http",
    "stop_http",
]

log = structlog.get_logger(__name__)

ReadinessFn = Callable[[], tuple[bool, str]]
"""Returns ``(ready, reason)``; the reason is shown to whoever probes ``/readyz``."""

CALL_TIMEOUT_SECONDS = 10.0
"""How long a call run by :func:`off_loop` (``readiness()``, a status) may take before the
request gives up."""

SHUTDOWN_TIMEOUT_SECONDS = 5.0
"""How long :func:`stop_http` lets in-flight requests finish; every request is short."""

_T = TypeVar("_T")

METRICS: web.AppKey[ServiceMetrics] = web.AppKey("lamina_metrics", ServiceMetrics)
READINESS: web.AppKey[ReadinessFn] = web.AppKey("lamina_readiness")
_POOL: web.AppKey[ThreadPoolExecutor] = web.AppKey("lamina_pool", ThreadPoolExecutor)


def service_app(metrics: ServiceMetrics, readiness: ReadinessFn) -> web.Application:
    """An aiohttp application serving ``/metrics``, ``/healthz`` and ``/readyz``, with the
    thread pool of :func:`off_loop`; add the daemon's own routes, then :func:`start_http`."""
    app = web.Application()
    app[METRICS] = metrics
    app[READINESS] = readiness
    app[_POOL] = ThreadPoolExecutor(max_workers=4, thread_name_prefix="lamina-http")
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.on_cleanup.append(_shutdown_pool)
    return app


class _ServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's request-handler logger, except that a request the server refused as the
    client's fault (a 4xx: headers over 8 KiB, a malformed request line) is one
    ``http.bad_request`` warning without a traceback: aiohttp logs those at error level
    with one, and error is for what an operator must act on (lamina.events)."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})

    def exception(self, msg: object, *args: object, exc_info: Any = True,
                  **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError) and 400 <= exc.code < 500:
            log.warning("http.bad_request", status=exc.code,
                        reason=str(exc.message).splitlines()[0][:200] if exc.message else "")
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


async def start_http(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Bind ``host:port`` and serve ``app``; port 0 picks a free port (read it from
    ``runner.addresses``). Raises :class:`~lamina.errors.ConfigError` when the address
    cannot be bound (port taken, address not local, privileged port)."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_SECONDS,
                           logger=_ServerLog())
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        where = f"{host}:{port}"
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"cannot serve HTTP on {where}: the address is already in use (another "
                "`lamina serve` may be running); stop it or choose another address with "
                "--http HOST:PORT / LAMINA_HTTP") from exc
        raise ConfigError(
            f"cannot serve HTTP on {where}: {exc.strerror or exc}; choose another address "
            "with --http HOST:PORT / LAMINA_HTTP") from exc
    log.info("http.listening", addresses=[f"{a[0]}:{a[1]}" for a in runner.addresses])
    return runner


async def stop_http(runner: web.AppRunner) -> None:
    """Stop listening, let in-flight requests finish (bounded by
    :data:`SHUTDOWN_TIMEOUT_SECONDS`) and release the thread pool."""
    await runner.cleanup()
    log.info("http.stopped")


async def off_loop(app: web.Application, fn: Callable[[], _T]) -> _T:
    """Run ``fn`` on the application's thread pool, bounded by
    :data:`CALL_TIMEOUT_SECONDS` (TimeoutError)."""
    loop = asyncio.get_running_loop()
    return await asyncio.wait_for(loop.run_in_executor(app[_POOL], fn), CALL_TIMEOUT_SECONDS)


async def _shutdown_pool(app: web.Application) -> None:
    # Do not wait for a stuck call: the daemon is exiting anyway.
    app[_POOL].shutdown(wait=False, cancel_futures=True)


async def _readiness(app: web.Application) -> tuple[bool, str]:
    """Ask ``readiness()`` off the loop; a failure or time-out is 'not ready'."""
    try:
        ready, reason = await off_loop(app, app[READINESS])
    except TimeoutError:
        ready, reason = False, f"readiness check took longer than {CALL_TIMEOUT_SECONDS:g} s"
    except Exception as exc:
        log.exception("http.readiness_failed")
        ready, reason = False, f"readiness check failed: {type(exc).__name__}: {exc}"
    app[METRICS].ready.set(1 if ready else 0)
    return bool(ready), str(reason)


async def _metrics(request: web.Request) -> web.Response:
    app = request.app
    await _readiness(app)
    encoder, content_type = choose_encoder(request.headers.get(hdrs.ACCEPT, ""))
    body = await off_loop(app, partial(encoder, app[METRICS].registry))
    return web.Response(body=body, headers={hdrs.CONTENT_TYPE: content_type})


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def _readyz(request: web.Request) -> web.Response:
    ready, reason = await _readiness(request.app)
    return web.Response(status=200 if ready else 503, text=(reason or "ready") + "\n")
