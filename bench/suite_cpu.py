"""Where a command's CPU goes, by kind of process: the table of docs/reliability.md, "The
test suite's time".

    .venv/bin/python -m bench.suite_cpu [--json FILE] -- COMMAND [ARG ...]
    # e.g. -- env CI=true bash .ci/run

Runs COMMAND and, once a second until it exits, reads the CPU time (user + system) of every
process on the machine from ``/proc/<pid>/stat``. ``/usr/bin/time`` cannot answer this for
the test suite: it counts only the descendants it reaps, and a daemon killed by a test
leaves its JVM to be reaped by init. A process is told apart by its pid and start time,
classed by its command line when first seen (JVMs by their main class, PySpark's Python
workers, ``lamina serve``, the drill's coordinators, the xdist workers...) and attributed to
the test named by the ``PYTEST_CURRENT_TEST`` it inherited (a process started by a test
carries it; the xdist workers themselves started before any test and carry none). A process
that lives less than a second may be missed, and everything else on the machine is counted
too: run it on a quiet machine.

The xdist workers' own CPU (the tests that run in-process) carries no test name in /proc;
the command gets ``LAMINA_TEST_CPU_LOG``, a file to which tests/conftest.py appends each
test's CPU inside its worker, and the costliest of those are listed too.

Prints CPU seconds by kind, the costliest (test, kind) pairs and the costliest tests inside
the workers; ``--json`` writes all three.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")
JAVA_MAINS = ("SparkSubmit", "CoarseGrainedExecutorBackend", "deploy.master.Master",
              "deploy.worker.Worker", "launcher.Main")


def kind_of(argv: list[str]) -> str:
    """A short class for a command line."""
    line = " ".join(argv)
    if argv and argv[0].endswith("java"):
        main = next((m for m in JAVA_MAINS if m in line), "?")
        return "java:" + main.rsplit(".", 1)[-1]
    rules = (("pyspark.daemon", "python:spark-worker"), ("pyspark/daemon", "python:spark-worker"),
             ("pyspark.worker", "python:spark-worker"), ("spark-submit", "java:SparkSubmit"),
             ("spark-class", "java:spark-class"), (" serve ", "python:lamina-serve"),
             ("drill.workload", "python:coordinator"), (" drill ", "python:lamina-drill"),
             ("forkserver", "python:forkserver"), (" ingest ", "python:lamina-ingest"),
             ("postgres", "postgres"), ("moto", "python:moto"),
             ("import sys;exec", "python:xdist-worker"), ("pytest", "python:pytest"))
    for needle, kind in rules:
        if needle in line:
            return kind
    return os.path.basename(argv[0])[:30] if argv else "?"


def _test_of(pid: str) -> str:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return ""
    for item in env:
        if item.startswith(b"PYTEST_CURRENT_TEST="):
            return item[20:].decode(errors="replace").split(" (")[0]
    return ""


def sample(seen: dict[tuple[str, str], list[object]]) -> None:
    """One pass over /proc: the CPU ticks of every process, its kind and test once."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            key, ticks = (pid, fields[19]), int(fields[11]) + int(fields[12])
            if key in seen:
                seen[key][0] = max(int(str(seen[key][0])), ticks)
                continue
            argv = [a.decode(errors="replace")
                    for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or a kernel thread
        if argv:
            seen[key] = [ticks, kind_of(argv), _test_of(pid)]


def in_worker_cpu(lines: str) -> list[tuple[str, float]]:
    """CPU seconds by test from the JSON lines tests/conftest.py appends to
    ``LAMINA_TEST_CPU_LOG`` (a test run twice, as by a rerun, adds up), costliest first."""
    by_test: dict[str, float] = collections.defaultdict(float)
    for line in lines.splitlines():
        if line.strip():
            entry = json.loads(line)
            by_test[str(entry["test"])] += float(entry["cpu"])
    return sorted(by_test.items(), key=lambda kv: -kv[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.suite_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    seen: dict[tuple[str, str], list[object]] = {}
    sample(seen)
    before = {k: int(str(v[0])) for k, v in seen.items()}  # what ran before the command
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as tmp:
        log = Path(tmp) / "tests.jsonl"
        log.touch()
        proc = subprocess.Popen(command, env={**os.environ, "LAMINA_TEST_CPU_LOG": str(log)})
        while proc.poll() is None:
            sample(seen)
            time.sleep(1.0)
        sample(seen)
        in_workers = in_worker_cpu(log.read_text(encoding="utf-8"))
    by_kind: dict[str, float] = collections.defaultdict(float)
    by_pair: dict[tuple[str, str], float] = collections.defaultdict(float)
    for key, (ticks, kind, test) in seen.items():
        seconds = (int(str(ticks)) - before.get(key, 0)) / HZ
        by_kind[str(kind)] += seconds
        by_pair[(str(test).rsplit("::", 1)[-1], str(kind))] += seconds
    wall = time.monotonic() - started
    total = sum(by_kind.values())
    print(f"{total:.0f} CPU seconds in {wall:.0f} s of wall time (exit {proc.returncode})")
    kinds = sorted(by_kind.items(), key=lambda kv: -kv[1])
    pairs = sorted(by_pair.items(), key=lambda kv: -kv[1])
    for kind, seconds in kinds[:args.top]:
        print(f"{seconds:9.1f}  {kind}")
    print()
    for (test, kind), seconds in pairs[:args.top]:
        print(f"{seconds:9.1f}  {kind:<24} {test}")
    print(f"\n{sum(s for _, s in in_workers):.0f} CPU seconds of tests inside the xdist workers")
    for test, seconds in in_workers[:args.top]:
        print(f"{seconds:9.1f}  {test}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "command": command, "wall_seconds": wall, "cpu_seconds": total,
            "by_kind": kinds, "by_test_and_kind": [[t, k, s] for (t, k), s in pairs],
            "in_workers_by_test": in_workers},
            indent=1) + "\n")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
