"""``lamina drill``: kill, restart, verify against an oracle of acknowledged writes.

Two loops run at once against one data directory:

- the **coordinator loop** starts the drill workload (lamina.drill.workload) and SIGKILLs
  it after a random delay, or lets it kill itself at a WAL fail point (half a record
  written; a record written but not synced), then starts it again;
- the **daemon loop** starts ``lamina serve`` and ends each life with a SIGKILL at a random
  moment or at a named fail point of a step (batch written, merge written, state
  published, segments half deleted, around garbage-collection deletes), then starts it
  again. Spark's start-up (about 10-15 s here) bounds how many daemon lives fit, so the
  coordinator, whose restarts cost well under a second, is killed far more often.

After the last kill the workload runs once more to completion and the daemon catches up
and stops with SIGTERM (which must exit 0). Then the checks, each a violation if it fails:

1. every acknowledged append is present exactly once: its marker row (``id = -op``) has a
   diff of exactly 1; an append whose ack was lost to a kill is present at most once;
2. ``snapshot(as_of)`` equals the oracle at every sealed time at or after since;
3. ``lamina verify`` finds no problem (checksums, invariants, WAL chain);
4. after garbage collection with no grace period, no file is left that no kept state
   version names, and no temp file is left.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lamina.drill.oracle import Oracle
from lamina.drill.procs import DaemonProcess, start_workload
from lamina.drill.workload import RELATION

COORDINATOR_POINTS = ("wal.mid_record", "wal.after_write", "fs.before_rename",
                      "fs.after_rename")
DAEMON_POINTS = ("trace.after_batch_written", "trace.mid_merge",
                 "trace.after_state_published", "trace.mid_segment_delete",
                 "gc.before_delete", "gc.after_delete")
DAEMON_ENV = {"LAMINA_GC_GRACE_SECONDS": "0.5", "LAMINA_GC_INTERVAL_SECONDS": "1",
              "LAMINA_KEEP_VERSIONS": "3"}


@dataclass
class DrillReport:
    seed: int
    data_dir: str
    kills: Counter[str] = field(default_factory=Counter)
    daemon_lives: int = 0
    coordinator_lives: int = 0
    in_doubt_ops: int = 0
    in_doubt_applied: int = 0
    acknowledged_ops: int = 0
    snapshots_checked: int = 0
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def total_kills(self) -> int:
        return sum(self.kills.values())

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["kills"] = dict(sorted(self.kills.items()))
        doc["total_kills"] = self.total_kills
        doc["ok"] = not self.violations
        return doc


class Drill:
    def __init__(self, data_dir: Path, work_dir: Path, *, kills: int, seed: int,
                 daemon_share: float = 0.1, master: str = "local[2]",
                 progress: Any = None) -> None:
        self.data_dir = data_dir
        self.work = work_dir
        self.ack = work_dir / "ack.jsonl"
        self.target = kills
        self.rng = random.Random(seed)
        self.daemon_kills_target = max(1, round(kills * daemon_share))
        self.master = master
        self.report = DrillReport(seed=seed, data_dir=str(data_dir))
        self._mu = threading.Lock()
        self._done = threading.Event()
        self.progress = progress

    def _count(self, kind: str) -> None:
        with self._mu:
            self.report.kills[kind] += 1
            total = self.report.total_kills
        if self.progress is not None:
            self.progress(total)
        if total >= self.target:
            self._done.set()

    def _daemon_kills(self) -> int:
        with self._mu:
            return sum(n for k, n in self.report.kills.items() if k.startswith("daemon"))

    # --- the coordinator loop -------------------------------------------------------------
    def _coordinator_loop(self) -> None:
        seed = 1
        while not self._done.is_set():
            point = None
            env: dict[str, str] = {}
            if self.rng.random() < 0.3:
                point = self.rng.choice(COORDINATOR_POINTS)
                env["LAMINA_FAILPOINTS"] = f"{point}=kill@{self.rng.randint(1, 30)}"
            proc = start_workload(self.data_dir, self.ack, seed=seed, ops=100_000, pause=0.002,
                                  env=env, quiet=True)
            self.report.coordinator_lives += 1
            seed += 1
            deadline = time.monotonic() + self.rng.uniform(0.8, 2.5)
            while time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.02)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                self._count("coordinator:random")
            elif proc.returncode == -signal.SIGKILL and point is not None:
                self._count(f"coordinator:{point}")
            elif proc.returncode != 0:
                self.report.violations.append(f"workload exited with {proc.returncode}")
                self._done.set()

    # --- the daemon loop ---------------------------------------------------------------------
    def _daemon_loop(self) -> None:
        life = 0
        while not self._done.is_set() and self._daemon_kills() < self.daemon_kills_target:
            life += 1
            point = self.rng.choice(DAEMON_POINTS) if life % 2 == 0 else None
            env = dict(DAEMON_ENV)
            if point is not None:
                env["LAMINA_FAILPOINTS"] = f"{point}=kill@{self.rng.randint(1, 3)}"
            with DaemonProcess(self.data_dir, self.work / "daemon.log", master=self.master,
                               extra_env=env) as daemon:
                self.report.daemon_lives += 1
                try:
                    daemon.wait_ready(timeout=180)
                except AssertionError as exc:
                    if daemon.proc.returncode == -signal.SIGKILL and point is not None:
                        self._count(f"daemon:{point}")  # died at its fail point in recovery
                        continue
                    self.report.violations.append(f"daemon failed to start: {exc}")
                    self._done.set()
                    return
                limit = time.monotonic() + (30 if point else self.rng.uniform(2, 12))
                while time.monotonic() < limit and daemon.proc.poll() is None:
                    if self._done.is_set():
                        break
                    time.sleep(0.1)
                if daemon.proc.poll() is None:
                    daemon.proc.send_signal(signal.SIGKILL)
                    daemon.wait()
                    self._count("daemon:random" if point is None else "daemon:random-fallback")
                elif daemon.proc.returncode == -signal.SIGKILL:
                    self._count(f"daemon:{point}")
                else:
                    self.report.violations.append(
                        f"daemon exited with {daemon.proc.returncode} (see {daemon.log_path})")
                    self._done.set()

    # --- run and check ------------------------------------------------------------------------
    def run(self) -> DrillReport:
        started = time.monotonic()
        coord = threading.Thread(target=self._coordinator_loop, name="drill-coordinator")
        daemon = threading.Thread(target=self._daemon_loop, name="drill-daemon")
        coord.start()
        daemon.start()
        coord.join()
        self._done.set()
        daemon.join()
        if not self.report.violations:
            self._finish()
        self.report.seconds = round(time.monotonic() - started, 1)
        return self.report

    def _finish(self) -> None:
        final = start_workload(self.data_dir, self.ack, seed=10_000, ops=40, quiet=True)
        if final.wait(120) != 0:
            self.report.violations.append("the final workload run failed")
            return
        oracle = Oracle.load(self.ack)
        with DaemonProcess(self.data_dir, self.work / "daemon.log", master=self.master,
                           extra_env=DAEMON_ENV) as daemon:
            daemon.wait_ready(timeout=180)
            daemon.wait_caught_up(RELATION, oracle.upper, timeout=300)
            daemon.signal(signal.SIGTERM)
            code = daemon.wait(90)
            if code != 0:
                self.report.violations.append(f"daemon exited {code} on SIGTERM, expected 0")
        self.report.violations.extend(check(self.data_dir, oracle, self.report))


def check(data_dir: Path, oracle: Oracle, report: DrillReport) -> list[str]:
    """The drill's checks (see the module docstring); returns the violations."""
    from lamina.layout import Layout
    from lamina.store import Store
    from lamina.trace.trace import Trace
    from lamina.verify import verify_store

    problems: list[str] = []
    report.in_doubt_ops = len(oracle.in_doubt)
    with Store.open(data_dir) as store:
        rel = store.relation(RELATION)
        upper, since = rel.upper, rel.since
        last = rel.snapshot(upper - 1) if upper > since else None
        markers: dict[int, int] = {}
        if last is not None:
            for row in last.to_pylist():
                if row["val"] == "marker":
                    markers[-int(row["id"])] = int(row["_diff"])
        acked_appends = {-i for i, v, _t, _d in oracle.updates if v == "marker"}
        report.in_doubt_applied = len(oracle.resolve(set(markers), upper, since))
        report.acknowledged_ops = oracle.ops
        for op in sorted(acked_appends):
            if markers.get(op) != 1:
                problems.append(f"acknowledged append {op}: marker diff {markers.get(op)}, "
                                "expected exactly 1")
        for op, diff in markers.items():
            if diff != 1:
                problems.append(f"append {op} applied {diff} times")
        if (upper, since) != (oracle.upper, oracle.since):
            problems.append(f"frontiers (upper, since) = {(upper, since)}, oracle says "
                            f"{(oracle.upper, oracle.since)}")
        for as_of in range(since, upper):
            got = sorted((r["id"], r["val"], r["_diff"]) for r in rel.snapshot(as_of).to_pylist())
            report.snapshots_checked += 1
            if got != oracle.snapshot(as_of):
                problems.append(f"snapshot at {as_of} differs from the oracle")
                break
        meta = rel.meta
    layout = Layout(data_dir)
    problems.extend(f"verify: {p}" for r in verify_store(layout) for p in r.problems)
    trace = Trace.open(layout.trace_dir(RELATION), meta)
    trace.collect_garbage(keep_versions=1, grace_seconds=0)
    named = trace.state.files()
    for path in sorted(layout.trace_dir(RELATION).rglob("*")):
        rel_path = path.relative_to(layout.trace_dir(RELATION)).as_posix()
        if path.is_file() and rel_path.split("/")[0] in ("batches", "pending") \
                and rel_path not in named:
            problems.append(f"orphan file after garbage collection: {rel_path}")
        if path.name.endswith(".tmp"):
            problems.append(f"temp file left: {rel_path}")
    return problems


def run_drill_cli(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    if args.data_dir is None:
        data_dir = Path(tempfile.mkdtemp(prefix="lamina-drill-")) / "data"
    else:
        data_dir = Path(args.data_dir)
        if data_dir.exists() and any(data_dir.iterdir()):
            print(f"lamina drill: {data_dir} is not empty; the drill needs a scratch "
                  "directory (omit --data-dir for a temporary one)")
            return 2
    work = data_dir.parent / f"{data_dir.name}.drill"
    work.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(f"drill (seed {seed})", total=args.kills)
        drill = Drill(data_dir, work, kills=args.kills, seed=seed,
                      progress=lambda n: bar.update(task, completed=n))
        report = drill.run()
    table = Table(title=f"lamina drill: seed {seed}, {report.seconds} s")
    table.add_column("kill kind")
    table.add_column("count", justify="right")
    for kind, n in sorted(report.kills.items()):
        table.add_row(kind, str(n))
    table.add_row("total", str(report.total_kills))
    Console().print(table)
    print(f"acknowledged ops {report.acknowledged_ops}, in doubt {report.in_doubt_ops} "
          f"(applied {report.in_doubt_applied}), snapshots checked "
          f"{report.snapshots_checked}, daemon lives {report.daemon_lives}, coordinator "
          f"lives {report.coordinator_lives}")
    for v in report.violations:
        print(f"VIOLATION: {v}")
    print("OK: no violation" if not report.violations else
          f"FAILED: {len(report.violations)} violations")
    if args.report:
        Path(args.report).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 1 if report.violations else 0
