"""Deleting WAL segments once the trace holds them.

Only the trace knows which segments are converted (its published state's
``converted_through``); only the WAL knows which segment must stay to keep the relation's
frontiers. :func:`delete_converted` is called after the state that converted them is
durable (docs/architecture.md, "Data files before state, inputs deleted after").

Invariant kept: only the converted segments of the relation whose trace converted them are
deleted. Segments are named by sequence number within a relation's directory, and a
relation dropped and created again under its name (``lamina ingest --resync`` does that)
starts again at 1: the caller names the ``relation_id`` its trace belongs to, and nothing
is deleted unless the directory's ``relation.json`` names the same one
(:class:`~lamina.errors.RelationReplacedError` otherwise). The check and the deletions are
not atomic: a drop and a re-creation in the instants between them are not caught here.

Invariant kept: the newest finished segment is never deleted while no later segment records
the frontiers by itself. After a crash between finishing a segment and opening the next one
(or in the middle of writing the next one's opening records) the writer recovers the
relation's upper and since from it, and readers take them from it.
"""

from __future__ import annotations

from pathlib import Path

from lamina import failpoints
from lamina.errors import CorruptionError, RelationReplacedError
from lamina.fs import FileSystem
from lamina.layout import META_NAME
from lamina.schema import RelationMeta
from lamina.wal.segment import SegmentFile, list_segments, scan_file, segment_name


def delete_converted(wal_dir: Path, relation: str, relation_id: str, converted_through: int,
                     fs: FileSystem) -> int:
    """Delete the finished segments numbered up to ``converted_through`` of the relation
    ``relation_id`` (but see the module's invariants), then sync the directory once.
    Returns how many were deleted; raises RelationReplacedError when the directory holds
    another relation, or none."""
    check_identity(wal_dir, relation, relation_id)
    deleted = 0
    for seq in deletable(wal_dir, relation, converted_through):
        if deleted:
            failpoints.hit("trace.mid_segment_delete")
        fs.unlink(wal_dir / segment_name(seq, finished=True), sync_dir=False)
        deleted += 1
    if deleted:
        fs.fsync_dir(wal_dir)
    return deleted


def check_identity(wal_dir: Path, relation: str, relation_id: str) -> None:
    """Raise RelationReplacedError unless ``wal_dir`` holds the relation ``relation_id``."""
    path = wal_dir / META_NAME
    try:
        current = RelationMeta.from_json(path.read_bytes(), path).relation_id
    except FileNotFoundError as exc:
        raise RelationReplacedError(f"relation {relation!r} was dropped: {wal_dir} holds no "
                                    f"{META_NAME}") from exc
    if current != relation_id:
        raise RelationReplacedError(
            f"relation {relation!r} was dropped and created again (relation_id {current}, "
            f"not {relation_id}): the segments in {wal_dir} are the new relation's")


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
