"""``lamina drill``: the checker catches what it must (fast), the command line refuses bad
use (fast), and a bounded drill of 100+ kills over every phase finds nothing (slow)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lamina.datadir import DataDir
from lamina.drill.check import CheckStats, check, check_live
from lamina.drill.driver import PHASES, phase_of
from lamina.drill.oracle import Oracle
from lamina.drill.workload import RELATION, next_op, run
from lamina.schema import RelationMeta
from lamina.store import Store
from lamina.trace.trace import Trace
from lamina.wal.reader import finished_segments
from lamina.wal.record import RecordType
from lamina.wal.segment import scan_file
from tests.trace.helpers import convert

LAMINA = str(Path(sys.executable).with_name("lamina"))


# --- a drilled data directory without the daemon ------------------------------------------

def workload(data: Path, ack: Path, *, ops: int, final: bool = True, seed: int = 7) -> None:
    run(data, ack, seed=seed, ops=ops, segment_bytes=4096, final=final)


def meta_of(data: Path) -> RelationMeta:
    path = DataDir(data).wal_dir(RELATION) / "relation.json"
    return RelationMeta.from_json(path.read_bytes(), path)


def make_drilled(tmp_path: Path, *, delete_converted: bool = True) -> tuple[Path, Path]:
    """A data dir written by the drill workload, its older half converted into the trace
    (with merges) by the reference executor, the rest still in WAL segments."""
    data, ack = tmp_path / "data", tmp_path / "ack.jsonl"
    workload(data, ack, ops=150)
    layout = DataDir(data)
    wal_dir = layout.wal_dir(RELATION)
    n = len(finished_segments(wal_dir))
    assert n >= 6, "the workload should have finished several segments"
    trace = Trace.open(layout.trace_store(RELATION), meta_of(data))
    convert(trace, wal_dir, per_plan=2, limit=n // 2)
    if delete_converted:
        trace.delete_converted_segments(wal_dir)
    assert trace.state.batches
    return data, ack


@pytest.fixture
def drilled(tmp_path: Path) -> tuple[Path, Path]:
    return make_drilled(tmp_path)


def unconverted_segment_with_updates(data: Path) -> tuple[Path, int, int]:
    """(path, offset, end) of an update record in a finished, unconverted segment."""
    wal_dir = DataDir(data).wal_dir(RELATION)
    trace = Trace.open(DataDir(data).trace_store(RELATION), meta_of(data))
    for seg in finished_segments(wal_dir):
        if seg.seq <= trace.state.converted_through:
            continue
        scan, _ = scan_file(seg, RELATION)
        for rec in scan.records:
            if rec.rtype is RecordType.UPDATES:
                return seg.path, rec.offset, rec.end
    raise AssertionError("no update record in an unconverted segment")


def test_check_passes_on_a_correct_store(drilled: tuple[Path, Path]) -> None:
    data, ack = drilled
    stats = CheckStats()
    assert check(data, Oracle.load(ack), stats) == []
    assert stats.snapshots_checked > 60  # every sealed time at or after since


def test_check_detects_a_double_applied_append(drilled: tuple[Path, Path]) -> None:
    """An update record written twice (what a retry after a lost ack without idempotence
    would do) is applied twice: the drill must say so."""
    data, ack = drilled
    path, start, end = unconverted_segment_with_updates(data)
    raw = path.read_bytes()
    path.write_bytes(raw[:end] + raw[start:end] + raw[end:])  # well-framed, checksums fine
    problems = check(data, Oracle.load(ack))
    assert any("applied twice" in p for p in problems), problems
    assert any("snapshot at" in p and "differs" in p for p in problems), problems


def test_check_detects_a_segment_counted_twice(tmp_path: Path) -> None:
    """A trace state that forgets it converted a segment still on disk (the double count
    that converted_through exists to prevent) makes readers see its updates twice."""
    data, ack = make_drilled(tmp_path, delete_converted=False)
    trace = Trace.open(DataDir(data).trace_store(RELATION), meta_of(data))
    st = trace.state
    trace.states.publish(st.next(converted_through=st.converted_through - 1))
    problems = check(data, Oracle.load(ack))
    assert any("applied twice" in p for p in problems), problems


def test_check_detects_a_segment_skipped_by_the_trace(drilled: tuple[Path, Path]) -> None:
    """A trace state claiming a segment it never converted loses that segment's updates."""
    data, ack = drilled
    trace = Trace.open(DataDir(data).trace_store(RELATION), meta_of(data))
    st = trace.state
    trace.states.publish(st.next(converted_through=st.converted_through + 1))
    problems = check(data, Oracle.load(ack))
    assert any("(lost)" in p for p in problems), problems


def test_check_detects_a_lost_append(drilled: tuple[Path, Path]) -> None:
    data, ack = drilled
    path, start, end = unconverted_segment_with_updates(data)
    raw = path.read_bytes()
    path.write_bytes(raw[:start] + raw[end:])  # the record is gone, the rest well-framed
    problems = check(data, Oracle.load(ack))
    assert any("(lost)" in p for p in problems), problems


def test_check_detects_an_orphan_file(drilled: tuple[Path, Path],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A data file no state names that garbage collection leaves behind is reported."""
    data, ack = drilled
    stray = DataDir(data).trace_dir(RELATION) / "batches" / "stray.parquet"
    stray.write_bytes(b"not named by any state")
    assert check(data, Oracle.load(ack)) == []  # collected: not a violation
    stray.write_bytes(b"not named by any state")
    monkeypatch.setattr(Trace, "collect_garbage", lambda self, **kw: None)
    problems = check(data, Oracle.load(ack))
    assert any("orphan file" in p for p in problems), problems


def test_check_detects_wrong_frontiers(drilled: tuple[Path, Path]) -> None:
    """An acknowledged seal the store does not report is a violation."""
    data, ack = drilled
    oracle = Oracle.load(ack)
    oracle.upper += 1
    assert any("frontiers" in p for p in check(data, oracle))


def test_live_check_detects_a_lost_append(tmp_path: Path) -> None:
    """Between coordinator lives (no final seal yet), a lost append is caught too."""
    data, ack = tmp_path / "data", tmp_path / "ack.jsonl"
    workload(data, ack, ops=120, final=False)
    oracle = Oracle()
    assert check_live(data, oracle, ack, random.Random(1), stats=CheckStats()) == []
    path, start, end = unconverted_segment_with_updates(data)
    raw = path.read_bytes()
    path.write_bytes(raw[:start] + raw[end:])
    problems = check_live(data, Oracle(), ack, random.Random(1), stats=CheckStats())
    assert any("(lost)" in p for p in problems), problems


# --- the oracle ------------------------------------------------------------------------------

def ack_lines(*recs: dict[str, object], torn: str = "") -> str:
    return "".join(json.dumps(r) + "\n" for r in recs) + torn


def test_oracle_settles_ops_in_doubt_from_the_store(tmp_path: Path) -> None:
    ack = tmp_path / "ack.jsonl"
    ack.write_text(ack_lines(
        {"op": 1, "intent": "append", "rows": [[-1, "marker", 0, 1], [5, "a", 0, 1]]},
        {"op": 1, "ack": True},
        {"op": 2, "intent": "seal", "value": 2}, {"op": 2, "ack": True},
        {"op": 3, "intent": "append", "rows": [[-3, "marker", 2, 1], [6, "b", 2, 1]]},
        {"op": 4, "intent": "append", "rows": [[-4, "marker", 2, 1], [7, "c", 3, 1]]},
        {"op": 5, "intent": "seal", "value": 4},
        torn='{"op": 6, "intent": "app'))
    oracle = Oracle.load(ack)
    assert (oracle.upper, sorted(oracle.in_doubt)) == (2, [3, 4, 5])
    # upper still 2: the appends at time 2 cannot be seen yet and stay in doubt
    assert oracle.resolve(set(), upper=2, since=0) == []
    assert sorted(oracle.in_doubt) == [3, 4]
    # sealed to 4 by a later op; op 3 reached the log, op 4 did not
    assert oracle.resolve({3}, upper=4, since=0) == [3]
    assert oracle.in_doubt == {}
    assert oracle.snapshot(3) == [(-3, "marker", 1), (-1, "marker", 1), (5, "a", 1),
                                  (6, "b", 1)]


def test_oracle_keeps_appends_in_doubt_while_nothing_is_readable(tmp_path: Path) -> None:
    """Regression (found by the soak): with since == upper no snapshot can be taken, so
    an append in doubt must stay in doubt, not be settled as "not applied" on an empty
    marker set (the drill then reported a present append as never acknowledged)."""
    ack = tmp_path / "ack.jsonl"
    ack.write_text(ack_lines(
        {"op": 1, "intent": "seal", "value": 2}, {"op": 1, "ack": True},
        {"op": 2, "intent": "append", "rows": [[-2, "marker", 2, 1], [5, "a", 2, 1]]},
        {"op": 3, "intent": "seal", "value": 4}, {"op": 3, "ack": True},
        {"op": 4, "intent": "since", "value": 4}, {"op": 4, "ack": True}))
    oracle = Oracle.load(ack)
    assert oracle.resolve(None, upper=4, since=4) == []
    assert sorted(oracle.in_doubt) == [2]
    oracle.upper = 5  # sealed further by a later life: the marker is readable at 4 now
    assert oracle.resolve({2}, upper=5, since=4) == [2]
    assert oracle.snapshot(4) == [(-2, "marker", 1), (5, "a", 1)]


def test_live_check_leaves_appends_in_doubt_when_since_equals_upper(tmp_path: Path) -> None:
    """The same through check_live: a kill right after allow_compaction(upper)."""
    from lamina.store import Store

    data, ack = tmp_path / "data", tmp_path / "ack.jsonl"
    workload(data, ack, ops=30, final=True)
    oracle = Oracle.load(ack)
    with Store.open(data) as store:
        rel = store.relation(RELATION)
        upper = rel.upper
        rel.allow_compaction(upper)
    # an append in doubt whose marker is below the upper (it did not reach the log)
    with ack.open("a") as f:
        f.write(ack_lines({"op": 999, "intent": "append",
                           "rows": [[-999, "marker", upper - 1, 1]]},
                          {"op": 1000, "intent": "since", "value": upper},
                          {"op": 1000, "ack": True}))
    assert check_live(data, oracle, ack, random.Random(1), stats=CheckStats()) == []
    assert 999 in oracle.in_doubt


def test_oracle_folds_history_before_since(tmp_path: Path) -> None:
    ack = tmp_path / "ack.jsonl"
    ack.write_text(ack_lines(
        {"op": 1, "intent": "append", "rows": [[-1, "marker", 0, 1], [5, "a", 0, 1],
                                               [5, "a", 1, -1], [6, "b", 3, 2]]},
        {"op": 1, "ack": True},
        {"op": 2, "intent": "seal", "value": 5}, {"op": 2, "ack": True},
        {"op": 3, "intent": "since", "value": 2}, {"op": 3, "ack": True}))
    oracle = Oracle.load(ack)
    assert oracle.snapshot(2) == [(-1, "marker", 1)]
    assert oracle.snapshot(4) == [(-1, "marker", 1), (6, "b", 2)]
    with pytest.raises(ValueError, match="before since"):
        oracle.snapshot(1)


def test_oracle_feeds_incrementally_and_skips_torn_lines(tmp_path: Path) -> None:
    ack = tmp_path / "ack.jsonl"
    ack.write_text(ack_lines({"op": 1, "intent": "seal", "value": 1}, {"op": 1, "ack": True},
                             torn='{"op": 2, "inte'))
    oracle = Oracle.load(ack)
    assert (oracle.upper, oracle.max_op) == (1, 1)
    assert next_op(ack) == 2
    with ack.open("a") as f:  # the next life ends the torn line first (AckLog does)
        f.write("\n" + ack_lines({"op": 2, "intent": "seal", "value": 3},
                                 {"op": 2, "ack": True}))
    oracle.feed(ack)
    assert (oracle.upper, oracle.max_op, oracle.ops) == (3, 2, 2)
    assert next_op(ack) == 3


def test_phases_cover_every_kill_kind() -> None:
    assert phase_of("coordinator:random") == "coordinator/random"
    assert phase_of("coordinator:fs.after_rename") == "coordinator/segment-rotation"
    assert phase_of("daemon:trace.mid_merge") == "daemon/merge"
    assert phase_of("daemon:gc.before_delete") == "daemon/gc"
    assert phase_of("daemon:compacter.pack_collected") == "daemon/pack"
    assert len(PHASES) == 9


@pytest.mark.parametrize("executor", ["spark", "inprocess", "mixed"])
def test_which_daemon_lives_run_spark(tmp_path: Path, executor: str) -> None:
    """spark: every life; inprocess: none, and the pack point (Spark's own) is never
    planned; mixed: the pack point, the first random kill and the final daemon."""
    from lamina.drill import driver

    drill = driver.Drill(tmp_path / "data", tmp_path, kills=20, seed=3, executor=executor)
    modes = drill._daemon_modes(first=True)
    assert ("compacter.pack_collected" in modes) is (executor != "inprocess")
    spark = {m for m in [*modes, driver.RANDOM, "final"] if drill._runs_spark(m)}
    expected = {"spark": {*modes, "final"}, "inprocess": set(),
                "mixed": {"compacter.pack_collected", driver.RANDOM, "final"}}[executor]
    assert spark == expected
    if executor == "mixed":  # only the first random life
        assert not drill._runs_spark(driver.RANDOM)
    with pytest.raises(ValueError, match="executor must be one of"):
        driver.Drill(tmp_path / "data", tmp_path, kills=1, seed=3, executor="local")


# --- the command line --------------------------------------------------------------------------

def lamina(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LAMINA, *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


def test_cli_refuses_a_non_empty_data_dir(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "precious").write_text("user data")
    out = lamina("drill", "--data-dir", str(data), "--kills", "1")
    assert out.returncode == 2
    assert "not an empty directory" in out.stderr
    assert (data / "precious").read_text() == "user data"
    assert not (tmp_path / "data.drill").exists()


def test_cli_refuses_a_leftover_work_dir(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """An ack log left by an earlier drill would poison the oracle."""
    from lamina.cli.main import main

    work = tmp_path / "data.drill"
    work.mkdir()
    (work / "ack-0.jsonl").write_text("{}\n")
    assert main(["drill", "--data-dir", str(tmp_path / "data"), "--kills", "1"]) == 2
    assert "work directory" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--kills", "-1", "--kills must be >= 0"),
    ("--daemon-share", "1.5", "--daemon-share must be between 0 and 1"),
    ("--max-seconds", "0", "--max-seconds must be > 0"),
    ("--coordinators", "0", "--coordinators must be between 1 and 8"),
])
def test_cli_refuses_bad_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 flag: str, value: str, message: str) -> None:
    from lamina.cli.main import main

    assert main(["drill", "--data-dir", str(tmp_path / "data"), flag, value]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "data").exists()
    assert not (tmp_path / "data.drill").exists()


def test_cli_exit_code_and_report_follow_the_violations(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A violation means exit 1 and ok=false in the report; none means exit 0."""
    from lamina.cli.main import build_parser
    from lamina.drill import driver

    found: list[str] = []

    def fake_run(self: driver.Drill) -> driver.DrillReport:
        self.report.kills["coordinator:random"] += 3
        self.report.kills["daemon:trace.mid_merge"] += 1
        self.report.violations.extend(found)
        return self.report

    monkeypatch.setattr(driver.Drill, "run", fake_run)
    for name, violations, code in (("clean", [], 0), ("bad", ["snapshot at 3 differs"], 1)):
        found[:] = violations
        report = tmp_path / f"{name}.json"
        args = build_parser().parse_args(["drill", "--data-dir", str(tmp_path / name),
                                          "--kills", "4", "--seed", "5",
                                          "--report", str(report)])
        assert driver.run_drill_cli(args) == code
        doc = json.loads(report.read_text())
        assert doc["ok"] is (code == 0)
        assert doc["violations"] == violations
        assert doc["total_kills"] == 4
        assert doc["phases"]["daemon/merge"] == 1
        out = capsys.readouterr().out
        assert ("OK: no violation" in out) is (code == 0)
        assert "daemon:trace.mid_merge" in out


class FakeDaemon:
    """Stands in for ``lamina serve`` (no Spark): a process that sleeps, is always ready
    and caught up, and exits cleanly on SIGTERM. The WAL is then never converted, which
    the read path and the checks handle like a daemon that is always behind."""

    def __init__(self, data_dir: Path, log_path: Path, *, master: str = "",
                 extra_env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        with log_path.open("a") as f:
            f.write('{"event": "daemon.ready", "level": "info"}\n')
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

    def get(self, path: str) -> tuple[int, bytes]:
        return 200, b"ready"

    def wait_caught_up(self, relation: str, sealed_upper: int, timeout: float = 0) -> None:
        pass

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        code = self.proc.wait(timeout)
        return 0 if code == -signal.SIGTERM else code

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.mark.parametrize(("kills", "coordinators", "relations"),
                         [(0, 1, None), (6, 2, None), (6, 2, 9)])
def test_coordinator_loops_without_spark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         kills: int, coordinators: int,
                                         relations: int | None) -> None:
    """The coordinator loops, live checks and final checks, with a stand-in daemon:
    random and fail-point kills, clean exits, no violation (--kills 0 included); with
    several relations per coordinator process, each relation has its own oracle."""
    from lamina.drill import driver

    monkeypatch.setattr(driver, "DaemonProcess", FakeDaemon)
    work = tmp_path / "data.drill"
    work.mkdir()
    drill = driver.Drill(tmp_path / "data", work, kills=kills, seed=11, daemon_share=0,
                         coordinators=coordinators, relations=relations)
    report = drill.run()
    if relations:
        assert sorted(store_relations(tmp_path / "data")) == sorted(
            [f"drill.{j}" for j in range(5)] + [f"drill-1.{j}" for j in range(4)])
        assert all(o.ops > 0 for c in drill.coordinators for o in c.oracles.values())
    assert report.violations == []
    assert report.total_kills >= kills
    assert report.daemon_lives == 1  # the final one
    assert report.coordinator_lives >= max(kills, 1)
    assert report.snapshots_checked > 60
    assert report.live_checks >= 1
    assert report.acknowledged_ops > 0
    if kills:
        assert report.kills["coordinator:random"] >= 1


def store_relations(data: Path) -> list[str]:
    with Store.open(data) as store:
        return store.relations()


# --- the CI drill ------------------------------------------------------------------------------

CI_KILLS = 100
CI_DAEMON_SHARE = 0.08  # 8 daemon lives: every daemon fail point once, one random kill
CI_MAX_SECONDS = 420
CI_RELATIONS = 12  # six per coordinator process: the daemon runs packs of many relations
# Spark where the kill is about Spark (the pack point, a random kill, the final daemon), the
# in-process executor for the other daemon fail points, which sit in the commit path both
# executors share: three JVM start-ups instead of nine (docs/reliability.md)
CI_EXECUTOR = "mixed"


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(CI_MAX_SECONDS + 480)
def test_drill_100_kills_over_every_phase(tmp_path: Path) -> None:
    """The bounded drill CI runs: >= 100 SIGKILLs spread over every phase (the daemon's amid
    packs of many relations too), no violation."""
    report_path = tmp_path / "drill.json"
    started = time.monotonic()
    out = subprocess.run(
        [LAMINA, "drill", "--data-dir", str(tmp_path / "data"), "--kills", str(CI_KILLS),
         "--seed", os.environ.get("LAMINA_DRILL_SEED", "20261122"),
         "--daemon-share", str(CI_DAEMON_SHARE), "--max-seconds", str(CI_MAX_SECONDS),
         "--relations", str(CI_RELATIONS), "--executor", CI_EXECUTOR,
         "--report", str(report_path)],
        capture_output=True, text=True, timeout=CI_MAX_SECONDS + 420, check=False)
    took = time.monotonic() - started
    report = json.loads(report_path.read_text())
    detail = f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}\nlogs: {tmp_path}/data.drill"
    assert out.returncode == 0, detail
    assert report["violations"] == [], detail
    assert report["ok"], detail
    assert report["total_kills"] >= CI_KILLS, detail
    phases = report["phases"]
    assert report["relations"] == CI_RELATIONS
    lives = report["daemon_lives_by_executor"]
    assert lives["spark"] >= 3, lives  # the pack point, a random kill, the final daemon
    assert lives["inprocess"] >= 5, lives
    for phase in ("coordinator/random", "coordinator/wal-record", "daemon/pack",
                  "daemon/conversion", "daemon/merge", "daemon/state-publication",
                  "daemon/gc"):
        assert phases[phase] >= 1, (phase, phases)
    kills = report["kills"]
    for point in ("compacter.pack_collected", "trace.after_batch_written", "trace.mid_merge",
                  "trace.after_state_published", "gc.before_delete", "gc.after_delete"):
        assert kills.get(f"daemon:{point}", 0) >= 1, (point, kills)
    assert report["live_checks"] >= 10
    assert report["acknowledged_ops"] > 1000
    assert report["snapshots_checked"] > 60
    print(f"drill: {report['total_kills']} kills in {took:.0f} s: {phases}")


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(600)
def test_drill_with_the_trace_on_s3(tmp_path: Path, s3_bucket: str) -> None:
    """``lamina drill --trace-url s3://...``: coordinators and daemons killed, daemons at
    the trace's fail points too, with every state, part and pending part an S3 object;
    no violation, and nothing of the trace under the data directory."""
    report_path = tmp_path / "drill.json"
    url = f"s3://{s3_bucket}/drill"
    out = subprocess.run(
        [LAMINA, "drill", "--data-dir", str(tmp_path / "data"), "--kills", "24",
         "--seed", "20261124", "--daemon-share", "0.35", "--max-seconds", "300",
         "--coordinators", "1", "--executor", "mixed", "--trace-url", url,
         "--report", str(report_path)],
        capture_output=True, text=True, timeout=500, check=False)
    report = json.loads(report_path.read_text())
    detail = f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}\nlogs: {tmp_path}/data.drill"
    assert out.returncode == 0, detail
    assert report["violations"] == [], detail
    assert report["trace_url"] == url
    assert report["total_kills"] >= 20, detail
    assert any(k.startswith("daemon:") for k in report["kills"]), detail
    assert report["snapshots_checked"] > 30, detail
    from lamina.objstore.base import open_store

    keys = [o.key for o in open_store(url).list("")]
    assert any(k.startswith("drill/state/") for k in keys), keys[:20]
    assert not list((tmp_path / "data" / "trace").glob("*/*"))


def test_every_coordinator_lives_once_when_the_daemon_is_ready_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no kills, a daemon that is ready before the coordinator threads first run
    (the race CI once hit) still leaves every coordinator one clean life to check."""
    from lamina.drill import driver

    monkeypatch.setattr(driver, "DaemonProcess", FakeDaemon)
    work = tmp_path / "data.drill"
    work.mkdir()
    drill = driver.Drill(tmp_path / "data", work, kills=0, seed=12, daemon_share=0,
                         coordinators=2)
    drill._daemon_done.set()  # the daemon loop won the race
    report = drill.run()
    assert report.violations == []
    assert report.coordinator_lives == 2
    assert report.clean_coordinator_lives == 2
    assert report.acknowledged_ops > 0
