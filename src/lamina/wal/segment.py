"""WAL segment files: naming, header, and scanning with the recovery rules.

File names in a relation's WAL directory: ``{seq:016d}.wal`` for a finished segment,
``{seq:016d}.wal.open`` for the one open segment. Sequence numbers grow by one.

Byte layout of a segment (little-endian)::

    offset   size  field
    0        8     magic b"LAMINAWL"
    8        2     format version (u16, 1 or 2)
    10       2     relation name length n (u16)
    12       8     segment sequence number (u64)
    20       n     relation name (UTF-8)
    20+n     4     CRC32C of bytes [0, 20+n)
    24+n     ...   records (see ``lamina.wal.record``)

Format versions (the header's u16): the layout is the same in both; the version says what
the UPDATES records of the segment may hold (lamina.wal.record):

- 1: uncompressed Arrow IPC streams only (what lamina wrote before WAL compression).
- 2: each UPDATES record's buffers may be compressed (Arrow IPC buffer compression, LZ4 or
  ZSTD, named in each record batch message), or not, record by record: a writer's
  ``compression`` setting applies to the records it writes, so a segment written by
  writers of different settings mixes them.

A writer creates version 2 segments when it compresses (:func:`version_for`), version 1
segments when it does not, so that data written with the default (no compression) stays
readable by a lamina that knows only version 1. It keeps appending uncompressed records
to a version 1 open segment it recovers until that segment finishes. Readers read both
versions; a lamina that knows only version 1 refuses a version 2 segment (as corruption
naming the version) instead of misreading it.

Invariants:

- The first record is PROGRESS: the segment's ``lower``. The writer follows it with a
  SINCE record carrying the relation's compaction frontier, so every segment knows the
  frontiers even after older segments were converted and deleted.
- A finished segment ends with a PROGRESS record, its ``upper``, and never changes.
- PROGRESS and SINCE values never decrease within a segment.

Scanning rules (docs/architecture.md, torn tail vs corruption): in the open segment a bad frame
with no valid frame after it
is a torn tail (cut off on recovery); a bad frame followed by a valid one is corruption
(an unsealed record's header of zeros only if it is still there when the file is read
again: :func:`scan_file`). In a finished segment any damage is corruption. Corruption
names file and offset.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from lamina.errors import CorruptionError
from lamina.fs import crc32c
from lamina.wal.record import (
    HEADER,
    HEADER_SIZE,
    MAX_PAYLOAD,
    UNSEALED,
    BadFrame,
    Record,
    RecordType,
    corrupt,
    decode_frontier,
    encode_frontier,
    find_valid_frame,
    frame,
    read_frame,
)

MAGIC = b"LAMINAWL"
FORMAT_VERSION = 2
"""The newest version of the segments this lamina writes (when it compresses)."""
READ_VERSIONS = (1, 2)
"""The versions it reads."""


def version_for(compression: str) -> int:
    """The version of a segment a writer with ``compression`` creates: 2 only when its
    records may be compressed, so uncompressed data stays readable by older laminas."""
    return 1 if compression == "none" else FORMAT_VERSION
_FIXED = struct.Struct("<8sHHQ")
FINISHED_SUFFIX = ".wal"
_FRONTIER_SIZE = len(encode_frontier(0))
_WALK_BLOCK = 64 << 10  # read_frontiers reads this much at a record's start
OPEN_SUFFIX = ".wal.open"


def segment_name(seq: int, *, finished: bool) -> str:
    return f"{seq:016d}{FINISHED_SUFFIX if finished else OPEN_SUFFIX}"


def parse_name(name: str) -> tuple[int, bool] | None:
    """``(seq, finished)`` for a segment file name, None for any other file."""
    for suffix, finished in ((OPEN_SUFFIX, False), (FINISHED_SUFFIX, True)):
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            if len(stem) == 16 and stem.isdigit():
                return int(stem), finished
    return None


def encode_header(relation: str, seq: int, version: int = FORMAT_VERSION) -> bytes:
    name = relation.encode()
    body = _FIXED.pack(MAGIC, version, len(name), seq) + name
    return body + struct.pack("<I", crc32c(body))


def opening_records(lower: int, since: int) -> bytes:
    """The records a new segment starts with: its lower, then the current since."""
    return (frame(RecordType.PROGRESS, encode_frontier(lower))
            + frame(RecordType.SINCE, encode_frontier(since)))


@dataclass(frozen=True)
class SegmentFile:
    """A segment file found in a relation's WAL directory."""

    path: Path
    seq: int
    finished: bool


def list_segments(wal_dir: Path) -> list[SegmentFile]:
    """All segment files of a relation, ordered by sequence number."""
    found = []
    try:
        names = [p.name for p in wal_dir.iterdir()]
    except FileNotFoundError:
        return []
    for name in names:
        parsed = parse_name(name)
        if parsed is not None:
            found.append(SegmentFile(wal_dir / name, parsed[0], parsed[1]))
    return sorted(found, key=lambda s: (s.seq, s.finished))


@dataclass
class Scan:
    """What a segment holds, as far as it is valid."""

    path: Path
    seq: int
    relation: str
    version: int = FORMAT_VERSION
    records: list[Record] = field(default_factory=list)
    valid_end: int = 0
    torn_at: int | None = None
    torn_reason: str = ""
    lower: int = 0
    upper: int = 0
    since: int = 0

    @property
    def finished_shape(self) -> bool:
        return bool(self.records) and self.records[-1].rtype is RecordType.PROGRESS

    def updates(self) -> list[Record]:
        return [r for r in self.records if r.rtype is RecordType.UPDATES]


def scan_buffer(buf: memoryview, path: Path, *, finished: bool, relation: str | None = None,
                seq: int | None = None) -> Scan:
    """Scan the bytes of a segment; raise CorruptionError per the rules above."""
    header = _read_header(buf, path, finished=finished)
    if header is None:  # torn header of an open segment: it never held anything acked
        return Scan(path=path, seq=seq or 0, relation=relation or "", torn_at=0,
                    torn_reason="incomplete segment header")
    rel, hseq, offset, version = header
    if relation is not None and rel != relation:
        raise corrupt(path, 0, f"segment header names relation {rel!r}, expected {relation!r}")
    if seq is not None and hseq != seq:
        raise corrupt(path, 0, f"segment header has sequence {hseq}, file name says {seq}")
    scan = Scan(path=path, seq=hseq, relation=rel, version=version, valid_end=offset)

    def take(rec: Record) -> None:
        _apply(scan, rec)
        scan.records.append(rec)

    scan.valid_end, scan.torn_reason = read_records(buf, offset, path, finished=finished,
                                                    each=take)
    if scan.torn_reason:
        scan.torn_at = scan.valid_end
    if not scan.records:
        if finished:
            raise corrupt(path, scan.valid_end, "finished segment holds no records")
    elif finished and not scan.finished_shape:
        raise corrupt(path, scan.valid_end, "finished segment does not end with a progress "
                                            "record")
    return scan


def read_records(buf: memoryview, offset: int, path: Path, *, finished: bool,
                 each: Callable[[Record], None], base: int = 0) -> tuple[int, str]:
    """Pass each valid record of ``buf`` from ``offset`` on to ``each``, in order, by the
    scanning rules above, and return ``(end, torn_reason)``: where the valid records end,
    and why the bytes from there on are a torn tail ("" when the records reach the end of
    ``buf``). A bad frame raises CorruptionError in a finished segment, and in the open one
    when a valid frame follows it. ``base`` is the file offset of ``buf[0]`` (a read from
    the middle of a file): the records, the end and the errors name offsets in the file.
    ``each`` sees a record before the next one is read, so the first damage in the file
    is the one reported (:func:`scan_buffer` checks frontiers there)."""
    while offset < len(buf):
        rec = read_frame(buf, offset)
        if isinstance(rec, BadFrame):
            if finished:
                raise corrupt(path, base + offset, f"{rec.reason} in a finished segment")
            nxt = find_valid_frame(buf, offset + 1)
            if nxt is not None:
                raise corrupt(path, base + offset, f"{rec.reason}, followed by a valid record "
                                                   f"at byte {base + nxt}")
            return base + offset, rec.reason
        each(rec if base == 0 else Record(base + offset, rec.rtype, rec.payload))
        offset = rec.end
    return base + offset, ""


def _apply(scan: Scan, rec: Record, *, first: bool | None = None) -> None:
    first = not scan.records if first is None else first
    if first and rec.rtype is not RecordType.PROGRESS:
        raise corrupt(scan.path, rec.offset, f"segment starts with a {rec.rtype.name} record, "
                                             "expected PROGRESS")
    if rec.rtype is RecordType.UPDATES:
        return
    try:
        value = decode_frontier(rec.payload)
    except ValueError as exc:
        raise corrupt(scan.path, rec.offset, str(exc)) from exc
    if rec.rtype is RecordType.PROGRESS:
        if first:
            scan.lower = scan.upper = value
        elif value < scan.upper:
            raise corrupt(scan.path, rec.offset, f"progress goes backwards from {scan.upper} "
                                                 f"to {value}")
        scan.upper = value
    else:
        if value < scan.since:
            raise corrupt(scan.path, rec.offset, f"since goes backwards from {scan.since} "
                                                 f"to {value}")
        scan.since = value


def _read_header(buf: memoryview, path: Path, *, finished: bool
                 ) -> tuple[str, int, int, int] | None:
    """``(relation, seq, offset of the first record, version)``, or None for a torn header
    of an open segment."""
    def bad(reason: str) -> None:
        if finished or find_valid_frame(buf, 1) is not None:
            raise corrupt(path, 0, reason)

    if len(buf) < _FIXED.size:
        bad(f"segment header incomplete ({len(buf)} bytes)")
        return None
    magic, version, name_len, seq = _FIXED.unpack_from(buf, 0)
    end = _FIXED.size + name_len
    if magic != MAGIC:
        bad(f"bad segment magic {bytes(magic)!r}")
        return None
    if version not in READ_VERSIONS:
        raise corrupt(path, 8, f"segment format version {version}; this lamina reads "
                               f"versions {', '.join(map(str, READ_VERSIONS))}")
    if len(buf) < end + 4:
        bad("segment header incomplete")
        return None
    (stored,) = struct.unpack_from("<I", buf, end)
    if crc32c(buf[:end]) != stored:
        bad("segment header checksum mismatch")
        return None
    try:
        rel = bytes(buf[_FIXED.size:end]).decode()
    except UnicodeDecodeError as exc:
        raise corrupt(path, _FIXED.size, "relation name in header is not UTF-8") from exc
    return rel, int(seq), end + 4, int(version)


RACE_RETRIES = 6
"""How many times an open segment is read again before a reader believes an unsealed
record followed by a valid one (:func:`read_past_seal_races`)."""

T = TypeVar("T")


def read_past_seal_races(read: Callable[[], bytes], parse: Callable[[bytes], T], *,
                         finished: bool, start: int = 0) -> T:
    """``parse(read())``, for bytes of a segment from byte ``start`` on, read again where
    they may have raced the writer's seal of a record.

    The open segment may be read while its writer seals a record: the writer writes the
    record behind a header of zeros, then writes the header over them, then the next
    record (lamina.wal.log, "Sealing a record last"). A read is not atomic against those
    writes, so it can copy the zeros before they were replaced and the next record after
    it was written: bytes the file never held at any one moment, which the rules above
    call corruption (a bad frame followed by a valid one). Where ``parse`` raises that for
    an open segment (``finished`` False) at a header of zeros, the bytes are read again (up
    to :data:`RACE_RETRIES` times, a millisecond or a few apart); a race is gone by then,
    damage stays and is reported. ``parse``'s CorruptionError names offsets in the file,
    so byte ``at`` of the file is ``data[at - start]``."""
    for attempt in range(RACE_RETRIES + 1):
        data = read()
        try:
            return parse(data)
        except CorruptionError as exc:
            at = None if exc.offset is None else exc.offset - start
            if (finished or attempt == RACE_RETRIES or at is None or at < 0
                    or data[at:at + HEADER_SIZE] != UNSEALED):
                raise
        time.sleep(0.001 * (attempt + 1))
    raise AssertionError("unreachable")  # pragma: no cover


def scan_file(seg: SegmentFile, relation: str | None = None) -> tuple[Scan, bytes]:
    """Scan a segment file, returning the scan over a private copy of its bytes (read again
    where the read raced the seal of a record: :func:`read_past_seal_races`)."""
    def parse(data: bytes) -> tuple[Scan, bytes]:
        return scan_buffer(memoryview(data), seg.path, finished=seg.finished,
                           relation=relation, seq=seg.seq), data

    return read_past_seal_races(seg.path.read_bytes, parse, finished=seg.finished)


def read_frontiers(seg: SegmentFile, relation: str) -> Scan:
    """The frontiers of a segment, reading only its header, the frame headers and the
    frontier records' payloads (seeking past update payloads).

    Update records are framed-checked (type, length within the file) but their checksums
    are left to whoever decodes them (conversion tasks, readers); frontier records are
    fully verified. Returns a Scan with ``lower``, ``upper``, ``since`` and ``valid_end``
    (the file size) set and only the frontier records in ``records``. In a finished segment
    any damage raises CorruptionError, as in :func:`scan_buffer`. In the open segment any
    irregularity (a torn tail, a frame the writer is still writing, damage) falls back to a
    full :func:`scan_file`, which applies the torn-tail vs corruption rules above exactly."""
    if seg.finished:
        return _walk_frontiers(seg, relation)
    try:
        return _walk_frontiers(seg, relation)
    except CorruptionError:
        return scan_file(seg, relation)[0]


def _walk_frontiers(seg: SegmentFile, relation: str) -> Scan:
    path = seg.path
    fd = os.open(path, os.O_RDONLY)
    try:  # unbuffered reads at a record's start: a block holding the next few records'
        # headers while updates are small, just one header (or frontier record) while
        # they are large
        size = os.fstat(fd).st_size
        head = os.pread(fd, _FIXED.size + 64 + 4 + 8, 0)
        rel, hseq, offset, version = (_read_header(memoryview(head), path, finished=True)
                                      or ("", 0, 0, 0))
        if rel != relation or hseq != seg.seq:
            raise corrupt(path, 0, f"segment header names {rel!r} #{hseq}, expected "
                                   f"{relation!r} #{seg.seq}")
        scan = Scan(path=path, seq=hseq, relation=rel, version=version, valid_end=size)
        last: int | None = None
        block, base = b"", offset  # the file's bytes [base, base + len(block))
        want = _WALK_BLOCK
        while offset < size:
            at = offset - base
            if at + HEADER_SIZE + _FRONTIER_SIZE > len(block) and base + len(block) < size:
                block, base, at = os.pread(fd, want, offset), offset, 0
            if len(block) - at < HEADER_SIZE:
                raise corrupt(path, offset, "incomplete record header in a finished segment")
            length, rtype, _crc = HEADER.unpack_from(block, at)
            end = offset + HEADER_SIZE + length
            if rtype not in RecordType._value2member_map_ or length > MAX_PAYLOAD or end > size:
                raise corrupt(path, offset, "bad record frame in a finished segment")
            if rtype == RecordType.UPDATES:
                if last is None:
                    raise corrupt(path, offset, "segment starts with an UPDATES record, "
                                                "expected PROGRESS")
                want = _WALK_BLOCK if length <= _WALK_BLOCK // 8 else HEADER_SIZE + _FRONTIER_SIZE
            else:
                raw = block[at:at + HEADER_SIZE + length]
                if len(raw) < HEADER_SIZE + length:  # a bad one, which read_frame names
                    raw = os.pread(fd, HEADER_SIZE + length, offset)
                rec = read_frame(memoryview(raw), 0)
                if isinstance(rec, BadFrame):
                    raise corrupt(path, offset, f"{rec.reason} in a finished segment")
                scan.records.append(Record(offset, rec.rtype, rec.payload))
                _apply(scan, scan.records[-1], first=last is None)
            last = rtype
            offset = end
    finally:
        os.close(fd)
    if last != RecordType.PROGRESS and (seg.finished or last is None):
        raise corrupt(path, size, "finished segment does not end with a progress record")
    return scan
