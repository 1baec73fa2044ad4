"""Scaling of the conversion job: one core, two cores, a two-worker standalone cluster.

    .venv/bin/python -m bench.scaling [--scale 1.0] [--rounds 5]

The conversion of bench/convert.py (``step.driver.spark_convert`` and commit on
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
import os
import sys

from tests.compacter.cluster import standalone_cluster

from bench import report
from bench.dataset import CACHE, conversion_input
from bench.procs import MemorySampler, compare

NAME = "scaling"
WORKERS = 2
WORKER_CORES = 1
WORKER_MEMORY = "2g"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scaling",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    run = report.Run(NAME, argv)
    inp = conversion_input(args.scale)
    work = CACHE / "work" / NAME
    with standalone_cluster(work, workers=WORKERS, cores=WORKER_CORES,
                            memory=WORKER_MEMORY) as cluster:
        masters = {"local[1]": "local[1]", "local[2]": "local[2]",
                   "cluster": cluster.master_url}
        contenders = {name: ["--child", "lamina", "--scale", str(args.scale),
                             "--master", master] for name, master in masters.items()}
        workers = [MemorySampler(p.pid) for p in cluster.procs[1:]]  # [0] is the master
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
