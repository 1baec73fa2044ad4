"""Reading a relation's log without being its writer.

Used by readers (snapshots, ``lamina status``), by the compacter (which finds finished
segments and converts them) and by ``lamina verify``. Nothing here writes: a torn tail of
the open segment is skipped, never cut (cutting it is the writer's recovery).

A reader races the writer (which renames the open segment when it finishes it) and the
compacter (which deletes converted segments). Functions here raise FileNotFoundError when
a file vanished under them; callers retry from a fresh listing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from lamina.errors import CorruptionError
from lamina.wal.record import RecordType, corrupt, decode_updates
from lamina.wal.segment import Scan, SegmentFile, list_segments, scan_file

_RETRIES = 20


def frontiers(wal_dir: Path, relation: str) -> tuple[int, int]:
    """``(upper, since)`` of the relation, read from its newest segment."""
    for _ in range(_RETRIES):
        segments = list_segments(wal_dir)
        if not segments:
            if not wal_dir.exists():
                raise FileNotFoundError(wal_dir)
            raise CorruptionError(f"relation {relation!r} has no WAL segments", path=wal_dir)
        try:
            scan, _ = scan_file(segments[-1], relation)
        except FileNotFoundError:
            continue
        if len(scan.records) < 2 and not segments[-1].finished:
            # an open segment being created (or with a torn opening): its predecessor knows
            if len(segments) < 2:
                return 0, 0
            try:
                scan, _ = scan_file(segments[-2], relation)
            except FileNotFoundError:
                continue
        return scan.upper, scan.since
    raise CorruptionError(f"relation {relation!r}: segments kept changing while reading "
                          "frontiers", path=wal_dir)


def updates_of(scan: Scan, schema: pa.Schema) -> Iterator[pa.Table]:
    """The update tables of a scanned segment, each checked against ``schema``."""
    for rec in scan.records:
        if rec.rtype is not RecordType.UPDATES:
            continue
        try:
            table = decode_updates(rec.payload)
        except ValueError as exc:
            raise corrupt(scan.path, rec.offset, str(exc)) from exc
        if not table.schema.equals(schema):
            raise corrupt(scan.path, rec.offset, f"update record schema {table.schema} does "
                                                 "not match the relation")
        yield table


def segment_updates(seg: SegmentFile, relation: str, schema: pa.Schema) -> list[pa.Table]:
    """Decode every update record of one segment file."""
    scan, _ = scan_file(seg, relation)
    return list(updates_of(scan, schema))


def finished_segments(wal_dir: Path) -> list[SegmentFile]:
    return [s for s in list_segments(wal_dir) if s.finished]
