"""Deleting WAL segments once the trace holds them.

Only the trace knows which segments are converted (its published state's
``converted_through``); only the WAL knows which segment must stay to keep the relation's
frontiers. :func:`delete_converted` is called after the state that converted them is
durable (docs/architecture.md, "Data files before state, inputs deleted after").

Invariant kept: the newest finished segment is never deleted while no later segment records
the frontiers by itself. After a crash between finishing a segment and opening the next one
(or in the middle of writing the next one's opening records) the writer recovers the
relation's upper and since from it, and readers take them from it.
"""

from __future__ import annotations

from pathlib import Path

from lamina import failpoints
from lamina.errors import CorruptionError
from lamina.fs import FileSystem
from lamina.wal.segment import SegmentFile, list_segments, scan_file, segment_name


def delete_converted(wal_dir: Path, relation: str, converted_through: int,
                     fs: FileSystem) -> int:
    """Delete the finished segments numbered up to ``converted_through`` (but see the
    module's invariant), then sync the directory once. Returns how many were deleted."""
    deleted = 0
    for seq in deletable(wal_dir, relation, converted_through):
        if deleted:
            failpoints.hit("trace.mid_segment_delete")
        fs.unlink(wal_dir / segment_name(seq, finished=True), sync_dir=False)
        deleted += 1
    if deleted:
        fs.fsync_dir(wal_dir)
    return deleted


def deletable(wal_dir: Path, relation: str, converted_through: int) -> list[int]:
    """The sequence numbers :func:`delete_converted` would delete."""
    segments = list_segments(wal_dir)
    converted = [s for s in segments if s.finished and s.seq <= converted_through]
    if converted and not _frontiers_after(segments, converted[-1].seq, relation):
        converted.pop()
    return [s.seq for s in converted]


def _frontiers_after(segments: list[SegmentFile], seq: int, relation: str) -> bool:
    """Whether a segment after ``seq`` records the relation's frontiers by itself: a
    finished one, or an open one whose opening records (PROGRESS lower, SINCE since) are
    in place. When in doubt (the file vanished or fails its scan) the answer is no."""
    later = [s for s in segments if s.seq > seq]
    if not later:
        return False
    if any(s.finished for s in later):
        return True
    try:
        scan, _ = scan_file(later[0], relation)
    except (FileNotFoundError, CorruptionError):
        return False
    return len(scan.records) >= 2
