"""Segments finish on age at a seal and on close, not only on size (issue: idle relations).

A segment that never reaches ``segment_bytes`` must still become work for the compacter:
at a seal once it is older than ``segment_max_age`` and holds something to convert, and
when the writer closes.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lamina.errors import InvalidArgumentError
from lamina.store import Store
from lamina.testing.faults import FailingFileSystem
from lamina.wal.segment import list_segments
from tests.conftest import ORDERS, updates


def finished(wal_dir: Path) -> list[int]:
    return [s.seq for s in list_segments(wal_dir) if s.finished]


def test_seal_finishes_an_old_segment_holding_an_update(data_dir: Path) -> None:
    with Store.open(data_dir, segment_max_age_seconds=2.0) as store:
        rel = store.create_relation("orders", ORDERS, key=["id"])
        rel.append(updates([(1, "a", 0, 1)]))
        rel.seal(1)
        assert finished(rel.wal_dir) == []  # young: stays open
        time.sleep(2.05)
        rel.seal(2)
        assert finished(rel.wal_dir) == [1]
        # The next segment starts at the upper and is young again.
        rel.seal(3)
        assert finished(rel.wal_dir) == [1]


def test_an_old_segment_without_updates_finishes_only_once_its_upper_moved(
        data_dir: Path) -> None:
    with Store.open(data_dir, segment_max_age_seconds=0.2) as store:
        rel = store.create_relation("orders", ORDERS, key=["id"])
        rel.allow_compaction(0)
        time.sleep(0.25)
        rel.seal(5)  # an idle relation that keeps sealing: its upper is work to convert
        assert finished(rel.wal_dir) == [1]
        time.sleep(0.25)
        rel.allow_compaction(1)  # no seal, no rotation: a segment only finishes at a seal
        assert finished(rel.wal_dir) == [1]


def test_close_finishes_a_segment_holding_work(data_dir: Path) -> None:
    with Store.open(data_dir) as store:  # default age: 60 s, default size: 64 MiB
        rel = store.create_relation("orders", ORDERS, key=["id"])
        rel.append(updates([(1, "a", 0, 1), (2, "b", 7, 1)]))  # 7: a future update
        rel.seal(3)
    segments = list_segments(data_dir / "wal" / "orders")
    assert [(s.seq, s.finished) for s in segments] == [(1, True), (2, False)]
    with Store.open(data_dir) as store:
        rel = store.relation("orders")
        assert rel.upper == 3
        assert sorted(rel.snapshot(2)["id"].to_pylist()) == [1]
        # Reopening and closing without writing adds no segment.
        rel.close()
    assert len(list_segments(data_dir / "wal" / "orders")) == 2


def test_close_with_updates_after_the_last_seal_keeps_them(data_dir: Path) -> None:
    """The segment finishes at a closing PROGRESS of the current upper; updates appended
    after the last seal are future updates of that segment and stay unapplied."""
    with Store.open(data_dir) as store:
        rel = store.create_relation("orders", ORDERS, key=["id"])
        rel.seal(2)
        rel.append(updates([(1, "a", 2, 1)]))
    with Store.open(data_dir) as store:
        rel = store.relation("orders")
        assert rel.upper == 2
        rel.seal(3)
        assert rel.snapshot(2).to_pylist() == [{"id": 1, "item": "a", "_diff": 1}]


def test_relation_close_releases_the_writer_and_the_handle_stays_usable(
        data_dir: Path) -> None:
    with Store.open(data_dir) as store:
        rel = store.create_relation("orders", ORDERS, key=["id"])
        rel.append(updates([(1, "a", 0, 1)]))
        rel.seal(1)
        rel.close()
        assert finished(rel.wal_dir) == [1]
        # Another process could take the writer now; this handle takes it back on write.
        rel.append(updates([(2, "b", 1, 1)]))
        rel.seal(2)
        assert sorted(rel.snapshot(1)["id"].to_pylist()) == [1, 2]


@pytest.mark.parametrize("bad", [0, -1, "60", True])
def test_bad_segment_max_age_is_refused(data_dir: Path, bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="segment_max_age_seconds"):
        Store.open(data_dir, segment_max_age_seconds=bad)  # type: ignore[arg-type]
    assert not data_dir.exists()


def test_a_failed_finish_on_close_leaves_the_segment_open_and_loses_nothing(
        data_dir: Path) -> None:
    """Close cannot report an error to anyone who could act on it: if finishing fails, the
    segment stays open, exactly as after a crash, and the next writer recovers it."""
    with Store.open(data_dir) as store:
        store.create_relation("orders", ORDERS, key=["id"])
    fs = FailingFileSystem({"rename": 1})
    store = Store.open(data_dir, fs=fs)
    rel = store.relation("orders")
    rel.append(updates([(1, "a", 0, 1)]))
    rel.seal(1)
    store.close()
    assert [op.kind for op in fs.failures] == ["rename"]
    with Store.open(data_dir) as store:
        rel = store.relation("orders")
        assert rel.upper == 1
        assert rel.snapshot(0).to_pylist() == [{"id": 1, "item": "a", "_diff": 1}]
        rel.seal(2)
    # Recovery finished segment 1 (its successor's opening was complete); this close
    # finished segment 2, which holds the seal to 2.
    assert finished(data_dir / "wal" / "orders") == [1, 2]
