"""lamina.compacter.spark: a local session's Python workers end quietly before its stop.

Run in a child process with a session of its own (stopping the workers of the test run's
shared session would take them from the other tests).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.spark]

CHILD = textwrap.dedent("""
    import json

    from lamina.compacter.spark import _children, build_session, stop_python_workers

    spark = build_session("local[2]")

    def task(batches):
        yield from batches

    spark.range(0, 8, 1, 8).mapInArrow(task, "id long").collect()  # workers now idle
    jvm = int(spark.sparkContext._jvm.ProcessHandle.current().pid())

    def daemons():
        out = []
        for pid in _children(jvm):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"pyspark.daemon" in f.read().split(b"\\0"):
                    out.append(pid)
        return out

    before = daemons()
    workers = [w for d in before for w in _children(d)]
    signalled = stop_python_workers(spark)
    after = daemons()
    spark.stop()
    print(json.dumps({"before": len(before), "workers": len(workers),
                      "signalled": signalled, "after": len(after)}))
""")


def test_the_worker_daemon_and_its_idle_workers_end_before_the_session_stops() -> None:
    """After a job, PySpark keeps its worker daemon and idle workers; stop_python_workers
    ends them (none left), and the stop that follows prints no traceback."""
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["before"] == 1, result
    assert result["workers"] >= 1, result
    assert result["signalled"] == 1, result
    assert result["after"] == 0, result
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
