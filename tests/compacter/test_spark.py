"""lamina.compacter.spark: a local session's Python workers end quietly before its stop, and
a JVM that dies first leaves an event in the log, not a traceback.

Run in a child process with a session of its own (stopping the workers of the test run's
shared session would take them from the other tests).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
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


DIES = textwrap.dedent("""
    import os, signal, time

    from lamina.compacter.spark import build_session

    spark = build_session("local[2]")

    def task(batches):
        yield from batches

    spark.range(0, 4, 1, 4).mapInArrow(task, "id long").collect()  # the JVM is connected
    print(int(spark.sparkContext._jvm.ProcessHandle.current().pid()), flush=True)
    time.sleep(30)  # the parent kills the JVM meanwhile, then this process
""")


def test_a_jvm_that_dies_first_leaves_an_event_not_a_traceback() -> None:
    """The JVM killed under a live session (what a signal to the daemon's whole process
    group does): PySpark's accumulator server loses its connection mid-read, which printed
    socketserver's EOFError traceback; now it logs spark.accumulators_closed."""
    child = subprocess.Popen([sys.executable, "-c", DIES], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        jvm = int(child.stdout.readline())
        os.kill(jvm, signal.SIGKILL)
        out, err = "", ""
        with contextlib.suppress(subprocess.TimeoutExpired):
            out, err = child.communicate(timeout=3)  # the server thread sees the end
    finally:
        child.kill()
        more_out, more_err = child.communicate(timeout=30)
    out, err = out + more_out, err + more_err
    assert "spark.accumulators_closed" in out + err, (out + err)[-3000:]
    assert "Traceback" not in out + err, (out + err)[-3000:]
