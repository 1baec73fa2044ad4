"""What keeps a read's files alive (the read contract, lamina.read; lamina.trace.lease):

- a reader killed with SIGKILL leaves a lease that keeps its state's files until the lease
  expires, and nothing after;
- a long ``snapshot_reader`` and a lazy Spark DataFrame on a relation the daemon converts,
  merges and collects under them with ``keep_versions = 1`` and no grace period each
  complete with the rows of the state they pinned, on ``file://`` and ``s3://``; the files
  only that state named are still in the store while the read runs, and go once it ends.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from lamina import Store
from lamina.datadir import DataDir
from lamina.drill.procs import DaemonProcess
from lamina.errors import InvalidArgumentError
from lamina.objstore.base import ObjectStore
from lamina.store import Relation
from lamina.trace.invariants import check_data
from lamina.trace.lease import LeaseKey
from lamina.trace.state import StateStore
from lamina.trace.trace import Trace
from tests.trace.helpers import KEY, NAME, SCHEMA, Oracle, append_rounds, convert, data_files

ROOT = Path(__file__).resolve().parents[2]


def _leases(store: ObjectStore) -> list[LeaseKey]:
    return [k for o in store.list("leases") if (k := LeaseKey.parse(o.key)) is not None]


def _until(what: str, check: Callable[[], bool], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


LEASE_SECONDS = 8


def test_a_killed_reader_holds_its_files_until_its_lease_expires(
        tmp_path: Path, trace_url: str | None) -> None:
    oracle = Oracle()
    with Store.open(tmp_path, segment_bytes=4096, fsync="never", trace_url=trace_url) as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        traces = store.layout.trace_store(NAME)
        trace = Trace.open(traces, rel.meta)
        append_rounds(rel, oracle, 30, seed=3)
        convert(trace, rel.wal_dir)
        trace.delete_converted_segments(rel.wal_dir)
        append_rounds(rel, oracle, 20, seed=60)  # for the compacter to go on with, later
        child = subprocess.Popen([sys.executable, "-m", "tests.read.lease_child",
                                  str(tmp_path), NAME, str(LEASE_SECONDS)], cwd=ROOT,
                                 stdout=subprocess.PIPE, text=True)
        try:
            line = child.stdout.readline() if child.stdout else ""
            assert line.startswith("PINNED"), line
            child.send_signal(signal.SIGKILL)
            assert child.wait(30) == -signal.SIGKILL
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(30)
            if child.stdout:
                child.stdout.close()
        [lease] = _leases(traces)
        pinned = trace.states.load(lease.version)
        convert(trace, rel.wal_dir, per_plan=4)  # the compacter goes on: merges
        trace.delete_converted_segments(rel.wal_dir)
        only_pinned = pinned.files() - trace.state.files()
        assert only_pinned

        trace.collect_garbage(keep_versions=1, grace_seconds=0.0)
        assert time.time() * 1000 < lease.expires_ms, "too slow to see the lease live"
        assert trace.states.versions() == [lease.version, trace.state.version]
        check_data(traces, pinned, rel.meta)

        _until("the dead reader's lease to expire", lambda: time.time() * 1000
               > lease.expires_ms, timeout=2 * LEASE_SECONDS)
        trace.collect_garbage(keep_versions=1, grace_seconds=0.0)
        assert trace.states.versions() == [trace.state.version]
        assert data_files(traces) == trace.state.files()
        assert _leases(traces) == []
        assert rel.snapshot().to_pylist() == oracle.snapshot(oracle.upper - 1)


# --- under the daemon ---------------------------------------------------------------------

class Writer:
    """The coordinator: rounds of appends and seals, in segments the daemon converts."""

    def __init__(self, rel: Relation, oracle: Oracle, seed: int) -> None:
        self.rel, self.oracle, self.rng = rel, oracle, random.Random(seed)

    def rounds(self, n: int) -> None:
        for _ in range(n):
            t = self.oracle.upper
            self.oracle.append(self.rel, [(self.rng.randrange(300), "x" * self.rng.randrange(80),
                                           t, self.rng.choice((1, 1, -1)))
                                          for _ in range(12)])
            self.oracle.seal(self.rel, t + 1)


@pytest.fixture
def daemon_relation(tmp_path: Path, trace_url: str | None
                    ) -> Iterator[tuple[Relation, Oracle, ObjectStore, Writer]]:
    """A relation the daemon (in-process executor: no JVM) converts, merges and collects
    with keep_versions = 1, no GC grace and GC every 0.2 s, on a directory or S3."""
    data = tmp_path / "data"
    with Store.open(data, segment_bytes=4096, fsync="never", trace_url=trace_url) as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        oracle = Oracle()
        env = {"LAMINA_EXECUTOR": "inprocess", "LAMINA_KEEP_VERSIONS": "1",
               "LAMINA_GC_GRACE_SECONDS": "0", "LAMINA_GC_INTERVAL_SECONDS": "0.2"}
        with DaemonProcess(data, tmp_path / "daemon.log", extra_env=env) as daemon:
            daemon.wait_ready()
            writer = Writer(rel, oracle, seed=11)
            traces = DataDir(data).trace_store(NAME)
            states = StateStore(traces)

            def converted() -> bool:
                writer.rounds(5)
                state = states.load_latest()
                return state is not None and len(state.batches) >= 2

            _until("the daemon's first conversions", converted)
            yield rel, oracle, traces, writer
            daemon.signal(signal.SIGTERM)
            assert daemon.wait() == 0


def _hold_while_the_daemon_moves_on(traces: ObjectStore, writer: Writer) -> tuple[int, set[str]]:
    """With one read's lease in place: write until the daemon has merged away files of the
    leased state and collected garbage since (the versions after it pruned); return the
    leased version and the files only it names, all still in the store."""
    [lease] = _leases(traces)
    states = StateStore(traces)
    pinned = states.load(lease.version)

    def moved_on() -> bool:
        writer.rounds(5)
        versions = states.versions()
        if versions[-1] < lease.version + 2 or lease.version + 1 in versions:
            return False  # no garbage collection since the leased version was superseded
        try:
            return bool(pinned.files() - states.load(versions[-1]).files())
        except FileNotFoundError:  # pruned meanwhile: look again
            return False

    _until("merges of the leased state's batches and a garbage collection", moved_on)
    assert states.versions()[0] == lease.version  # kept for the lease alone (keep 1)
    only_pinned = pinned.files() - states.load(states.versions()[-1]).files()
    assert only_pinned <= {o.key for sub in ("batches", "pending") for o in traces.list(sub)}
    return lease.version, only_pinned


def _collected(traces: ObjectStore, files: set[str], writer: Writer) -> None:
    """Once the read ended, the daemon's GC deletes the files only its state named."""
    def gone() -> bool:
        writer.rounds(1)
        present = {o.key for sub in ("batches", "pending") for o in traces.list(sub)}
        return not (files & present) and not _leases(traces)

    _until("the collection of the released state's files", gone)


@pytest.mark.slow
def test_a_long_snapshot_reader_under_the_daemon(
        daemon_relation: tuple[Relation, Oracle, ObjectStore, Writer]) -> None:
    rel, oracle, traces, writer = daemon_relation
    as_of = oracle.upper - 1
    want = oracle.snapshot(as_of)
    reader = rel.snapshot_reader(as_of)
    first = reader.read_next_batch()
    _, only_pinned = _hold_while_the_daemon_moves_on(traces, writer)
    rest = reader.read_all()  # exhausted: its lease ends
    got = pa.Table.from_batches([first]).to_pylist() + rest.to_pylist()
    assert got == want
    _collected(traces, only_pinned, writer)


@pytest.mark.slow
@pytest.mark.spark
def test_a_lazy_spark_dataframe_under_the_daemon(
        daemon_relation: tuple[Relation, Oracle, ObjectStore, Writer], spark: Any,
        trace_url: str | None, request: pytest.FixtureRequest) -> None:
    from lamina.spark import read_snapshot, release

    if trace_url is not None:
        request.getfixturevalue("spark_s3_env")  # the executors reach the S3 server
    rel, oracle, traces, writer = daemon_relation
    as_of = oracle.upper - 1
    want = oracle.snapshot(as_of)
    df = read_snapshot(spark, rel.store.layout.root, NAME, as_of)
    _, only_pinned = _hold_while_the_daemon_moves_on(traces, writer)
    assert df.toArrow().to_pylist() == want  # evaluated now, long after it was made
    assert df.toArrow().to_pylist() == want  # and again
    release(df)
    _collected(traces, only_pinned, writer)


@pytest.mark.parametrize("seconds", [0, -1, 0.5, 10**6, True, "60", float("nan")])
def test_a_bad_lease_duration_is_refused(tmp_path: Path, seconds: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="lease_seconds"):
        Store.open(tmp_path / "data", lease_seconds=seconds)
    assert not (tmp_path / "data").exists()
