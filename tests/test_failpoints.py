"""Fail points: configured by environment, inert when off, and each kind of action works
at the points the drill uses (checked in real subprocesses)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lamina import failpoints
from lamina.store import Store

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
                         capture_output=True, timeout=60, check=False,
                         cwd=Path(__file__).resolve().parents[1])
    return out.returncode, [int(x) for x in out.stdout.split()]


def test_parse_rejects_unknown_points_and_actions() -> None:
    with pytest.raises(ValueError, match="unknown fail point"):
        failpoints.parse("wal.nowhere=kill")
    with pytest.raises(ValueError, match="unknown action"):
        failpoints.parse("wal.after_write=explode")
    points = failpoints.parse("wal.after_write=kill@3, gc.after_delete=sleep:0.1")
    assert points["wal.after_write"].nth == 3
    assert points["gc.after_delete"].action == "sleep:0.1"


def test_inert_when_unset() -> None:
    assert failpoints.ACTIVE == {}  # the test run itself configures none
    failpoints.hit("wal.after_write")
    assert not failpoints.fires("wal.mid_record")


@pytest.mark.parametrize("point", ["wal.mid_record", "wal.after_write", "fs.before_rename",
                                   "fs.after_rename"])
def test_kill_at_a_wal_point_loses_nothing_acknowledged(tmp_path: Path, point: str) -> None:
    """The child dies by SIGKILL at the point; reopening recovers every acknowledged
    append exactly once (an unacknowledged one at most once)."""
    data = tmp_path / "data"
    code, acked = run_child(data, f"{point}=kill@7")
    assert code == -signal.SIGKILL
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
    code, acked = run_child(data, "wal.mid_record=error@5")
    assert code == 1  # the StorageError ended the child
    # Records 1-4 are append, seal, append, seal; the 5th (the third append) is torn.
    assert len(acked) == 2
    with Store.open(data) as store:
        rel = store.relation("orders")
        rel.seal(rel.upper)
        ids = rel.snapshot(rel.upper - 1).column("id").to_pylist()
    assert ids == acked


def test_shared_count_fires_once_across_processes(tmp_path: Path) -> None:
    """With LAMINA_FAILPOINTS_SHARED the passes of every process are counted together
    (as the Spark Python workers of one daemon need: each failed task attempt runs in a
    fresh process): the point fires in the first process, and a second process carries on
    from its count instead of firing again."""
    data, shared = tmp_path / "data", tmp_path / "shared"
    shared.mkdir()
    code, acked = run_child(data, "wal.after_write=error@3", shared)
    assert code == 1
    assert len(acked) == 1  # append, seal, then the third record's write fails
    code, acked = run_child(data, "wal.after_write=error@3", shared)
    assert code == 0
    assert len(acked) == 50
    assert (shared / "wal.after_write.hits").stat().st_size > 100
