"""lamina.compacter.spark: a local session's Python workers end quietly before its stop, and
a JVM that dies first leaves an event in the log, not a traceback.

Run in a child process with a session of its own (stopping the workers of the test run's
shared session would take them from the other tests).
"""

from __future__ import annotations

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
    import os, time

    from py4j.protocol import Py4JError

    from lamina.compacter.logs import configure_logging
    from lamina.compacter.spark import build_session

    configure_logging("json", "info")  # as the daemon does
    spark = build_session("local[2]")

    def task(batches):
        yield from batches

    spark.range(0, 4, 1, 4).mapInArrow(task, "id long").collect()  # the JVM is connected
    jvm = int(spark.sparkContext._jvm.ProcessHandle.current().pid())
    print(jvm, flush=True)  # the parent kills the JVM now

    def gone():
        try:
            with open(f"/proc/{jvm}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except FileNotFoundError:
            return True

    while not gone():
        time.sleep(0.05)
    time.sleep(1)  # the accumulator server's thread sees its connection end
    try:  # what a Java object's finalizer, or a stop, does next: a call into the dead JVM
        spark.sparkContext._jvm.System.currentTimeMillis()
    except (Py4JError, OSError):  # py4j retries once, and the reconnection is refused
        print("the call failed", flush=True)
    os._exit(0)  # no atexit hooks: they call into the JVM as well
""")


def test_a_jvm_that_dies_first_leaves_events_not_tracebacks() -> None:
    """The JVM killed under a live session (what a signal to the daemon's whole process
    group does). PySpark's accumulator server loses its connection mid-read, which printed
    socketserver's EOFError traceback: now it logs spark.accumulators_closed. A call into
    the dead JVM afterwards (a Java object's finalizer, at any garbage collection) has py4j
    log its failure through the root logger with a traceback, which lamina's logging holds
    back (below WARNING) or turns into one warning line (compacter/logs.py; a call cut off
    mid-answer is the second case, test_logs.py has both). So the child logs as the
    daemon does; CI once caught the traceback of a finalizer's call in a child that did
    not."""
    child = subprocess.Popen([sys.executable, "-c", DIES], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        os.kill(int(child.stdout.readline()), signal.SIGKILL)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0, err[-3000:]
    assert "the call failed" in out, (out + err)[-3000:]
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert "spark.accumulators_closed" in [e["event"] for e in events], err[-3000:]
    assert "Traceback" not in out + err, (out + err)[-3000:]
