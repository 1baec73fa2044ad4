"""lamina.wal.record: the record framing, frontier and update payloads.

Property tests: any schema-valid batch over random schemas (every supported type, nulls
where nullable), uncompressed or LZ4- or ZSTD-compressed, and any frontier (including
CLOSED = 2**64) survives encode -> frame -> read_frame -> decode bit for bit; any
truncation or single bit flip of a frame is a BadFrame, never a different record; a
compressed payload that passed its checksum but does not decompress is a ValueError (the
readers' corruption), never a crash, whatever byte of it is damaged.
"""

from __future__ import annotations

import struct

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lamina.frontier import CLOSED, MAX_TIME
from lamina.fs import crc32c
from lamina.schema import RelationMeta, conform_updates
from lamina.wal.record import (
    COMPRESSIONS,
    HEADER_SIZE,
    MAX_PAYLOAD,
    BadFrame,
    Compression,
    Record,
    RecordType,
    UpdatesEncoder,
    decode_frontier,
    decode_updates,
    encode_frontier,
    encode_updates,
    find_valid_frame,
    frame,
    read_frame,
)
from tests.conftest import ORDERS, updates
from tests.strategies import batches, frontiers, same_table, schemas


def test_crc32c_is_castagnoli() -> None:
    """The checksum is CRC32C (check value of "123456789" is 0xE3069283) and can be
    continued over pieces."""
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"6789", crc32c(b"12345")) == 0xE3069283
    assert crc32c(b"") == 0


def test_frame_layout() -> None:
    """A frame is u32 length, u8 type, u32 CRC32C over type byte + payload, then the
    payload, little-endian."""
    payload = b"\x01\x02\x03"
    data = frame(RecordType.SINCE, payload)
    assert len(data) == HEADER_SIZE + 3 == 12
    length, rtype, crc = struct.unpack_from("<IBI", data)
    assert (length, rtype) == (3, 3)
    assert crc == crc32c(b"\x03" + payload)
    assert data[HEADER_SIZE:] == payload


@pytest.mark.parametrize(("value", "encoded"), [
    (0, b"\x00" * 8 + b"\x00"),
    (1, b"\x01" + b"\x00" * 7 + b"\x00"),
    (MAX_TIME, b"\xff" * 8 + b"\x00"),
    (CLOSED, b"\x00" * 8 + b"\x01"),
])
def test_frontier_encoding(value: int, encoded: bytes) -> None:
    """A frontier payload is u64 value + u8 flag; CLOSED is value 0 with flag 1."""
    assert encode_frontier(value) == encoded
    assert decode_frontier(encoded) == value


@pytest.mark.parametrize("payload", [
    b"", b"\x00" * 8, b"\x00" * 10, b"\x00" * 8 + b"\x02", b"\x01" + b"\x00" * 7 + b"\x01",
])
def test_malformed_frontiers_are_refused(payload: bytes) -> None:
    """Wrong lengths, unknown flags and a closed flag with a non-zero value are errors."""
    with pytest.raises(ValueError, match="frontier"):
        decode_frontier(payload)


@given(frontiers, st.sampled_from([RecordType.PROGRESS, RecordType.SINCE]))
def test_frontier_records_round_trip(value: int, rtype: RecordType) -> None:
    """Every frontier in [0, 2**64] survives framing and parsing unchanged."""
    data = frame(rtype, encode_frontier(value))
    rec = read_frame(memoryview(data), 0)
    assert isinstance(rec, Record)
    assert rec.rtype is rtype
    assert rec.offset == 0
    assert rec.end == len(data)
    assert decode_frontier(rec.payload) == value


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_update_records_round_trip(data: st.DataObject) -> None:
    """Any batch valid for any supported schema (all types, nulls where nullable, times
    up to 2**64-1, diffs over all of int64) is conformed unchanged, encodes, with any
    compression, to the same bytes through the zero-copy append path (UpdatesEncoder's
    pieces, one encoder reused for several records) as through frame(encode_updates), and
    decodes from its record to the same schema and bit-identical values."""
    meta = RelationMeta.new("r", data.draw(schemas()), None)
    table = data.draw(batches(meta))
    compression: Compression = data.draw(st.sampled_from(COMPRESSIONS))  # type: ignore[arg-type]
    conformed = conform_updates(meta, table)
    assert same_table(conformed, table)
    payload = encode_updates(conformed, compression)
    expected = frame(RecordType.UPDATES, payload)
    encoder = UpdatesEncoder(conformed.schema, compression)
    half = conformed.slice(conformed.num_rows // 2)
    for t in (conformed, half, conformed):  # a kept-open stream writer: no state leaks
        pieces, size = encoder.encode(t)
        assert b"".join(pieces) == frame(RecordType.UPDATES, encode_updates(t, compression))
        assert size == sum(len(p) for p in pieces)
    assert b"".join(encoder.encode(conformed)[0]) == expected
    # the same table built with every field nullable, as Relation.append passes it on
    loose = pa.Table.from_arrays(conformed.columns, schema=meta.loose_update_schema)
    as_is = UpdatesEncoder(meta.update_schema, compression, batches=loose.schema)
    assert b"".join(as_is.encode(loose)[0]) == expected
    buf = memoryview(b"junk" + frame(RecordType.UPDATES, payload))
    rec = read_frame(buf, 4)
    assert isinstance(rec, Record)
    assert rec.rtype is RecordType.UPDATES
    assert rec.end == len(buf)
    decoded = decode_updates(rec.payload)
    assert decoded.schema.equals(meta.update_schema)
    assert same_table(decoded, conformed)
    assert encode_updates(decoded, compression) == payload


def test_encoder_pieces_equal_a_fresh_stream_for_chunks_slices_and_dictionaries() -> None:
    """The encoder's pieces concatenate to frame(encode_updates(t)) for tables of several
    chunks, sliced tables (offset validity bitmaps the IPC writer rewrites) and, through
    a fresh stream per record, dictionary columns, whose dictionary a kept-open stream
    would write only once; the column buffers are passed on uncopied."""
    plain = pa.table({"k": pa.array([1, None, 3, 4], pa.int64()), "s": ["a", None, "cc", "d"]})
    chunked = pa.concat_tables([plain, plain.slice(1, 2), plain])
    dicts = pa.table({"d": pa.array(["x", "y", "x"]).dictionary_encode(),
                      "l": pa.array([[1], [2, 3], []], pa.list_(pa.int32()))})
    for compression in COMPRESSIONS:
        for tables in ([plain, chunked, plain.slice(1), plain],
                       [dicts, dicts.slice(1), dicts]):
            encoder = UpdatesEncoder(tables[0].schema, compression)  # type: ignore[arg-type]
            for t in tables:
                pieces, size = encoder.encode(t)
                expected = frame(RecordType.UPDATES,
                                 encode_updates(t, compression))  # type: ignore[arg-type]
                assert b"".join(pieces) == expected
                assert size == len(expected)
                assert decode_updates(expected[HEADER_SIZE:]).equals(t.combine_chunks())
        # tables whose fields are all nullable, records declaring non-nullable ones
        for t in (plain.drop_null(), dicts):
            strict = pa.schema([f.with_nullable(False) for f in t.schema])
            as_is = UpdatesEncoder(strict, compression, batches=t.schema)  # type: ignore[arg-type]
            expected = frame(RecordType.UPDATES, encode_updates(
                pa.Table.from_arrays(t.columns, schema=strict), compression))  # type: ignore[arg-type]
            assert b"".join(as_is.encode(t)[0]) == expected
            assert decode_updates(expected[HEADER_SIZE:]).schema.equals(strict)
    big = pa.table({"k": pa.array(range(1000), pa.int64())})
    pieces, _ = UpdatesEncoder(big.schema).encode(big)
    column = big.column("k").chunk(0).buffers()[1]
    assert any(isinstance(p, pa.Buffer) and p.address == column.address for p in pieces)


def test_an_encoder_refuses_tables_that_differ_beyond_nullability() -> None:
    """An encoder writes tables of another schema than its records declare only where the
    two differ in nothing but nullability."""
    declared = pa.schema([pa.field("k", pa.int64(), False), pa.field("s", pa.string())])
    for other in (pa.schema([("k", pa.int32()), ("s", pa.string())]),
                  pa.schema([("s", pa.string()), ("k", pa.int64())]),
                  pa.schema([("k", pa.int64()), ("s", pa.string())], metadata={"m": "1"})):
        with pytest.raises(ValueError, match="only in nullability"):
            UpdatesEncoder(declared, batches=other)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.sampled_from([RecordType.PROGRESS, RecordType.SINCE]), frontiers),
    st.tuples(st.just(RecordType.UPDATES), st.integers(0, 5))), max_size=12))
def test_records_parse_back_to_back(specs: list[tuple[RecordType, int]]) -> None:
    """A sequence of frames parses record by record from offset to ``end``."""
    payloads = [encode_frontier(v) if t is not RecordType.UPDATES
                else encode_updates(updates([(i, "x" * v, i, 1) for i in range(v)]))
                for t, v in specs]
    buf = memoryview(b"".join(frame(t, p) for (t, _), p in zip(specs, payloads, strict=True)))
    offset = 0
    for (rtype, _), payload in zip(specs, payloads, strict=True):
        rec = read_frame(buf, offset)
        assert isinstance(rec, Record)
        assert rec.rtype is rtype
        assert bytes(rec.payload) == payload
        offset = rec.end
    assert offset == len(buf)


def _sample_frames() -> list[bytes]:
    return [frame(RecordType.PROGRESS, encode_frontier(12345)),
            frame(RecordType.SINCE, encode_frontier(CLOSED)),
            frame(RecordType.UPDATES, encode_updates(updates([(1, "a", 2, 3),
                                                              (4, None, 5, -6)])))]  # type: ignore[list-item]


@pytest.mark.parametrize("data", _sample_frames(), ids=["progress", "since", "updates"])
def test_every_truncation_is_a_bad_frame(data: bytes) -> None:
    """A frame cut at any byte is reported as incomplete or running past the end."""
    for cut in range(len(data)):
        bad = read_frame(memoryview(data[:cut]), 0)
        assert isinstance(bad, BadFrame), cut
        assert bad.offset == 0
        assert "incomplete" in bad.reason or "past the end" in bad.reason


@pytest.mark.parametrize("data", _sample_frames(), ids=["progress", "since", "updates"])
def test_every_bit_flip_is_a_bad_frame(data: bytes) -> None:
    """Flipping any single bit of a frame (length, type, checksum or payload) makes it a
    BadFrame; the trailing bytes stand for a following record."""
    tail = frame(RecordType.PROGRESS, encode_frontier(99))
    for pos in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data + tail)
            flipped[pos] ^= 1 << bit
            assert isinstance(read_frame(memoryview(flipped), 0), BadFrame), (pos, bit)


def test_unknown_type_and_oversized_length_are_bad_frames() -> None:
    """Type bytes outside RecordType and lengths above MAX_PAYLOAD are refused even when
    the checksum would match."""
    payload = b"abc"
    unknown = struct.pack("<IBI", 3, 9, crc32c(b"\x09" + payload)) + payload
    bad = read_frame(memoryview(unknown), 0)
    assert isinstance(bad, BadFrame)
    assert "unknown record type 9" in bad.reason
    huge = struct.pack("<IBI", MAX_PAYLOAD + 1, 1, 0) + payload
    bad = read_frame(memoryview(huge), 0)
    assert isinstance(bad, BadFrame)
    assert "exceeds the maximum" in bad.reason


def test_malformed_arrow_payload_is_a_value_error() -> None:
    """A checksummed payload that is not an Arrow IPC stream decodes to ValueError, which
    the segment reader reports as corruption."""
    with pytest.raises(ValueError, match="malformed Arrow IPC"):
        decode_updates(b"\x00" * 16)
    good = encode_updates(updates([(1, "a", 2, 3)]))
    with pytest.raises(ValueError, match="malformed Arrow IPC"):
        decode_updates(good[: len(good) // 2])


def test_find_valid_frame() -> None:
    """find_valid_frame returns the offset of the next valid frame after garbage, and None
    when none follows."""
    rec = frame(RecordType.PROGRESS, encode_frontier(7))
    buf = memoryview(b"\xde\xad\xbe\xef" * 5 + rec + b"\x00\x01")
    assert find_valid_frame(buf, 0) == 20
    assert find_valid_frame(buf, 21) is None
    assert find_valid_frame(memoryview(b""), 0) is None


def test_empty_and_orders_batches_round_trip() -> None:
    """The ORDERS table of the fixtures, with a null item and the extreme time, and an
    empty table keep their schema through a record."""
    meta = RelationMeta.new("orders", ORDERS, ["id"])
    for table in (updates([(1, None, MAX_TIME, -(2**63)), (2, "b", 0, 2**63 - 1)]),  # type: ignore[list-item]
                  meta.update_schema.empty_table()):
        conformed = conform_updates(meta, table)
        back = decode_updates(encode_updates(conformed))
        assert back.equals(conformed)
        assert back.schema.equals(meta.update_schema)
    assert isinstance(decode_updates(encode_updates(pa.table({"a": [1]}))), pa.Table)


def _find_valid_frame_reference(buf: memoryview, start: int) -> int | None:
    """The specification of find_valid_frame: try every offset."""
    for offset in range(start, len(buf) - HEADER_SIZE + 1):
        if isinstance(read_frame(buf, offset), Record):
            return offset
    return None


_PIECES = st.one_of(
    st.binary(max_size=30),
    st.sampled_from([b"\x00" * 9, b"\x01\x02\x03", b"\x00\x00\x00\x00\x01"]),
    frontiers.map(lambda v: frame(RecordType.PROGRESS, encode_frontier(v))),
    st.binary(max_size=12).map(lambda p: frame(RecordType.UPDATES, p)),
    st.binary(max_size=12).map(lambda p: frame(RecordType.UPDATES, p)[:-1]),  # torn
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_PIECES, max_size=6), st.integers(0, 40))
def test_find_valid_frame_matches_a_byte_by_byte_search(pieces: list[bytes],
                                                        start: int) -> None:
    """The fast search for the next valid frame finds exactly the offset a byte-by-byte
    search finds, over garbage, torn frames and frames embedded anywhere."""
    buf = memoryview(b"".join(pieces))
    assert find_valid_frame(buf, start) == _find_valid_frame_reference(buf, start)


def _compressible(rows: int = 2000) -> pa.Table:
    return pa.table({"id": pa.array(range(rows), pa.int64()),
                     "item": [f"item-{i % 37:05d}" for i in range(rows)],
                     "_time": pa.array([7] * rows, pa.uint64()),
                     "_diff": pa.array([1] * rows, pa.int64())})


@pytest.mark.parametrize("compression", ["lz4", "zstd"])
def test_compressed_records_are_smaller_and_decode_to_the_same_table(
        compression: Compression) -> None:
    """A compressed record is a different, smaller Arrow IPC stream with the same schema
    message, and decodes to the very table an uncompressed one does."""
    t = _compressible()
    plain, packed = encode_updates(t), encode_updates(t, compression)
    assert len(packed) < len(plain) / 3
    assert decode_updates(packed).equals(decode_updates(plain))
    sink = pa.BufferOutputStream()
    pa.ipc.new_stream(sink, t.schema).close()
    schema_message = sink.getvalue().to_pybytes()[:-8]  # without the end-of-stream marker
    assert packed.startswith(schema_message)
    assert plain.startswith(schema_message)


def test_unknown_compression_is_refused() -> None:
    """Only the documented settings are accepted, by the encoders alike."""
    t = _compressible(3)
    for bad in ("gzip", "LZ4", None, ""):
        with pytest.raises(ValueError, match="WAL compression"):
            encode_updates(t, bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="WAL compression"):
            UpdatesEncoder(t.schema, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("compression", ["lz4", "zstd"])
def test_damaged_compressed_payload_is_a_value_error_never_a_crash(
        compression: Compression) -> None:
    """Damage inside a compressed payload that its checksum did not catch (a writer's bug,
    or bytes made to pass): flipping any byte of it, or cutting it anywhere, decodes to
    ValueError or to a table (lz4 and zstd frames carry no checksum of
    their own: the record's CRC32C is what catches damage), never another exception.
    (tests/wal/test_segment.py: the readers turn the ValueError into corruption naming
    file and offset.)"""
    t = _compressible(300)
    payload = encode_updates(t, compression)
    outcomes: set[str] = set()
    variants = [payload[:cut] for cut in range(0, len(payload), 7)]
    for pos in range(len(payload)):
        flipped = bytearray(payload)
        flipped[pos] ^= 0xFF
        variants.append(bytes(flipped))
    for variant in variants:
        try:
            back = decode_updates(variant)
        except ValueError as exc:
            outcomes.add("error" if "malformed Arrow IPC" in str(exc) else f"other: {exc}")
        else:  # the readers check the schema against the relation's
            outcomes.add("table" if isinstance(back, pa.Table) else f"other: {back!r}")
    assert "error" in outcomes
    assert outcomes <= {"error", "table"}, outcomes


def test_a_buffer_declaring_more_than_the_record_limit_is_a_value_error() -> None:
    """A compressed buffer's declared uncompressed length beyond MAX_PAYLOAD (no writer
    makes one: appends are limited) makes Arrow fail to allocate it; that is damage, a
    ValueError, not the process running out of memory."""
    t = pa.table({"id": pa.array(range(64), pa.int64()),
                  "_time": pa.array([1] * 64, pa.uint64()),
                  "_diff": pa.array([1] * 64, pa.int64())})
    payload = bytearray(encode_updates(t, "lz4"))
    length = struct.pack("<q", 64 * 8)  # the id column's uncompressed length
    at = payload.find(length)
    assert at > 0
    payload[at:at + 8] = struct.pack("<q", 1 << 56)
    with pytest.raises(ValueError, match="malformed Arrow IPC"):
        decode_updates(bytes(payload))
