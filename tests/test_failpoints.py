"""Fail points: configured by environment or at run time, inert when off, a malformed
setting is a ConfigError at start-up (never at import), and each kind of action works at
the points the drill uses. ``kill`` is checked in real subprocesses (it ends the process);
``error`` and ``sleep`` run in this process through the runtime API."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lamina import failpoints
from lamina.errors import ConfigError, StorageError
from lamina.store import Store
from lamina.wal.segment import list_segments, scan_file
from tests.conftest import ORDERS, updates

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import sys
from lamina import Store
from tests.conftest import ORDERS, updates
with Store.open(sys.argv[1], segment_bytes=4096) as store:
    rel = store.relation("orders") if "orders" in store.relations() else \\
        store.create_relation("orders", ORDERS, key=["id"])
    for t in range(rel.upper, rel.upper + 50):
        rel.append(updates([(t, "x" * 50, t, 1)]))
        print(t, flush=True)
        rel.seal(t + 1)
"""


def run_child(data: Path, spec: str, shared: Path | None = None) -> tuple[int, list[int]]:
    env = dict(os.environ, LAMINA_FAILPOINTS=spec)
    if shared is not None:
        env["LAMINA_FAILPOINTS_SHARED"] = str(shared)
    out = subprocess.run([sys.executable, "-c", CHILD, str(data)], env=env,
                         capture_output=True, timeout=60, check=False, cwd=ROOT)
    return out.returncode, [int(x) for x in out.stdout.split()]


def run_here(data: Path) -> list[int]:
    """The child's workload in this process: the times acknowledged before it raised."""
    acked: list[int] = []
    with Store.open(data, segment_bytes=4096) as store:
        rel = store.relation("orders") if "orders" in store.relations() else \
            store.create_relation("orders", ORDERS, key=["id"])
        try:
            for t in range(rel.upper, rel.upper + 50):
                rel.append(updates([(t, "x" * 50, t, 1)]))
                acked.append(t)
                rel.seal(t + 1)
        except StorageError:
            pass
    return acked


@pytest.fixture(autouse=True)
def _no_fail_points_left() -> object:
    """Every test starts and ends with no fail point configured."""
    assert failpoints.ACTIVE == {}  # the test run itself configures none
    yield None
    failpoints.clear()


@pytest.mark.parametrize(("spec", "match"), [
    ("wal.nowhere=kill", "unknown fail point 'wal.nowhere'"),
    ("wal.after_write", "unknown fail point"),
    ("wal.after_write=explode", "unknown action 'explode'"),
    ("wal.after_write=kill@0", "bad count"),
    ("wal.after_write=kill@x", "bad count"),
    ("wal.after_write=sleep:soon", "bad sleep time"),
    ("wal.after_write=sleep:-1", "bad sleep time"),
])
def test_parse_rejects_bad_specs_with_config_error(spec: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        failpoints.parse(spec)


def test_parse_accepts_counts_and_sleeps() -> None:
    points = failpoints.parse("wal.after_write=kill@3, gc.after_delete=sleep:0.1")
    assert points["wal.after_write"].nth == 3
    assert points["gc.after_delete"].action == "sleep:0.1"
    assert points["gc.after_delete"].nth == 1


def test_inert_when_unset() -> None:
    failpoints.hit("wal.after_write")
    assert not failpoints.fires("wal.mid_record")


def test_runtime_api_configures_clears_and_restores() -> None:
    """configure() replaces the points and resets their counts; a bad spec changes
    nothing; active() restores the points and counts it found; clear() ends all."""
    failpoints.configure("wal.after_write=error@2")
    assert not failpoints.fires("wal.after_write")
    with pytest.raises(ConfigError):
        failpoints.configure("wal.after_write=explode")
    assert failpoints.fires("wal.after_write")  # the second pass: the count survived
    with failpoints.active("gc.before_delete=error"):
        assert set(failpoints.ACTIVE) == {"gc.before_delete"}
        with pytest.raises(StorageError, match=r"fail point gc\.before_delete"):
            failpoints.hit("gc.before_delete")
        failpoints.hit("gc.before_delete")  # fires once only
    assert set(failpoints.ACTIVE) == {"wal.after_write"}
    assert failpoints.ACTIVE["wal.after_write"].hits == 2
    failpoints.clear()
    assert failpoints.ACTIVE == {}
    failpoints.hit("wal.after_write")


def test_active_restores_after_an_exception() -> None:
    with pytest.raises(StorageError), failpoints.active("fs.before_rename=error"):
        failpoints.hit("fs.before_rename")
    assert failpoints.ACTIVE == {}


def test_malformed_env_fails_at_start_up_not_at_import(tmp_path: Path) -> None:
    """``import lamina`` works with a malformed LAMINA_FAILPOINTS; the CLI refuses to start
    (exit 2, the message names the variable); a library process gets ConfigError at the
    first fail point it reaches, before anything is written."""
    env = dict(os.environ, LAMINA_FAILPOINTS="wal.after_write=explode")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, text=True,
                              capture_output=True, timeout=60, check=False)

    out = run("-c", "import lamina, lamina.failpoints as f; print(sorted(f.ACTIVE) != [])")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"  # a placeholder: the fast path leads to the parse
    data = tmp_path / "data"
    out = run("-c", "import sys; from lamina.cli.main import main; sys.exit(main())",
              "status", "--data-dir", str(data))
    assert out.returncode == 2
    assert "LAMINA_FAILPOINTS: unknown action 'explode'" in out.stderr
    out = run("-c", CHILD, str(data))
    assert out.returncode == 1
    assert "ConfigError" in out.stderr
    assert "LAMINA_FAILPOINTS" in out.stderr
    assert out.stdout == ""  # nothing was acknowledged
    with Store.open(data) as store:  # refused at relation.json's rename: never created
        assert store.relations() == []


@pytest.mark.parametrize("point", ["wal.mid_record", "wal.before_seal", "wal.after_write",
                                   "fs.before_rename", "fs.after_rename"])
def test_kill_at_a_wal_point_loses_nothing_acknowledged(tmp_path: Path, point: str) -> None:
    """The child dies by SIGKILL at the point; reopening recovers every acknowledged
    append exactly once (an unacknowledged one at most once). Killed before it sealed
    its record, the writer left the record whole behind a header of zeros: a torn tail
    that recovery cuts off."""
    data = tmp_path / "data"
    code, acked = run_child(data, f"{point}=kill@7")
    assert code == -signal.SIGKILL
    if point == "wal.before_seal":
        (seg,) = [s for s in list_segments(data / "wal" / "orders") if not s.finished]
        scan, _ = scan_file(seg, "orders")
        assert scan.torn_reason == "unknown record type 0"
        assert seg.path.stat().st_size - scan.valid_end > 50  # the record's bytes are there
    with Store.open(data) as store:
        rel = store.relation("orders")
        rel.seal(rel.upper)  # runs the writer's recovery
        ids = rel.snapshot(rel.upper - 1).column("id").to_pylist() if rel.upper else []
    assert set(acked) <= set(ids)
    assert len(ids) == len(set(ids))
    assert len(ids) - len(acked) <= 1


def test_error_action_fails_the_writer_and_recovery_keeps_acked(tmp_path: Path) -> None:
    """An injected I/O error half-way through a record: the call raises, nothing is
    acknowledged for it, and a reopened store has exactly the earlier appends."""
    data = tmp_path / "data"
    with failpoints.active("wal.mid_record=error@5"):
        acked = run_here(data)
    # Records 1-4 are append, seal, append, seal; the 5th (the third append) is torn.
    assert len(acked) == 2
    with Store.open(data) as store:
        rel = store.relation("orders")
        rel.seal(rel.upper)
        ids = rel.snapshot(rel.upper - 1).column("id").to_pylist()
    assert ids == acked


def test_sleep_action_delays_at_the_point(tmp_path: Path) -> None:
    """``sleep:S`` holds the caller at the point for S seconds, once (the @N pass)."""
    with Store.open(tmp_path / "data") as store:
        rel = store.create_relation("orders", ORDERS, key=["id"])
        with failpoints.active("wal.after_write=sleep:1.5@2"):
            start = time.monotonic()
            rel.append(updates([(1, "a", 0, 1)]))
            first = time.monotonic() - start
            rel.append(updates([(2, "b", 0, 1)]))  # the second record written sleeps
            second = time.monotonic() - start - first
            rel.append(updates([(3, "c", 0, 1)]))
            third = time.monotonic() - start - first - second
        assert second >= 1.5
        assert first < 1.5
        assert third < 1.5


def test_shared_count_fires_once_across_processes(tmp_path: Path) -> None:
    """With a shared directory (LAMINA_FAILPOINTS_SHARED, or ``shared=``) the passes of
    every process are counted together in one file per point (as the Spark Python workers
    of one daemon need: each failed task attempt runs in a fresh process): the point fires
    in the first run, and a second one, configured afresh, carries on from that count
    instead of firing again. (The Spark failure suites check it across real workers.)"""
    data, shared = tmp_path / "data", tmp_path / "shared"
    shared.mkdir()
    with failpoints.active("wal.after_write=error@3", shared=shared):
        acked = run_here(data)
    assert len(acked) == 1  # append, seal, then the third record's write fails
    with failpoints.active("wal.after_write=error@3", shared=shared):
        acked = run_here(data)
    assert len(acked) == 50
    assert (shared / "wal.after_write.hits").stat().st_size > 100
