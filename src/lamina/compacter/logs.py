"""Structured logging for the compacter: JSON lines for machines, a console view for people.

:func:`configure_logging` is called once at start-up, before anything logs. Every line is
one event with key-values; with ``fmt="json"`` (or ``"auto"`` when stderr is not a TTY:
systemd's journal, Docker, a pipe) it is one JSON object per line::

    {"relation": "orders", "segments": "17..18", "batch": "b-000042", "rows_out": 1200,
     "duration_seconds": 1.84, "event": "conversion.committed", "level": "info",
     "logger": "lamina.compacter.pipeline", "timestamp": "2025-05-01T12:00:00.123456Z"}

``timestamp`` is ISO 8601 in UTC, ``level`` is lower case, ``event`` is a stable dotted
name ``<subject>.<what happened>`` (grep for it, alert on it; docs/operations.md lists
them), ``logger`` is the emitting module (``structlog.get_logger(__name__)``); everything
else is bound context. ``level``, ``event``, ``logger`` and ``timestamp`` are reserved: a
batch's compaction level is ``batch_level`` (a merge's output ``batch_level_out``), never
``level``, which would overwrite the log level. Standard-library loggers
(py4j, pyspark, aiohttp, asyncio) go through the same renderer; py4j, pyspark and aiohttp
only from WARNING up, whatever the level, because they are chatty below it.

How the daemon binds the ids every event carries::

    import structlog
    from structlog.contextvars import bound_contextvars

    log = structlog.get_logger(__name__)

    # 1. A bound logger: the keys ride along on every call made through it.
    rlog = log.bind(relation=name)
    rlog.info("conversion.submitted", segments=[s.seq for s in segs], batch=desc.id,
              lower=desc.lower, upper=desc.upper, wal_bytes=total)

    # 2. Context variables: bound for a block (one asyncio task = one context, so two
    #    concurrent jobs do not mix their keys). Code deeper down that only does
    #    structlog.get_logger(...).info(...) still carries them.
    with bound_contextvars(relation=name, job="conversion", batch=desc.id):
        t0 = time.monotonic()
        await run_conversion(...)
        log.info("conversion.committed", rows_out=rows,
                 duration_seconds=round(time.monotonic() - t0, 3))

    # 3. Exceptions: log.exception(...) inside an except block adds the traceback
    #    ("exception" key in JSON).

Context variables follow ``asyncio.create_task`` and ``asyncio.to_thread`` (which copy the
current context), but not ``loop.run_in_executor``: bind explicitly in such callbacks.
Durations are in seconds (``duration_seconds``), sizes in bytes, as in the metrics.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal, TextIO

import structlog
from structlog.typing import Processor

from lamina.errors import ConfigError

__all__ = ["NOISY_LOGGERS", "configure_logging"]

NOISY_LOGGERS = ("py4j", "pyspark", "aiohttp")
"""Standard-library loggers held at WARNING or above."""

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}


class _LaminaHandler(logging.StreamHandler[TextIO]):
    """Marks the root handler this module installed, so reconfiguring replaces it."""


class _NoisyModules(logging.Filter):
    """Holds records of the noisy packages below WARNING even when they log through the
    root logger, as py4j does (``logging.info("Exception while sending command.",
    exc_info=True)`` when the JVM is gone, e.g. after a stop signal to the process group):
    a logger's level cannot catch those. When py4j cannot retry it logs the same line with
    ``logging.exception``; that record is passed as a warning of one line (the exception's
    type and message, and its cause's, after py4j's text; no traceback), since the call
    that failed raises and lamina logs what follows from it at the level it deserves (a
    failed job is retried, ``spark.stop_failed`` at a stop). ``error`` is for what an
    operator must act on, and a traceback for a bug (docs/operations.md)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != "root" or not any(f"/{name}/" in record.pathname
                                            for name in NOISY_LOGGERS):
            return True
        if record.levelno > logging.WARNING:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            exc = record.exc_info[1] if record.exc_info else None
            if exc is not None:
                cause = exc.__cause__ or exc.__context__
                why = f"{_summary(exc)}; from {_summary(cause)}" if cause else _summary(exc)
                record.msg, record.args = f"{record.getMessage()} ({why})", None
            record.exc_info, record.exc_text = None, None
        return record.levelno >= logging.WARNING


def _summary(exc: BaseException) -> str:
    """``Type: message`` of an exception whose ``str`` may itself fail (py4j's errors
    call into a JVM that may be gone)."""
    try:
        text = str(exc)
    except Exception:
        text = "<no message>"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def configure_logging(fmt: Literal["auto", "json", "console"], level: str, *,
                      stream: TextIO | None = None) -> None:
    """Route structlog and standard-library logging to ``stream`` (default: stderr).

    ``fmt="auto"`` renders for a person when ``stream`` is a TTY and JSON lines otherwise.
    ``level`` is a name (``debug``, ``info``, ``warning``, ``error``; any case). Calling it
    again replaces the previous configuration.
    """
    lvl = _LEVELS.get(level.lower())
    if lvl is None:
        raise ConfigError(f"unknown log level {level!r}; use one of {', '.join(_LEVELS)}")
    if fmt not in ("auto", "json", "console"):
        raise ConfigError(f"unknown log format {fmt!r}; use auto, json or console")
    out = sys.stderr if stream is None else stream
    if fmt == "auto":
        isatty = getattr(out, "isatty", None)
        fmt = "console" if isatty is not None and isatty() else "json"

    # Run for structlog events and for stdlib records alike.
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.stdlib.ExtraAdder(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: list[Processor]
    if fmt == "json":
        renderer = [
            structlog.processors.format_exc_info,
            structlog.processors.UnicodeDecoder(),
            structlog.processors.JSONRenderer(sort_keys=False),
        ]
    else:
        renderer = [structlog.dev.ConsoleRenderer(
            colors=bool(getattr(out, "isatty", lambda: False)()),
            exception_formatter=structlog.dev.RichTracebackFormatter(show_locals=False),
        )]

    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
    )
    handler = _LaminaHandler(out)
    handler.setFormatter(formatter)
    handler.addFilter(_NoisyModules())

    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _LaminaHandler)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(lvl)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(max(lvl, logging.WARNING))

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        context_class=dict,
        # Not cached: module-level loggers created before (re)configuration follow it.
        cache_logger_on_first_use=False,
    )
