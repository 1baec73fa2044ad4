"""configure_logging: JSON lines with the keys the daemon binds, stdlib routing, console;
and the daemon's own lines keeping that contract."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.contextvars import bound_contextvars

from lamina.compacter.daemon import Daemon
from lamina.compacter.logs import NOISY_LOGGERS, configure_logging
from lamina.drill.procs import free_port
from lamina.errors import ConfigError
from tests.compacter.backlog import backlog, settings, until

ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """Put the root logger and structlog back as they were: configure_logging is global."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    noisy = {n: logging.getLogger(n).level for n in NOISY_LOGGERS}
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
            h.close()
    root.setLevel(level)
    for n, lvl in noisy.items():
        logging.getLogger(n).setLevel(lvl)
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def lines(buf: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def test_json_lines_carry_bound_keys() -> None:
    buf = io.StringIO()
    configure_logging("json", "info", stream=buf)
    log = structlog.get_logger("lamina.compacter.daemon").bind(relation="orders")
    log.info("conversion.committed", segments=[17, 18], batch="b-000042",
             duration_seconds=1.84)
    with bound_contextvars(job="merge", batch="b-000043"):
        structlog.get_logger("lamina.trace").warning("merge.slow", duration_seconds=61.0)
    log.debug("hidden at info")

    first, second = lines(buf)
    assert first["event"] == "conversion.committed"
    assert first["level"] == "info"
    assert first["logger"] == "lamina.compacter.daemon"
    assert ISO_UTC.match(first["timestamp"]), first["timestamp"]
    assert first["relation"] == "orders"
    assert first["segments"] == [17, 18]
    assert first["batch"] == "b-000042"
    assert first["duration_seconds"] == 1.84
    assert second["event"] == "merge.slow"
    assert second["level"] == "warning"
    assert (second["job"], second["batch"]) == ("merge", "b-000043")
    assert ISO_UTC.match(second["timestamp"])


def test_exceptions_are_one_json_line() -> None:
    buf = io.StringIO()
    configure_logging("json", "info", stream=buf)
    try:
        raise RuntimeError("spark said no")
    except RuntimeError:
        structlog.get_logger("lamina").exception("job.failed", relation="orders")
    [rec] = lines(buf)
    assert rec["level"] == "error"
    assert "RuntimeError: spark said no" in rec["exception"]


def test_stdlib_loggers_are_routed_and_noisy_ones_held_at_warning() -> None:
    buf = io.StringIO()
    configure_logging("json", "debug", stream=buf)
    logging.getLogger("py4j.clientserver").info("chatty")
    logging.getLogger("aiohttp.access").info("GET /metrics")
    logging.getLogger("pyspark").warning("executor %s lost", 3)
    logging.getLogger("lamina.wal").debug("segment %d finished", 7,
                                          extra={"relation": "orders"})
    recs = lines(buf)
    assert [r["event"] for r in recs] == ["executor 3 lost", "segment 7 finished"]
    assert recs[0]["logger"] == "pyspark"
    assert recs[0]["level"] == "warning"
    assert ISO_UTC.match(recs[0]["timestamp"])
    assert recs[1]["relation"] == "orders"
    assert recs[1]["level"] == "debug"


def test_noisy_packages_logging_through_the_root_logger_are_held_too() -> None:
    """py4j logs "Exception while sending command." with a traceback at INFO through the
    root logger (``logging.info``) when the JVM is gone: held like its own loggers, while
    its warnings and everyone else's root records still pass. When it cannot retry it logs
    the line at ERROR (``logging.exception``, seen when a stop signal to the process group
    killed the JVM amid a pack): that passes as a warning of one line, its exception named
    but without the traceback (lamina logs the consequence), and only py4j's does: an
    app's own error keeps its level and its traceback."""
    buf = io.StringIO()
    configure_logging("json", "info", stream=buf)
    root = logging.getLogger()
    gateway = "/venv/lib/python3.11/site-packages/py4j/java_gateway.py"

    def raised(exc: Exception) -> Any:
        try:
            try:
                raise ConnectionResetError(104, "Connection reset by peer")
            except OSError as cause:
                raise exc from cause
        except Exception:
            return sys.exc_info()

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("the JVM is gone")

    for level, path, msg, exc_info in (
            (logging.INFO, gateway, "Exception while sending command.", None),
            (logging.WARNING, gateway, "gateway gone", None),
            (logging.ERROR, gateway, "Exception while sending command.",
             raised(OSError("Error while sending or receiving"))),
            (logging.ERROR, gateway, "cannot retry", raised(Unprintable())),
            (logging.INFO, "/app/main.py", "an app's own line", None),
            (logging.ERROR, "/app/main.py", "an app's own error", raised(ValueError("bad")))):
        root.handle(root.makeRecord("root", level, path, 1, msg, (), exc_info))
    recs = lines(buf)
    assert [(r["event"], r["level"]) for r in recs] == [
        ("gateway gone", "warning"),
        ("Exception while sending command. (OSError: Error while sending or receiving; "
         "from ConnectionResetError: [Errno 104] Connection reset by peer)", "warning"),
        ("cannot retry (Unprintable: <no message>; from ConnectionResetError: [Errno 104] "
         "Connection reset by peer)", "warning"),
        ("an app's own line", "info"), ("an app's own error", "error")]
    assert [("exception" in r) for r in recs] == [False, False, False, False, True]
    assert "Traceback" in recs[-1]["exception"]


def test_auto_is_json_off_a_tty_and_console_on_one() -> None:
    buf = io.StringIO()
    configure_logging("auto", "info", stream=buf)
    structlog.get_logger("lamina").info("hello", relation="orders")
    assert lines(buf)[0]["relation"] == "orders"

    tty = FakeTTY()
    configure_logging("auto", "info", stream=tty)
    structlog.get_logger("lamina").info("hello", relation="orders")
    out = tty.getvalue()
    assert "hello" in out
    assert "relation" in out
    assert not out.lstrip().startswith("{")


def test_reconfiguring_replaces_the_handler() -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("json", "info", stream=first)
    configure_logging("json", "warning", stream=second)
    structlog.get_logger("lamina").info("dropped")
    structlog.get_logger("lamina").warning("kept")
    assert first.getvalue() == ""
    assert [r["event"] for r in lines(second)] == ["kept"]


def test_bad_level_is_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown log level"):
        configure_logging("json", "loud")


DOTTED = re.compile(r"^[a-z_]+(\.[a-z_]+)+$")


def test_the_daemon_keeps_the_contract(tmp_path: Path) -> None:
    """A real in-process daemon run (conversions, merges, GC, SIGTERM) logs only dotted
    event names, from per-module loggers, with durations as ``duration_seconds``; a
    merge's level is ``batch_level`` and ``level`` stays the log level."""
    backlog(tmp_path, rounds=16)  # 8 segments: 4 conversions, 3 merges
    daemon = Daemon(settings(tmp_path, http=f"127.0.0.1:{free_port()}",
                             max_segments_per_job=2, gc_interval_seconds=0.01,
                             gc_grace_seconds=0, keep_versions=1))
    buf = io.StringIO()
    configure_logging("json", "info", stream=buf)

    async def run() -> int:
        task = asyncio.create_task(daemon.run())
        await until("merges and a GC", lambda: '"gc.collected"' in buf.getvalue()
                    and buf.getvalue().count('"merge.committed"') >= 2)
        os.kill(os.getpid(), signal.SIGTERM)
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(run()) == 0
    recs = lines(buf)
    by_event: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        by_event.setdefault(r["event"], []).append(r)
        assert DOTTED.match(r["event"]), r
        assert r["level"] in ("debug", "info", "warning", "error", "critical"), r
        assert "seconds" not in r, r
    for event in ("daemon.starting", "daemon.ready", "shutdown.requested", "daemon.stopped"):
        assert by_event[event][0]["logger"] == "lamina.compacter.daemon", event
    for event in ("relation.recovered", "conversion.started", "conversion.committed",
                  "merge.started", "merge.committed", "gc.collected"):
        assert by_event[event][0]["logger"] == "lamina.compacter.pipeline", event
        assert by_event[event][0]["relation"] == "orders"
    merge = by_event["merge.committed"][0]
    assert merge["level"] == "info"
    assert merge["batch_level"] == 0
    assert merge["batch_level_out"] == 1
    for event in ("conversion.committed", "merge.committed", "gc.collected",
                  "relation.recovered", "daemon.stopped"):
        assert all(isinstance(r["duration_seconds"], float) for r in by_event[event]), event
