"""What a JVM option costs or saves a short-lived Spark driver: the figure behind the test
suite's ``tests/spark_jvm.py`` (docs/reliability.md, "The test suite's time").

    .venv/bin/python -m bench.suite_jvm [--jobs 3 40] [--rounds 3]
        [--options "" "-XX:TieredStopAtLevel=1"] [--cds | --cds-each]

Each measurement is a fresh interpreter that starts a ``local[2]`` session the way the
daemon does (:func:`lamina.compacter.spark.build_session`, with
``spark.driver.extraJavaOptions`` set to the options under test), runs ``--jobs`` small
jobs (a ``mapInArrow`` over 200,000 rows in 4 partitions, then a group-by: the shape of a
pack of small steps), and reports the JVM's own CPU time (user + system, from
``/proc/<pid>/stat``) and the wall time from start to the last job. Option sets alternate
round by round; the medians are printed with each set's ratio to the first. ``--cds`` adds
the last set with a class-data-sharing archive (``-XX:SharedArchiveFile``), which one more
driver of that set dumps first (``-XX:ArchiveClassesAtExit``): what tests/spark_jvm.py does
for the test suite; ``--cds-each`` gives every set an archive of its own (how the test
suite's collector was chosen). CPU time, not wall time, is the figure: the suite is CPU-bound on 2
cores, so a JVM's CPU is what it takes from every other test.

Prints a table; writes no result file (it measures the test suite, not lamina).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import json, os, sys, time
t0 = time.perf_counter()
from lamina.compacter.spark import build_session
opts, jobs = sys.argv[1], int(sys.argv[2])
conf = {"spark.driver.extraJavaOptions": opts} if opts else {}
spark = build_session("local[2]", app_name="suite-jvm", conf=conf)
pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
df = spark.range(0, 200_000, numPartitions=4).selectExpr("id", "id % 7 AS k")
def same(batches):
    yield from batches
for _ in range(jobs):
    df.mapInArrow(same, df.schema).groupBy("k").count().collect()
wall = time.perf_counter() - t0
with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rpartition(")")[2].split()
cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
spark.stop()
print(json.dumps({"jvm_cpu": cpu, "wall": wall}))
"""


def measure(options: str, jobs: int, conf_dir: str) -> dict[str, float]:
    """One fresh driver with ``options``; its JVM CPU and wall seconds."""
    # no spark-defaults.conf or properties file of a caller's
    env = {**os.environ, "SPARK_CONF_DIR": conf_dir}
    env.pop("PYSPARK_SUBMIT_ARGS", None)
    out = subprocess.run([sys.executable, "-c", CHILD, options, str(jobs)], env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"the driver with {options!r} failed (exit {out.returncode}): "
                         f"{out.stderr[-2000:]}")
    doc: dict[str, float] = json.loads(lines[-1])
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.suite_jvm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[3, 40])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--options", nargs="+", default=["", "-XX:TieredStopAtLevel=1"])
    parser.add_argument("--cds", action="store_true",
                        help="also the last option set with a class-data archive, dumped "
                             "first by a driver of the same options (tests/spark_jvm.py)")
    parser.add_argument("--cds-each", action="store_true",
                        help="every option set with a class-data archive of its own, dumped "
                             "first by a driver of its options (options that change how the "
                             "JVM runs once the archive is there, e.g. the collector)")
    args = parser.parse_args(argv)
    if args.cds and args.cds_each:
        parser.error("--cds and --cds-each exclude each other")
    # the conf dir stays empty: Spark puts it on the class path, and class-data sharing
    # refuses a non-empty directory there
    with tempfile.TemporaryDirectory() as conf_dir, tempfile.TemporaryDirectory() as work:
        if args.cds:
            archive = os.path.join(work, "spark.jsa")
            last = args.options[-1]
            measure(f"{last} -XX:ArchiveClassesAtExit={archive}", 3, conf_dir)
            args.options.append(f"{last} -XX:SharedArchiveFile={archive}")
        if args.cds_each:
            with_archives = []
            for i, opts in enumerate(args.options):
                archive = os.path.join(work, f"spark-{i}.jsa")
                measure(f"{opts} -XX:ArchiveClassesAtExit={archive}", 3, conf_dir)
                with_archives.append(f"{opts} -XX:SharedArchiveFile={archive}")
            args.options = with_archives
        runs: dict[tuple[int, str], list[dict[str, float]]] = {
            (j, o): [] for j in args.jobs for o in args.options}
        for r in range(args.rounds):
            for jobs in args.jobs:
                for opts in args.options:
                    runs[(jobs, opts)].append(measure(opts, jobs, conf_dir))
            print(f"  round {r + 1}/{args.rounds} done", flush=True)
    print(f"{'jobs':>5}  {'options':<28} {'JVM CPU s':>10} {'wall s':>8} {'CPU ratio':>10}")
    for jobs in args.jobs:
        first = None
        for opts in args.options:
            cpu = statistics.median(x["jvm_cpu"] for x in runs[(jobs, opts)])
            wall = statistics.median(x["wall"] for x in runs[(jobs, opts)])
            first = cpu if first is None else first
            shown = opts.replace(work, "<tmp>") if opts else "(defaults)"
            print(f"{jobs:>5}  {shown:<28} {cpu:>10.2f} {wall:>8.1f} "
                  f"{cpu / first:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
