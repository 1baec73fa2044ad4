"""Reading a running daemon's /metrics in tests (no pytest import: plain helpers)."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from lamina.drill.procs import DaemonProcess


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the sample ``name`` with ``labels`` in a /metrics exposition."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"{name}{labels} not in /metrics")


def scrape_after_conversions(daemon: DaemonProcess, n: int, timeout: float = 30.0) -> str:
    """/metrics once ``n`` successful conversions have been counted (or the timeout
    passed). The daemon counts a conversion just after deleting its segments, so
    /v1/relations may show the backlog gone a moment before /metrics shows the job."""
    deadline = time.monotonic() + timeout
    while True:
        code, body = daemon.get("/metrics")
        assert code == 200, body
        text = body.decode()
        done = metric(text, "lamina_jobs_total", kind="conversion", outcome="success")
        if done >= n or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def wait_trace_upper(daemon: DaemonProcess, relation: str, upper: int,
                     timeout: float = 120.0) -> None:
    """Until the relation's trace reaches ``upper`` (every update sealed below it is
    converted), as /v1/relations reports it."""
    deadline = time.monotonic() + timeout
    rows: list[dict[str, object]] = []
    while time.monotonic() < deadline:
        try:
            rows = [r for r in daemon.relations() if r["name"] == relation]
        except OSError:  # a slow answer on a busy machine: ask again
            rows = []
        if rows and rows[0]["trace_upper"] == upper:
            return
        assert daemon.proc.poll() is None, daemon.log_path.read_text()[-4000:]
        time.sleep(0.2)
    raise AssertionError(f"trace of {relation} did not reach {upper}: {rows}\n"
                         + daemon.log_path.read_text()[-3000:])
