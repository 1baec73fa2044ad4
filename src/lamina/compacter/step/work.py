"""Work items: how a step's inputs are cut into the decode tasks' shares.

The driver never reads data (the compacter's pipeline samples two records of each WAL
segment whose records may be compressed when it lists it,
:func:`lamina.wal.reader.sampled_expansion`). It cuts the inputs
into work items: WAL segments into record-aligned byte ranges
(:func:`lamina.wal.ranges.segment_ranges`, which walks the frame headers only when a
segment is bigger than a task's share), and Parquet parts (consumed pending parts, merge
parents) whole. Each item has a *weight*, the bytes it stands for decoded (a compressed
segment's bytes times its sampled expansion, a Parquet part's compressed bytes
:data:`PARQUET_EXPANSION` times), and
:func:`pack` groups consecutive items into task groups by weight. A group is never empty,
except the one group of a step with no input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lamina.compacter.step.runs import ScratchCompression
from lamina.trace.batch import PartFile
from lamina.wal.ranges import SegmentRange
from lamina.wal.reader import SegmentSpan

PARQUET_EXPANSION = 4
"""Parquet parts are compressed; their bytes count this many times when sizing tasks."""


@dataclass(frozen=True)
class JobTuning:
    """How a step is cut into tasks. Defaults suit a laptop and small clusters."""

    single_task_bytes: int = 8 << 20
    """Inputs up to this size run as one task with no shuffle. Like every size here, in
    bytes decoded (:func:`input_bytes`)."""
    split_bytes: int = 32 << 20
    """Largest input share of one decode task, decoded (a WAL segment is split beyond
    it)."""
    min_split_bytes: int = 1 << 20
    """Smallest input share of one decode task."""
    part_bytes: int = 32 << 20
    """Input bytes (decoded) per written part: the number of write partitions is the
    input over this."""
    max_parts: int = 256
    """At most this many write partitions (parts of one batch)."""
    chunk_rows: int = 1 << 18
    """Rows a write task sorts and consolidates at a time (written as Parquet row groups of
    ``lamina.trace.batch.ROW_GROUP_ROWS`` rows, with statistics, for key lookups)."""
    run_compression: ScratchCompression = "auto"
    """The codec of the decode tasks' scratch runs (the daemon's ``scratch_compression``;
    ``auto`` is resolved per step: :func:`lamina.compacter.step.runs.run_codec`)."""


DEFAULT_TUNING = JobTuning()


@dataclass(frozen=True)
class WalRange:
    """A record-aligned byte range of a finished segment, read by one task."""

    range: SegmentRange

    @property
    def weight(self) -> int:
        return self.range.decoded_bytes


@dataclass(frozen=True)
class PartInput:
    """A Parquet part (pending part or batch part) read whole by one task."""

    part: PartFile

    @property
    def weight(self) -> int:
        return self.part.bytes * PARQUET_EXPANSION


WorkItem = WalRange | PartInput


def input_bytes(segments: Sequence[SegmentSpan], parts: Sequence[PartFile]) -> int:
    """What a step reads, as it is sized: WAL bytes decoded (a compressed segment's bytes
    times its sampled expansion), and Parquet bytes :data:`PARQUET_EXPANSION` times (a
    step of at most ``single_task_bytes`` is small)."""
    return (sum(s.decoded_bytes for s in segments)
            + sum(p.bytes for p in parts) * PARQUET_EXPANSION)


def pack(items: Sequence[WorkItem], target: int) -> list[tuple[WorkItem, ...]]:
    """Group consecutive items into tasks of about ``target`` weight (at least one each)."""
    groups: list[tuple[WorkItem, ...]] = []
    current: list[WorkItem] = []
    weight = 0
    for item in items:
        if current and weight + item.weight > target:
            groups.append(tuple(current))
            current, weight = [], 0
        current.append(item)
        weight += item.weight
    if current or not groups:
        groups.append(tuple(current))
    return groups
