"""lamina.testing.faults: the fault-injection storage shim works as the crash and failure suites
assume — operations are numbered exactly, a crash happens at the chosen operation and
nowhere else, and failures surface as StorageError from the layer above without leaving a
half-published file."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lamina.compacter.executors import reference
from lamina.errors import StorageError, WriterFailedError
from lamina.fs import FileSystem
from lamina.objstore.local import LocalObjectStore
from lamina.store import Store
from lamina.testing.faults import (
    OP_KINDS,
    CountingFileSystem,
    CrashingFileSystem,
    FailingFileSystem,
    InjectingFileSystem,
    Op,
)
from lamina.trace.plan import plan_conversion
from lamina.trace.trace import Trace
from tests.trace.helpers import KEY, NAME, SCHEMA, Oracle, check_snapshots, pending_spans

ROOT = Path(__file__).resolve().parents[1]


def test_counting_numbers_every_primitive_in_order(tmp_path: Path) -> None:
    """A publish is write, fdatasync, rename, directory fsync; numbers count from 1 over
    all kinds and per kind, and each op names its file."""
    fs = CountingFileSystem()
    fs.write_atomic(tmp_path / "a", b"x" * 10)
    fs.write_atomic(tmp_path / "b", b"y")
    assert [op.kind for op in fs.ops] == ["write", "fdatasync", "rename", "fsync_dir"] * 2
    assert [op.number for op in fs.ops] == list(range(1, 9))
    assert fs.count == 8
    assert fs.counts == {"write": 2, "fdatasync": 2, "fsync_dir": 2, "rename": 2, "link": 0,
                         "unlink": 0}
    assert [op.kind_number for op in fs.ops if op.kind == "write"] == [1, 2]
    rename = fs.ops[2]
    assert rename.target == tmp_path / "a"
    assert rename.path.name.endswith(".tmp")
    assert fs.ops[0].size == 10
    assert "rename" in str(rename)
    assert "->" in str(rename)
    assert (tmp_path / "a").read_bytes() == b"x" * 10


def test_injecting_counts_without_recording_by_default(tmp_path: Path) -> None:
    """The base class always counts; it keeps the op list only when asked to."""
    fs = InjectingFileSystem()
    assert fs.publish_exclusive(tmp_path / "s", b"1")
    assert fs.count == 5  # write, fdatasync, link, unlink (temp), fsync_dir
    assert fs.counts["link"] == 1
    assert fs.counts["unlink"] == 1
    assert fs.ops == []
    assert set(fs.counts) == set(OP_KINDS)


def _crash_child(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(f"""
        from pathlib import Path
        from lamina.testing.faults import CrashingFileSystem
        d = Path({str(tmp_path)!r})
    """) + textwrap.dedent(script)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.parametrize(("when", "published"), [("before", False), ("after", True)])
def test_crash_kills_the_process_at_the_chosen_operation(tmp_path: Path, when: str,
                                                         published: bool) -> None:
    """Crashing at op 3 of a publish (the rename) dies by SIGKILL with nothing after it
    run: "before" leaves only the synced temp file, "after" leaves the renamed file but
    no directory fsync was issued (the process is gone)."""
    proc = _crash_child(f"""
        fs = CrashingFileSystem(3, when={when!r})
        fs.write_atomic(d / "f", b"data")
        print("survived")
    """, tmp_path)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "survived" not in proc.stdout
    assert (tmp_path / "f").exists() is published
    temps = list(tmp_path.glob(".f.*.tmp"))
    assert len(temps) == (0 if published else 1)
    if not published:
        assert temps[0].read_bytes() == b"data"


def test_crash_beyond_the_last_operation_is_a_normal_run(tmp_path: Path) -> None:
    """crash_at = count + 1 never fires: the dry-run count is exact."""
    counting = CountingFileSystem()
    counting.write_atomic(tmp_path / "g", b"1")
    proc = _crash_child(f"""
        fs = CrashingFileSystem({counting.count + 1})
        fs.write_atomic(d / "f", b"1")
        print(fs.count)
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(counting.count)]


def test_crash_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="from 1"):
        CrashingFileSystem(0)
    with pytest.raises(ValueError, match="before"):
        CrashingFileSystem(1, when="during")  # type: ignore[arg-type]


@pytest.mark.parametrize(("kind", "err"), [("write", errno.ENOSPC), ("fdatasync", errno.EIO),
                                           ("rename", errno.EIO)])
def test_failing_surfaces_as_storage_error_and_publishes_nothing(
        tmp_path: Path, kind: str, err: int) -> None:
    """An injected EIO/ENOSPC comes out of the storage layer as StorageError with that
    errno; the target is untouched and no temp file stays behind."""
    (tmp_path / "f").write_bytes(b"old")
    fs = FailingFileSystem({kind: 1}, err)  # type: ignore[dict-item]
    with pytest.raises(StorageError) as info:
        fs.write_atomic(tmp_path / "f", b"new")
    assert info.value.errno == err
    assert (tmp_path / "f").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]
    assert [op.kind for op in fs.failures] == [kind]


def test_failing_by_call_number_predicate_and_sticky(tmp_path: Path) -> None:
    """The N-th call of a kind fails and the others pass; a predicate picks by path;
    sticky fails everything after the first failure."""
    fs = FailingFileSystem({"fdatasync": [2]})
    fs.write_atomic(tmp_path / "a", b"1")
    with pytest.raises(StorageError):
        fs.write_atomic(tmp_path / "b", b"2")
    fs.write_atomic(tmp_path / "c", b"3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "c"]

    def only_b(op: Op) -> bool:
        return op.kind == "rename" and op.target is not None and op.target.name == "b"

    picky = FailingFileSystem(only_b)
    picky.write_atomic(tmp_path / "d", b"4")
    with pytest.raises(StorageError):
        picky.write_atomic(tmp_path / "b", b"2")

    sticky = FailingFileSystem({"rename": 1}, sticky=True)
    with pytest.raises(StorageError):
        sticky.write_atomic(tmp_path / "e", b"5")
    with pytest.raises(StorageError):  # the first write of the next publish fails now
        sticky.write_atomic(tmp_path / "f", b"6")
    assert [op.kind for op in sticky.failures] == ["rename", "write"]


def test_failing_rejects_unknown_kinds() -> None:
    with pytest.raises(ValueError, match="unknown operation kinds"):
        FailingFileSystem({"fsync": 1})  # type: ignore[dict-item]


def test_store_writer_fails_stop_on_injected_fsync_error(tmp_path: Path) -> None:
    """Store.open(fs=...) routes the WAL through the shim: an fdatasync error fails the
    append and every later call (no retried fsync); a reopened store with a healthy
    file system has every acknowledged update (the failed one may or may not be there:
    it was never acknowledged)."""
    armed = {"fdatasync": False}
    fs = FailingFileSystem(lambda op: armed.get(op.kind, False))
    oracle = Oracle()
    unacknowledged = (3, "x", 0, 1)
    with Store.open(tmp_path, fs=fs) as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        oracle.append(rel, [(1, "x", 0, 1), (2, "x", 0, 1)])
        armed["fdatasync"] = True  # the disk goes bad
        with pytest.raises(StorageError):
            oracle.append(rel, [unacknowledged])
        assert [op.kind for op in fs.failures] == ["fdatasync"]
        armed["fdatasync"] = False  # even a healthy disk is not trusted again
        with pytest.raises(WriterFailedError):
            rel.seal(1)
    with Store.open(tmp_path) as store:
        rel = store.relation(NAME)
        rel.seal(1)
        got = rel.snapshot(0).to_pylist()
        assert got in (oracle.snapshot(0),
                       Oracle([*oracle.updates, unacknowledged]).snapshot(0))


def test_trace_conversion_failing_at_publication_changes_nothing(tmp_path: Path) -> None:
    """Trace.open(fs=...) routes the trace through the shim: a conversion whose state
    publication fails leaves the published state as it was, and a retry succeeds."""
    oracle = Oracle()
    with Store.open(tmp_path, segment_bytes=4096, fsync="never") as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        for i in range(12):
            oracle.append(rel, [(i % 3, "x", oracle.upper + i % 4, 1)])
            oracle.seal(rel, oracle.upper + 1)
        trace_dir = store.layout.trace_dir(NAME)
        failing_fs = FailingFileSystem({"link": 1})
        failing = Trace.open(LocalObjectStore(trace_dir, failing_fs), rel.meta, fs=failing_fs)
        spans = pending_spans(failing, rel.wal_dir)
        assert spans
        with pytest.raises(StorageError):
            reference.convert(failing, plan_conversion(failing.state, spans))
        fresh = Trace.open(LocalObjectStore(trace_dir, FileSystem()), rel.meta, fs=FileSystem())
        assert fresh.state.version == 0
        reference.convert(fresh, plan_conversion(fresh.state, spans))
        fresh.delete_converted_segments(rel.wal_dir)
        check_snapshots(rel, oracle)


def test_production_path_never_imports_the_test_seams() -> None:
    """The fault-injection layers live in ``lamina.testing``, which nothing on the
    production path imports: the library, the CLI, the daemon and the drill (which selects
    its faults through fail points, not these file systems)."""
    code = ("import sys, lamina, lamina.store, lamina.read.snapshot, lamina.cli.main, "
            "lamina.compacter.daemon, lamina.compacter.step.driver, lamina.drill.driver, "
            "lamina.drill.workload, lamina.verify\n"
            "print(sorted(m for m in sys.modules if m.startswith('lamina.testing')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
