"""Staged WAL segments: copies of finished segments in the trace store, for decode tasks
on machines that cannot read the daemon's disk (a Spark cluster with no shared directory).

The WAL stays on the daemon's machine: its latency is an fdatasync there, and only the
daemon reads it. When a conversion runs on executors elsewhere, the driver first copies
each finished segment of the step to ``staging/<seq:020d>.wal`` in the relation's trace
(:meth:`lamina.layout.TraceLayout.staged_segment`) and the work items name that key
(:attr:`lamina.wal.ranges.SegmentRange.staged`): decode tasks read their byte ranges with
ranged gets and verify them exactly as they verify the file (every frame's CRC32C, the
segment header, the planned frontiers), so a damaged or short copy is a
``CorruptionError``, never wrong data.

A finished segment never changes, so staging is a plain put: a re-stage after a crash
or a retry writes the same bytes, and speculative tasks read identical ones. Staged
copies follow crash-safety rule 3 like the segments: they are deleted only after the
state that converted them is published (:func:`retire_staged`, called with the deletion
of the converted segments, again at recovery, so a crash in between leaves nothing
behind for long), and a dropped relation's trace goes with its staging.
"""

from __future__ import annotations

from lamina.layout import TraceLayout
from lamina.objstore.base import ObjectStore
from lamina.wal.reader import SegmentSpan

_COPY_BLOCK = 8 << 20


def stage(store: ObjectStore, span: SegmentSpan) -> str:
    """Copy the finished segment of ``span`` into the trace store; its key."""
    key = TraceLayout.staged_segment(span.seq)
    with open(span.path, "rb") as src, store.writer(key) as out:
        while block := src.read(_COPY_BLOCK):
            out.write(block)
    return key


def retire_staged(store: ObjectStore, converted_through: int) -> int:
    """Delete staged copies of segments up to ``converted_through`` (call only once a
    published state says so); how many were deleted."""
    deleted = 0
    for obj in store.list(TraceLayout.STAGING):
        stem = obj.key.rsplit("/", 1)[-1].partition(".")[0]
        if stem.isdigit() and int(stem) <= converted_through:
            store.delete(obj.key)
            deleted += 1
    return deleted
