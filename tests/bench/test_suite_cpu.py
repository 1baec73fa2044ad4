"""``python -m bench.suite_cpu``: the CPU of a command by kind of process, and of the tests
that run inside pytest's own processes, by test (through tests/conftest.py's log)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import suite_cpu

ROOT = Path(__file__).resolve().parents[2]
QUICK = "tests/test_threads.py"


def test_in_worker_cpu_adds_a_test_seen_twice_and_sorts_costliest_first() -> None:
    lines = "\n".join(json.dumps(e) for e in (
        {"test": "a::x", "cpu": 0.25}, {"test": "b::y", "cpu": 1.0}, {"test": "a::x", "cpu": 1.0}))
    assert suite_cpu.in_worker_cpu(lines + "\n\n") == [("a::x", 1.25), ("b::y", 1.0)]


def test_a_pytest_run_is_split_by_test(tmp_path: Path) -> None:
    """Every test the inner run collected is listed with its in-process CPU, and the
    pytest process itself is counted by kind."""
    out = tmp_path / "cpu.json"
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "0", "-q", "--collect-only", "-p",
         "no:cacheprovider", QUICK], cwd=ROOT, capture_output=True, text=True, check=True)
    want = {line for line in collected.stdout.splitlines() if line.startswith(QUICK + "::")}
    assert want, collected.stdout
    run = subprocess.run(
        [sys.executable, "-m", "bench.suite_cpu", "--json", str(out), "--",
         sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider", QUICK],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert {test for test, _ in result["in_workers_by_test"]} == want
    assert all(seconds >= 0 for _, seconds in result["in_workers_by_test"])
    assert dict(result["by_kind"]).get("python:pytest", 0) > 0
    assert "CPU seconds of tests inside the xdist workers" in run.stdout
