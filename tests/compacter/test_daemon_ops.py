"""The running daemon as an operator's tools see it: systemd notifications over a real
unix datagram socket, and a /metrics scrape that parses and passes promtool."""

from __future__ import annotations

import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lamina.drill.procs import DaemonProcess
from tests.deploy.tools import promtool_check_metrics

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def test_notify_and_metrics_of_a_running_daemon(tmp_path: Path) -> None:
    """READY=1 once recovered, WATCHDOG=1 pings while serving, STOPPING=1 on SIGTERM (exit
    0); /metrics of the live daemon parses and passes ``promtool check metrics``."""
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.2)
    messages: list[str] = []
    done = threading.Event()

    def listen() -> None:  # read continuously, as systemd does: the queue holds only ~10
        while not done.is_set():
            try:
                messages.extend(sock.recv(4096).decode().splitlines())
            except TimeoutError:
                continue

    listener = threading.Thread(target=listen)
    listener.start()
    env = {"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "1000000"}
    try:
        with DaemonProcess(tmp_path / "data", tmp_path / "daemon.log",
                           extra_env=env) as daemon:
            daemon.wait_ready()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (
                    "READY=1" not in messages or messages.count("WATCHDOG=1") < 2):
                time.sleep(0.1)
            _scrape_and_stop(daemon)
        time.sleep(0.5)
    finally:
        done.set()
        listener.join()
        sock.close()
    assert "READY=1" in messages
    ready_at = messages.index("READY=1")
    assert messages.count("WATCHDOG=1") >= 2
    assert "STOPPING=1" in messages
    assert messages.index("STOPPING=1") > ready_at


def _scrape_and_stop(daemon: DaemonProcess) -> None:
    """Scrape /metrics (parse + promtool), then SIGTERM: the daemon must exit 0."""
    code, body = daemon.get("/metrics")
    assert code == 200
    text = body.decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"lamina_ready", "lamina_jobs", "lamina_recovery_seconds"} <= names
    checked = promtool_check_metrics(text)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    daemon.signal(signal.SIGTERM)
    assert daemon.wait() == 0
