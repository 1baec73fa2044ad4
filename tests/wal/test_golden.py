"""The WAL format pinned by golden files, one per format version:
tests/wal/golden/0000000000000007.wal (version 1) and
tests/wal/golden/v2/0000000000000007.wal (version 2).

Each file is a finished segment of relation "golden" written by :func:`golden_segment`
(deterministic, no clock or randomness). The version 1 file was written by lamina before
WAL compression and is frozen. The version 2 file holds the same tables, the first one
uncompressed, then LZ4- and ZSTD-compressed. The tests check that

- today's encoder produces exactly the committed bytes of version 1 (told to write version
  1), and of version 2 except inside compressed buffers, whose bytes are the codec
  library's choice (a pyarrow upgrade may compress differently and still be read), so
  those records are compared decoded (a format change shows up as a diff here and needs a
  new format version, not a silent rewrite);
- today's decoder reads both committed files to the records and tables they were made from;
- the layout documented in lamina.wal.segment and lamina.wal.record holds, byte by byte,
  checked with ``struct`` independently of lamina's encoders.

Write the version 2 file (only on a deliberate format change, with a new version number
and a new file for it) with::

    .venv/bin/python -m tests.wal.test_golden --write
"""

from __future__ import annotations

import struct
import sys
from decimal import Decimal
from pathlib import Path

import crc32c as crc32c_package
import pyarrow as pa
import pytest

from lamina.frontier import CLOSED, MAX_TIME
from lamina.schema import RelationMeta, conform_updates
from lamina.wal.reader import segment_updates
from lamina.wal.record import (
    Compression,
    Record,
    RecordType,
    encode_frontier,
    frame,
    read_frame,
)
from lamina.wal.record import encode_updates as encode_updates_payload
from lamina.wal.segment import SegmentFile, encode_header, opening_records, scan_file

GOLDEN = Path(__file__).parent / "golden" / "0000000000000007.wal"
GOLDEN_V2 = Path(__file__).parent / "golden" / "v2" / "0000000000000007.wal"
FILES = {1: GOLDEN, 2: GOLDEN_V2}
RELATION = "golden"
SEQ = 7
LZ4_FRAME_MAGIC = b"\x04\x22\x4d\x18"
ZSTD_FRAME_MAGIC = b"\x28\xb5\x2f\xfd"

SCHEMA = pa.schema([
    pa.field("id", pa.int64(), nullable=False),
    pa.field("item", pa.string()),
    pa.field("price", pa.decimal128(10, 2)),
    pa.field("ratio", pa.float64()),
    pa.field("flag", pa.bool_()),
    pa.field("blob", pa.binary()),
    pa.field("day", pa.date32()),
    pa.field("at", pa.timestamp("us", tz="UTC")),
    pa.field("small", pa.int8()),
])
META = RelationMeta("golden", "0" * 32, SCHEMA, ("id",), "2026-01-01T00:00:00Z")


def golden_tables() -> list[pa.Table]:
    """The two update tables in the golden segment."""
    first = pa.table({
        "id": [1, 2, 3],
        "item": ["apple", None, "\u00e9t\u00e9"],
        "price": pa.array([Decimal("1.50"), Decimal("-99999999.99"), None],
                          pa.decimal128(10, 2)),
        "ratio": [0.5, float("inf"), None],
        "flag": [True, False, None],
        "blob": [b"\x00\x01", b"", None],
        "day": pa.array([0, 19000, None], pa.date32()),
        "at": pa.array([0, 1_700_000_000_000_000, None], pa.timestamp("us", tz="UTC")),
        "small": pa.array([-128, 127, None], pa.int8()),
        "_time": pa.array([100, 150, MAX_TIME], pa.uint64()),
        "_diff": pa.array([1, -(2**63), 2**63 - 1], pa.int64()),
    })
    second = pa.table({
        "id": [4], "item": ["x"], "price": pa.array([Decimal("0.01")], pa.decimal128(10, 2)),
        "ratio": [-0.0], "flag": [True], "blob": [b"b"], "day": pa.array([1], pa.date32()),
        "at": pa.array([1], pa.timestamp("us", tz="UTC")), "small": pa.array([0], pa.int8()),
        "_time": pa.array([210], pa.uint64()), "_diff": pa.array([-1], pa.int64()),
    })
    return [conform_updates(META, first), conform_updates(META, second)]


UPDATE_CODECS: dict[int, list[Compression]] = {1: ["none", "none"],
                                               2: ["none", "lz4", "zstd"]}
"""The compression of each update record of the golden segment of each version."""


def golden_records(version: int) -> list[tuple[RecordType, bytes, Compression]]:
    """The golden segment's records (type, payload, compression): lower 100, since 50,
    updates, PROGRESS 200, SINCE 150, updates (with a future time), in version 2 the first
    table again (ZSTD), then PROGRESS CLOSED (the empty frontier) finishing it."""
    first, second = golden_tables()
    codecs = UPDATE_CODECS[version]
    records = [
        (RecordType.PROGRESS, encode_frontier(100), "none"),
        (RecordType.SINCE, encode_frontier(50), "none"),
        (RecordType.UPDATES, encode_updates_payload(first, codecs[0]), codecs[0]),
        (RecordType.PROGRESS, encode_frontier(200), "none"),
        (RecordType.SINCE, encode_frontier(150), "none"),
        (RecordType.UPDATES, encode_updates_payload(second, codecs[1]), codecs[1]),
    ]
    if version >= 2:
        records.append((RecordType.UPDATES, encode_updates_payload(first, codecs[2]),
                        codecs[2]))
    records.append((RecordType.PROGRESS, encode_frontier(CLOSED), "none"))
    return records  # type: ignore[return-value]


def golden_segment(version: int = 1) -> bytes:
    """The golden segment of ``version`` (:func:`golden_records`)."""
    head = encode_header(RELATION, SEQ, version)
    return head + b"".join(frame(t, p) for t, p, _ in golden_records(version))


def test_opening_records_are_the_golden_opening() -> None:
    """What writers start a segment with is the golden segments' first two records."""
    assert opening_records(100, 50) == b"".join(
        frame(t, p) for t, p, _ in golden_records(2)[:2])


def test_encoder_reproduces_the_golden_bytes() -> None:
    """Encoding the same records today, as version 1, gives exactly the committed version 1
    file."""
    assert golden_segment(1) == GOLDEN.read_bytes(), (
        "the WAL encoding changed: existing logs would no longer match; bump the format "
        "version and keep a reader for version 1 instead of regenerating the golden file")


def test_encoder_reproduces_the_golden_v2_bytes() -> None:
    """Encoding the same records today, as version 2, gives the committed version 2 file:
    the header and every uncompressed record byte for byte, each compressed record a
    frame of the same type whose payload decodes to the same table."""
    data = GOLDEN_V2.read_bytes()
    head = encode_header(RELATION, SEQ, 2)
    assert data[:len(head)] == head
    offset = len(head)
    for rtype, payload, codec in golden_records(2):
        rec = read_frame(memoryview(data), offset)
        assert isinstance(rec, Record)
        assert rec.rtype is rtype
        if codec == "none":
            assert data[offset:rec.end] == frame(rtype, payload), (
                f"the version 2 encoding changed at byte {offset}")
        else:
            stored = pa.ipc.open_stream(rec.payload).read_all()
            assert stored.equals(pa.ipc.open_stream(payload).read_all())
        offset = rec.end
    assert offset == len(data)


@pytest.mark.parametrize("version", [1, 2])
def test_decoder_reads_the_golden_file(version: int) -> None:
    """Scanning and decoding each committed file gives back its version, the frontiers,
    the record sequence and the tables, value for value."""
    seg = SegmentFile(FILES[version], SEQ, finished=True)
    scan, _ = scan_file(seg, RELATION)
    assert scan.version == version
    assert (scan.lower, scan.upper, scan.since) == (100, CLOSED, 150)
    assert [r.rtype for r in scan.records] == [t for t, _, _ in golden_records(version)]
    tables = segment_updates(seg, RELATION, META.update_schema)
    first, second = golden_tables()
    want = [first, second, first][:len(tables)]
    assert len(tables) == len(UPDATE_CODECS[version])
    for got, expected in zip(tables, want, strict=True):
        assert got.equals(expected)
    assert tables[0].column("item").to_pylist() == ["apple", None, "\u00e9t\u00e9"]
    assert tables[0].column("_diff").to_pylist() == [1, -(2**63), 2**63 - 1]


def crc32c(data: bytes) -> int:
    """CRC32C straight from the crc32c package, not through lamina."""
    return int(crc32c_package.crc32c(data))


@pytest.mark.parametrize("version", [1, 2])
def test_golden_layout_byte_by_byte(version: int) -> None:
    """The documented layout, read with struct alone: the segment header (its version
    field), then frames of u32 length, u8 type, u32 CRC32C(type + payload) and payload;
    frontier payloads are u64 value + u8 flag (CLOSED = 0 with flag 1); update payloads
    are Arrow IPC streams, and in version 2 a compressed one's record batch body starts
    with the first buffer's int64 uncompressed length followed by an LZ4 or ZSTD frame."""
    data = FILES[version].read_bytes()
    magic, stored_version, name_len, seq = struct.unpack_from("<8sHHQ", data, 0)
    assert (magic, stored_version, name_len, seq) == (b"LAMINAWL", version, 6, 7)
    assert data[20:26] == b"golden"
    assert struct.unpack_from("<I", data, 26)[0] == crc32c(data[:26])
    offset = 30
    seen: list[tuple[int, bytes]] = []
    while offset < len(data):
        length, rtype, crc = struct.unpack_from("<IBI", data, offset)
        payload = data[offset + 9: offset + 9 + length]
        assert len(payload) == length
        assert crc == crc32c(bytes([rtype]) + payload)
        seen.append((rtype, payload))
        offset += 9 + length
    assert offset == len(data)
    assert [t for t, _ in seen] == [t for t, _, _ in golden_records(version)]
    frontier_values = [struct.unpack("<QB", p) for t, p in seen if t != 1]
    assert frontier_values == [(100, 0), (50, 0), (200, 0), (150, 0), (0, 1)]
    updates = [p for t, p in seen if t == 1]
    for p, codec in zip(updates, UPDATE_CODECS[version], strict=True):
        assert p[:4] == b"\xff\xff\xff\xff"  # Arrow IPC continuation marker
        assert pa.ipc.open_stream(p).read_all().num_rows in (1, 3)
        schema_message, batch = list(pa.ipc.MessageReader.open_stream(p))
        assert (schema_message.type, batch.type) == ("schema", "record batch")
        body = batch.body.to_pybytes()
        if codec == "none":
            assert LZ4_FRAME_MAGIC not in body
            assert ZSTD_FRAME_MAGIC not in body
        else:
            (uncompressed,) = struct.unpack_from("<q", body, 0)
            assert 0 < uncompressed < len(body) * 64
            frame_magic = LZ4_FRAME_MAGIC if codec == "lz4" else ZSTD_FRAME_MAGIC
            assert body[8:12] == frame_magic


if __name__ == "__main__":  # pragma: no cover - run by hand on a format change
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.wal.test_golden --write")
    GOLDEN_V2.parent.mkdir(exist_ok=True)
    GOLDEN_V2.write_bytes(golden_segment(2))
    print(f"wrote {GOLDEN_V2} ({GOLDEN_V2.stat().st_size} bytes)")
