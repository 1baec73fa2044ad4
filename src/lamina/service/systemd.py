"""systemd service notifications (``sd_notify(3)``) without a dependency.

Under ``Type=notify`` systemd passes ``NOTIFY_SOCKET``, an ``AF_UNIX`` datagram socket (a
path, or an abstract name written with a leading ``@``), and with ``WatchdogSec=``
``WATCHDOG_USEC`` (and usually ``WATCHDOG_PID``). The daemon uses it like this::

    notifier = Notifier()
    notifier.status("recovering")
    ...                                   # recovery, HTTP bound
    notifier.ready()                      # systemd now reports the unit as started
    interval = watchdog_interval()
    if interval is not None:              # ping at half the period, from the event loop,
        ...                               # so a stuck loop is what trips the watchdog
        notifier.watchdog()
    notifier.stopping()                   # on SIGTERM, before the grace period

Everything is a no-op when ``NOTIFY_SOCKET`` is unset (a laptop, Docker, tests). A failed
send is logged and reported by the return value, never raised: losing a notification must
not stop the service (if ``READY=1`` is lost, systemd times the start out and says so).
:func:`watchdog_loop` is the ping task both daemons run on their event loop.

The compacter's Spark JVM and Python workers inherit the environment; with
``NotifyAccess=main`` (as in ``deploy/systemd/lamina-compacter.service``) systemd ignores
anything they might send.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Mapping

import structlog

__all__ = ["Notifier", "watchdog_interval", "watchdog_loop"]

log = structlog.get_logger(__name__)

SEND_TIMEOUT_SECONDS = 1.0
"""Upper bound on one send; systemd's queue is only full when the manager is wedged."""


def _address(raw: str) -> str | None:
    """The ``sendto`` address of a ``NOTIFY_SOCKET`` value, or None if unsupported."""
    if raw.startswith("@"):
        return "\0" + raw[1:]          # abstract namespace
    if raw.startswith("/"):
        return raw
    return None                        # e.g. vsock:CID:PORT (systemd >= 253), not needed here


class Notifier:
    """Sends ``sd_notify`` messages to the socket named by ``NOTIFY_SOCKET``.

    ``env`` defaults to ``os.environ`` read once, at construction.
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        self._raw = raw
        self._address = _address(raw) if raw else None
        self._failing = False
        if raw and self._address is None:
            log.warning("systemd.notify_socket_unsupported", notify_socket=raw)

    @property
    def enabled(self) -> bool:
        """True when there is a notification socket to talk to."""
        return self._address is not None

    def notify(self, *fields: str) -> bool:
        """Send ``KEY=value`` fields in one datagram; True if it was sent."""
        if self._address is None:
            return False
        message = "\n".join(fields).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.settimeout(SEND_TIMEOUT_SECONDS)
                s.sendto(message, self._address)
        except OSError as exc:
            # Once per failure streak at warning, so a dead socket does not flood the log.
            level = log.debug if self._failing else log.warning
            level("systemd.notify_failed", notify_socket=self._raw, fields=list(fields),
                  error=str(exc))
            self._failing = True
            return False
        if self._failing:
            log.info("systemd.notify_recovered", notify_socket=self._raw)
        self._failing = False
        return True

    def ready(self) -> bool:
        """Start-up finished: recovery done, HTTP bound, work loop running."""
        return self.notify("READY=1")

    def watchdog(self) -> bool:
        """Keep-alive ping; send at :func:`watchdog_interval` while the loop is healthy."""
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        """Shutdown started (SIGTERM received)."""
        return self.notify("STOPPING=1")

    def status(self, text: str) -> bool:
        """Free-form one-line status, shown by ``systemctl status``."""
        return self.notify("STATUS=" + " ".join(text.splitlines()))

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more before start/stop time-outs fire (a long recovery or a
        long shutdown); systemd >= 236."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={max(0, round(seconds * 1e6))}")


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings: half of ``WATCHDOG_USEC``, as ``sd_watchdog_enabled``
    recommends; None when the watchdog is off, malformed, or meant for another process
    (``WATCHDOG_PID`` set and not our pid)."""
    env = os.environ if env is None else env
    raw_usec = env.get("WATCHDOG_USEC")
    if not raw_usec:
        return None
    try:
        usec = int(raw_usec)
    except ValueError:
        log.warning("systemd.watchdog_usec_invalid", watchdog_usec=raw_usec)
        return None
    if usec <= 0:
        return None
    raw_pid = env.get("WATCHDOG_PID")
    if raw_pid:
        try:
            pid = int(raw_pid)
        except ValueError:
            log.warning("systemd.watchdog_pid_invalid", watchdog_pid=raw_pid)
            return None
        if pid != os.getpid():
            return None
    return usec / 2_000_000


async def watchdog_loop(notifier: Notifier, interval: float | None) -> None:
    """Ping ``WATCHDOG=1`` every ``interval`` seconds until cancelled; returns at once when
    the watchdog is off (``interval`` None). Run it as a task on the service's event loop,
    so a stuck loop is what trips the watchdog."""
    if interval is None:
        return
    while True:
        notifier.watchdog()
        await asyncio.sleep(interval)
