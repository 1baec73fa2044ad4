"""lamina.wal.segment: file naming, the segment header, and scanning with the recovery
rules of lamina.wal.segment.

The bit-flip tests are exhaustive: every bit of every byte of a finished segment is
flipped in turn and each variant must be refused with CorruptionError; in the open segment
a flip in any record but the last is corruption (a valid record follows it) and a flip in
the last record is a torn tail. They run over segments of LZ4- and ZSTD-compressed update
records too (there one bit of every byte): the rules are about frames, whatever they
carry.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from lamina.errors import CorruptionError
from lamina.frontier import CLOSED
from lamina.fs import crc32c
from lamina.wal.reader import segment_updates, updates_of
from lamina.wal.record import (
    COMPRESSIONS,
    HEADER_SIZE,
    Compression,
    RecordType,
    encode_frontier,
    encode_updates,
    frame,
)
from lamina.wal.segment import (
    FORMAT_VERSION,
    MAGIC,
    Scan,
    SegmentFile,
    encode_header,
    list_segments,
    opening_records,
    parse_name,
    scan_buffer,
    scan_file,
    segment_name,
)
from tests.conftest import updates

PATH = Path("/data/wal/orders/0000000000000003.wal")


def progress(v: int) -> bytes:
    return frame(RecordType.PROGRESS, encode_frontier(v))


def since(v: int) -> bytes:
    return frame(RecordType.SINCE, encode_frontier(v))


def upd(*rows: tuple[int, str, int, int], compression: Compression = "none") -> bytes:
    return frame(RecordType.UPDATES, encode_updates(updates(list(rows)), compression))


def segment(*records: bytes, relation: str = "orders", seq: int = 3,
            version: int = FORMAT_VERSION) -> bytes:
    return encode_header(relation, seq, version) + b"".join(records)


def finished_segment(compression: Compression = "none") -> bytes:
    """A small finished segment: lower 10, since 4, two update records (one with a future
    time; compressed with ``compression``), upper 20."""
    return segment(opening_records(10, 4),
                   upd((1, "a", 10, 1), (2, "b", 25, 1), compression=compression),
                   progress(15), since(6), upd((3, "c", 17, -1), compression=compression),
                   progress(20))


def scan(data: bytes, *, finished: bool, relation: str | None = "orders",
         seq: int | None = 3) -> Scan:
    return scan_buffer(memoryview(data), PATH, finished=finished, relation=relation, seq=seq)


def test_names() -> None:
    """Segments are named by a 16-digit sequence number with .wal (finished) or .wal.open;
    anything else is not a segment."""
    assert segment_name(7, finished=True) == "0000000000000007.wal"
    assert segment_name(7, finished=False) == "0000000000000007.wal.open"
    assert parse_name("0000000000000007.wal") == (7, True)
    assert parse_name("0000000000000007.wal.open") == (7, False)
    for other in ("LOCK", "relation.json", "7.wal", "000000000000000x.wal",
                  ".0000000000000007.wal.open.abc.tmp", "0000000000000007.wal.open.tmp",
                  "00000000000000007.wal"):
        assert parse_name(other) is None, other


def test_list_segments_orders_by_sequence(tmp_path: Path) -> None:
    """list_segments returns segment files only, ordered by sequence number."""
    for name in ("0000000000000010.wal.open", "0000000000000002.wal", "0000000000000009.wal",
                 "LOCK", "relation.json", ".0000000000000011.wal.open.x.tmp"):
        (tmp_path / name).write_bytes(b"")
    assert [(s.seq, s.finished) for s in list_segments(tmp_path)] == [
        (2, True), (9, True), (10, False)]
    assert list_segments(tmp_path / "absent") == []


@pytest.mark.parametrize("version", [1, 2])
def test_header_layout(version: int) -> None:
    """Header: magic, u16 version, u16 name length, u64 sequence, name, CRC32C; writers
    write version 2."""
    head = encode_header("orders", 3, version)
    magic, stored, n, seq = struct.unpack_from("<8sHHQ", head)
    assert (magic, stored, n, seq) == (MAGIC, version, 6, 3)
    assert head[20:26] == b"orders"
    assert struct.unpack_from("<I", head, 26)[0] == crc32c(head[:26])
    assert len(head) == 30
    assert encode_header("orders", 3) == encode_header("orders", 3, 2)
    assert FORMAT_VERSION == 2


def test_scan_of_a_finished_segment() -> None:
    """Scanning gives lower, upper, since and the records in order; future updates are
    kept as they are."""
    s = scan(finished_segment(), finished=True)
    assert (s.lower, s.upper, s.since) == (10, 20, 6)
    assert [r.rtype for r in s.records] == [
        RecordType.PROGRESS, RecordType.SINCE, RecordType.UPDATES, RecordType.PROGRESS,
        RecordType.SINCE, RecordType.UPDATES, RecordType.PROGRESS]
    assert len(s.updates()) == 2
    assert s.torn_at is None
    assert s.valid_end == len(finished_segment())
    assert s.finished_shape


def test_scan_file_reads_the_file(tmp_path: Path) -> None:
    """scan_file checks the header against the file name's sequence number."""
    p = tmp_path / segment_name(3, finished=True)
    p.write_bytes(finished_segment())
    s, data = scan_file(SegmentFile(p, 3, True), "orders")
    assert s.upper == 20
    assert data == finished_segment()
    wrong = tmp_path / segment_name(4, finished=True)
    wrong.write_bytes(finished_segment())
    with pytest.raises(CorruptionError, match="sequence 3, file name says 4"):
        scan_file(SegmentFile(wrong, 4, True), "orders")


@pytest.mark.parametrize(("data", "match"), [
    (segment(opening_records(0, 0), upd((1, "a", 0, 1))), "does not end with a progress"),
    (segment(), "holds no records"),
    (segment(since(0), progress(1)), "starts with a SINCE record"),
    (segment(upd((1, "a", 0, 1)), progress(1)), "starts with a UPDATES record"),
    (segment(opening_records(5, 0), progress(4)), "progress goes backwards from 5 to 4"),
    (segment(opening_records(5, 3), since(2), progress(6)), "since goes backwards"),
    (segment(opening_records(5, 3), progress(CLOSED), progress(6)), "progress goes backwards"),
    (segment(opening_records(0, 0), progress(1), relation="other"), "names relation 'other'"),
    (segment(opening_records(0, 0), progress(1), seq=4), "sequence 4"),
    (segment(opening_records(0, 0), frame(RecordType.PROGRESS, b"\x00" * 9 + b"\x01")),
     "frontier payload"),
])
def test_invariant_violations_are_corruption(data: bytes, match: str) -> None:
    """Shapes a writer never produces are corruption naming the file."""
    with pytest.raises(CorruptionError, match=match) as info:
        scan(data, finished=True)
    assert info.value.path == PATH
    assert str(PATH) in str(info.value)


def test_unknown_format_version_is_refused() -> None:
    """A segment of another format version is refused in both states, at byte 8, naming
    the versions this lamina reads."""
    for version in (0, 3, 258):
        data = bytearray(finished_segment())
        struct.pack_into("<H", data, 8, version)
        for finished in (True, False):
            with pytest.raises(CorruptionError, match=f"format version {version}; this "
                                                      "lamina reads versions 1, 2") as info:
                scan(bytes(data), finished=finished)
            assert info.value.offset == 8


@pytest.mark.parametrize("version", [1, 2])
def test_both_versions_scan_to_the_same_records(version: int) -> None:
    """A version 1 segment (uncompressed records) and a version 2 one scan alike, and the
    scan says which version it read."""
    data = segment(opening_records(10, 4), upd((1, "a", 10, 1)), progress(20),
                   version=version)
    s = scan(data, finished=True)
    assert s.version == version
    assert (s.lower, s.upper, s.since) == (10, 20, 4)
    assert [t.to_pylist() for t in updates_of(s, updates([]).schema)] == [
        [{"id": 1, "item": "a", "_time": 10, "_diff": 1}]]


def test_a_segment_mixes_compressed_and_uncompressed_records() -> None:
    """One version 2 segment holding records of every setting reads back each table in
    order, whatever each record's compression."""
    rows = [[(i, f"item-{i}", 10 + i, 1) for i in range(k, k + 50)] for k in (0, 50, 100, 150)]
    codecs: list[Compression] = ["none", "lz4", "zstd", "none"]
    data = segment(opening_records(10, 0),
                   *[upd(*r, compression=c) for r, c in zip(rows, codecs, strict=True)],
                   progress(300))
    sizes = [len(upd(*r, compression=c)) for r, c in zip(rows, codecs, strict=True)]
    assert sizes[1] < sizes[0]  # they really are compressed
    assert sizes[2] < sizes[0]
    s = scan(data, finished=True)
    got = [t.to_pylist() for t in updates_of(s, updates([]).schema)]
    assert got == [updates(r).to_pylist() for r in rows]


@pytest.mark.parametrize("compression", ["lz4", "zstd"])
def test_a_compressed_record_that_does_not_decompress_is_corruption(
        tmp_path: Path, compression: Compression) -> None:
    """A compressed record whose checksum matches (so no torn tail or bit flip the frame
    check catches) but whose compressed bytes do not decompress is corruption naming the
    file and the record's offset, in a finished and in the open segment, never a crash
    nor a record skipped."""
    good = upd(*[(i, "x" * (i % 5), 10, 1) for i in range(200)], compression=compression)
    payload = bytearray(good[HEADER_SIZE:])
    magic = {"lz4": b"\x04\x22\x4d\x18", "zstd": b"\x28\xb5\x2f\xfd"}[compression]
    at = payload.index(magic) - 8  # a compressed buffer: its int64 uncompressed length
    (length,) = struct.unpack_from("<q", payload, at)
    struct.pack_into("<q", payload, at, length + 8)  # more than its frame holds
    bad = frame(RecordType.UPDATES, bytes(payload))  # a checksum over the damaged bytes
    head = segment(opening_records(10, 0), upd((1, "a", 10, 1), compression=compression))
    for finished in (True, False):
        data = head + bad + progress(20)
        path = tmp_path / segment_name(3, finished=finished)
        path.write_bytes(data)
        seg = SegmentFile(path, 3, finished)
        s, _ = scan_file(seg, "orders")  # the frames are fine
        assert [r.offset for r in s.updates()] == [len(segment(opening_records(10, 0))),
                                                    len(head)]
        with pytest.raises(CorruptionError, match="malformed Arrow IPC") as info:
            segment_updates(seg, "orders", updates([]).schema)
        assert info.value.path == path
        assert info.value.offset == len(head)
        assert str(path) in str(info.value)
        path.unlink()


def _bits(pos: int, compression: Compression) -> range:
    """The bits of byte ``pos`` to flip: all eight in the uncompressed segment; one, a
    different one from byte to byte, in the compressed ones (the frames are checked the
    same way whatever their payload holds; every byte is still hit)."""
    return range(8) if compression == "none" else range(pos % 8, pos % 8 + 1)


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_every_bit_flip_in_a_finished_segment_is_corruption(compression: Compression) -> None:
    """Any single bit flipped anywhere in a finished segment (header, frame headers,
    checksums, payloads, compressed or not) raises CorruptionError naming the file and an
    offset, never a scan with different records."""
    data = finished_segment(compression)
    for pos in range(len(data)):
        for bit in _bits(pos, compression):
            flipped = bytearray(data)
            flipped[pos] ^= 1 << bit
            with pytest.raises(CorruptionError) as info:
                scan(bytes(flipped), finished=True)
            assert info.value.path == PATH
            assert info.value.offset is not None
            assert info.value.offset <= pos, (pos, bit)


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_every_bit_flip_in_the_open_segment(compression: Compression) -> None:
    """In the open segment a flipped bit in any record but the last is corruption at that
    record's offset (a valid record follows); in the last record it is a torn tail that
    leaves exactly the records before it. The last record here is a compressed update."""
    data = segment(opening_records(10, 4), upd((1, "a", 10, 1), compression=compression),
                   progress(15), since(5), upd((3, "c", 17, -1), compression=compression))
    clean = scan(data, finished=False)
    starts = [r.offset for r in clean.records]
    last = clean.records[-1]
    for pos in range(len(data)):
        for bit in _bits(pos, compression):
            flipped = bytearray(data)
            flipped[pos] ^= 1 << bit
            if pos >= last.offset:
                s = scan(bytes(flipped), finished=False)
                assert s.torn_at == last.offset, (pos, bit)
                assert s.valid_end == last.offset
                assert [r.offset for r in s.records] == starts[:-1]
                assert (s.upper, s.since) == (15, 5)
            else:
                with pytest.raises(CorruptionError) as info:
                    scan(bytes(flipped), finished=False)
                assert info.value.path == PATH
                assert info.value.offset is not None
                if pos < starts[0]:  # the header: reported at its start or the bad field
                    assert info.value.offset <= pos, (pos, bit)
                    continue
                at = max(o for o in starts if o <= pos)
                assert info.value.offset == at, (pos, bit)
                assert "followed by a valid record" in str(info.value)


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_every_truncation_of_the_open_segment(compression: Compression) -> None:
    """Cut at any byte, the open segment scans to its longest complete prefix: the torn
    part starts at the last record boundary at or before the cut; a cut inside the
    header is a torn header (nothing in it was ever acknowledged). Compressed records
    are cut like any other."""
    data = segment(opening_records(10, 4), upd((1, "a", 10, 1), compression=compression),
                   progress(15), since(5), upd((3, "c", 17, -1), compression=compression))
    clean = scan(data, finished=False)
    header_end = clean.records[0].offset
    for cut in range(len(data)):
        s = scan(data[:cut], finished=False)
        if cut < header_end:
            assert s.torn_at == 0, cut
            assert not s.records
            continue
        complete = [r for r in clean.records if r.end <= cut]
        assert [r.offset for r in s.records] == [r.offset for r in complete], cut
        assert s.valid_end == (complete[-1].end if complete else header_end)
        assert s.torn_at == (None if cut == s.valid_end else s.valid_end), cut
    with pytest.raises(CorruptionError):
        scan(data[:-1], finished=True)
