"""I/O errors: EIO and ENOSPC from the disk, a real file-size limit, and injected errors in
the daemon's Spark tasks.

- The WAL writer, through FailingFileSystem, with the N-th write, fdatasync, directory
  fsync or rename failing: the failing call raises StorageError with that errno and is
  not acknowledged, every later call raises WriterFailedError (fail-stop, crash-safety
  rule 5 of docs/architecture.md), and a reopened store holds every acknowledged call
  (the failed one at most whole), verifies clean and writes on.
- Trace steps (reference conversion with segment deletion, a merge cascade, garbage
  collection), with any single file operation failing: the published state is the one
  before the step or one the step published, never broken; every snapshot is unchanged;
  a retry from the disk (what the compacter's pipeline does after a failed pass) finishes
  the step and leaves no garbage.
- A real disk-full: a child process under ``RLIMIT_FSIZE`` (SIGXFSZ ignored, so write(2)
  fails with EFBIG) appends until lamina raises StorageError; every earlier acknowledged
  append is read back after reopening and verify is clean.
- The daemon (real Spark): fail points make the first rename of every Spark Python worker
  (inside a task's ``write_part``) and the first commit of the driver fail; the failed
  attempts are counted in ``lamina_job_retries_total``, logged, retried, and the final
  snapshots equal the oracle.
"""

from __future__ import annotations

import errno
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from lamina.errors import StorageError, WriterFailedError
from lamina.fs import FileSystem
from lamina.store import Relation, Store
from lamina.testing.faults import OP_KINDS, CountingFileSystem, FailingFileSystem, Op, OpKind
from lamina.trace.state import StateStore
from lamina.trace.trace import Trace
from lamina.verify import verify_store
from lamina.wal.reader import finished_segments
from tests.trace.helpers import (
    KEY,
    NAME,
    SCHEMA,
    STEPS,
    NoSyncFileSystem,
    Oracle,
    StepBase,
    Update,
    append_rounds,
    check_snapshots,
    check_trace,
    convert,
    data_files,
    pending_spans,
    recover,
    run_step,
    table_of,
    temp_files,
)

ROOT = Path(__file__).resolve().parents[1]
ERRNOS = (errno.EIO, errno.ENOSPC)


# --- the WAL writer -----------------------------------------------------------------------------

def _rows(i: int, upper: int) -> list[Update]:
    return [(i % 7, "v" * (20 + i % 50), upper + i % 3, 1),
            ((i + 3) % 7, "w", upper + 5 + i % 11, 1 if i % 4 else -1)]


def _wal_workload(rel: Relation, oracle: Oracle, inflight: list[object], n: int = 40) -> None:
    """Appends (present and future updates), seals rotating 4 KiB segments, and a
    compaction frontier now and then; ``inflight`` holds the call under way."""
    for i in range(n):
        rows = _rows(i, oracle.upper)
        inflight[:] = ["append", rows]
        oracle.append(rel, rows)
        inflight[:] = ["seal", oracle.upper + 1]
        oracle.seal(rel, oracle.upper + 1)
        if i % 9 == 8:
            inflight[:] = ["since", oracle.upper - 2]
            oracle.allow_compaction(rel, oracle.upper - 2)
    inflight.clear()


def _new_store(root: Path) -> None:
    with Store.open(root) as store:
        store.create_relation(NAME, SCHEMA, key=KEY)


@pytest.fixture(scope="module")
def wal_op_counts(tmp_path_factory: pytest.TempPathFactory) -> dict[OpKind, int]:
    """How many operations of each kind the WAL workload issues (a dry run)."""
    root = tmp_path_factory.mktemp("wal-dry")
    _new_store(root)
    fs = CountingFileSystem()
    with Store.open(root, segment_bytes=4096, fs=fs) as store:
        _wal_workload(store.relation(NAME), Oracle(), [])
        return dict(fs.counts)  # the workload's own calls, not the close's rotation


def _wal_cases() -> Iterator[tuple[OpKind, int, int]]:
    """(kind, which call of that kind fails (as a fraction of the count, in 1/12ths),
    errno)."""
    for kind in ("write", "fdatasync", "fsync_dir", "rename"):
        for twelfth in range(1, 13, 2 if kind in ("write", "fdatasync") else 1):
            yield kind, twelfth, ERRNOS[twelfth % 2]


def test_wal_workload_exercises_every_failing_kind(wal_op_counts: dict[OpKind, int]) -> None:
    """The dry run issues enough writes, syncs, directory fsyncs and renames (rotations)
    for the cases below to hit each kind at many points."""
    assert wal_op_counts["write"] > 60
    assert wal_op_counts["fdatasync"] > 60
    assert wal_op_counts["rename"] >= 6
    assert wal_op_counts["fsync_dir"] >= 12


@pytest.mark.parametrize(("kind", "twelfth", "err"), list(_wal_cases()))
def test_wal_writer_fails_stop_and_recovers(tmp_path: Path, wal_op_counts: dict[OpKind, int],
                                            kind: OpKind, twelfth: int, err: int) -> None:
    """One failing operation of ``kind`` (the ``twelfth``/12 point of the workload's calls
    of that kind) with ``err``: see the module docstring, first item."""
    n = max(1, wal_op_counts[kind] * twelfth // 12)
    _new_store(tmp_path)
    fs = FailingFileSystem({kind: n}, err)
    oracle = Oracle()
    inflight: list[object] = []
    with Store.open(tmp_path, segment_bytes=4096, fs=fs) as store:
        rel = store.relation(NAME)
        with pytest.raises(StorageError) as info:
            _wal_workload(rel, oracle, inflight)
        assert info.value.errno == err
        assert not isinstance(info.value, WriterFailedError), "the first error names the cause"
        assert [op.kind for op in fs.failures] == [kind]
        later: list[Callable[[], None]] = [
            lambda: rel.append(table_of(_rows(0, oracle.upper + 5))),
            lambda: rel.seal(oracle.upper + 9), lambda: rel.allow_compaction(oracle.since)]
        for call in later:
            with pytest.raises(WriterFailedError):
                call()
    # the failed call may have reached the disk, whole; nothing else may differ
    maybe = Oracle(list(oracle.updates), oracle.upper, oracle.since)
    if inflight[0] == "append":
        maybe.updates.extend(inflight[1])  # type: ignore[arg-type]
    elif inflight[0] == "seal":
        maybe.upper = int(inflight[1])  # type: ignore[call-overload]
    else:
        maybe.since = int(inflight[1])  # type: ignore[call-overload]
    with Store.open(tmp_path, segment_bytes=4096) as store:
        rel = store.relation(NAME)
        assert (rel.upper, rel.since) in ((oracle.upper, oracle.since),
                                          (maybe.upper, maybe.since))
        final = maybe if (rel.upper, rel.since) != (oracle.upper, oracle.since) else oracle
        points = final.as_of_points(6)
        got = [rel.snapshot(t).to_pylist() for t in points]
        assert got in ([oracle.snapshot(t) for t in points], [maybe.snapshot(t) for t in points])
        final.append(rel, [(100, "after", final.upper, 1)])  # the writer works on
        final.seal(rel, final.upper + 3)
        assert all(r.ok for r in verify_store(store.layout)), \
            [r.problems for r in verify_store(store.layout)]


# --- disk full: a real file-size limit --------------------------------------------------------

DISK_FULL_CHILD = """
import resource, signal, sys
import pyarrow as pa
from lamina import Store
from lamina.errors import StorageError, WriterFailedError
from lamina.objstore.local import LocalObjectStore

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write(2) returns EFBIG instead
store = Store.open(sys.argv[1], segment_bytes=1 << 22)
rel = store.relation("r")
rel.seal(1)  # takes the writer (recovery) before the limit is set
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
i = 0
while True:
    n = 1 + i % 30
    table = pa.table({"id": pa.array([i] * n, pa.int64()),
                      "item": pa.array([f"row-{j}-" + "p" * (i % 90) for j in range(n)]),
                      "_time": pa.array([1 + i % 3] * n, pa.uint64()),
                      "_diff": pa.array([1] * n, pa.int64())})
    try:
        rel.append(table)
    except StorageError as exc:
        print("FAILED", type(exc).__name__, exc.errno, exc, flush=True)
        break
    print("ACK", i, n, flush=True)
    i += 1
try:
    rel.append(table)
except WriterFailedError:
    print("STOPPED", flush=True)
store.close()
"""


def test_disk_full_fails_the_append_and_keeps_every_acknowledged_one(tmp_path: Path) -> None:
    """See the module docstring, third item: the append that meets the limit raises
    StorageError (EFBIG), the next one WriterFailedError; after reopening every
    acknowledged append is there, whole, and verify is clean."""
    _new_store(tmp_path)
    limit = 96 << 10
    proc = subprocess.run([sys.executable, "-c", DISK_FULL_CHILD, str(tmp_path), str(limit)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    acked = {int(ln.split()[1]): int(ln.split()[2]) for ln in lines if ln.startswith("ACK ")}
    failed = [ln for ln in lines if ln.startswith("FAILED")]
    assert len(acked) > 20
    assert failed, lines[-3:]
    assert failed[0].split()[1:3] == ["StorageError", str(errno.EFBIG)], failed
    assert lines[-1] == "STOPPED"
    with Store.open(tmp_path) as store:
        rel = store.relation(NAME)
        rel.seal(4)
        counts: dict[int, int] = {}
        for row in rel.snapshot(3).to_pylist():
            counts[row["id"]] = counts.get(row["id"], 0) + row["_diff"]
        unacked = set(counts) - set(acked)
        assert unacked <= {len(acked)}, "only the failed append may be there"
        for i, n in acked.items():
            assert counts.get(i) == n, f"acknowledged append {i} lost or torn"
        assert all(r.ok for r in verify_store(store.layout))
        assert max(p.stat().st_size for p in rel.wal_dir.glob("*.wal*")) <= limit


# --- trace steps ----------------------------------------------------------------------------

def _trace_base(root: Path, step: str) -> StepBase:
    """A data directory right before ``step``: segments to convert (and pending parts to
    consume), four level-0 batches to merge, or garbage to collect."""
    oracle = Oracle()
    fs = NoSyncFileSystem()
    with Store.open(root, segment_bytes=4096, fsync="never", fs=fs) as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        trace = Trace.open(store.layout.trace_store(NAME, fs), rel.meta, fs=fs)
        append_rounds(rel, oracle, 8, 0)
        if step == "convert":
            convert(trace, rel.wal_dir)
            trace.delete_converted_segments(rel.wal_dir)
            oracle.allow_compaction(rel, oracle.upper - 3)
            append_rounds(rel, oracle, 10, 8)
        elif step == "merge":
            oracle.allow_compaction(rel, oracle.upper - 6)
            append_rounds(rel, oracle, 18, 8)
            assert convert(trace, rel.wal_dir, merge=False) == 4
            trace.delete_converted_segments(rel.wal_dir)
        else:
            convert(trace, rel.wal_dir)
            append_rounds(rel, oracle, 10, 8)
            convert(trace, rel.wal_dir)
            trace.delete_converted_segments(rel.wal_dir)
        oracle.append(rel, [(1, "tail", oracle.upper, 1)])
        oracle.seal(rel, oracle.upper + 1)
        return StepBase(root, oracle, trace.state.version)


def _run_step(step: str, root: Path, fs: FileSystem) -> None:
    with Store.open(root, fsync="never", fs=fs) as store:
        rel = store.relation(NAME)
        run_step(step, Trace.open(store.layout.trace_store(NAME, fs), rel.meta, fs=fs), rel.wal_dir)



def _is_op(number: int, op: Op) -> bool:
    return op.number == number


@pytest.fixture(scope="module")
def trace_bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[StepBase, int]]:
    """Per step: the base directory and the number of file operations the step issues."""
    out = {}
    for step in STEPS:
        base = _trace_base(tmp_path_factory.mktemp(f"{step}-base"), step)
        dry = tmp_path_factory.mktemp(f"{step}-dry") / "d"
        shutil.copytree(base.root, dry)
        fs = CountingFileSystem()
        _run_step(step, dry, fs)
        out[step] = (base, fs.count)
    return out


@pytest.mark.parametrize("step", STEPS)
def test_a_failing_trace_step_leaves_the_state_intact_and_a_retry_succeeds(
        tmp_path: Path, trace_bases: dict[str, tuple[StepBase, int]], step: str) -> None:
    """See the module docstring, second item: every single file operation of the step
    fails once (EIO and ENOSPC alternating)."""
    base, count = trace_bases[step]
    assert count > 5
    kinds: set[str] = set()
    for k in range(1, count + 1):
        work = tmp_path / f"k{k}"
        shutil.copytree(base.root, work)
        err = ERRNOS[k % 2]
        fs = FailingFileSystem(partial(_is_op, k), err)
        error: StorageError | None = None
        try:
            _run_step(step, work, fs)
        except StorageError as exc:  # or not: a failed cleanup of a temp file is ignored
            error = exc
        assert error is None or error.errno == err
        kinds.update(op.kind for op in fs.failures)
        what = f"{step}: {err} at {fs.failures}"
        with Store.open(work, fsync="never") as store:
            rel = store.relation(NAME)
            trace_dir = store.layout.trace_dir(NAME)
            state = check_trace(trace_dir, rel.meta)
            assert (0 if state is None else state.version) >= base.version, what
            check_snapshots(rel, base.oracle)
            trace = recover(trace_dir, rel.wal_dir, rel.meta)
            assert check_trace(trace_dir, rel.meta) == trace.state, what
            check_snapshots(rel, base.oracle)
            assert not pending_spans(trace, rel.wal_dir), what
            assert all(s.seq > trace.state.converted_through
                       for s in finished_segments(rel.wal_dir)), what
            assert data_files(trace_dir) == trace.state.files(), what
            assert not temp_files(trace_dir), what
            assert StateStore(trace.store).versions() == [trace.state.version], what
            assert all(r.ok for r in verify_store(store.layout)), what
        shutil.rmtree(work)
    expected = ({"write", "fdatasync", "rename", "link", "fsync_dir"} if step != "gc"
                else {"unlink", "fsync_dir"})
    assert expected <= kinds <= set(OP_KINDS)


def _sticky_cases() -> list[tuple[str, OpKind]]:
    return [(step, kind) for step in ("convert", "merge") for kind in ("write", "fdatasync")]


@pytest.mark.parametrize(("step", "kind"), _sticky_cases())
def test_a_disk_gone_bad_mid_step_changes_nothing(
        tmp_path: Path, trace_bases: dict[str, tuple[StepBase, int]], step: str,
        kind: OpKind) -> None:
    """A disk that fails every operation from the first failing ``kind`` on (sticky):
    the step raises StorageError and the data directory still reads as before."""
    base, _ = trace_bases[step]
    work = tmp_path / "work"
    shutil.copytree(base.root, work)
    fs = FailingFileSystem({kind: 2}, errno.EIO, sticky=True)
    with pytest.raises(StorageError):
        _run_step(step, work, fs)
    with Store.open(work, fsync="never") as store:
        rel = store.relation(NAME)
        state = check_trace(store.layout.trace_dir(NAME), rel.meta)
        assert state is not None
        assert state.version == base.version
        check_snapshots(rel, base.oracle)


# --- the daemon --------------------------------------------------------------------------------

def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
        if not labels and line.startswith(f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name}{{{want}}} not found")


def _log_events(path: Path) -> Iterator[dict[str, object]]:
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                yield json.loads(line)
            except ValueError:
                continue


def _snapshots_match(data: Path, oracle_upper: int, expected: Callable[[int], object]) -> None:
    with Store.open(data) as store:
        rel = store.relation("drill")
        assert rel.upper == oracle_upper
        for as_of in range(rel.since, rel.upper):
            got = sorted((r["id"], r["val"], r["_diff"])
                         for r in rel.snapshot(as_of).to_pylist())
            assert got == expected(as_of), f"snapshot at {as_of}"
        assert all(r.ok for r in verify_store(store.layout))


@pytest.mark.slow
@pytest.mark.spark
def test_daemon_retries_injected_io_errors(tmp_path: Path) -> None:
    """See the module docstring, fourth item."""
    from lamina.drill.oracle import Oracle as AckOracle
    from lamina.drill.procs import DaemonProcess, start_workload
    from tests.compacter.scrape import scrape_after_jobs

    data, ack = tmp_path / "data", tmp_path / "ack.jsonl"
    assert start_workload(data, ack, seed=5, ops=150, quiet=True).wait(120) == 0
    oracle = AckOracle.load(ack)
    assert not oracle.in_doubt
    log = tmp_path / "daemon.log"
    shared = tmp_path / "failpoints"
    shared.mkdir()
    env = {"LAMINA_FAILPOINTS": "fs.before_rename=error@1,trace.after_batch_written=error@1",
           "LAMINA_FAILPOINTS_SHARED": str(shared)}  # once across the daemon and its workers
    with DaemonProcess(data, log, extra_env=env) as daemon:
        daemon.wait_ready()
        daemon.wait_caught_up("drill", oracle.upper, timeout=180)
        text = scrape_after_jobs(daemon, 1)  # the counter trails the state a moment
        retries = _metric(text, "lamina_job_retries_total", kind="conversion")
        successes = _metric(text, "lamina_jobs_total", kind="conversion", outcome="success")
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0
    events = list(_log_events(log))
    task_failures = [e for e in events if "fail point fs.before_rename" in str(e.get("error"))]
    commit_failures = [e for e in events
                       if "fail point trace.after_batch_written" in str(e.get("error"))]
    assert task_failures, "the fail point in the Spark task never fired"
    assert commit_failures, "the fail point in the driver's commit never fired"
    assert all(e.get("relation") == "drill" for e in task_failures + commit_failures)
    assert (shared / "fs.before_rename.hits").stat().st_size > 1  # later renames went on
    assert retries >= len(task_failures) + len(commit_failures) == 2
    assert successes >= 1
    _snapshots_match(data, oracle.upper, oracle.snapshot)
