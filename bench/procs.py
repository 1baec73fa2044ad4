"""Contenders in child processes, and their memory.

One process holds at most one SparkContext, and a JVM that ran one contender's job would
carry its heap and JIT state into the next, so every contender of a benchmark runs in a
child process of its own: ``python -m bench.<module> --child <contender> ...``. The child
sets itself up once (session, warm-up) and then answers commands read from stdin, one JSON
object per line, with one line ``RESULT {json}`` on stdout. The parent keeps all children
alive and asks them in turn, so that the contenders' runs interleave and a change in the
machine's load (other processes) hits all of them alike.

While a child works, :class:`MemorySampler` samples its process tree every 50 ms with
psutil: the child itself (the driver: daemon-side Python), Java processes (the Spark JVM:
driver and, in local mode, executors) and other Python processes (PySpark workers), and
keeps each one's peak resident set size (RSS) and the peak of their sum (:class:`Sampler`
is the background loop it shares with bench.peers_measure's disk sampler).
:func:`start_serve` starts ``lamina serve`` in a session of its own, :func:`serve_ready`
probes its ``/readyz``, and :func:`stop_group` stops it and waits until its whole process
group (Spark's JVM included) is gone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self, TextIO

import psutil

PROTOCOL = "RESULT "
ROOT = Path(__file__).resolve().parents[1]


class Sampler:
    """Calls :meth:`sample` on a background thread every ``interval`` seconds (first at
    once) from the start of a ``with`` block to its end; subclasses keep their peaks."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)


class MemorySampler(Sampler):
    """Peak RSS of a process tree by role, sampled in a background thread."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        super().__init__(interval)
        self.pid = pid
        self.peaks: dict[str, int] = {"driver": 0, "jvm": 0, "python_workers": 0, "total": 0}

    def sample(self) -> None:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        now = {"driver": 0, "jvm": 0, "python_workers": 0}
        for p in procs:
            try:
                rss = int(p.memory_info().rss)
                role = "driver" if p.pid == self.pid else \
                    "jvm" if p.name().startswith("java") else "python_workers"
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            now[role] += rss
        for role, value in now.items():
            self.peaks[role] = max(self.peaks[role], value)
        self.peaks["total"] = max(self.peaks["total"], sum(now.values()))


def start_serve(data: Path, log: Path, *, master: str,
                env: Mapping[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    """``lamina serve`` on ``data`` in a session of its own (:func:`stop_group` stops its
    Spark JVM with it), JSON logs to ``log``, ``env`` over the defaults; the process and
    its HTTP port."""
    from lamina.drill.procs import LAMINA, free_port

    port = free_port()
    full_env = {**os.environ, "LAMINA_LOG_FORMAT": "json", "SPARK_LOCAL_IP": "127.0.0.1",
                **env}
    with log.open("wb") as err:
        proc = subprocess.Popen([LAMINA, "serve", "--data-dir", str(data), "--spark-master",
                                 master, "--http", f"127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=err, env=full_env,
                                start_new_session=True)
    return proc, port


def serve_ready(port: int) -> bool:
    """Whether the daemon on ``port`` answers ``/readyz`` with 200 (False while it starts)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as resp:
            return bool(resp.status == 200)
    except urllib.error.HTTPError as exc:  # 503 while it starts; the error holds the socket
        exc.close()
    except OSError:  # nothing listens yet (URLError is an OSError)
        pass
    return False


def stop_group(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM the process group that ``proc`` leads (started with
    ``start_new_session=True``), SIGKILL it if ``proc`` has not exited within ``timeout``
    seconds, then wait until every process of the group is gone: a daemon's Spark JVM and
    Python workers outlive it by seconds of shutdown work, which would otherwise compete
    with whatever is measured next."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 30
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class Child:
    """A contender's child process, driven through stdin/stdout (module docstring)."""

    def __init__(self, name: str, module: str, args: Sequence[str], log: Path) -> None:
        """Start ``python -m module *args`` (``args`` include ``--child``) as ``name``."""
        self.name = name
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            bufsize=1)
        self.log = log

    def call(self, command: dict[str, Any], timeout: float = 3600.0
             ) -> tuple[dict[str, Any], dict[str, int]]:
        """Send one command; return the child's answer and the peak RSS while it worked."""
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        with MemorySampler(self.proc.pid) as memory:
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
            deadline = time.monotonic() + timeout
            while True:
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"{self.name} child exited ({self.proc.wait()}); "
                                       f"see {self.log}")
                if line.startswith(PROTOCOL):
                    answer: dict[str, Any] = json.loads(line[len(PROTOCOL):])
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} child did not answer in {timeout} s")
        if "error" in answer:
            raise RuntimeError(f"{self.name} child failed: {answer['error']} (see {self.log})")
        return answer, dict(memory.peaks)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(json.dumps({"command": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(120)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


Handler = Callable[[dict[str, Any]], dict[str, Any]]


def serve(handler: Handler, out: TextIO = sys.stdout) -> int:
    """The child's loop: answer every command line on stdin until ``quit``."""
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("command") == "quit":
            break
        try:
            answer = handler(command)
        except Exception as exc:  # reported to the parent, which raises
            import traceback

            traceback.print_exc()
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(PROTOCOL + json.dumps(answer) + "\n")
        out.flush()
    return 0


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def contest(children: Sequence[Child], rounds: int, command: dict[str, Any]
            ) -> dict[str, list[tuple[dict[str, Any], dict[str, int]]]]:
    """Ask every child ``rounds`` times, in rotating order; their answers and peaks."""
    out: dict[str, list[tuple[dict[str, Any], dict[str, int]]]] = {c.name: [] for c in children}
    for r in range(rounds):
        order = list(children[r % len(children):]) + list(children[:r % len(children)])
        for child in order:
            answer, peaks = child.call(command)
            out[child.name].append((answer, peaks))
            print(f"  round {r + 1}/{rounds} {child.name:>8}: {answer.get('seconds', 0):7.2f} s",
                  file=sys.stderr, flush=True)
    return out


def peak_memory(runs: Sequence[tuple[dict[str, Any], dict[str, int]]]) -> dict[str, int]:
    """The largest peak of every role over several runs."""
    roles = ("driver", "jvm", "python_workers", "total")
    return {role: max(p[role] for _, p in runs) for role in roles}


Verify = Callable[[float, dict[str, Any]], str]


def compare(name: str, module: str, *, scale: float, rounds: int,
            contenders: dict[str, list[str]], updates: int, targets: dict[str, float],
            reference: str = "lamina", verify: Verify | None = None,
            logs: Path | None = None) -> dict[str, Any]:
    """Start one child per contender (``python -m module *args``), wait until all are set
    up, run them ``rounds`` times interleaved and summarize: median seconds, updates/s,
    peak RSS by role, and the ``reference`` contender's throughput over each other's
    against ``targets`` (contender name: target ratio). With ``verify``, one more run of
    the reference keeps its output and ``verify(scale, answer)`` checks it (the answer
    names the kept ``trace_dir``)."""
    logs = logs or ROOT / "bench" / ".cache" / "logs"
    children = [Child(c, module, args, logs / f"{name}-{c.replace('/', '_')}.log")
                for c, args in contenders.items()]
    verified = None
    try:
        for child in children:
            child.call({"command": "ready"})
        runs = contest(children, rounds, {"command": "run"})
        if verify is not None and reference in contenders:
            ref = next(c for c in children if c.name == reference)
            answer, _ = ref.call({"command": "run", "keep": True})
            try:
                verified = verify(scale, answer)
            finally:
                import shutil

                shutil.rmtree(answer["trace_dir"], ignore_errors=True)
    finally:
        for child in children:
            child.close()
    summary: dict[str, Any] = {}
    for c, rs in runs.items():
        secs = [a["seconds"] for a, _ in rs]
        summary[c] = {"seconds_median": round(median(secs), 3),
                      "seconds": [round(s, 3) for s in secs],
                      "updates_per_s": round(updates / median(secs)),
                      "peak_rss_bytes": peak_memory(rs),
                      "last": {k: v for k, v in rs[-1][0].items() if k != "seconds"}}
    ratios = {}
    if reference in summary:
        for base, target in targets.items():
            if base in summary:
                r = summary[base]["seconds_median"] / summary[reference]["seconds_median"]
                ratios[base] = {"ratio": round(r, 3), "target": target, "met": r >= target}
    return {"contenders": summary, "ratios": ratios, "verified": verified}


# --- the pieces convert.py and merge.py share ----------------------------------------------------

SPARK_CONTENDERS = ("lamina", "naive")
DRIVER_MEMORY = "4g"
"""The Spark contenders' driver memory (in local mode the executors live in the driver)."""


class SparkContender:
    """A child's state: its name, a scratch directory under ``cache/work`` and, for the
    Spark contenders, a session on ``master``. Subclasses load their input, warm up and
    answer ``run`` commands (:meth:`handle`)."""

    def __init__(self, bench: str, name: str, master: str, cache: Path) -> None:
        self.name = name
        self.work = cache / "work" / f"{bench}-{name}-{uuid.uuid4().hex[:6]}"
        self.work.mkdir(parents=True)
        self.spark: Any = None
        if name in SPARK_CONTENDERS:
            from lamina.compacter.spark import build_session

            self.spark = build_session(master, app_name=f"bench-{bench}-{name}",
                                       driver_memory=DRIVER_MEMORY)

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
        if self.spark is not None:
            self.spark.stop()


def child_main(make: Callable[[], SparkContender]) -> int:
    """A child process: set the contender up, answer the parent, clean up."""
    contender = make()
    try:
        return serve(contender.handle)
    finally:
        contender.close()


def comparison_args(prog: str, doc: str | None, contenders: Sequence[str],
                    argv: list[str] | None) -> argparse.Namespace:
    """The command line of a comparison benchmark (bench.convert, bench.merge)."""
    parser = argparse.ArgumentParser(prog=prog,
                                     description=doc.split("\n\n")[0] if doc else "")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--contenders", default=",".join(contenders))
    parser.add_argument("--verify", action="store_true",
                        help="check lamina's output against the reference executor")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def print_comparison(doc: dict[str, Any]) -> None:
    for c, v in doc["contenders"].items():
        print(f"{c:>8}: {v['seconds_median']:8.2f} s  {v['updates_per_s']:>12,} updates/s  "
              f"peak RSS {v['peak_rss_bytes']['total'] / 2**20:,.0f} MiB")
    for base, r in doc["ratios"].items():
        print(f"lamina / {base}: {r['ratio']}x (target >= {r['target']}x): "
              f"{'met' if r['met'] else 'MISSED'}")
