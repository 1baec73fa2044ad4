"""lamina.wal.ranges: the byte ranges a conversion's decode tasks read, over segments of
both format versions and records of every compression setting, from the file and from a
staged copy in the trace store (what the Spark decode tasks run; tests/compacter/test_step.py
runs them through Spark).
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import pyarrow as pa
import pytest

from lamina.errors import CorruptionError
from lamina.objstore.local import LocalObjectStore
from lamina.schema import RelationMeta, conform_updates
from lamina.trace.staging import stage
from lamina.wal.log import WalWriter
from lamina.wal.ranges import SegmentRange, range_updates, segment_ranges
from lamina.wal.reader import segment_spans, segment_updates
from lamina.wal.record import Compression, RecordType, frame
from lamina.wal.segment import encode_header, list_segments, opening_records, scan_file
from tests.conftest import ORDERS, updates
from tests.wal.codecs import codec_of

NAME = "orders"
META = RelationMeta.new(NAME, ORDERS, ["id"])
SCHEMA = META.update_schema


def batch(first: int, n: int, t: int) -> pa.Table:
    return conform_updates(META, updates([(i, f"item-{i % 13}", t, 1)
                                          for i in range(first, first + n)]))


def write_log(wal: Path, codecs: list[Compression], *, version: int = 2) -> None:
    """A relation whose first segment (format ``version``) holds one append per entry of
    ``codecs``, each by a writer of that setting, finished by a seal."""
    wal.mkdir(parents=True)
    (wal / "0000000000000001.wal.open").write_bytes(encode_header(NAME, 1, version)
                                                    + opening_records(0, 0))
    for k, c in enumerate(codecs):
        w = WalWriter(wal, NAME, compression=c)
        w.append(batch(k * 500, 500, k))
        w.close()
    w = WalWriter(wal, NAME)
    w.seal(len(codecs) + 1)
    w.close(finish=True)


def read_all(ranges: list[SegmentRange], store: LocalObjectStore | None = None
             ) -> list[pa.Table]:
    return [t for r in ranges for t in range_updates(r, NAME, SCHEMA, store)]


@pytest.mark.parametrize(("version", "codecs"), [
    (1, ["lz4", "zstd", "none"]),
    (2, ["lz4", "none", "zstd", "lz4", "zstd"]),
], ids=["version-1", "version-2-mixed"])
def test_ranges_read_every_record_of_both_versions(tmp_path: Path, version: int,
                                                   codecs: list[Compression]) -> None:
    """Cut at any target, the ranges of a finished segment decode to exactly the tables
    the segment reader gives, whatever the format version and each record's compression,
    read from the file and from a staged copy alike."""
    wal = tmp_path / "wal" / NAME
    write_log(wal, codecs, version=version)  # a version 1 segment takes none compressed
    (span,) = list(segment_spans(wal, NAME))
    seg = list_segments(wal)[0]
    scan, _ = scan_file(seg, NAME)
    assert scan.version == version
    assert [codec_of(r.payload) for r in scan.updates()] == (
        codecs if version == 2 else ["none"] * len(codecs))
    want = segment_updates(seg, NAME, SCHEMA)
    assert len(want) == len(codecs)
    store = LocalObjectStore(tmp_path / "trace")
    key = stage(store, span)
    for target in (1, 3000, 1 << 30):
        ranges = segment_ranges(span, NAME, target)
        for got in (read_all(ranges),
                    read_all([dataclasses.replace(r, staged=key) for r in ranges], store)):
            assert len(got) == len(want)
            for a, b in zip(got, want, strict=True):
                assert a.equals(b)


def test_an_unknown_version_in_the_first_range_is_corruption(tmp_path: Path) -> None:
    """The first range checks the segment header: a version this lamina does not read is
    corruption at byte 0."""
    wal = tmp_path / "wal" / NAME
    write_log(wal, ["lz4"])
    (span,) = list(segment_spans(wal, NAME))
    path = Path(span.path)
    data = bytearray(path.read_bytes())
    data[:30] = encode_header(NAME, 1, 3)
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="segment header") as info:
        read_all(segment_ranges(span, NAME, 1 << 30))
    assert (info.value.path, info.value.offset) == (path, 0)


@pytest.mark.parametrize("compression", ["lz4", "zstd"])
def test_a_compressed_record_that_does_not_decompress_is_corruption(
        tmp_path: Path, compression: Compression) -> None:
    """A compressed record that passes its checksum but does not decompress makes the
    range that holds it raise CorruptionError naming the file (or the staged copy) and the
    record's offset; the ranges before it read fine."""
    wal = tmp_path / "wal" / NAME
    write_log(wal, [compression, compression])
    (span,) = list(segment_spans(wal, NAME))
    path = Path(span.path)
    scan, data = scan_file(list_segments(wal)[0], NAME)
    victim = scan.updates()[1]
    payload = bytearray(victim.payload)
    magic = {"lz4": b"\x04\x22\x4d\x18", "zstd": b"\x28\xb5\x2f\xfd"}[compression]
    at = payload.index(magic) - 8
    (length,) = struct.unpack_from("<q", payload, at)
    struct.pack_into("<q", payload, at, length - 8)  # less than its frame holds
    path.write_bytes(data[:victim.offset] + frame(RecordType.UPDATES, bytes(payload))
                     + data[victim.end:])
    store = LocalObjectStore(tmp_path / "trace")
    key = stage(store, span)
    ranges = segment_ranges(span, NAME, 1)  # one record per range
    holding = next(r for r in ranges if r.start == victim.offset)
    before = [r for r in ranges if r.end <= victim.offset]
    assert len(read_all(before)) == 1
    for item, where in ((holding, str(path)),
                        (dataclasses.replace(holding, staged=key), store.location(key))):
        with pytest.raises(CorruptionError, match="malformed Arrow IPC") as info:
            read_all([item], store)
        assert info.value.offset == victim.offset
        assert str(info.value.path) == where


def test_compressed_segments_are_cut_and_weighed_by_their_decoded_bytes(
        tmp_path: Path) -> None:
    """A decode task holds its share decoded, so a compressed segment is sized by what its
    updates take decoded (a sample of its records), not by its file: the same updates
    written uncompressed, with lz4 and with zstd give spans of about the same decoded
    bytes, about as many ranges for one target, and work items of about that weight;
    every update is still read back once."""
    from lamina.compacter.step.work import WalRange, input_bytes, pack

    spans = {}
    for codec in ("none", "lz4", "zstd"):
        wal = tmp_path / codec
        write_log(wal, [codec] * 8, version=1 if codec == "none" else 2)
        [spans[codec]] = segment_spans(wal, NAME)
    assert spans["none"].expansion == 1.0
    assert spans["lz4"].expansion > 2
    assert spans["zstd"].expansion > spans["lz4"].expansion
    decoded = spans["none"].decoded_bytes
    target = decoded // 4
    for codec, span in spans.items():
        assert span.bytes < decoded or codec == "none"
        assert 0.8 * decoded < span.decoded_bytes < 1.25 * decoded, codec
        assert input_bytes([span], []) == span.decoded_bytes
        ranges = segment_ranges(span, NAME, target)
        assert 3 <= len(ranges) <= 5, (codec, len(ranges))
        items = [WalRange(r) for r in ranges]
        assert all(i.weight <= 1.5 * target for i in items[:-1]), codec
        assert sum(i.weight for i in items) == pytest.approx(span.decoded_bytes, rel=0.01)
        assert len(pack(items, target)) == len(ranges)
        assert sum(t.num_rows for t in read_all(ranges)) == 8 * 500


def test_the_expansion_sample_of_a_damaged_or_empty_segment(tmp_path: Path) -> None:
    """A damaged sample counts as UNSAMPLED_EXPANSION (the larger estimate, so smaller
    tasks; the conversion's read reports the damage itself), and a compressed segment
    with no update record expands by 1."""
    from lamina.wal.reader import UNSAMPLED_EXPANSION, sampled_expansion

    wal = tmp_path / "wal"
    write_log(wal, ["zstd", "zstd"])
    [seg] = [s for s in list_segments(wal) if s.finished]
    healthy = sampled_expansion(seg.path, NAME, seg.seq)
    assert 1 < healthy < UNSAMPLED_EXPANSION
    first_updates = next(r for r in scan_file(seg, NAME)[0].records
                         if r.rtype is RecordType.UPDATES)
    data = bytearray(seg.path.read_bytes())
    data[first_updates.offset + 20] ^= 0xFF  # inside the payload: its checksum fails
    seg.path.write_bytes(bytes(data))
    assert sampled_expansion(seg.path, NAME, seg.seq) == UNSAMPLED_EXPANSION

    empty = tmp_path / "empty"
    write_log(empty, [])
    [seg] = [s for s in list_segments(empty) if s.finished]
    assert sampled_expansion(seg.path, NAME, seg.seq) == 1.0


def test_the_expansion_of_uncompressed_and_of_unsampled_records(tmp_path: Path) -> None:
    """A version 2 segment whose records were written uncompressed (a store reopened with
    wal_compression "none") expands by 1, as a version 1 segment does; compressed records
    all larger than the sampling limit count UNSAMPLED_EXPANSION, and under a limit that
    admits them, their measured ratio."""
    from lamina.wal.reader import UNSAMPLED_EXPANSION, sampled_expansion

    plain = tmp_path / "plain"
    write_log(plain, ["none", "none"])  # version 2 header, uncompressed records
    [seg] = [s for s in list_segments(plain) if s.finished]
    assert sampled_expansion(seg.path, NAME, seg.seq) == 1.0
    [span] = segment_spans(plain, NAME)
    assert span.expansion == 1.0

    packed = tmp_path / "packed"
    write_log(packed, ["zstd", "zstd"])
    [seg] = [s for s in list_segments(packed) if s.finished]
    assert sampled_expansion(seg.path, NAME, seg.seq, limit=64) == UNSAMPLED_EXPANSION
    measured = sampled_expansion(seg.path, NAME, seg.seq)
    assert 1 < measured < UNSAMPLED_EXPANSION
