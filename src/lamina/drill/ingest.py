"""``lamina drill --ingest files``: kill ``lamina ingest`` while a writer feeds its files.

One data directory, three actors (see docs/reliability.md):

- a **writer** thread appends JSON Lines ``{"id": n, "text": "line n"}`` to numbered files
  in an input directory (a new file every :data:`LINES_PER_FILE` lines), a few lines at a
  time, and now and then half a line first and its rest a moment later (a line without its
  newline must wait). What it wrote, whole lines only, is the oracle;
- the **coordinator**: ``lamina ingest`` on a files source over that directory (key
  ``id``, ``timestamp_interval_seconds`` 0.05), one life per kill: SIGKILL a random 0-0.6 s
  after its source logged ``source.running``, or let it kill itself at an ``ingest.*``
  fail point (``kill@N``: binding sealed, outputs appended, outputs sealed, offset
  committed). After each kill the output's upper, read from disk, must not have gone back;
- the **compacter daemon** (``lamina serve``, Spark ``local[2]``, or with ``--executor
  inprocess`` the in-process executor: this drill is about ingest, not the executor) runs
  throughout. It converts a WAL segment once it is finished, and ``lamina ingest`` (no
  segment setting: 64 MiB or 60 s) finishes one only on a clean stop, so in a short drill
  it converts the output and the remap relation at the end (see docs/reliability.md).

Then the writer stops, ``lamina ingest`` runs once more without fail points until the output
holds as many rows as the writer wrote lines, and stops on SIGTERM (exit 0, finishing its
segments); the daemon must convert the output up to its upper (``/v1/relations``: nothing
pending, the trace non-empty), then stops on SIGTERM (exit 0, no error logged). The final
check, on what the daemon converted: the output's snapshot holds
every line the writer wrote exactly once (``_diff`` 1), and nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from lamina.drill.procs import DaemonProcess
from lamina.forkserver import ChildProcess, ForkServer

POINTS = ("ingest.binding_sealed", "ingest.outputs_appended", "ingest.outputs_sealed",
          "ingest.offset_committed")
RANDOM = "random"
SOURCE = "lines"
"""The files source's name, and so its output relation's (``lines.remap`` its bindings)."""
LINES_PER_FILE = 400
RANDOM_KILL_SPAN = 0.6
POINT_TIMEOUT = 30.0
START_TIMEOUT = 60.0
FINAL_TIMEOUT = 180.0
#: what the fork server that starts every ``lamina ingest`` life imports once: the command
#: line, the files source, and pandas, which pyarrow imports the first time ingestion
#: builds an array from Python rows (about 1.2 s of CPU per start in all)
PRELOAD = ("lamina.cli.main", "lamina.ingest.service", "lamina.ingest.files", "uvloop",
           "pandas")


@dataclass
class IngestDrillReport:
    seed: int
    data_dir: str
    kills_requested: int
    daemon: bool
    kills: Counter[str] = field(default_factory=Counter)
    points_missed: Counter[str] = field(default_factory=Counter)
    ingest_lives: int = 0
    lines_written: int = 0
    files_written: int = 0
    rows_checked: int = 0
    upper_checks: int = 0
    daemon_caught_up: bool = False
    seconds: float = 0.0
    stopped_by_time_bound: bool = False
    violations: list[str] = field(default_factory=list)

    @property
    def total_kills(self) -> int:
        return sum(self.kills.values())

    def to_json(self) -> dict[str, Any]:
        return {"mode": "ingest-files", "seed": self.seed, "data_dir": self.data_dir,
                "kills_requested": self.kills_requested, "kills": dict(self.kills),
                "total_kills": self.total_kills, "points_missed": dict(self.points_missed),
                "daemon": self.daemon,
                "daemon_caught_up": self.daemon_caught_up, "ingest_lives": self.ingest_lives,
                "lines_written": self.lines_written, "files_written": self.files_written,
                "rows_checked": self.rows_checked, "upper_checks": self.upper_checks,
                "seconds": self.seconds, "stopped_by_time_bound": self.stopped_by_time_bound,
                "violations": self.violations}


class _Writer:
    """Appends lines to the input directory in a thread; ``written`` is the oracle."""

    def __init__(self, directory: Path, rng: random.Random) -> None:
        self.dir = directory
        self.rng = rng
        self.written = 0       # lines 0 .. written-1 are whole in the files
        self.files = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="drill-ingest-writer",
                                       daemon=True)

    def _run(self) -> None:
        f: IO[bytes] | None = None
        try:
            while not self.stop.is_set():
                if self.written % LINES_PER_FILE == 0:
                    if f is not None:
                        f.close()
                    f = open(self.dir / f"part-{self.files:05d}.jsonl", "ab")  # noqa: SIM115
                    self.files += 1
                assert f is not None
                n = min(self.rng.randint(1, 20), LINES_PER_FILE - self.written % LINES_PER_FILE)
                lines = b"".join(_line(i) for i in range(self.written, self.written + n))
                if self.rng.random() < 0.1:   # half a line first: the reader must wait
                    cut = len(lines) - self.rng.randint(1, len(_line(self.written + n - 1)))
                    f.write(lines[:cut])
                    f.flush()
                    time.sleep(self.rng.uniform(0.0, 0.05))
                    f.write(lines[cut:])
                else:
                    f.write(lines)
                f.flush()
                self.written += n
                time.sleep(self.rng.uniform(0.0, 0.01))
        except BaseException as exc:
            self.error = exc
        finally:
            if f is not None:
                f.close()


def _line(i: int) -> bytes:
    return json.dumps({"id": i, "text": f"line {i}"}).encode() + b"\n"


def config_text(data_dir: Path, input_dir: Path) -> str:
    return (f'data_dir = "{data_dir}"\nlog_format = "json"\nshutdown_grace_seconds = 30\n'
            f"retry_initial_seconds = 0.1\n"
            # segments finish each second, so the daemon converts while ingest is killed
            f"segment_max_age_seconds = 1.0\n\n"
            f'[[sources]]\nname = "{SOURCE}"\nkind = "files"\npath = "{input_dir}"\n'
            f'format = "jsonl"\nschema = {{ id = "int64", text = "string" }}\n'
            f'key = ["id"]\ntimestamp_interval_seconds = 0.05\npoll_interval_seconds = 0.02\n')


def _upper(data_dir: Path) -> int:
    """The output's upper as a reader sees it on disk (0 before it exists)."""
    from lamina.layout import Layout
    from lamina.store import Store

    if not Layout(data_dir).wal_dir(SOURCE).exists():
        return 0
    with Store.open(data_dir) as store:
        return store.relation(SOURCE).upper


class IngestDrill:
    def __init__(self, data_dir: Path, work_dir: Path, *, kills: int, seed: int,
                 max_seconds: float | None = None, daemon: bool = True,
                 executor: str = "spark") -> None:
        if executor not in ("spark", "inprocess"):
            raise ValueError(f"the ingest drill runs one daemon life: executor 'spark' or "
                             f"'inprocess', not {executor!r}")
        self.executor = executor
        self.data_dir = data_dir
        self.work = work_dir
        self.kills = kills
        self.rng = random.Random(seed)
        self.max_seconds = max_seconds
        self.report = IngestDrillReport(seed, str(data_dir), kills, daemon)
        self.input = work_dir / "input"
        self.config = work_dir / "ingest.toml"
        self.log = work_dir / "ingest.log"
        self.daemon_log = work_dir / "daemon.log"
        self._started = time.monotonic()
        self._upper = 0
        self._forks: ForkServer | None = None  # what starts each lamina ingest (run())

    def _violation(self, text: str) -> None:
        self.report.violations.append(text)

    def _start(self, env: dict[str, str]) -> tuple[ChildProcess, int]:
        assert self._forks is not None, "lives start inside run()"
        offset = self.log.stat().st_size if self.log.exists() else 0
        full = {k: v for k, v in os.environ.items()
                if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID",
                             "LAMINA_FAILPOINTS")}
        full.update(env)
        with self.log.open("ab") as log:
            log.write(f"=== life {self.report.ingest_lives} {env or ''} ===\n".encode())
            log.flush()
            proc = self._forks.spawn("lamina.cli.main:main",
                                     ["ingest", "--config", str(self.config), "--http",
                                      "127.0.0.1:0"], env=full, stdout=subprocess.DEVNULL,
                                     stderr=log)
        self.report.ingest_lives += 1
        return proc, offset

    def _saw(self, proc: ChildProcess, offset: int, event: str,
             timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.log.open("rb") as f:
                f.seek(offset)
                if f'"{event}"'.encode() in f.read():
                    return True
            if proc.poll() is not None:
                return False
            time.sleep(0.02)
        return False

    def _life(self, kind: str) -> None:
        env = {}
        if kind != RANDOM:
            env["LAMINA_FAILPOINTS"] = f"{kind}=kill@{self.rng.randint(1, 8)}"
        proc, offset = self._start(env)
        try:
            if kind == RANDOM:
                if not self._saw(proc, offset, "source.running", START_TIMEOUT):
                    self._violation(f"lamina ingest did not reach source.running (exit "
                                    f"{proc.poll()}); see {self.log}")
                    return
                time.sleep(self.rng.uniform(0.0, RANDOM_KILL_SPAN))
                if proc.poll() is not None:
                    self._violation(f"lamina ingest exited on its own with {proc.returncode}; "
                                    f"see {self.log}")
                    return
                proc.send_signal(signal.SIGKILL)
            else:
                try:
                    proc.wait(POINT_TIMEOUT)
                except subprocess.TimeoutExpired:
                    self.report.points_missed[kind] += 1
                    proc.send_signal(signal.SIGKILL)
            code = proc.wait(30)
            if code != -signal.SIGKILL:
                self._violation(f"lamina ingest ({kind}) exited with {code}, expected a "
                                f"SIGKILL; see {self.log}")
                return
            self.report.kills[kind] += 1
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        upper = _upper(self.data_dir)
        self.report.upper_checks += 1
        if upper < self._upper:
            self._violation(f"the output's upper went back from {self._upper} to {upper} "
                            f"after a kill at {kind}")
        self._upper = max(self._upper, upper)

    def run(self) -> IngestDrillReport:
        self.input.mkdir(parents=True, exist_ok=True)
        self.config.write_text(config_text(self.data_dir, self.input))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        daemon = None
        if self.report.daemon:
            daemon = DaemonProcess(self.data_dir, self.daemon_log,
                                   extra_env={"LAMINA_EXECUTOR": self.executor})
        writer = _Writer(self.input, random.Random(self.rng.random()))
        writer.thread.start()
        # every life is a child of one fork server that imported lamina ingest's modules
        with ForkServer(PRELOAD) as self._forks:
            try:
                for i in range(self.kills):
                    if (self.max_seconds is not None
                            and time.monotonic() - self._started > self.max_seconds * 0.6):
                        self.report.stopped_by_time_bound = True
                        break
                    kind = RANDOM if i % 2 == 0 else POINTS[(i // 2) % len(POINTS)]
                    self._life(kind)
                    if self.report.violations:
                        break
            finally:
                writer.stop.set()
                writer.thread.join(30)
            self.report.lines_written = writer.written
            self.report.files_written = writer.files
            if writer.error is not None:
                self._violation(f"the writer failed: {writer.error!r}")
            try:
                if not self.report.violations:
                    self._final(writer.written)
            finally:
                if daemon is not None:
                    self._stop_daemon(daemon)
        if not self.report.violations:
            self._check(writer.written)
        self.report.seconds = round(time.monotonic() - self._started, 1)
        return self.report

    def _final(self, lines: int) -> None:
        from lamina.store import Store

        proc, _ = self._start({})
        try:
            deadline = time.monotonic() + FINAL_TIMEOUT
            rows = -1
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    self._violation(f"the final lamina ingest exited with {proc.returncode}; "
                                    f"see {self.log}")
                    return
                upper = _upper(self.data_dir)
                if upper > 0:
                    with Store.open(self.data_dir) as store:
                        rows = store.relation(SOURCE).snapshot(upper - 1).num_rows
                    if rows >= lines:
                        break
                time.sleep(0.2)
            else:
                self._violation(f"the final lamina ingest did not catch up in "
                                f"{FINAL_TIMEOUT:.0f} s: {rows} rows of {lines} lines")
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
            if code != 0:
                self._violation(f"the final lamina ingest exited {code} on SIGTERM, "
                                "expected 0")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)

    def _stop_daemon(self, daemon: DaemonProcess) -> None:
        if daemon.proc.poll() is not None:
            self._violation(f"the daemon exited on its own with {daemon.proc.returncode}; "
                            f"see {self.daemon_log}")
            return
        try:  # the final ingest finished its segments: the trace must take them all
            daemon.wait_ready(timeout=300)
            daemon.wait_caught_up(SOURCE, _upper(self.data_dir), timeout=300)
            self.report.daemon_caught_up = True
        except AssertionError as exc:
            self._violation(f"the daemon did not convert the output: {str(exc)[:1500]}")
        daemon.signal(signal.SIGTERM)
        code = daemon.wait(180)
        if code != 0:
            self._violation(f"the daemon exited {code} on SIGTERM, expected 0")
        for line in self.daemon_log.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("level") == "error":
                self._violation(f"the daemon logged an error: {rec.get('event')}: "
                                f"{str(rec.get('error', ''))[:500]}")

    def _check(self, lines: int) -> None:
        """Every line the writer wrote, exactly once, and nothing else."""
        from lamina.store import Store

        with Store.open(self.data_dir) as store:
            rel = store.relation(SOURCE)
            table = rel.snapshot(rel.upper - 1)
        ids = table.column("id").to_pylist()
        diffs = table.column("_diff").to_pylist()
        texts = table.column("text").to_pylist()
        self.report.rows_checked = len(ids)
        count = Counter(ids)
        dup = [i for i, n in count.items() if n > 1]
        bad = [(i, d) for i, d in zip(ids, diffs, strict=True) if d != 1]
        wrong = [(i, s) for i, s in zip(ids, texts, strict=True) if s != f"line {i}"]
        missing = sorted(set(range(lines)) - set(count))
        extra = sorted(set(count) - set(range(lines)))
        for what, xs in (("lines missing", missing), ("rows not written", extra),
                         ("rows more than once", dup), ("rows with _diff != 1", bad),
                         ("rows with the wrong text", wrong)):
            if xs:
                self._violation(f"{len(xs)} {what}: {xs[:20]}")


def run_ingest_drill_cli(args: argparse.Namespace) -> int:
    """``lamina drill --ingest files`` (the arguments were checked by the caller)."""
    import shutil

    from lamina.drill.workdirs import drill_dirs

    executor = getattr(args, "executor", "spark")
    if executor == "mixed":
        print("lamina drill: --executor mixed is for the store drill; --ingest runs one "
              "daemon life: pass spark or inprocess", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    dirs = drill_dirs(args.data_dir, "lamina-drill-ingest-")
    if dirs is None:
        return 2
    data_dir, work, scratch = dirs
    drill = IngestDrill(data_dir, work, kills=args.kills, seed=seed,
                        max_seconds=getattr(args, "max_seconds", None),
                        daemon=not getattr(args, "no_daemon", False), executor=executor)
    report = drill.run()
    doc = report.to_json()
    doc["executor"] = executor
    doc["work_dir"] = str(work)
    print(f"lamina drill --ingest files: seed {seed}, {report.seconds} s, kills "
          f"{report.total_kills} ({', '.join(f'{k} {n}' for k, n in sorted(report.kills.items()))}"
          f"), lines written {report.lines_written} in {report.files_written} files, rows "
          f"checked {report.rows_checked}, ingest lives {report.ingest_lives}")
    if report.points_missed:
        print(f"fail points that did not fire in time: {dict(report.points_missed)}")
    for v in report.violations:
        print(f"VIOLATION: {v}")
    print("OK: no violation" if not report.violations else
          f"FAILED: {len(report.violations)} violations")
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(doc, indent=2) + "\n")
    if scratch is not None and not report.violations:
        shutil.rmtree(scratch, ignore_errors=True)
    elif report.violations:
        print(f"lamina drill: logs and data kept in {work} and {data_dir}", file=sys.stderr)
    return 1 if report.violations else 0
