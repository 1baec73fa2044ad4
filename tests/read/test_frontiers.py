"""Reading a relation's frontiers from its open WAL segment without decoding updates
(lamina.wal.segment.read_frontiers, lamina.wal.reader.frontiers): the same frontiers as a
full scan, a torn tail tolerated by the scanner's rules, damage refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lamina import Relation, Store
from lamina.errors import CorruptionError
from lamina.wal.reader import frontiers
from lamina.wal.record import RecordType
from lamina.wal.segment import Scan, SegmentFile, list_segments, read_frontiers, scan_file
from tests.conftest import ORDERS, updates

NAME = "orders"


@pytest.fixture
def rel(tmp_path: Path) -> Iterator[Relation]:
    """One open segment: P(0) S(0), 30 rounds of U P(t+1) (a since every 7th round), S(25).
    Every 5th update is large (over 8 KiB: read_frontiers then reads headers one by one)."""
    with Store.open(tmp_path, segment_bytes=1 << 30, fsync="never") as store:
        r = store.create_relation(NAME, ORDERS, ("id",))
        for t in range(30):
            rows = 2000 if t % 5 == 2 else 20 + t
            r.append(updates([(i, "x" * (i % 5), t, 1) for i in range(rows)]))
            r.seal(t + 1)
            if t % 7 == 6:
                r.allow_compaction(t - 3)
        r.allow_compaction(25)
        yield r


def _open(rel: Relation) -> SegmentFile:
    (seg,) = list_segments(rel.wal_dir)
    assert not seg.finished
    return seg


def _frontiers(scan: Scan) -> tuple[int, int, int]:
    return scan.lower, scan.upper, scan.since


def _quick_or_error(seg: SegmentFile) -> tuple[int, int, int] | str:
    try:
        return _frontiers(read_frontiers(seg, NAME))
    except CorruptionError as exc:
        return f"corrupt at {exc.offset}"


def _full_or_error(seg: SegmentFile) -> tuple[int, int, int] | str:
    try:
        return _frontiers(scan_file(seg, NAME)[0])
    except CorruptionError as exc:
        return f"corrupt at {exc.offset}"


def test_open_segment_frontiers_match_a_full_scan(rel: Relation) -> None:
    seg = _open(rel)
    assert _frontiers(read_frontiers(seg, NAME)) == _frontiers(scan_file(seg, NAME)[0]) \
        == (0, 30, 25)
    assert frontiers(rel.wal_dir, NAME) == (rel.upper, rel.since) == (30, 25)


def test_torn_tail_anywhere_in_the_last_records_matches_a_full_scan(rel: Relation) -> None:
    """Cut the open segment at every byte of its last two records (P, S) and every 7th of
    the update before them: the quick reader agrees with the scanner (which treats the cut
    as a torn tail)."""
    seg = _open(rel)
    full = seg.path.read_bytes()
    records = scan_file(seg, NAME)[0].records
    assert [r.rtype for r in records[-3:]] == [RecordType.UPDATES, RecordType.PROGRESS,
                                              RecordType.SINCE]
    cuts = [*range(records[-3].offset, records[-2].offset, 7),
            *range(records[-2].offset, len(full) + 1)]
    for cut in cuts:
        seg.path.write_bytes(full[:cut])
        expected = _full_or_error(seg)
        assert isinstance(expected, tuple), cut  # a torn tail, not corruption
        assert _quick_or_error(seg) == expected, cut
        assert frontiers(rel.wal_dir, NAME) == expected[1:], cut


@pytest.mark.parametrize("where", ["frontier payload", "frontier header", "update length"])
def test_damage_followed_by_a_valid_record_is_corruption(rel: Relation, where: str) -> None:
    seg = _open(rel)
    raw = bytearray(seg.path.read_bytes())
    records = scan_file(seg, NAME)[0].records
    progress = next(r for r in records[4:] if r.rtype is RecordType.PROGRESS)
    update = next(r for r in records[4:] if r.rtype is RecordType.UPDATES)
    target = {"frontier payload": progress.offset + 10, "frontier header": progress.offset + 4,
              "update length": update.offset + 3}[where]
    raw[target] ^= 0x40
    seg.path.write_bytes(bytes(raw))
    assert _full_or_error(seg).startswith("corrupt")  # type: ignore[union-attr]
    assert _quick_or_error(seg) == _full_or_error(seg)
    with pytest.raises(CorruptionError):
        frontiers(rel.wal_dir, NAME)


def test_damaged_update_payload_is_left_to_the_decoder(rel: Relation) -> None:
    """Update payload checksums are not verified by the frontier reader (that would mean
    reading every payload): the frontiers are those the records carry, and the first read
    that decodes the segment refuses it."""
    seg = _open(rel)
    raw = bytearray(seg.path.read_bytes())
    update = next(r for r in scan_file(seg, NAME)[0].records[4:]
                  if r.rtype is RecordType.UPDATES)
    raw[update.offset + 40] ^= 0x01
    seg.path.write_bytes(bytes(raw))
    assert _full_or_error(seg) == f"corrupt at {update.offset}"
    assert frontiers(rel.wal_dir, NAME) == (30, 25)
    with pytest.raises(CorruptionError, match="checksum"):
        rel.snapshot(29)


def test_only_the_header_of_an_open_segment_falls_back_to_its_predecessor(
        tmp_path: Path) -> None:
    with Store.open(tmp_path, segment_bytes=4096, fsync="never") as store:
        r = store.create_relation(NAME, ORDERS, ("id",))
        r.append(updates([(i, "y" * 40, 0, 1) for i in range(200)]))
        r.seal(5)
        r.allow_compaction(2)
        segs = list_segments(r.wal_dir)
        assert [s.finished for s in segs] == [True, False]
        header_end = scan_file(segs[-1], NAME)[0].records[0].offset
        segs[-1].path.write_bytes(segs[-1].path.read_bytes()[:header_end])
        assert _quick_or_error(segs[-1]) == _full_or_error(segs[-1]) == (0, 0, 0)
        # the since of 2 was in the cut opening only: the predecessor's frontiers are read
        assert frontiers(r.wal_dir, NAME) == (5, 0)
