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


def scrape_after_jobs(daemon: DaemonProcess, n: int, kind: str = "conversion",
                      timeout: float = 30.0) -> str:
    """/metrics once ``n`` successful jobs of ``kind`` (conversion, merge) have been counted
    (or the timeout passed). The daemon counts a step just after committing it (a
    conversion after deleting its segments), so /v1/relations may show the backlog gone a
    moment before /metrics shows the job."""
    deadline = time.monotonic() + timeout
    while True:
        code, body = daemon.get("/metrics")
        assert code == 200, body
        text = body.decode()
        done = metric(text, "lamina_jobs_total", kind=kind, outcome="success")
        if done >= n or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def wait_some_work(daemon: DaemonProcess, relation: str, timeout: float = 90.0) -> None:
    """Until the daemon has committed a conversion of ``relation`` (its trace upper is above
    0), as /v1/relations reports it: a kill after this lands while the daemon works."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = [r for r in daemon.relations() if r["name"] == relation]
        if rows and rows[0]["trace_upper"] > 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"no conversion of {relation} committed: "
                         + daemon.log_path.read_text()[-3000:])


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
