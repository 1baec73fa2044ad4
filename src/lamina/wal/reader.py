"""Reading a relation's log without being its writer.

Used by readers (snapshots, ``lamina status``), by the compacter (which finds finished
segments and converts them) and by ``lamina verify``. Nothing here writes: a torn tail of
the open segment is skipped, never cut (cutting it is the writer's recovery).

A reader races the writer (which renames the open segment when it finishes it) and the
compacter (which deletes converted segments). Functions here raise FileNotFoundError when
a file vanished under them; callers retry from a fresh listing.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from lamina.errors import CorruptionError
from lamina.wal.record import (
    HEADER_SIZE,
    BadFrame,
    RecordType,
    corrupt,
    decode_updates,
    frame_headers,
    read_frame,
)
from lamina.wal.segment import (
    Scan,
    SegmentFile,
    encode_header,
    list_segments,
    read_frontiers,
    read_past_seal_races,
    read_records,
    scan_file,
)

_RETRIES = 20


def frontiers(wal_dir: Path, relation: str) -> tuple[int, int]:
    """``(upper, since)`` of the relation, read from its newest segment's frame headers and
    frontier records (:func:`read_frontiers`: update payloads are skipped, not read, so a
    poll costs a few bytes read per record however large the updates; a torn tail of the
    open segment is handled by a full scan, with the scanner's rules)."""
    for _ in range(_RETRIES):
        segments = list_segments(wal_dir)
        if not segments:
            if not wal_dir.exists():
                raise FileNotFoundError(wal_dir)
            raise CorruptionError(f"relation {relation!r} has no WAL segments", path=wal_dir)
        try:
            scan = read_frontiers(segments[-1], relation)
        except FileNotFoundError:
            continue
        if len(scan.records) < 2 and not segments[-1].finished:
            # an open segment being created (or with a torn opening): its predecessor knows
            if len(segments) < 2:
                return 0, 0
            try:
                scan = read_frontiers(segments[-2], relation)
            except FileNotFoundError:
                continue
        return scan.upper, scan.since
    raise CorruptionError(f"relation {relation!r}: segments kept changing while reading "
                          "frontiers", path=wal_dir)


def checked_updates(payload: bytes | memoryview, path: object, offset: int,
                    schema: pa.Schema) -> pa.Table:
    """The update table of the UPDATES record at ``offset`` of ``path``, checked against
    ``schema`` (CorruptionError naming file and offset otherwise)."""
    try:
        table = decode_updates(payload)
    except ValueError as exc:
        raise corrupt(path, offset, str(exc)) from exc
    if not table.schema.equals(schema):
        raise corrupt(path, offset, f"update record schema {table.schema} does not match "
                                    "the relation")
    return table


def updates_of(scan: Scan, schema: pa.Schema) -> Iterator[pa.Table]:
    """The update tables of a scanned segment, each checked against ``schema``."""
    for rec in scan.records:
        if rec.rtype is RecordType.UPDATES:
            yield checked_updates(rec.payload, scan.path, rec.offset, schema)


def segment_updates(seg: SegmentFile, relation: str, schema: pa.Schema) -> list[pa.Table]:
    """Decode every update record of one segment file."""
    scan, _ = scan_file(seg, relation)
    return list(updates_of(scan, schema))


def appended_updates(seg: SegmentFile, schema: pa.Schema,
                     start: int) -> tuple[list[pa.Table], int]:
    """The update tables of the records the open segment ``seg`` holds from byte ``start``
    on (the ``valid_end`` of an earlier scan of it, or of an earlier call), and the new
    valid end: :func:`segment_updates` for a reader that polls a growing open segment.

    The bytes before ``start`` were verified then and do not change: the writer only
    appends, and its recovery cuts only a torn tail, which lies after every valid record. The
    new bytes follow the open segment's rules (lamina.wal.segment): a bad frame followed by
    a valid one is corruption, unless it is a record's header of zeros that the read raced
    the writer's seal of (read again: :func:`lamina.wal.segment.read_past_seal_races`);
    with nothing valid after it, it is a torn tail (or a record being written), left for a
    later call."""
    def read() -> bytes:
        with open(seg.path, "rb") as f:
            f.seek(start)
            return f.read()

    def parse(data: bytes) -> tuple[list[pa.Table], int]:
        scan = Scan(path=seg.path, seq=seg.seq, relation="")
        end, _torn = read_records(memoryview(data), 0, seg.path, finished=False,
                                  each=scan.records.append, base=start)
        return list(updates_of(scan, schema)), end

    return read_past_seal_races(read, parse, finished=seg.finished, start=start)


SAMPLE_PAYLOAD = 1 << 20
"""The largest UPDATES payload :func:`sampled_expansion` decodes (the daemon decodes at
most two per new compressed segment)."""
UNSAMPLED_EXPANSION = 16.0
"""The expansion assumed for a compressed segment with no record to sample (none small
enough, or the samples damaged): above what LZ4 and ZSTD reach on lamina's benchmark
tables (about 4x and 8x on the peers benchmark's stream), so such a segment errs towards
smaller tasks."""


def sampled_expansion(path: Path, relation: str, seq: int, *,
                      limit: int = SAMPLE_PAYLOAD) -> float:
    """How many times their size a finished segment's update payloads take decoded,
    sampled: of the UPDATES records of at most ``limit`` bytes, the largest and the last
    are decoded, and the larger ratio of decoded bytes (the tables' Arrow buffers) to
    payload bytes is taken, at least 1. Records of one segment come from the writers of
    one relation, so two of them say how well the rest compress (the largest, because a
    small record's ratio is diluted by the schema every record carries); where
    compression settings were mixed in the segment (a store reopened with another
    ``wal_compression``), taking the larger errs towards smaller tasks. Only frame headers
    are read besides the samples (through a read-only mmap), and neither sample's checksum
    is trusted: a damaged one counts as :data:`UNSAMPLED_EXPANSION` (the conversion's own
    reads report the damage), and so does a segment whose update records are all larger
    than ``limit``. A segment with no update record expands by 1."""
    start = len(encode_header(relation, seq))
    largest: tuple[int, int] | None = None  # (start, end) of a frame in the file
    last: tuple[int, int] | None = None
    updates = False
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size <= start:
            return 1.0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for off, rtype, length in frame_headers(mm, start, size):
                if rtype == RecordType.UPDATES:
                    updates = True
                    if length <= limit:
                        last = (off, off + HEADER_SIZE + length)
                        if largest is None or last[1] - last[0] > largest[1] - largest[0]:
                            largest = last
            samples = [mm[a:b] for a, b in dict.fromkeys(x for x in (largest, last) if x)]
    if not samples:
        return UNSAMPLED_EXPANSION if updates else 1.0
    ratios = []
    for frame_bytes in samples:
        rec = read_frame(memoryview(frame_bytes), 0)
        try:
            decoded = -1 if isinstance(rec, BadFrame) else decode_updates(rec.payload).nbytes
        except ValueError:
            decoded = -1
        payload = len(frame_bytes) - HEADER_SIZE
        ratios.append(UNSAMPLED_EXPANSION if decoded < 0 else float(decoded) / max(1, payload))
    return max(1.0, *ratios)


def finished_segments(wal_dir: Path) -> list[SegmentFile]:
    return [s for s in list_segments(wal_dir) if s.finished]


def finished_sizes(wal_dir: Path, after: int = 0) -> list[tuple[int, int]]:
    """``(seq, bytes)`` of each finished segment after ``after`` (file sizes only; segments
    deleted meanwhile are skipped)."""
    out = []
    for seg in finished_segments(wal_dir):
        if seg.seq > after:
            try:
                out.append((seg.seq, seg.path.stat().st_size))
            except FileNotFoundError:
                continue
    return out


def backlog(wal_dir: Path, converted_through: int) -> tuple[int, int]:
    """``(segments, bytes)`` of the finished segments after ``converted_through``: what the
    compacter has yet to convert (:func:`finished_sizes`)."""
    sizes = finished_sizes(wal_dir, converted_through)
    return len(sizes), sum(n for _, n in sizes)


@dataclass(frozen=True)
class SegmentSpan:
    """A finished WAL segment's sequence number, path and frontiers: what a conversion is
    planned over (lamina.trace.plan)."""

    seq: int
    path: str
    lower: int
    upper: int
    since: int
    bytes: int
    expansion: float = 1.0
    """Bytes its updates take decoded, per byte of the file: 1 for a segment of
    uncompressed records (format version 1), sampled for one whose records may be
    compressed (:func:`sampled_expansion`). Conversions size their tasks by
    :attr:`decoded_bytes`: a decode task holds its share decoded."""

    @property
    def decoded_bytes(self) -> int:
        """About how many bytes the segment's updates take decoded."""
        return round(self.bytes * self.expansion)


def segment_spans(wal_dir: Path, relation: str, *, after: int = 0,
                  known: Mapping[int, SegmentSpan] | None = None) -> Iterator[SegmentSpan]:
    """The finished segments numbered ``after + 1, after + 2, ...`` in order, up to the
    first gap (a missing or still open segment), lazily: the caller stops when it has
    enough. Frontiers come from frame headers only (:func:`read_frontiers`); the payloads
    are verified by whoever decodes them. ``known`` spans are reused instead of re-read
    (finished segments never change)."""
    expected = after + 1
    for seg in finished_segments(wal_dir):
        if seg.seq <= after:
            continue
        if seg.seq != expected:
            return
        span = (known or {}).get(seg.seq)
        if span is None:
            scan = read_frontiers(seg, relation)
            span = SegmentSpan(seq=seg.seq, path=str(seg.path), lower=scan.lower,
                               upper=scan.upper, since=scan.since, bytes=scan.valid_end,
                               expansion=(1.0 if scan.version < 2 else
                                          sampled_expansion(seg.path, relation, seg.seq)))
        yield span
        expected += 1
