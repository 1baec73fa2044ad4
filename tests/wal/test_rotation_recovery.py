"""Recovery from crashes inside rotation, and quarantine on corruption.

Rotation makes the next segment durable before finishing the old one, so a crash leaves
either two open segments in a row or one; these tests build each on-disk shape a crash
can leave and check that reopening recovers exactly the acknowledged data.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lamina import Store
from lamina.errors import CorruptionError, QuarantinedError
from lamina.wal.log import WalWriter
from lamina.wal.segment import encode_header, list_segments, segment_name
from tests.conftest import ORDERS, updates

SEG = 4096


def _rotated_store(data_dir: Path) -> tuple[list[dict[str, object]], Path]:
    """A relation with several finished segments; returns its snapshot and WAL dir."""
    with Store.open(data_dir, segment_bytes=SEG) as store:
        rel = store.create_relation("orders", ORDERS, key=["id"])
        for t in range(12):
            rel.append(updates([(i, "x" * 40, t, 1) for i in range(20)]))
            rel.seal(t + 1)
        rel.allow_compaction(5)
        snap = rel.snapshot(11).to_pylist()
        return snap, rel.wal_dir


def _reopen(data_dir: Path) -> tuple[int, int, list[dict[str, object]]]:
    with Store.open(data_dir, segment_bytes=SEG) as store:
        rel = store.relation("orders")
        rel.seal(rel.upper)  # takes the writer: runs recovery
        return rel.upper, rel.since, rel.snapshot(11).to_pylist()


def test_crash_after_next_segment_synced_before_rename(data_dir: Path) -> None:
    """Two open segments, the newer complete: the older is finished on recovery."""
    snap, wal = _rotated_store(data_dir)
    last_finished = [s for s in list_segments(wal) if s.finished][-1]
    last_finished.path.rename(wal / segment_name(last_finished.seq, finished=False))
    assert sum(not s.finished for s in list_segments(wal)) == 2
    upper, since, again = _reopen(data_dir)
    assert (upper, since, again) == (12, 5, snap)
    assert [s.finished for s in list_segments(wal)].count(False) == 1
    assert (wal / segment_name(last_finished.seq, finished=True)).exists()


def test_crash_while_creating_next_segment(data_dir: Path) -> None:
    """Two open segments, the newer torn in its opening (the crash hit while it was being
    created, so it holds nothing acknowledged): it is removed and the older stays open
    with every acknowledged record."""
    with Store.open(data_dir, segment_bytes=1 << 20) as store:
        rel = store.create_relation("orders", ORDERS, key=["id"])
        for t in range(12):
            rel.append(updates([(i, "x" * 40, t, 1) for i in range(20)]))
            rel.seal(t + 1)
        rel.allow_compaction(5)
        snap = rel.snapshot(11).to_pylist()
        wal = rel.wal_dir
    # Closing the store finished the segment holding the records; the open one after it
    # holds the frontiers.
    before = list_segments(wal)
    older = before[-1]
    assert not older.finished
    torn = wal / segment_name(older.seq + 1, finished=False)
    torn.write_bytes(encode_header("orders", older.seq + 1)[:25])  # a header cut short
    assert (12, 5, snap) == _reopen(data_dir)
    assert not torn.exists()
    assert [s.seq for s in list_segments(wal)] == [s.seq for s in before]


def test_torn_opening_without_finished_segments_is_refused_and_quarantined(
        data_dir: Path) -> None:
    """If every finished segment was converted and deleted, a torn opening of the open
    segment leaves nothing to recover the frontiers from: refuse, never restart at 0."""
    _, wal = _rotated_store(data_dir)
    for s in list_segments(wal):
        if s.finished:
            s.path.unlink()
    (opened,) = list_segments(wal)
    opened.path.write_bytes(opened.path.read_bytes()[:30])
    with Store.open(data_dir) as store:
        rel = store.relation("orders")
        with pytest.raises(CorruptionError, match="opening is torn"):
            rel.seal(rel.upper + 1)
    with Store.open(data_dir) as store, pytest.raises(QuarantinedError, match="lamina verify"):
        store.relation("orders")


def test_mid_log_corruption_quarantines_the_relation(data_dir: Path) -> None:
    """A damaged record followed by a valid one in the open segment is refused with file
    and offset, and the relation is quarantined for every later caller."""
    with Store.open(data_dir) as store:
        wal_dir = store.create_relation("orders", ORDERS, key=["id"]).wal_dir
    # The writer itself, closed as a crash would leave it: the records in the open segment.
    writer = WalWriter(wal_dir, "orders")
    for t in range(3):
        writer.append(updates([(1, "a", t, 1)]))
    writer.close()
    (opened,) = list_segments(wal_dir)
    raw = bytearray(opened.path.read_bytes())
    raw[60] ^= 0xFF
    opened.path.write_bytes(bytes(raw))
    with Store.open(data_dir) as store:
        rel = store.relation("orders")
        with pytest.raises(CorruptionError, match=r"at byte \d+"):
            rel.append(updates([(2, "b", 5, 1)]))
    assert (data_dir / "wal" / "orders" / "QUARANTINED").exists()
    with Store.open(data_dir) as store, pytest.raises(QuarantinedError):
        store.relation("orders")


def test_sealing_closed_finishes_the_segment_whatever_its_size(data_dir: Path) -> None:
    """seal(CLOSED) ends the relation: its segment is finished at once (so the compacter
    converts it), exactly once, and the relation reports the empty frontier."""
    from lamina import CLOSED

    with Store.open(data_dir, segment_bytes=1 << 20) as store:
        rel = store.create_relation("orders", ORDERS, key=["id"])
        rel.append(updates([(1, "a", 3, 1)]))
        rel.seal(CLOSED)
        rel.seal(CLOSED)  # idempotent: no second rotation
        rel.allow_compaction(10)
        wal = rel.wal_dir
    segs = list_segments(wal)
    assert [s.finished for s in segs] == [True, False]
    assert _reopen_frontiers(data_dir) == (CLOSED, 10)


def _reopen_frontiers(data_dir: Path) -> tuple[int, int]:
    with Store.open(data_dir) as store:
        rel = store.relation("orders")
        return rel.upper, rel.since


def test_read_frontiers_agrees_with_a_full_scan_and_catches_damage(data_dir: Path) -> None:
    """The compacter's header-only frontier reader gives the full scan's frontiers for
    every finished segment, and refuses damaged frontier records and frames."""
    from lamina.wal.segment import read_frontiers, scan_file

    _, wal = _rotated_store(data_dir)
    finished = [s for s in list_segments(wal) if s.finished]
    assert len(finished) >= 3
    for seg in finished:
        full, raw = scan_file(seg, "orders")
        quick = read_frontiers(seg, "orders")
        assert (quick.lower, quick.upper, quick.since) == (full.lower, full.upper, full.since)
        assert quick.valid_end == len(raw)
    seg = finished[0]
    raw = bytearray(seg.path.read_bytes())
    last = scan_file(seg, "orders")[0].records[-1]
    raw[last.offset + 12] ^= 0x01  # inside the closing PROGRESS payload
    seg.path.write_bytes(bytes(raw))
    with pytest.raises(CorruptionError, match="checksum"):
        read_frontiers(seg, "orders")
    seg.path.write_bytes(bytes(raw[: last.offset + 5]))  # a frame cut short
    with pytest.raises(CorruptionError):
        read_frontiers(seg, "orders")
