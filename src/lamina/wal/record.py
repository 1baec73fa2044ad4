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
  ``append`` call is one record, so an append is all-or-nothing after a crash.
- ``PROGRESS`` (2) and ``SINCE`` (3): a frontier, 9 bytes: u64 value, then u8 flag
  (1 = the empty frontier, "closed for ever", with value 0). In Python a frontier is an
  ``int`` in ``[0, CLOSED]`` where ``CLOSED = 2**64`` stands for the empty frontier, so
  ``time < upper`` reads the same for both.

The checksum covers the type so that a flipped type byte is caught; the length is
checked against the bytes that follow and against ``MAX_PAYLOAD``, so a flipped length
is caught as a frame that runs past the end or fails its checksum.
"""

from __future__ import annotations

import enum
import re
import struct
from dataclasses import dataclass

import pyarrow as pa

from lamina.errors import CorruptionError
from lamina.fs import crc32c

CLOSED = 2**64
"""The empty frontier: every time is closed."""

MAX_TIME = 2**64 - 1
HEADER = struct.Struct("<IBI")
HEADER_SIZE = HEADER.size
MAX_PAYLOAD = 1 << 30
_FRONTIER = struct.Struct("<QB")
_TYPE_BYTE = re.compile(rb"[\x01-\x03]")  # the RecordType values, for find_valid_frame


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


_WRITE_OPTIONS = pa.ipc.IpcWriteOptions()
"""Arrow IPC as written to segments: metadata V5, the current format, whatever the
``ARROW_PRE_*`` environment variables say (a storage format must not depend on them; and
passing options spares pyarrow reading the environment twice per append)."""


def encode_updates(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=_WRITE_OPTIONS) as writer:
        writer.write_table(table)
    data: bytes = sink.getvalue().to_pybytes()
    return data


def encode_updates_record(table: pa.Table, scratch: bytearray | None = None) -> memoryview:
    """The bytes of ``frame(UPDATES, encode_updates(table))``, built in one buffer.

    The write path of ``append``: the Arrow IPC stream is sized on a MockOutputStream (no
    data copied) and then serialized once, straight behind the record header, so a large
    append costs one copy of its data instead of four (stream growth, ``to_pybytes``,
    ``bytes(payload)``, header concatenation).

    The record is built in ``scratch`` when it is big enough (the result is then a view of
    it, valid until ``scratch`` is reused), else in a new bytearray (the view's ``.obj``,
    which the caller may keep as the next scratch). Reusing one buffer spares every large
    append the page faults and zeroing of fresh memory (docs/performance.md)."""
    mock = pa.MockOutputStream()
    with pa.ipc.new_stream(mock, table.schema, options=_WRITE_OPTIONS) as writer:
        writer.write_table(table)
    size = mock.size()
    if scratch is None or len(scratch) < HEADER_SIZE + size:
        scratch = bytearray(HEADER_SIZE + size)
    out = memoryview(scratch)[:HEADER_SIZE + size]
    with pa.FixedSizeBufferWriter(pa.py_buffer(out[HEADER_SIZE:])) as sink, \
            pa.ipc.new_stream(sink, table.schema, options=_WRITE_OPTIONS) as writer:
        writer.write_table(table)
    rtype = RecordType.UPDATES
    HEADER.pack_into(out, 0, size, rtype, crc32c(out[HEADER_SIZE:], crc32c(bytes((rtype,)))))
    return out


_READ_OPTIONS = pa.ipc.IpcReadOptions(ensure_alignment=pa.ipc.Alignment.DataTypeSpecific)


def decode_updates(payload: bytes | memoryview) -> pa.Table:
    """Decode an UPDATES payload. Raises ``ValueError`` on malformed Arrow IPC.

    Records sit at arbitrary offsets of a segment, so their buffers may be misaligned for
    their types; Arrow copies just those buffers to aligned memory (compute kernels would
    otherwise warn, or on some platforms misread).

    The IPC reader checks the framing, not the data: a payload that passed its checksum
    but was written wrong (a bug, or bytes crafted to pass) could still carry string
    offsets pointing outside their buffer, invalid UTF-8 or decimals beyond their
    precision, which compute kernels would read out of bounds. Full validation (about
    9 GB/s) turns those into the same ValueError."""
    try:
        table = pa.ipc.open_stream(pa.py_buffer(payload), options=_READ_OPTIONS).read_all()
        table.validate(full=True)
    except (pa.ArrowInvalid, pa.ArrowIOError, pa.ArrowNotImplementedError) as exc:
        raise ValueError(f"malformed Arrow IPC payload: {exc}") from exc
    return table


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
        f"write-ahead log damaged: {reason}; the relation is quarantined, run "
        "'lamina verify' and restore the file from a backup", path=str(path), offset=offset)
