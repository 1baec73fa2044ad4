"""The subscription's WAL tail cache (lamina.read.subscribe.TailCache): the open segment is read
incrementally (lamina.wal.reader.appended_updates) and always yields what a full decode
yields, through records being written (torn tails), rotation and damage."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from lamina import Store
from lamina.errors import CorruptionError
from lamina.read.subscribe import TailCache
from lamina.wal.reader import segment_updates
from lamina.wal.record import RecordType
from lamina.wal.segment import SegmentFile, list_segments, scan_file
from tests.conftest import ORDERS, updates

NAME = "orders"


def _rows(tables: list[pa.Table]) -> list[dict[str, object]]:
    return pa.concat_tables(tables).to_pylist() if tables else []


def _open(wal: Path) -> SegmentFile:
    seg = list_segments(wal)[-1]
    assert not seg.finished
    return seg


def test_the_open_segment_is_read_incrementally_and_equals_a_full_decode(
        tmp_path: Path) -> None:
    with Store.open(tmp_path, segment_bytes=1 << 30, fsync="never") as store:
        rel = store.create_relation(NAME, ORDERS, ("id",))
        cache = TailCache(rel.meta)
        schema = rel.meta.update_schema
        for t in range(12):
            rel.append(updates([(i, f"{t}", t, 1) for i in range(5 + t)]))
            rel.seal(t + 1)
            seg = _open(rel.wal_dir)
            assert _rows(cache.read(seg)) == _rows(segment_updates(seg, NAME, schema))
        # a record being written (any prefix of it) is a torn tail: left for the next read
        full = seg.path.read_bytes()
        rel.append(updates([(100, "late", 12, 1)]))
        grown = seg.path.read_bytes()
        for cut in range(len(full), len(grown), 3):
            seg.path.write_bytes(grown[:cut])
            assert _rows(cache.read(seg)) == _rows(segment_updates(seg, NAME, schema)), cut
        seg.path.write_bytes(grown)
        got = _rows(cache.read(seg))
        assert got == _rows(segment_updates(seg, NAME, schema))
        assert got[-1] == {"id": 100, "item": "late", "_time": 12, "_diff": 1}
        # updates below the frontier are dropped from the cache, the rest stays
        cache.advance(11, 0)
        assert [r["_time"] for r in _rows(cache.read(seg))] == [11] * 16 + [12]


def test_damage_in_appended_records_followed_by_a_valid_one_is_corruption(
        tmp_path: Path) -> None:
    with Store.open(tmp_path, segment_bytes=1 << 30, fsync="never") as store:
        rel = store.create_relation(NAME, ORDERS, ("id",))
        cache = TailCache(rel.meta)
        rel.append(updates([(1, "a", 0, 1)]))
        rel.seal(1)
        seg = _open(rel.wal_dir)
        assert len(cache.read(seg)) == 1
        rel.append(updates([(2, "b", 1, 1)]))
        rel.seal(2)
        raw = bytearray(seg.path.read_bytes())
        damaged = scan_file(seg, NAME)[0].records[-2]
        assert damaged.rtype is RecordType.UPDATES
        raw[damaged.offset + 20] ^= 0x01
        seg.path.write_bytes(bytes(raw))
        with pytest.raises(CorruptionError, match="followed by a valid record") as info:
            cache.read(seg)
        assert info.value.offset == damaged.offset


def test_a_finished_segment_is_decoded_whole_once_rotated(tmp_path: Path) -> None:
    with Store.open(tmp_path, segment_bytes=4096, fsync="never") as store:
        rel = store.create_relation(NAME, ORDERS, ("id",))
        cache = TailCache(rel.meta)
        rel.append(updates([(1, "a", 0, 1)]))
        rel.seal(1)
        first = _open(rel.wal_dir)
        assert len(cache.read(first)) == 1
        rel.append(updates([(i, "x" * 50, 1, 1) for i in range(100)]))
        rel.seal(2)  # rotates: the first segment is finished now
        finished = next(s for s in list_segments(rel.wal_dir) if s.seq == first.seq)
        assert finished.finished
        assert _rows(cache.read(finished)) == _rows(
            segment_updates(finished, NAME, rel.meta.update_schema))
        assert len(_rows(cache.read(finished))) == 101
