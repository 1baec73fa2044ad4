"""Record-aligned byte ranges of finished segments: how a conversion's WAL input is cut
into work items and how each item is read.

A finished segment never changes (lamina.wal.segment), so it can be cut once, by whoever
plans the work, and its pieces read independently, by whoever does it (the Spark decode
tasks, :mod:`lamina.compacter.step.decode`). Cutting (:func:`segment_ranges`) walks only
the 9-byte frame headers, through a read-only mmap, and only when the segment is bigger
than the target; the first range starts after the segment header, every range starts at a
record's frame, and the ranges are contiguous and end at the file's end.

A range is read from the segment file, or, on a cluster whose workers cannot see the
daemon's disk, from the segment's staged copy in the trace store (``staged``: its key,
:mod:`lamina.trace.staging`) by ranged gets; the bytes and the checks are the same.

Reading a range (:func:`range_updates`) verifies what it reads the way the readers do:
every frame's CRC32C, the segment header for the first range (which must be exactly the
one the relation and sequence number produce, in a format version this lamina reads), the
first record being PROGRESS(lower) and the last PROGRESS(upper) of the planned span, each
update record's schema; compressed update records are decompressed as the readers do
(:func:`lamina.wal.record.decode_updates`). Damage raises CorruptionError naming the file
and the byte offset.
"""

from __future__ import annotations

import itertools
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from lamina.wal.reader import SegmentSpan, checked_updates
from lamina.wal.record import (
    HEADER_SIZE,
    BadFrame,
    RecordType,
    corrupt,
    decode_frontier,
    frame_headers,
    read_frame,
)
from lamina.wal.segment import READ_VERSIONS, encode_header

if TYPE_CHECKING:
    from lamina.objstore.base import ObjectStore


@dataclass(frozen=True)
class SegmentRange:
    """Records ``[start, end)`` (byte offsets, record-aligned) of a finished segment.
    ``first``: the range starts the segment (after its header); ``last``: it ends it;
    ``lower`` and ``upper`` are the segment's frontiers, as planned."""

    path: str
    seq: int
    start: int
    end: int
    first: bool
    last: bool
    lower: int
    upper: int
    staged: str | None = None
    """The key of the segment's staged copy in the trace store, read instead of ``path``."""
    expansion: float = 1.0
    """The segment's :attr:`~lamina.wal.reader.SegmentSpan.expansion`."""

    @property
    def bytes(self) -> int:
        return self.end - self.start

    @property
    def decoded_bytes(self) -> int:
        """About how many bytes the range's updates take decoded."""
        return round(self.bytes * self.expansion)


def segment_ranges(span: SegmentSpan, relation: str, target: int) -> list[SegmentRange]:
    """Cut a finished segment into record-aligned byte ranges of about ``target`` bytes
    decoded (file bytes times the span's ``expansion``: a compressed segment is cut
    into more ranges than an uncompressed one of its size).

    No cut leaves less than a quarter of ``target`` after it: the last range takes a short
    tail (a segment's closing PROGRESS record alone, or its last few records) instead of
    becoming a work item of its own, which :func:`lamina.compacter.step.work.pack` would
    have made a task of its own, a Spark task that decodes nothing (6 of the 21 decode
    tasks of the 10M-update conversion before; docs/performance.md).

    Only frame headers are read (through a read-only mmap); checksums are verified by
    :func:`range_updates`. A frame whose length runs past the end of the file stops the
    walk: the rest of the file becomes the last range, and reading it reports the damage
    with its offset."""
    path = Path(span.path)
    start = len(encode_header(relation, span.seq))
    size = path.stat().st_size
    target = max(1, int(target / span.expansion))  # in file bytes
    cuts = [start]
    if size - start > target:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for off, _, length in frame_headers(mm, start, size):
                end = off + HEADER_SIZE + length
                if end - cuts[-1] >= target and size - end >= max(target // 4, 1):
                    cuts.append(end)
    cuts.append(max(size, start))
    return [SegmentRange(path=str(path), seq=span.seq, start=a, end=b, first=i == 0,
                         last=i == len(cuts) - 2, lower=span.lower, upper=span.upper,
                         expansion=span.expansion)
            for i, (a, b) in enumerate(itertools.pairwise(cuts))]


def pread_exact(fd: int, size: int, offset: int) -> bytes:
    """``size`` bytes of ``fd`` from ``offset``, fewer only at the end of the file."""
    chunks: list[bytes] = []
    while size > 0:
        chunk = os.pread(fd, size, offset)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _read_range(item: SegmentRange, relation: str, store: ObjectStore | None
                ) -> tuple[Path | str, bytes]:
    """Where the range is read from (for messages) and its bytes, the header checked."""
    # a header of every version has this length (they differ in the version field alone)
    expected = encode_header(relation, item.seq) if item.first else b""
    if item.staged is not None:
        if store is None:
            raise ValueError(f"range of staged segment {item.staged!r} read without a store")
        where: Path | str = store.location(item.staged)
        header = store.get_range(item.staged, 0, len(expected))
        data = store.get_range(item.staged, item.start, item.end)
    else:
        where = Path(item.path)
        with where.open("rb") as f:
            header = pread_exact(f.fileno(), len(expected), 0)
            data = pread_exact(f.fileno(), item.end - item.start, item.start)
    if item.first and header not in {encode_header(relation, item.seq, version)
                                     for version in READ_VERSIONS}:
        raise corrupt(where, 0, f"segment header is damaged or does not name relation "
                                f"{relation!r} and sequence {item.seq}")
    return where, data


def range_updates(item: SegmentRange, relation: str, schema: pa.Schema,
                  store: ObjectStore | None = None) -> Iterator[pa.Table]:
    """Verify and decode the records of one range of a finished segment: its update
    tables, in order (``store``: the trace store holding a staged copy, if any)."""
    path, data = _read_range(item, relation, store)
    if len(data) != item.end - item.start:
        raise corrupt(path, item.start + len(data), "finished segment is shorter than when the "
                                                    "step was planned")
    buf = memoryview(data)
    off = 0
    last: tuple[RecordType, int, int] | None = None  # type, value, offset of the last record
    while off < len(buf):
        rec = read_frame(buf, off)
        at = item.start + off
        if isinstance(rec, BadFrame):
            raise corrupt(path, at, f"{rec.reason} in a finished segment")
        value = -1
        if rec.rtype is RecordType.UPDATES:
            if item.first and off == 0:
                raise corrupt(path, at, "segment starts with an UPDATES record, expected "
                                        "PROGRESS")
            yield checked_updates(rec.payload, path, at, schema)
        else:
            try:
                value = decode_frontier(rec.payload)
            except ValueError as exc:
                raise corrupt(path, at, str(exc)) from exc
            if item.first and off == 0 and (rec.rtype is not RecordType.PROGRESS
                                            or value != item.lower):
                raise corrupt(path, at, f"segment starts with {rec.rtype.name} {value}, the "
                                        f"plan expects PROGRESS {item.lower}")
        last = (rec.rtype, value, at)
        off = rec.end
    if item.last:
        if last is None and item.first:
            raise corrupt(path, item.start, "finished segment holds no records")
        if last is None or last[0] is not RecordType.PROGRESS or last[1] != item.upper:
            raise corrupt(path, last[2] if last else item.start,
                          f"finished segment does not end with PROGRESS {item.upper} as "
                          "planned")
