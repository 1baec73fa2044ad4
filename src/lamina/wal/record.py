"""Record framing of the write-ahead log.

Byte layout of one record (all integers little-endian)::

    offset  size  field
    0       4     payload length N (u32, at most MAX_PAYLOAD)
    4       1     record type (u8, a RecordType)
    5       4     CRC32C over the type byte followed by the payload (u32)
    9       N     payload

Payloads by type:

- ``UPDATES`` (1): an Arrow IPC *stream* (schema, one or more record batches, end marker)
  holding the relation's row columns plus ``_time`` (uint64) and ``_diff`` (int64). One
  ``append`` call is one record, so an append is all-or-nothing after a crash. In a
  segment of format version 2 (lamina.wal.segment) the record batches' buffers may be
  compressed, with Arrow IPC's own buffer compression: the batch message's metadata names
  the codec (``BodyCompression``: LZ4_FRAME or ZSTD) and each buffer of its body is an
  int64 uncompressed length followed by that codec's frame (or, with length -1, the
  buffer as is). The schema message and the framing are the same as uncompressed, the
  length and the CRC32C cover the bytes as stored (compressed), and any Arrow reader
  decodes the stream. In a version 1 segment no record is compressed.
- ``PROGRESS`` (2) and ``SINCE`` (3): a frontier, 9 bytes: u64 value, then u8 flag
  (1 = the empty frontier, "closed for ever", with value 0). In Python a frontier is an
  ``int`` in ``[0, CLOSED]`` (lamina.frontier), the flag set for ``CLOSED``.

The checksum covers the type so that a flipped type byte is caught; the length is
checked against the bytes that follow and against ``MAX_PAYLOAD``, so a flipped length
is caught as a frame that runs past the end or fails its checksum.

A record's payload is at most ``MAX_PAYLOAD`` bytes as stored, and a compressed record's
column buffers, uncompressed, at most ``MAX_PAYLOAD`` bytes too (the writer refuses
larger appends), so a decoder never needs more: a buffer declaring more is damage.
"""

from __future__ import annotations

import enum
import itertools
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa

from lamina.errors import CorruptionError
from lamina.frontier import CLOSED
from lamina.fs import crc32c, crc32c_raw
from lamina.schema import all_nullable

HEADER = struct.Struct("<IBI")
HEADER_SIZE = HEADER.size
UNSEALED = bytes(HEADER_SIZE)
"""What stands in a record's header until the writer seals it: length 0 and type 0, which
no reader takes for a record (an unknown type: a bad frame, so a torn tail at the end of
the open segment). See lamina.wal.log, "Sealing a record last"."""
MAX_PAYLOAD = 1 << 30
_FRONTIER = struct.Struct("<QB")
_crc = crc32c_raw  # over the many small pieces of a record, without a wrapper's call
_TYPE_BYTE = re.compile(rb"[\x01-\x03]")  # the RecordType values, for find_valid_frame


Compression = Literal["none", "lz4", "zstd"]
"""How UPDATES records' buffers are written: uncompressed, LZ4 frames or ZSTD (level 1)."""
COMPRESSIONS: tuple[str, ...] = ("none", "lz4", "zstd")
DEFAULT_COMPRESSION: Compression = "none"
"""What ``Store.open`` writes unless told otherwise (docs/performance.md says why)."""


class RecordType(enum.IntEnum):
    UPDATES = 1
    PROGRESS = 2
    SINCE = 3


def frame(rtype: RecordType, payload: bytes | memoryview) -> bytes:
    """Encode one record: header then payload."""
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"record payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    crc = crc32c(payload, crc32c(bytes((rtype,))))
    return HEADER.pack(len(payload), rtype, crc) + bytes(payload)


def encode_frontier(value: int) -> bytes:
    if value == CLOSED:
        return _FRONTIER.pack(0, 1)
    return _FRONTIER.pack(value, 0)


def decode_frontier(payload: bytes | memoryview) -> int:
    if len(payload) != _FRONTIER.size:
        raise ValueError(f"frontier payload has {len(payload)} bytes, expected {_FRONTIER.size}")
    value, flag = _FRONTIER.unpack(payload)
    if flag == 1 and value == 0:
        return CLOSED
    if flag != 0:
        raise ValueError(f"frontier flag {flag} is neither 0 nor 1")
    return int(value)


_WRITE_OPTIONS = {
    "none": pa.ipc.IpcWriteOptions(),
    "lz4": pa.ipc.IpcWriteOptions(compression="lz4", use_threads=False),
    "zstd": pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", 1), use_threads=False),
}
"""Arrow IPC as written to segments: metadata V5, the current format, whatever the
``ARROW_PRE_*`` environment variables say (a storage format must not depend on them; and
passing options spares pyarrow reading the environment twice per append). Compression
runs on the appending thread (``use_threads=False``): Arrow's pool made an append of
10,000 updates slower, not faster, on two loaded cores (docs/performance.md)."""


def check_compression(compression: object) -> Compression:
    """``compression`` if it is one of :data:`COMPRESSIONS`, else ValueError."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"WAL compression {compression!r} is not one of {COMPRESSIONS}")
    return compression  # type: ignore[return-value]


def encode_updates(table: pa.Table, compression: Compression = "none") -> bytes:
    """``table`` as one Arrow IPC stream, the payload of an UPDATES record (its buffers
    compressed with ``compression``)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema,
                           options=_WRITE_OPTIONS[check_compression(compression)]) as writer:
        writer.write_table(table)
    data: bytes = sink.getvalue().to_pybytes()
    return data


_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"
"""The end-of-stream marker of an Arrow IPC stream (continuation marker, length 0)."""


class _Parts:
    """The file object behind an encoder's ``pyarrow.PythonFile``: Arrow's IPC writer hands
    it each piece of the stream, metadata as small ``bytes`` and each column buffer as a
    ``pyarrow.Buffer`` over the table's own memory (no copy); ``write`` just keeps them."""

    closed = False

    def __init__(self) -> None:
        self.pieces: list[Any] = []
        self.write = self.pieces.append

    def flush(self) -> None:
        pass


class UpdatesEncoder:
    """Encodes UPDATES records of one schema as a list of buffers, for ``writev``.

    ``encode(table)`` returns the pieces whose concatenation is exactly
    ``frame(UPDATES, encode_updates(table, compression))``: the record header, the
    stream's schema message, the table's record batch messages (their metadata, and the
    column buffers themselves, not copies; compressed, the codec's output), the
    end-of-stream marker. The CRC32C is continued over the pieces, so no byte of the
    table is copied before the kernel copies it into the file; uncompressed, that copy and
    the checksum pass are all the work left per byte (docs/performance.md).

    One IPC stream writer is kept open for all of the encoder's records (started with an
    empty batch, whose output is dropped), which spares each append setting up a stream;
    the schema message, taken once from a stream closed at once, is put before every
    record's batches. This is byte-for-byte a fresh stream per record because a stream
    writer keeps no state between batches, except for dictionary-encoded columns (a
    dictionary is written once per stream): a schema with one gets a fresh stream per
    record. tests/wal/test_record.py checks the equality over random schemas and tables.

    ``batches`` (default ``schema``) is the schema of the tables it encodes, when that
    differs from the one its records declare only in which top-level fields are nullable:
    a record batch message names no field, so a table built with ``pa.table()`` (every
    field nullable) whose non-nullable columns were checked for nulls is written under the
    relation's schema as it is, byte for byte the record of the same table copied under
    that schema (``Relation.append``: lamina.schema.checked_updates).

    Not thread-safe: one encoder per appending thread. A record's pieces hold the table's
    buffers alive while the caller holds the list."""

    def __init__(self, schema: pa.Schema, compression: Compression = "none", *,
                 batches: pa.Schema | None = None) -> None:
        batches = schema if batches is None else batches
        if not all_nullable(batches).equals(all_nullable(schema), check_metadata=True):
            raise ValueError(f"an encoder's tables may differ from the schema its records "
                             f"declare only in nullability: {batches} against {schema}")
        self.schema = schema
        self.batches = batches
        self.compression = check_compression(compression)
        self._options = _WRITE_OPTIONS[compression]
        self._schema_message = self._stream_head(schema)
        self._start_crc = crc32c(self._schema_message, crc32c(bytes((RecordType.UPDATES,))))
        self._fixed = len(self._schema_message) + len(_EOS)
        self._sink = _Parts()
        self._file = pa.PythonFile(self._sink, mode="w")
        self._writer: Any = None
        self._batches_head = 0  # what a fresh stream of the tables' schema starts with
        if _has_dictionary(schema):  # a fresh stream per record, its head cut off
            self._batches_head = len(self._stream_head(batches))
        else:
            self._writer = pa.ipc.new_stream(self._file, batches, options=self._options)
            # starts it; an empty batch of typed empty arrays (from_pylist would import
            # pandas, a second of a coordinator's first append: lamina.columns)
            self._writer.write_batch(pa.RecordBatch.from_arrays(
                [pa.nulls(0, f.type) for f in batches], schema=batches))
        self._sink.pieces.clear()

    def _stream_head(self, schema: pa.Schema) -> bytes:
        """The schema message a stream of ``schema`` starts with."""
        probe = _Parts()
        pa.ipc.new_stream(pa.PythonFile(probe, mode="w"), schema, options=self._options).close()
        stream = b"".join(probe.pieces)
        if not stream.endswith(_EOS):  # pragma: no cover - a pyarrow that writes otherwise
            raise RuntimeError("pyarrow wrote an IPC stream without the expected end marker")
        return stream[:-len(_EOS)]

    def encode(self, table: pa.Table) -> tuple[list[Any], int]:
        """The pieces of ``table``'s record (header first) and the record's length in bytes."""
        record, size = self.encode_unsealed(table)
        record[0] = self.header(record, size)
        return record, size

    def encode_unsealed(self, table: pa.Table) -> tuple[list[Any], int]:
        """As :meth:`encode`, but the first piece is :data:`UNSEALED` in place of the
        header: the record as the WAL writer writes it first, to be sealed by writing
        :meth:`header` over those bytes (lamina.wal.log, "Sealing a record last")."""
        pieces = self._sink.pieces
        pieces.clear()
        if self._writer is not None:
            self._writer.write_table(table)
        else:
            with pa.ipc.new_stream(self._file, self.batches, options=self._options) as writer:
                writer.write_table(table)
            pieces[:] = [b"".join(pieces)[self._batches_head:-len(_EOS)]]
        size = self._fixed + sum(len(piece) for piece in pieces)
        record = [UNSEALED, self._schema_message, *pieces, _EOS]
        pieces.clear()  # the table's buffers stay referenced by the record alone
        return record, HEADER_SIZE + size

    def header(self, record: list[Any], size: int) -> bytes:
        """The header of a record from :meth:`encode_unsealed` (of ``size`` bytes): its
        length and the CRC32C continued over its pieces, the table's buffers read once."""
        crc = self._start_crc
        for piece in itertools.islice(record, 2, None):  # after the header, schema message
            crc = _crc(piece, crc)
        return HEADER.pack(size - HEADER_SIZE, RecordType.UPDATES, crc)


def _has_dictionary(schema: pa.Schema) -> bool:
    def walk(t: pa.DataType) -> bool:
        return pa.types.is_dictionary(t) or any(walk(t.field(i).type)
                                                for i in range(t.num_fields))
    return any(walk(f.type) for f in schema)


_READ_OPTIONS = pa.ipc.IpcReadOptions(ensure_alignment=pa.ipc.Alignment.DataTypeSpecific)


def decode_updates(payload: bytes | memoryview) -> pa.Table:
    """Decode an UPDATES payload, compressed or not. Raises ``ValueError`` on malformed
    Arrow IPC, and on compressed buffers that do not decompress to their declared length.

    Records sit at arbitrary offsets of a segment, so their buffers may be misaligned for
    their types; Arrow copies just those buffers to aligned memory (compute kernels would
    otherwise warn, or on some platforms misread). Compressed buffers are decompressed
    into fresh (aligned) memory.

    The IPC reader checks the framing, not the data: a payload that passed its checksum
    but was written wrong (a bug, or bytes crafted to pass) could still carry string
    offsets pointing outside their buffer, invalid UTF-8 or decimals beyond their
    precision, which compute kernels would read out of bounds. Full validation (about
    9 GB/s) turns those into the same ValueError. So does a compressed buffer declaring
    more than ``MAX_PAYLOAD`` bytes (Arrow fails to allocate it), which no writer makes;
    a smaller allocation that fails is the process running out of memory, and stays a
    ``MemoryError``."""
    try:
        table = pa.ipc.open_stream(pa.py_buffer(payload), options=_READ_OPTIONS).read_all()
        table.validate(full=True)
    except (pa.ArrowInvalid, pa.ArrowIOError, pa.ArrowNotImplementedError,
            UnicodeDecodeError) as exc:  # the last: a field name that is not UTF-8
        raise ValueError(f"malformed Arrow IPC payload: {exc}") from exc
    except pa.ArrowMemoryError as exc:
        wanted = _ALLOCATION.search(str(exc))
        if wanted is None or int(wanted.group(1)) <= MAX_PAYLOAD:
            raise
        raise ValueError(f"malformed Arrow IPC payload: a buffer declares "
                         f"{int(wanted.group(1))} bytes, beyond the record limit of "
                         f"{MAX_PAYLOAD}") from exc
    return table


_ALLOCATION = re.compile(r"of size (\d+) failed")
"""How Arrow's allocators word a failed allocation ("malloc of size N failed")."""


@dataclass(frozen=True, slots=True)
class Record:
    offset: int
    rtype: RecordType
    payload: memoryview

    @property
    def end(self) -> int:
        return self.offset + HEADER_SIZE + len(self.payload)


@dataclass(frozen=True, slots=True)
class BadFrame:
    """Why the bytes at ``offset`` are not a valid record."""

    offset: int
    reason: str


def read_frame(buf: memoryview, offset: int) -> Record | BadFrame:
    """Parse the record starting at ``offset`` of ``buf``."""
    remaining = len(buf) - offset
    if remaining < HEADER_SIZE:
        return BadFrame(offset, f"incomplete record header ({remaining} of {HEADER_SIZE} bytes)")
    length, rtype, crc = HEADER.unpack_from(buf, offset)
    if length > MAX_PAYLOAD:
        return BadFrame(offset, f"record length {length} exceeds the maximum {MAX_PAYLOAD}")
    if rtype not in RecordType._value2member_map_:
        return BadFrame(offset, f"unknown record type {rtype}")
    start = offset + HEADER_SIZE
    if length > len(buf) - start:
        return BadFrame(offset, f"record of {length} bytes runs past the end of the file")
    payload = buf[start:start + length]
    if crc32c(payload, crc32c(bytes((rtype,)))) != crc:
        return BadFrame(offset, "record checksum mismatch")
    return Record(offset, RecordType(rtype), payload)


def frame_headers(buf: Any, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """``(offset, type, length)`` of each frame of ``buf`` (bytes-like, e.g. a read-only
    mmap of a segment) from ``start``, reading headers only: checksums are left to whoever
    reads the payloads. Stops before ``end``, and at the first frame whose length exceeds
    :data:`MAX_PAYLOAD` or runs past ``end`` (whoever reads that frame reports it)."""
    off = start
    while off + HEADER_SIZE <= end:
        length, rtype, _ = HEADER.unpack_from(buf, off)
        if length > MAX_PAYLOAD or off + HEADER_SIZE + length > end:
            return
        yield off, rtype, length
        off += HEADER_SIZE + length


def find_valid_frame(buf: memoryview, start: int) -> int | None:
    """The offset of the first valid record at or after ``start``, or None.

    Used only after a bad frame, to tell a torn tail (nothing valid follows) from
    corruption in the middle of a log (a valid record follows the bad one). Only offsets
    whose type byte is a known type and whose length fits are checksummed; the regex finds
    the type bytes in C, so a torn tail of many megabytes is searched in well under a
    second instead of a Python step per byte."""
    last = len(buf) - HEADER_SIZE  # the last offset a header fits at
    for match in _TYPE_BYTE.finditer(buf, start + 4, last + 5):
        offset = match.start() - 4
        if HEADER.unpack_from(buf, offset)[0] <= last - offset and isinstance(
                read_frame(buf, offset), Record):
            return offset
    return None


def corrupt(path: object, offset: int, reason: str) -> CorruptionError:
    return CorruptionError(
        f"write-ahead log damaged: {reason}; restore the file from a backup "
        "(docs/operations.md, LaminaRelationQuarantined)", path=str(path), offset=offset)
