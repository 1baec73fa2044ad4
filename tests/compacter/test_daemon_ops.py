"""The running daemon as an operator's tools see it: systemd notifications over a real
unix datagram socket, a /metrics scrape that parses and passes promtool, and the job
counters after real conversions."""

from __future__ import annotations

import signal
import socket
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lamina.drill.procs import DaemonProcess
from lamina.store import Store
from lamina.wal.segment import list_segments
from tests.compacter.scrape import metric, scrape_after_jobs, wait_trace_upper
from tests.conftest import ORDERS, updates
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
    # the in-process executor: what is checked is the service manager's protocol and the
    # exposition, not Spark (whose jobs' metrics test_conversions_count_the_updates_they_read
    # scrapes), and a JVM's start costs the suite 10 s of CPU
    env = {"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "1000000",
           "LAMINA_EXECUTOR": "inprocess"}
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


def test_conversions_count_the_updates_they_read(tmp_path: Path) -> None:
    """``lamina_job_input_rows_total{kind="conversion"}`` counts every update a conversion
    decodes: the WAL's updates, and future updates once more when the conversion that
    reaches their time brings them in from the pending area. All rows are distinct, so
    nothing consolidates away between the two reads."""
    data = tmp_path / "data"
    future_time, n_past, n_future, n_late = 1_000, 0, 40, 25
    with Store.open(data, segment_bytes=4096, fsync="never") as store:
        rel = store.create_relation("orders", ORDERS, key=["id"])
        next_id = 0
        for t in range(12):  # every append passes the segment target: one segment each
            rows = [(next_id + i, "x" * 40, t, 1) for i in range(60)]
            if t == 5:  # future updates, far beyond every seal of this phase
                rows += [(10_000 + i, "future", future_time, 1) for i in range(n_future)]
            next_id += 60
            n_past += 60
            rel.append(updates(rows))
            rel.seal(t + 1)
        first_upper = rel.upper
        assert all(s.finished for s in list_segments(store.layout.wal_dir("orders"))[:-1])
    with DaemonProcess(data, tmp_path / "daemon.log") as daemon:
        daemon.wait_ready()
        wait_trace_upper(daemon, "orders", first_upper)
        text = scrape_after_jobs(daemon, 1)
        converted = metric(text, "lamina_jobs_total", kind="conversion", outcome="success")
        assert converted == 1, "the backlog present at start-up is one conversion"
        assert metric(text, "lamina_job_input_rows_total",
                      kind="conversion") == n_past + n_future
        assert metric(text, "lamina_job_output_rows_total",
                      kind="conversion") == n_past + n_future
        with Store.open(data, segment_bytes=4096, fsync="never") as store:
            rel = store.relation("orders")  # one more segment, sealed past the future time
            rel.append(updates([(20_000 + i, "late" * 50, future_time + 1, 1)
                                for i in range(n_late)]))
            rel.seal(future_time + 2)
            assert list_segments(store.layout.wal_dir("orders"))[-2].finished
        wait_trace_upper(daemon, "orders", future_time + 2)
        text = scrape_after_jobs(daemon, 2)
        assert metric(text, "lamina_jobs_total", kind="conversion", outcome="success") == 2
        assert metric(text, "lamina_job_input_rows_total",
                      kind="conversion") == n_past + n_future + n_late + n_future
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0
    with Store.open(data) as store:  # and the data is all there, once
        assert store.relation("orders").snapshot(future_time + 1).num_rows == (
            n_past + n_future + n_late)
