"""``lamina drill``: kill, restart, verify against an oracle of acknowledged writes.

Loops run at once against one data directory (see docs/reliability.md):

- **coordinator loops** (``--coordinators``, default 2; ``--relations`` in all, spread over
  them, default one each) start the drill workload (lamina.drill.workload: one process
  writing its loop's relations) and end each life with a SIGKILL at a random moment
  (mostly while it appends, seals and advances since; a few while it starts and recovers
  its WAL), or let it kill itself at a WAL fail point (half a record written, a record
  written but not synced, just before or after the rename that finishes a segment); then
  start it again. Between two lives, with no workload running on that relation, a loop
  checks the store against its oracle (``check_live``) while the daemon keeps converting,
  merging and collecting garbage;
- the **daemon loop** starts ``lamina serve`` (Spark ``local[2]``) and ends each life with
  a SIGKILL at a random moment (before or after it is ready) or at a named fail point of a
  step: a pack's Spark job returned with none of its relations committed, a conversion's
  batch written, a merge's batch written, a state version published, converted segments
  half deleted, before or after a garbage-collection delete. With many relations the
  daemon runs packs of many relations' steps, so most kills land amid a pack's commits.

Spark's start-up (10-15 s on an idle 2-core machine, twice that under load; measured per
life in the report) and the first Spark job of each life bound how many daemon lives fit,
while a coordinator life costs well under a second (each is a child of one fork server
that imported the workload once, lamina.forkserver: ready about 0.03 s after it was
forked), so by default one kill in ten is a daemon
kill (``--daemon-share``), mostly at fail points: each point fires at a known step, so a
few daemon lives cover every step.

Which executor a daemon life runs (``--executor``): ``spark`` (the default) every life;
``inprocess`` none (no JVM, a life is ready in about a second; the pack point, which only
Spark's packs reach, is left out); ``mixed`` Spark where the kill is about Spark (the
pack point, the first random kill, the final daemon) and the in-process executor for the
other lives. The trace's and garbage collection's fail points sit in the commit path both
executors share (lamina.trace.trace), so a mixed drill covers every phase with two or
three JVM start-ups instead of one per life: the CI drill runs mixed.

When all loops have their kills (or ``--max-seconds`` is near), the daemon runs without
fail points, each workload runs once more to completion and seals beyond every time it
wrote, the daemon catches up and stops with SIGTERM (which must exit 0), and the final
checks run (lamina.drill.check). Any failed check, any process exiting other than as
planned, an error logged by the daemon or a quarantined relation is a violation: exit 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from lamina.drill.check import CheckStats, check, check_live
from lamina.drill.oracle import Oracle
from lamina.drill.procs import WORKLOAD, DaemonProcess, start_workload
from lamina.drill.workdirs import drill_dirs
from lamina.drill.workload import RELATION, relation_names
from lamina.forkserver import ChildProcess, ForkServer
from lamina.store import Store

#: coordinator fail points: phase, and the range of N for ``kill@N``
COORDINATOR_POINTS: dict[str, tuple[str, int, int]] = {
    "wal.mid_record": ("coordinator/wal-record", 1, 40),
    "wal.before_seal": ("coordinator/wal-record", 1, 40),
    "wal.after_write": ("coordinator/wal-record", 1, 40),
    "fs.before_rename": ("coordinator/segment-rotation", 1, 6),
    "fs.after_rename": ("coordinator/segment-rotation", 1, 6),
}
#: daemon fail points: phase, and the range of N for ``kill@N``
DAEMON_POINTS: dict[str, tuple[str, int, int]] = {
    "compacter.pack_collected": ("daemon/pack", 1, 3),
    "trace.after_batch_written": ("daemon/conversion", 1, 2),
    "trace.mid_segment_delete": ("daemon/conversion", 1, 2),
    "trace.mid_merge": ("daemon/merge", 1, 2),
    "trace.after_state_published": ("daemon/state-publication", 1, 4),
    "gc.before_delete": ("daemon/gc", 1, 3),
    "gc.after_delete": ("daemon/gc", 1, 3),
}
RANDOM = "random"
#: every phase a full drill covers
PHASES = ("coordinator/random", "coordinator/wal-record", "coordinator/segment-rotation",
          "daemon/random", "daemon/pack", "daemon/conversion", "daemon/merge",
          "daemon/state-publication", "daemon/gc")
DAEMON_ENV = {"LAMINA_GC_GRACE_SECONDS": "0.5", "LAMINA_GC_INTERVAL_SECONDS": "1",
              "LAMINA_KEEP_VERSIONS": "3", "LAMINA_POLL_INTERVAL": "0.2"}
WORKLOAD_PAUSE = 0.003
SEGMENT_BYTES = 4096
READY_TIMEOUT = 300.0  # a daemon start on a busy 2-core machine
POINT_TIMEOUT = 150.0  # after ready: a fail point that has not fired by then is missed
COORDINATOR_POINT_TIMEOUT = 30.0
RANDOM_KILL_SPAN = 0.8  # random coordinator kills: up to this long after ready
#: kills while a coordinator starts: up to this long after it was forked. A forked
#: workload parses its arguments, opens the store and recovers its WAL in 0.02 to 0.03 s
#: (the median ready time in the CI drill), so most of these land in that start
START_KILL_SPAN = 0.03
DAEMON_RANDOM_SPAN = 30.0  # random daemon kills: up to this long after ready
FINAL_RESERVE = 60.0  # seconds --max-seconds keeps for the final phase
EXECUTORS = ("spark", "inprocess", "mixed")
#: fail points only the Spark executor reaches (a pack's job)
SPARK_POINTS = frozenset({"compacter.pack_collected"})


def phase_of(kind: str) -> str:
    """``coordinator:wal.mid_record`` -> ``coordinator/wal-record`` (see PHASES)."""
    who, _, what = kind.partition(":")
    if what == RANDOM:
        return f"{who}/random"
    table = COORDINATOR_POINTS if who == "coordinator" else DAEMON_POINTS
    return table[what][0]


@dataclass
class DrillReport:
    seed: int
    data_dir: str
    kills_requested: int
    daemon_share: float
    max_seconds: float | None
    coordinators: int = 1
    trace_url: str | None = None
    relations: int = 1
    executor: str = "spark"
    kills: Counter[str] = field(default_factory=Counter)
    random_kill_context: Counter[str] = field(default_factory=Counter)
    points_missed: Counter[str] = field(default_factory=Counter)
    daemon_lives: int = 0
    daemon_lives_by_executor: Counter[str] = field(default_factory=Counter)
    coordinator_lives: int = 0
    clean_coordinator_lives: int = 0
    daemon_ready_seconds: list[float] = field(default_factory=list)
    coordinator_ready_seconds: list[float] = field(default_factory=list)
    acknowledged_ops: int = 0
    in_doubt_applied: int = 0
    in_doubt_not_applied: int = 0
    live_checks: int = 0
    snapshots_checked: int = 0
    job_retries: int = 0
    stopped_by_time_bound: bool = False
    coordinator_kills_done_at: float | None = None
    daemon_kills_done_at: float | None = None
    notes: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def total_kills(self) -> int:
        return sum(self.kills.values())

    def phases(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for kind, n in self.kills.items():
            out[phase_of(kind)] += n
        return {p: out[p] for p in PHASES}

    def to_json(self) -> dict[str, Any]:
        def summary(xs: list[float]) -> dict[str, float] | None:
            if not xs:
                return None
            return {"n": len(xs), "mean": round(statistics.fmean(xs), 2),
                    "median": round(statistics.median(xs), 2), "min": round(min(xs), 2),
                    "max": round(max(xs), 2)}

        return {
            "ok": not self.violations,
            "seed": self.seed,
            "data_dir": self.data_dir,
            "trace_url": self.trace_url,
            "seconds": self.seconds,
            "kills_requested": self.kills_requested,
            "daemon_share": self.daemon_share,
            "max_seconds": self.max_seconds,
            "coordinators": self.coordinators,
            "relations": self.relations,
            "executor": self.executor,
            "stopped_by_time_bound": self.stopped_by_time_bound,
            "coordinator_kills_done_at": self.coordinator_kills_done_at,
            "daemon_kills_done_at": self.daemon_kills_done_at,
            "total_kills": self.total_kills,
            "kills": dict(sorted(self.kills.items())),
            "phases": self.phases(),
            "random_kill_context": dict(sorted(self.random_kill_context.items())),
            "points_missed": dict(sorted(self.points_missed.items())),
            "daemon_lives": self.daemon_lives,
            "daemon_lives_by_executor": dict(sorted(self.daemon_lives_by_executor.items())),
            "coordinator_lives": self.coordinator_lives,
            "clean_coordinator_lives": self.clean_coordinator_lives,
            "daemon_ready_seconds": summary(self.daemon_ready_seconds),
            "coordinator_ready_seconds": summary(self.coordinator_ready_seconds),
            "acknowledged_ops": self.acknowledged_ops,
            "in_doubt_applied": self.in_doubt_applied,
            "in_doubt_not_applied": self.in_doubt_not_applied,
            "live_checks": self.live_checks,
            "snapshots_checked": self.snapshots_checked,
            "job_retries": self.job_retries,
            "notes": self.notes,
            "violations": self.violations,
        }


class _Stop(Exception):
    """Raised inside a loop when the drill must stop (violation or time bound)."""


@dataclass
class _Coordinator:
    """One coordinator loop: its relations (``base``, or ``base.0`` ... with several), ack
    log, an oracle per relation, and random stream."""

    index: int
    base: str
    count: int
    ack: Path
    log: Path
    rng: random.Random
    oracles: dict[str, Oracle] = field(default_factory=dict)
    next_check: float = 0.0
    lives: int = 0

    def __post_init__(self) -> None:
        self.oracles = {n: Oracle(relation=n if self.count > 1 else None)
                        for n in relation_names(self.base, self.count)}

    def feed(self) -> None:
        for o in self.oracles.values():
            o.feed(self.ack)

    @property
    def next_op(self) -> int:
        return max(o.max_op for o in self.oracles.values()) + 1


class Drill:
    def __init__(self, data_dir: Path, work_dir: Path, *, kills: int, seed: int,
                 daemon_share: float = 0.1, max_seconds: float | None = None,
                 coordinators: int = 2, relations: int | None = None,
                 master: str = "local[2]",
                 progress: Callable[[DrillReport], None] | None = None,
                 trace_url: str | None = None, executor: str = "spark") -> None:
        """``relations``: how many relations the coordinators write in all (default: one
        each), spread evenly over them; with more than one each, a coordinator writes
        ``<base>.0`` ... in one process. ``executor``: one of :data:`EXECUTORS` (the
        module docstring says which daemon lives run Spark)."""
        if executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, "
                             f"not {executor!r}")
        self.executor = executor
        self._spark_random_done = False
        self.data_dir = data_dir
        self.trace_url = trace_url
        self.work = work_dir
        self.daemon_log = work_dir / "daemon.log"
        self.daemon_quota = min(kills, round(kills * daemon_share))
        self.coordinator_quota = kills - self.daemon_quota
        self.master = master
        self.progress = progress
        self.report = DrillReport(seed=seed, data_dir=str(data_dir), kills_requested=kills,
                                  daemon_share=daemon_share, max_seconds=max_seconds,
                                  coordinators=coordinators, trace_url=trace_url,
                                  relations=relations or coordinators, executor=executor)
        total = relations or coordinators
        self.coordinators = [
            _Coordinator(i, RELATION if i == 0 else f"{RELATION}-{i}",
                         total // coordinators + (i < total % coordinators),
                         work_dir / f"ack-{i}.jsonl", work_dir / f"coordinator-{i}.log",
                         random.Random(f"{seed}/coordinator/{i}"))
            for i in range(coordinators)]
        self.stats = CheckStats()
        self._rng_daemon = random.Random(f"{seed}/daemon")
        self._rng_check = random.Random(f"{seed}/check")
        self._mu = threading.Lock()
        self._stop = threading.Event()
        self._daemon_done = threading.Event()
        self._started = time.monotonic()
        self._kill_deadline: float | None = None
        if max_seconds is not None:
            reserve = min(FINAL_RESERVE, max_seconds / 2)
            self._kill_deadline = self._started + max_seconds - reserve
        self.final_daemon: DaemonProcess | None = None
        self._final_log_offset = 0
        self._forks: ForkServer | None = None  # what starts the coordinators (run())
        self.coordinator_kills = 0
        self.daemon_kills = 0

    # --- bookkeeping ----------------------------------------------------------------------
    def _count(self, kind: str, context: str | None = None) -> None:
        with self._mu:
            self.report.kills[kind] += 1
            if context is not None:
                self.report.random_kill_context[context] += 1
            at = round(time.monotonic() - self._started, 1)
            if kind.startswith("daemon"):
                self.daemon_kills += 1
                if self.daemon_kills == self.daemon_quota:
                    self.report.daemon_kills_done_at = at
            else:
                self.coordinator_kills += 1
                if self.coordinator_kills == self.coordinator_quota:
                    self.report.coordinator_kills_done_at = at
        if self.progress is not None:
            self.progress(self.report)

    def _elapsed(self) -> float:
        return time.monotonic() - self._started

    def _violation(self, text: str) -> None:
        with self._mu:
            self.report.violations.append(text)
        self._stop.set()

    def _check_time(self) -> None:
        if self._stop.is_set():
            raise _Stop
        if self._kill_deadline is not None and time.monotonic() >= self._kill_deadline:
            if (self.coordinator_kills < self.coordinator_quota
                    or self.daemon_kills < self.daemon_quota):
                self.report.stopped_by_time_bound = True
            self._stop.set()
            raise _Stop

    # --- the coordinator loops ------------------------------------------------------------
    def _coordinator_loop(self, c: _Coordinator) -> None:
        try:
            with c.log.open("ab") as log:
                while True:
                    self._check_time()
                    killing = self.coordinator_kills < self.coordinator_quota
                    # every coordinator lives at least once, even when the daemon is
                    # ready before this thread first runs (--kills 0 with a fast daemon)
                    if not killing and self._daemon_done.is_set() and c.lives > 0:
                        return
                    c.lives += 1
                    self._coordinator_life(c, killing, log)
                    self._maybe_check_live(c)
        except _Stop:
            return
        except Exception as exc:  # the drill itself broke: report, do not hang
            self._violation(f"coordinator loop {c.index} failed: {exc!r}")

    def _coordinator_life(self, c: _Coordinator, killing: bool, log: IO[bytes]) -> None:
        rng = c.rng
        point = None
        env: dict[str, str] = {}
        if killing and rng.random() < 0.35:
            point = rng.choice(sorted(COORDINATOR_POINTS))
            _, lo, hi = COORDINATOR_POINTS[point]
            env["LAMINA_FAILPOINTS"] = f"{point}=kill@{rng.randint(lo, hi)}"
        mode = point or ("random" if killing else "clean")
        label = f"coordinator {c.index} life {c.lives} ({mode})"
        log.write(f"=== {label} {env} first op {c.next_op} at "
                  f"{self._elapsed():.1f} s ===\n".encode())
        log.flush()
        started = time.monotonic()
        proc = start_workload(
            self.data_dir, c.ack, seed=self.report.seed * 100_000 + c.lives,
            ops=100_000 if killing else rng.randint(40, 120), pause=WORKLOAD_PAUSE,
            segment_bytes=SEGMENT_BYTES, env=env, first_op=c.next_op,
            stdout=subprocess.PIPE, stderr=log, relation=c.base, relations=c.count,
            forks=self._forks)
        with self._mu:
            self.report.coordinator_lives += 1
        try:
            if point is None and killing and rng.random() < 0.05:
                # a kill while it starts: opening the store, recovering the WAL
                time.sleep(rng.uniform(0, START_KILL_SPAN))
                ready = _saw_line(proc, "ready", 0)
                self._kill_coordinator(proc, "coordinator:random",
                                       "coordinator: appending" if ready
                                       else "coordinator: starting", c)
                return
            if not _saw_line(proc, "ready", 120):
                # EOF on its stdout comes a moment before the exit status can be reaped
                try:
                    code: int | None = proc.wait(10)
                except subprocess.TimeoutExpired:
                    code = None
                if point is not None and code == -signal.SIGKILL:
                    self._count(f"coordinator:{point}")  # it fired while creating the relation
                    return
                self._violation(f"{label} did not get ready (exit code {code}); see {c.log}")
                return
            with self._mu:
                self.report.coordinator_ready_seconds.append(time.monotonic() - started)
            if point is None and killing:
                time.sleep(rng.uniform(0, RANDOM_KILL_SPAN))
                self._kill_coordinator(proc, "coordinator:random", "coordinator: appending", c)
                return
            timeout = COORDINATOR_POINT_TIMEOUT if point else 300.0
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                if point is None:
                    self._violation(f"{label} did not finish in {timeout} s")
                    return
                with self._mu:
                    self.report.points_missed[f"coordinator:{point}"] += 1
                self._kill_coordinator(proc, "coordinator:random", "coordinator: appending", c)
                return
            if point is not None and code == -signal.SIGKILL:
                self._count(f"coordinator:{point}")
            elif point is None and code == 0:
                with self._mu:
                    self.report.clean_coordinator_lives += 1
            else:
                self._violation(f"{label} exited with {code}; see {c.log}")
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

    def _kill_coordinator(self, proc: ChildProcess, kind: str, context: str,
                          c: _Coordinator) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            self._count(kind, context)
        elif proc.returncode == -signal.SIGKILL:
            self._violation("a coordinator without a fail point died by SIGKILL on its own")
        elif proc.returncode != 0:
            self._violation(f"coordinator {c.index} exited with {proc.returncode}; see {c.log}")

    def _maybe_check_live(self, c: _Coordinator) -> None:
        """Feed the oracle; check against it when the last check's cost allows (checks
        take at most about a sixth of the coordinator loop's time)."""
        now = time.monotonic()
        if now < c.next_check:
            c.feed()
            return
        for name, oracle in c.oracles.items():
            for p in check_live(self.data_dir, oracle, c.ack, c.rng, stats=self.stats,
                                relation=name):
                self._violation(f"live check of {name}: {p}")
        took = time.monotonic() - now
        c.next_check = time.monotonic() + 5 * took

    # --- the daemon loop ------------------------------------------------------------------
    def _daemon_modes(self, first: bool) -> deque[str]:
        """Every fail point once, in random order, and random kills: the first block ends
        with one (so that as few as seven daemon kills cover every point), later blocks
        mix in two (a quarter of the daemon kills)."""
        rng = self._rng_daemon
        block = sorted(p for p in DAEMON_POINTS
                       if self.executor != "inprocess" or p not in SPARK_POINTS)
        rng.shuffle(block)
        if first:
            block.append(RANDOM)
        else:
            for _ in range(2):
                block.insert(rng.randint(0, len(block)), RANDOM)
        return deque(block)

    def _daemon_loop(self) -> None:
        try:
            modes: deque[str] = deque()
            life = 0
            while self.daemon_kills < self.daemon_quota:
                self._check_time()
                if not modes:
                    modes = self._daemon_modes(first=life == 0)
                life += 1
                self._daemon_life(life, modes)
            self._check_time()
            self._final_log_offset = _size(self.daemon_log)
            self.final_daemon = self._start_daemon("final", {}, "final")
            self._wait_ready(self.final_daemon, "final")
        except _Stop:
            return
        except Exception as exc:
            self._violation(f"daemon loop failed: {exc!r}")
        finally:
            self._daemon_done.set()

    def _runs_spark(self, mode: str) -> bool:
        """Whether a daemon life in ``mode`` (a fail point, RANDOM, or "final") runs Spark."""
        if self.executor != "mixed":
            return self.executor == "spark"
        if mode == RANDOM and not self._spark_random_done:
            self._spark_random_done = True
            return True
        return mode == "final" or mode in SPARK_POINTS

    def _start_daemon(self, label: str, env: dict[str, str], mode: str) -> DaemonProcess:
        executor = "spark" if self._runs_spark(mode) else "inprocess"
        env = {**env, "LAMINA_EXECUTOR": executor}
        with self.daemon_log.open("a") as f:
            f.write(f"=== drill: daemon life {label} {env} at {self._elapsed():.1f} s ===\n")
        self.report.daemon_lives += 1
        self.report.daemon_lives_by_executor[executor] += 1
        return DaemonProcess(self.data_dir, self.daemon_log, master=self.master,
                             extra_env={**DAEMON_ENV, **env})

    def _wait_ready(self, daemon: DaemonProcess, label: str) -> None:
        started = time.monotonic()
        while time.monotonic() - started < READY_TIMEOUT:
            if daemon.proc.poll() is not None:
                raise RuntimeError(f"daemon {label} exited with {daemon.proc.returncode} "
                                   f"while starting; see {self.daemon_log}")
            if self._probe(daemon, label):
                self.report.daemon_ready_seconds.append(time.monotonic() - started)
                return
            time.sleep(0.2)
        raise RuntimeError(f"daemon {label} not ready after {READY_TIMEOUT} s")

    def _probe(self, daemon: DaemonProcess, label: str) -> bool:
        """True once /readyz answers 200; a quarantined relation is a violation."""
        try:
            code, body = daemon.get("/readyz")
        except OSError:
            return False
        if code != 200 and b"quarantined" in body:
            self._violation(f"daemon {label}: {body.decode(errors='replace').strip()}")
            raise _Stop
        return code == 200

    def _daemon_life(self, life: int, modes: deque[str]) -> None:
        rng = self._rng_daemon
        mode = modes.popleft()
        point = None if mode == RANDOM else mode
        env: dict[str, str] = {}
        if point is not None:
            _, lo, hi = DAEMON_POINTS[point]
            env["LAMINA_FAILPOINTS"] = f"{point}=kill@{rng.randint(lo, hi)}"
        log_offset = _size(self.daemon_log)
        started = time.monotonic()
        daemon = self._start_daemon(str(life), env, mode)
        ready_at: float | None = None
        kill_at: float | None = None
        if point is None and rng.random() < 0.2:  # while Spark starts or during recovery
            kill_at = started + rng.uniform(1, 14)
        we_killed = False
        try:
            while daemon.proc.poll() is None:
                now = time.monotonic()
                if ready_at is None and self._probe(daemon, str(life)):
                    ready_at = now
                    self.report.daemon_ready_seconds.append(now - started)
                    if kill_at is None:
                        kill_at = now + (POINT_TIMEOUT if point else
                                         rng.uniform(0, DAEMON_RANDOM_SPAN))
                if ready_at is None and now - started > READY_TIMEOUT:
                    self._violation(f"daemon life {life} not ready after {READY_TIMEOUT} s; "
                                    f"see {self.daemon_log}")
                if (kill_at is not None and now >= kill_at) or self._stop.is_set():
                    daemon.proc.send_signal(signal.SIGKILL)
                    we_killed = True
                    break
                time.sleep(0.1)
            code = daemon.wait(60)
        finally:
            daemon.__exit__(None, None, None)
        section = _read_from(self.daemon_log, log_offset)
        self._scan_daemon_log(section, f"daemon life {life}")
        if we_killed:
            if point is not None and not self._stop.is_set():
                with self._mu:
                    self.report.points_missed[f"daemon:{point}"] += 1
                modes.appendleft(point)  # try it again in the next life
            context = ("daemon: starting" if ready_at is None
                       else f"daemon: after {_last_event(section)!r}")
            self._count(f"daemon:{RANDOM}", context)
        elif code == -signal.SIGKILL and point is not None:
            self._count(f"daemon:{point}")
        else:
            self._violation(f"daemon life {life} ({mode}) exited with {code}; see "
                            f"{self.daemon_log}")

    def _scan_daemon_log(self, section: str, label: str) -> None:
        """Errors logged by the daemon are violations; retried jobs are counted."""
        for line in section.splitlines():
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by the kill
            if rec.get("level") == "error":
                self._violation(f"{label} logged an error: {rec.get('event')}: "
                                f"{rec.get('error', '')}")
            elif "retrying" in str(rec.get("event", "")):
                with self._mu:
                    self.report.job_retries += 1
                    if len(self.report.notes) < 50:
                        self.report.notes.append(f"{label}: {rec.get('event')}: "
                                                 f"{str(rec.get('error', ''))[:300]}")

    # --- run and check --------------------------------------------------------------------
    def run(self) -> DrillReport:
        # every process (coordinators, daemons, checks) finds the traces where this records
        Store.open(self.data_dir, fsync="never", trace_url=self.trace_url).close()
        # every coordinator life is a child of one fork server that imported the workload
        # once: a fresh interpreter would spend about 0.3 s of CPU importing per life
        with ForkServer([WORKLOAD]) as self._forks:
            threads = [threading.Thread(target=self._coordinator_loop, args=(c,),
                                        name=f"drill-coordinator-{c.index}")
                       for c in self.coordinators]
            threads.append(threading.Thread(target=self._daemon_loop, name="drill-daemon"))
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            try:
                self._finish()
            except Exception as exc:
                self.report.violations.append(f"final phase failed: {exc!r}")
            finally:
                if self.final_daemon is not None:
                    self.final_daemon.__exit__(None, None, None)
        for o in (o for c in self.coordinators for o in c.oracles.values()):
            self.report.acknowledged_ops += o.ops - o.resolved_applied
            self.report.in_doubt_applied += o.resolved_applied
            self.report.in_doubt_not_applied += o.resolved_not_applied
        self.report.live_checks = self.stats.live_checks
        self.report.snapshots_checked = self.stats.snapshots_checked
        self.report.notes.extend(self.stats.notes)
        self.report.seconds = round(time.monotonic() - self._started, 1)
        return self.report

    def _finish(self) -> None:
        """The final runs, catch-up and checks. After a violation the daemon is left out
        (it may be what failed); the checks still run on what is on disk."""
        finals = []
        for c in self.coordinators:
            c.feed()
            with c.log.open("ab") as log:
                log.write(b"=== final run ===\n")
                log.flush()
                finals.append(start_workload(
                    self.data_dir, c.ack, seed=self.report.seed, ops=40,
                    pause=WORKLOAD_PAUSE, segment_bytes=SEGMENT_BYTES,
                    first_op=c.next_op, final=True, stdout=subprocess.DEVNULL,
                    stderr=log, relation=c.base, relations=c.count, forks=self._forks))
        for c, proc in zip(self.coordinators, finals, strict=True):
            code = proc.wait(300)
            if code != 0:
                self.report.violations.append(f"the final run of coordinator {c.index} "
                                              f"exited with {code}; see {c.log}")
                return
            c.feed()
        if not self.report.violations:
            self._final_daemon()
        for name, oracle in ((n, o) for c in self.coordinators for n, o in c.oracles.items()):
            self.report.violations.extend(
                f"{name}: {p}" for p in check(self.data_dir, oracle, self.stats, relation=name))

    def _final_daemon(self) -> None:
        offset = self._final_log_offset
        daemon = self.final_daemon
        if daemon is not None and daemon.proc.poll() is not None:
            self.report.violations.append(f"the final daemon exited on its own with "
                                          f"{daemon.proc.returncode}; see {self.daemon_log}")
            return
        if daemon is None:
            offset = _size(self.daemon_log)
            daemon = self.final_daemon = self._start_daemon("final", {}, "final")
            self._wait_ready(daemon, "final")
        try:
            for c in self.coordinators:
                for name, oracle in c.oracles.items():
                    daemon.wait_caught_up(name, oracle.upper, timeout=900)
        except AssertionError as exc:
            self.report.violations.append(f"the daemon did not catch up: {str(exc)[:2000]}")
            return
        daemon.signal(signal.SIGTERM)
        code = daemon.wait(180)
        if code != 0:
            self.report.violations.append(f"the daemon exited {code} on SIGTERM, expected 0")
        self._scan_daemon_log(_read_from(self.daemon_log, offset), "final daemon")


def _saw_line(proc: ChildProcess, want: str, timeout: float) -> bool:
    """Whether the process printed the line ``want`` within ``timeout`` seconds."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while True:
        ready, _, _ = select.select([proc.stdout], [], [],
                                    max(0.0, deadline - time.monotonic()))
        if not ready:
            return False
        line = proc.stdout.readline()
        if not line:
            return False  # it exited
        if line.decode(errors="replace").strip() == want:
            return True


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _read_from(path: Path, offset: int) -> str:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def _last_event(section: str) -> str:
    event = "daemon.starting"
    for line in section.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError, AttributeError):
                event = str(json.loads(line).get("event", event))
    return event


# --- command line -------------------------------------------------------------------------

def run_drill_cli(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    """``lamina drill`` (without ``--ingest``); the arguments are checked here."""
    kills: int = args.kills
    share: float = getattr(args, "daemon_share", 0.1)
    max_seconds: float | None = getattr(args, "max_seconds", None)
    coordinators: int = getattr(args, "coordinators", 2)
    relations: int | None = getattr(args, "relations", None)
    err = Console(stderr=True)
    if kills < 0:
        print("lamina drill: --kills must be >= 0", file=sys.stderr)
        return 2
    if not 0 <= share <= 1:
        print("lamina drill: --daemon-share must be between 0 and 1", file=sys.stderr)
        return 2
    if not 1 <= coordinators <= 8:
        print("lamina drill: --coordinators must be between 1 and 8", file=sys.stderr)
        return 2
    if relations is not None and not coordinators <= relations <= 1000:
        print(f"lamina drill: --relations must be between --coordinators ({coordinators}) "
              "and 1000", file=sys.stderr)
        return 2
    if max_seconds is not None and max_seconds <= 0:
        print("lamina drill: --max-seconds must be > 0", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    dirs = drill_dirs(args.data_dir, "lamina-drill-")
    if dirs is None:
        return 2
    data_dir, work, scratch = dirs
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[detail]}"), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(f"drill seed {seed}", total=kills, detail="starting")

        def progress(r: DrillReport) -> None:
            coord = sum(n for k, n in r.kills.items() if k.startswith("coordinator"))
            bar.update(task, completed=r.total_kills,
                       detail=f"coordinator {coord}, daemon {r.total_kills - coord} "
                       f"(lives {r.daemon_lives})")

        drill = Drill(data_dir, work, kills=kills, seed=seed, daemon_share=share,
                      max_seconds=max_seconds, coordinators=coordinators,
                      relations=relations, progress=progress,
                      trace_url=getattr(args, "trace_url", None),
                      executor=getattr(args, "executor", "spark"))
        report = drill.run()
    _print_summary(Console(), Table, report)
    doc = report.to_json()
    doc["work_dir"] = str(work)
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(doc, indent=2) + "\n")
    if scratch is not None and not report.violations:
        shutil.rmtree(scratch, ignore_errors=True)
    elif report.violations:
        print(f"lamina drill: logs and data kept in {work} and {data_dir}", file=sys.stderr)
    return 1 if report.violations else 0


def _print_summary(console: Any, table_cls: Any, report: DrillReport) -> None:
    table = table_cls(title=f"lamina drill: seed {report.seed}, {report.seconds} s")
    table.add_column("phase")
    table.add_column("kill kind")
    table.add_column("count", justify="right")
    for kind, n in sorted(report.kills.items(), key=lambda kv: (phase_of(kv[0]), kv[0])):
        table.add_row(phase_of(kind), kind, str(n))
    table.add_row("", "total", str(report.total_kills), end_section=True)
    console.print(table)
    ready = report.daemon_ready_seconds
    console.print(
        f"acknowledged ops {report.acknowledged_ops}; in doubt after a kill: "
        f"{report.in_doubt_applied} applied, {report.in_doubt_not_applied} not; "
        f"live checks {report.live_checks}; snapshots checked {report.snapshots_checked}; "
        f"daemon lives {report.daemon_lives} "
        f"{dict(report.daemon_lives_by_executor)} (ready after "
        f"{statistics.median(ready) if ready else 0:.1f} s median); coordinator lives "
        f"{report.coordinator_lives}; job retries {report.job_retries}",
        highlight=False)
    missing = [p for p, n in report.phases().items() if n == 0]
    if missing and report.total_kills:
        console.print(f"phases without a kill: {', '.join(missing)}", highlight=False)
    if report.points_missed:
        console.print(f"fail points that did not fire in time: "
                      f"{dict(report.points_missed)}", highlight=False)
    if report.stopped_by_time_bound:
        console.print("stopped by --max-seconds before all kills were done", highlight=False)
    for v in report.violations:
        console.print(f"[red]VIOLATION[/red]: {v}", highlight=False)
    console.print("[green]OK: no violation[/green]" if not report.violations else
                  f"[red]FAILED: {len(report.violations)} violations[/red]")
