"""Scaling of the conversion job: one core, two cores, a two-worker standalone cluster.

    .venv/bin/python -m bench.scaling [--scale 1.0] [--rounds 5]

The conversion of bench/convert.py (``jobs.spark_convert`` and commit on
:func:`bench.dataset.conversion_input`) with three Spark masters, each driven by a child
process of its own (``python -m bench.convert --child lamina --master ...``; one process
holds one SparkContext), warmed up and then run ``--rounds`` times interleaved:

- ``local[1]`` and ``local[2]``: executors inside the driver's JVM;
- ``cluster``: a standalone master and two workers of one core and 2 GiB each on
  127.0.0.1, started with ``bin/spark-class`` of the installed pyspark; the driver's
  session takes both (two executor JVMs with their own Python workers). The data directory
  is on the local disk, which every executor sees, as a shared file system would be.

Reported: median seconds, updates/s and the speed-up over ``local[1]``, peak RSS of each
driver's process tree (the cluster's executors are not in it; their peak is sampled from
the workers' process trees). The machine has as many cores as ``os.cpu_count()`` says, so
two-way parallelism is the most there is to see. Writes bench/results/scaling.json and
scaling.png.
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
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import report
from bench.dataset import CACHE, conversion_input
from bench.procs import MemorySampler, compare

NAME = "scaling"
WORKERS = 2
WORKER_CORES = 1
WORKER_MEMORY = "2g"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spark_class(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    import pyspark

    spark_home = Path(pyspark.__file__).parent
    with log.open("ab") as out:
        return subprocess.Popen([str(spark_home / "bin" / "spark-class"), *args], env=env,
                                stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _status(web: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{web}/json", timeout=5) as resp:  # noqa: S310
        doc: dict[str, Any] = json.loads(resp.read())
    return doc


def _wait(procs: list[subprocess.Popen[bytes]], web: str, ready: Any, what: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a Spark daemon exited while waiting for {what}")
        with contextlib.suppress(OSError, ValueError):
            if ready(_status(web)):
                return
        time.sleep(0.5)
    raise TimeoutError(f"{what} not ready after 300 s")


@contextlib.contextmanager
def standalone_cluster(work: Path) -> Iterator[tuple[str, list[subprocess.Popen[bytes]]]]:
    """A master and ``WORKERS`` workers on 127.0.0.1; their master URL and processes."""
    import pyspark

    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SPARK_HOME": str(Path(pyspark.__file__).parent),
           "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOG_DIR": str(logs),
           "SPARK_WORKER_DIR": str(work / "worker"), "SPARK_NO_DAEMONIZE": "1",
           "PYSPARK_PYTHON": sys.executable}
    port, web = _free_port(), _free_port()
    url, web_url = f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{web}"
    procs = [_spark_class(["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                           "--port", str(port), "--webui-port", str(web)], env,
                          logs / "master.log")]
    try:
        _wait(procs, web_url, lambda d: d.get("status") == "ALIVE", "the master")
        for i in range(WORKERS):
            (work / "worker").mkdir(parents=True, exist_ok=True)
            procs.append(_spark_class(
                ["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                 "--cores", str(WORKER_CORES), "--memory", WORKER_MEMORY,
                 "--webui-port", str(_free_port()), "--work-dir", str(work / "worker"), url],
                env, logs / f"worker-{i}.log"))
        _wait(procs, web_url,
              lambda d: sum(w.get("state") == "ALIVE" for w in d.get("workers", [])) == WORKERS,
              "the workers")
        yield url, procs
    finally:
        for p in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scaling",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    run = report.Run(NAME, argv)
    inp = conversion_input(args.scale)
    work = CACHE / "work" / NAME
    with standalone_cluster(work) as (url, procs):
        masters = {"local[1]": "local[1]", "local[2]": "local[2]", "cluster": url}
        contenders = {name: ["--child", "lamina", "--scale", str(args.scale),
                             "--master", master] for name, master in masters.items()}
        workers = [MemorySampler(p.pid) for p in procs[1:]]
        with contextlib.ExitStack() as stack:
            for w in workers:
                stack.enter_context(w)
            result = compare(NAME, "bench.convert", scale=args.scale, rounds=args.rounds,
                             contenders=contenders, updates=inp.updates,
                             targets={"local[1]": 0.0}, reference="local[2]")
    cluster_rss = sum(w.peaks["total"] for w in workers)
    base = result["contenders"]["local[1]"]["seconds_median"]
    speedup = {name: round(base / v["seconds_median"], 3)
               for name, v in result["contenders"].items()}
    doc = run.document({"scale": args.scale, "updates": inp.updates,
                        "cluster": {"workers": WORKERS, "cores_per_worker": WORKER_CORES,
                                    "memory_per_worker": WORKER_MEMORY,
                                    "executors_peak_rss_bytes": cluster_rss},
                        "contenders": result["contenders"], "speedup_over_local1": speedup})
    report.write_result(NAME, doc)
    report.bar_chart(NAME, f"Conversion of {inp.updates:,} updates by Spark master", [
        ("throughput (updates/s)",
         {n: float(v["updates_per_s"]) for n, v in result["contenders"].items()}),
        ("speed-up over local[1]", speedup),
    ], ylabel="", note=f"{os.cpu_count()} cores; cluster: {WORKERS} workers x "
                       f"{WORKER_CORES} core on 127.0.0.1; load "
                       f"{doc['load_average']['before'][0]}")
    for name, v in result["contenders"].items():
        print(f"{name:>9}: {v['seconds_median']:8.2f} s  {v['updates_per_s']:>12,} updates/s  "
              f"x{speedup[name]} over local[1]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
