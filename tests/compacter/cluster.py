"""A Spark standalone cluster on 127.0.0.1 for tests, and the child that uses it.

:func:`standalone_cluster` starts one master and one worker with ``bin/spark-class`` of the
installed pyspark (``org.apache.spark.deploy.master.Master`` and
``org.apache.spark.deploy.worker.Worker``), on free loopback ports, waits until the master
reports the worker ALIVE (its web UI's ``/json``), and stops both at the end (each was
started in a session of its own; its process group, which holds the worker's executors,
is terminated by id).

Only one SparkContext can exist per process and the test process may already hold the
local one, so the conversion against the cluster runs in a child process::

    python -m tests.compacter.cluster --master spark://127.0.0.1:PORT \\
        --data-dir DIR --relation NAME --plan PLAN.json

which builds its own session against the cluster, runs ``spark_convert`` on the plan and
prints one line ``RESULT {json}`` with the parts and pending parts it wrote and the number
of updates it read.

This module must not import pytest (the child imports it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULT_PREFIX = "RESULT "


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def cluster_env(work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "SPARK_HOME": str(spark_home()),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOG_DIR": str(work / "logs"),
        "SPARK_WORKER_DIR": str(work / "worker"),
        "SPARK_NO_DAEMONIZE": "1",
        "PYSPARK_PYTHON": sys.executable,
    })
    return env


@dataclass
class StandaloneCluster:
    master_url: str
    web_url: str
    work: Path
    procs: list[subprocess.Popen[bytes]]

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.web_url}/json", timeout=5) as resp:  # noqa: S310
            doc: dict[str, Any] = json.loads(resp.read())
        return doc

    def logs(self) -> str:
        out = []
        for p in sorted((self.work / "logs").glob("*.log")):
            out.append(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _start(args: list[str], env: dict[str, str], log: Path, hide: Path | None = None
           ) -> subprocess.Popen[bytes]:
    """``spark-class args``; with ``hide``, in a mount namespace of its own where an empty
    tmpfs covers ``hide`` (the process and its children cannot see what lies there: a
    machine that shares no directory with the daemon)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(spark_home() / "bin" / "spark-class"), *args]
    if hide is not None:
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
               f'mount -t tmpfs lamina-hidden "{hide}" && exec "$@"', "sh", *cmd]
    with log.open("ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def can_hide_directories() -> bool:
    """Whether this process may start children in a mount namespace of their own
    (``unshare --mount``: root, or a kernel and container that allow it)."""
    try:
        probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                               capture_output=True, check=False)
    except FileNotFoundError:  # no util-linux (.ci/run installs it)
        return False
    return probe.returncode == 0


def _wait(cluster: StandaloneCluster, ready: Any, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        for proc in cluster.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a Spark daemon exited with {proc.returncode} while "
                                   f"waiting for {what}\n{cluster.logs()}")
        try:
            doc = cluster.status()
            if ready(doc):
                return
            last = doc
        except urllib.error.HTTPError as exc:  # the UI answers, not yet with /json
            with exc:  # it holds the connection: closed here, not by the garbage collector
                last = f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:  # not up yet, or the UI's HTML before /json
            last = exc
        time.sleep(0.5)
    raise TimeoutError(f"{what} not ready after {timeout}s (last: {last})\n{cluster.logs()}")


def start_worker(cluster: StandaloneCluster, *, cores: int = 2, memory: str = "1g",
                 env: dict[str, str] | None = None, timeout: float = 180.0,
                 hide: Path | None = None) -> subprocess.Popen[bytes]:
    """Start one more worker (in a session of its own: its process group holds its
    executors and their Python workers, which inherit ``env`` on top of the cluster's
    environment; with ``hide``, none of them sees that directory) and wait until the
    master counts it ALIVE."""
    alive = sum(w.get("state") == "ALIVE" for w in cluster.status().get("workers", []))
    n = sum(1 for _ in (cluster.work / "logs").glob("worker*.log"))
    work_dir = cluster.work / f"worker{n or ''}"
    work_dir.mkdir(parents=True, exist_ok=True)
    proc = _start(["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                   "--cores", str(cores), "--memory", memory, "--webui-port", str(free_port()),
                   "--work-dir", str(work_dir), cluster.master_url],
                  {**cluster_env(cluster.work), **(env or {})},
                  cluster.work / "logs" / f"worker{n or ''}.log", hide)
    cluster.procs.append(proc)
    _wait(cluster, lambda d: sum(w.get("state") == "ALIVE"
                                 for w in d.get("workers", [])) > alive,
          "the worker", timeout)
    return proc


@contextlib.contextmanager
def standalone_cluster(work: Path, *, cores: int = 2, memory: str = "1g",
                       timeout: float = 180.0, worker_env: dict[str, str] | None = None,
                       workers: int = 1, hide: Path | None = None
                       ) -> Iterator[StandaloneCluster]:
    """A running master and ``workers`` workers on 127.0.0.1 (more can be added with
    :func:`start_worker`; ``hide``: a directory the workers cannot see); stopped when the
    block exits."""
    env = cluster_env(work)
    port, web = free_port(), free_port()
    cluster = StandaloneCluster(master_url=f"spark://127.0.0.1:{port}",
                                web_url=f"http://127.0.0.1:{web}", work=work, procs=[])
    try:
        cluster.procs.append(_start(
            ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
             "--port", str(port), "--webui-port", str(web)], env, work / "logs" / "master.log"))
        _wait(cluster, lambda d: d.get("status") == "ALIVE", "the master", timeout)
        for _ in range(workers):
            start_worker(cluster, cores=cores, memory=memory, env=worker_env,
                         timeout=timeout, hide=hide)
        yield cluster
    finally:
        cluster.stop()


# --- the child: a conversion against the cluster ---------------------------------------------

def run_child(master: str, data_dir: Path, relation: str, plan_file: Path,
              timeout: float = 300.0) -> dict[str, Any]:
    """Run the conversion of ``plan_file`` in a child process against ``master``."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.compacter.cluster", "--master", master,
         "--data-dir", str(data_dir), "--relation", relation, "--plan", str(plan_file)],
        cwd=root, capture_output=True, timeout=timeout, check=False,
        env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})
    out = proc.stdout.decode(errors="replace")
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"cluster child failed ({proc.returncode}):\n{out[-4000:]}\n"
                           f"{proc.stderr.decode(errors='replace')[-8000:]}")
    doc: dict[str, Any] = json.loads(lines[-1][len(RESULT_PREFIX):])
    return doc


def _main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--master", required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--relation", required=True)
    parser.add_argument("--plan", type=Path, required=True)
    args = parser.parse_args()

    from lamina.compacter.spark import build_session
    from lamina.compacter.step.driver import spark_convert
    from lamina.compacter.step.work import JobTuning
    from lamina.datadir import DataDir
    from lamina.schema import RelationMeta
    from lamina.trace.trace import Trace
    from tests.compacter.workload import plan_from_json

    layout = DataDir(args.data_dir)
    meta_path = layout.wal_dir(args.relation) / "relation.json"
    meta = RelationMeta.from_json(meta_path.read_bytes(), meta_path)
    trace = Trace.open(layout.trace_store(args.relation), meta)
    plan = plan_from_json(json.loads(args.plan.read_text()))
    spark = build_session(args.master, app_name="lamina-cluster-test", driver_memory="512m",
                          conf={"spark.executor.memory": "512m", "spark.cores.max": "2",
                                "spark.executor.cores": "2"})
    try:
        started = time.monotonic()
        # small shares: several decode and write tasks run on the cluster's executor
        tuning = JobTuning(single_task_bytes=4096, split_bytes=16 << 10,
                           min_split_bytes=4 << 10, part_bytes=24 << 10)
        result = spark_convert(spark, trace, plan, tuning=tuning)
        seconds = time.monotonic() - started
        executors = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size()
    finally:
        spark.stop()
    print(RESULT_PREFIX + json.dumps({
        "parts": [p.to_dict() for p in result.parts],
        "pending": [p.to_dict() for p in result.pending], "input_rows": result.input_rows,
        "seconds": seconds, "block_managers": executors}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
