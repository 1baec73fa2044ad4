"""The WAL format pinned by a golden file: tests/wal/golden/0000000000000007.wal.

The file is a finished segment of relation "golden" written by :func:`golden_segment`
(deterministic, no clock or randomness). The tests check that

- today's encoder produces exactly the committed bytes (a format change shows up as a
  diff here and needs a new format version, not a silent rewrite);
- today's decoder reads the committed file to the records and tables it was made from;
- the layout documented in lamina.wal.segment and lamina.wal.record holds, byte by byte,
  checked with ``struct`` independently of lamina's encoders.

Regenerate (only on a deliberate format change, with a new version number) with::

    .venv/bin/python -m tests.wal.test_golden --write
"""

from __future__ import annotations

import struct
import sys
from decimal import Decimal
from pathlib import Path

import crc32c as crc32c_package
import pyarrow as pa

from lamina.frontier import CLOSED, MAX_TIME
from lamina.schema import RelationMeta, conform_updates
from lamina.wal.reader import segment_updates
from lamina.wal.record import RecordType, encode_frontier, frame
from lamina.wal.record import encode_updates as encode_updates_payload
from lamina.wal.segment import SegmentFile, encode_header, opening_records, scan_file

GOLDEN = Path(__file__).parent / "golden" / "0000000000000007.wal"
RELATION = "golden"
SEQ = 7

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


def golden_segment() -> bytes:
    """The golden segment: lower 100, since 50, updates, PROGRESS 200, SINCE 150, updates
    (with a future time), PROGRESS CLOSED (the empty frontier) finishing it."""
    first, second = golden_tables()
    return b"".join([
        encode_header(RELATION, SEQ),
        opening_records(100, 50),
        frame(RecordType.UPDATES, encode_updates_payload(first)),
        frame(RecordType.PROGRESS, encode_frontier(200)),
        frame(RecordType.SINCE, encode_frontier(150)),
        frame(RecordType.UPDATES, encode_updates_payload(second)),
        frame(RecordType.PROGRESS, encode_frontier(CLOSED)),
    ])


def test_encoder_reproduces_the_golden_bytes() -> None:
    """Encoding the same records today gives exactly the committed file."""
    assert golden_segment() == GOLDEN.read_bytes(), (
        "the WAL encoding changed: existing logs would no longer match; bump the format "
        "version and keep a reader for version 1 instead of regenerating the golden file")


def test_decoder_reads_the_golden_file() -> None:
    """Scanning and decoding the committed file gives back the frontiers, the record
    sequence and the two tables, value for value."""
    seg = SegmentFile(GOLDEN, SEQ, finished=True)
    scan, _ = scan_file(seg, RELATION)
    assert (scan.lower, scan.upper, scan.since) == (100, CLOSED, 150)
    assert [r.rtype for r in scan.records] == [
        RecordType.PROGRESS, RecordType.SINCE, RecordType.UPDATES, RecordType.PROGRESS,
        RecordType.SINCE, RecordType.UPDATES, RecordType.PROGRESS]
    tables = segment_updates(seg, RELATION, META.update_schema)
    assert len(tables) == 2
    for got, want in zip(tables, golden_tables(), strict=True):
        assert got.equals(want)
    assert tables[0].column("item").to_pylist() == ["apple", None, "\u00e9t\u00e9"]
    assert tables[0].column("_diff").to_pylist() == [1, -(2**63), 2**63 - 1]


def crc32c(data: bytes) -> int:
    """CRC32C straight from the crc32c package, not through lamina."""
    return int(crc32c_package.crc32c(data))


def test_golden_layout_byte_by_byte() -> None:
    """The documented layout, read with struct alone: the segment header, then frames of
    u32 length, u8 type, u32 CRC32C(type + payload) and payload; frontier payloads are u64
    value + u8 flag (CLOSED = 0 with flag 1); update payloads are Arrow IPC streams."""
    data = GOLDEN.read_bytes()
    magic, version, name_len, seq = struct.unpack_from("<8sHHQ", data, 0)
    assert (magic, version, name_len, seq) == (b"LAMINAWL", 1, 6, 7)
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
    assert [t for t, _ in seen] == [2, 3, 1, 2, 3, 1, 2]
    frontier_values = [struct.unpack("<QB", p) for t, p in seen if t != 1]
    assert frontier_values == [(100, 0), (50, 0), (200, 0), (150, 0), (0, 1)]
    for t, p in seen:
        if t == 1:
            assert p[:4] == b"\xff\xff\xff\xff"  # Arrow IPC continuation marker
            assert pa.ipc.open_stream(p).read_all().num_rows in (1, 3)


if __name__ == "__main__":  # pragma: no cover - run by hand on a format change
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.wal.test_golden --write")
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_bytes(golden_segment())
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")
