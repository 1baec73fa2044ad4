"""The WAL backlog bound (lamina.wal.throttle, ``Store.open(wal_backlog_bytes=...)``): an
append waits while the finished, unconverted segments pass the bound and goes on once the
compacter converts them; one that waits too long is refused and writes nothing; seals
never wait; the trace state is read only when the listing passes the bound, and only once
per open segment. Against a real ``lamina serve`` (in-process executor) the backlog stays
within the bound after every append and everything appended is read back."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lamina.datadir import DataDir
from lamina.drill.procs import DaemonProcess
from lamina.errors import BacklogTimeoutError, InvalidArgumentError
from lamina.store import Relation, Store
from lamina.trace.trace import Trace
from lamina.wal.reader import backlog
from lamina.wal.throttle import BacklogGate
from tests.trace.helpers import KEY, NAME, SCHEMA, Oracle, check_snapshots, convert

SEGMENT = 4096
LIMIT = 6000


def _open(root: Path, **options: Any) -> Store:
    return Store.open(root, segment_bytes=SEGMENT, fsync="never", **options)


def _round(rel: Relation, oracle: Oracle, r: int) -> None:
    """One append of four wide rows (about 1.1 KB) and a seal: a segment finishes every
    four rounds or so."""
    t = oracle.upper
    oracle.append(rel, [(r * 4 + i, f"{r}-{i}-" + "x" * 250, t, 1) for i in range(4)])
    oracle.seal(rel, t + 1)


def _fill_past_limit(rel: Relation, oracle: Oracle) -> int:
    """Rounds until the finished segments pass LIMIT; the next round's append would wait."""
    r = 0
    while backlog(rel.wal_dir, 0)[1] <= LIMIT:
        _round(rel, oracle, r)
        r += 1
    return r


def _convert_all(root: Path) -> None:
    """What a compacter does: convert every finished segment, then delete them."""
    layout = DataDir(root)
    trace = Trace.open(layout.trace_store(NAME), layout.relation(NAME).meta)
    convert(trace, layout.wal_dir(NAME), per_plan=64)
    trace.delete_converted_segments(layout.wal_dir(NAME))


def _wal_files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in DataDir(root).wal_dir(NAME).iterdir()}


def test_an_append_waits_for_the_compacter_then_writes(tmp_path: Path) -> None:
    oracle = Oracle()
    with _open(tmp_path, wal_backlog_bytes=LIMIT, wal_backlog_timeout=30) as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        r = _fill_past_limit(rel, oracle)
        compacter = threading.Timer(0.5, _convert_all, args=(tmp_path,))
        started = time.monotonic()
        compacter.start()
        _round(rel, oracle, r)  # waits for the conversion, then appends
        took = time.monotonic() - started
        compacter.join()
        assert took >= 0.45
        assert rel.wal_backlog_wait_seconds >= 0.45
        assert backlog(rel.wal_dir, 0)[1] <= LIMIT
    _convert_all(tmp_path)
    with Store.open(tmp_path, read_only=True) as store:
        check_snapshots(store.relation(NAME), oracle)


def test_an_append_that_waits_too_long_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    oracle = Oracle()
    with _open(tmp_path, wal_backlog_bytes=LIMIT, wal_backlog_timeout=0.3) as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        r = _fill_past_limit(rel, oracle)
        before = _wal_files(tmp_path)
        started = time.monotonic()
        with pytest.raises(BacklogTimeoutError,
                           match=rf"wal_backlog_bytes={LIMIT} without shrinking for 0.3 s"
                           r".*nothing was written"):
            _round(rel, oracle, r)
        assert time.monotonic() - started >= 0.3
        assert _wal_files(tmp_path) == before
        assert isinstance(BacklogTimeoutError("x"), TimeoutError)
        rel.seal(oracle.upper + 1)  # seals never wait
        oracle.upper += 1
        _convert_all(tmp_path)
        _round(rel, oracle, r)  # the same updates, appended again
    _convert_all(tmp_path)
    with Store.open(tmp_path, read_only=True) as store:
        check_snapshots(store.relation(NAME), oracle)


def test_the_trace_state_is_read_only_past_the_bound_and_once_per_segment(
        tmp_path: Path) -> None:
    oracle = Oracle()
    with _open(tmp_path) as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        for r in range(4):
            _round(rel, oracle, r)
        listed = backlog(rel.wal_dir, 0)
        assert listed[0] >= 1
        reads: list[int] = []

        def converted_through() -> int:
            reads.append(1)
            return rel._converted_through()

        roomy = BacklogGate(NAME, rel.wal_dir, listed[1], 1.0, converted_through)
        assert roomy.pending() == listed
        assert reads == []
        _convert_all(tmp_path)  # every finished segment converted (some may stay listed)
        tight = BacklogGate(NAME, rel.wal_dir, 1, 1.0, converted_through)
        seq = rel._writer_or_open("append").seq
        kept = backlog(rel.wal_dir, 0)
        tight.wait(seq)
        tight.wait(seq)  # the check passed while this segment is open: no second check
        assert len(reads) == (1 if kept[1] > 1 else 0)
        assert tight.pending()[1] == 0


@pytest.mark.parametrize("options", [
    {"wal_backlog_bytes": 0}, {"wal_backlog_bytes": True}, {"wal_backlog_bytes": 1.5},
    {"wal_backlog_bytes": "1GiB"}, {"wal_backlog_timeout": 0},
    {"wal_backlog_timeout": -1.0}, {"wal_backlog_timeout": True}])
def test_bad_bounds_are_refused_before_anything_is_created(tmp_path: Path,
                                                           options: dict[str, Any]) -> None:
    name = next(iter(options))
    with pytest.raises(InvalidArgumentError, match=name):
        Store.open(tmp_path / "data", **options)
    assert not (tmp_path / "data").exists()


def test_against_lamina_serve_the_backlog_stays_within_the_bound(tmp_path: Path) -> None:
    """A coordinator far faster than the compacter's 0.2 s poll: after every append the
    backlog is within the bound, and every update is read back once the daemon caught up."""
    data = tmp_path / "data"
    oracle = Oracle()
    log_path = tmp_path / "daemon.log"
    with _open(data, wal_backlog_bytes=LIMIT, wal_backlog_timeout=60) as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        with DaemonProcess(data, log_path, extra_env={"LAMINA_EXECUTOR": "inprocess"}) as d:
            d.wait_ready(60)
            most = 0
            for r in range(30):
                t = oracle.upper
                oracle.append(rel, [(r * 4 + i, f"{r}-{i}-" + "x" * 250, t, 1)
                                    for i in range(4)])
                # checked before the append wrote; the daemon only shrinks it since
                most = max(most, backlog(rel.wal_dir, rel._converted_through())[1])
                assert most <= LIMIT, most
                oracle.seal(rel, t + 1)
            store.close()
            deadline = time.monotonic() + 60
            while backlog(rel.wal_dir, rel._converted_through())[0] \
                    and time.monotonic() < deadline:
                time.sleep(0.1)
            assert rel.wal_backlog_wait_seconds > 0
    with Store.open(data, read_only=True) as store:
        check_snapshots(store.relation(NAME), oracle)
