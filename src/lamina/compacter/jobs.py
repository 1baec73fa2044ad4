"""Conversion and merge steps as Spark jobs: the production executor of trace plans.

:func:`spark_convert` and :func:`spark_merge` carry out a
:class:`~lamina.trace.plan.ConversionPlan` / :class:`~lamina.trace.plan.MergePlan` and
return the written files; the caller commits them (``Trace.commit_conversion`` /
``Trace.commit_merge``). For the same plan and inputs the output is identical, row for row
and in order, to the in-process reference executor :mod:`lamina.trace.reference`; the
tests compare the two.

Spark schedules the tasks, retries them, places them on executors and cancels them; the
rows never enter the JVM. A step is two Spark jobs of Python tasks (``mapInArrow`` over
``spark.range(n, numPartitions=n)``, one task per id, only metadata collected), and the
decode tasks hand the write tasks their rows as Arrow files in the trace directory, which
every executor sees already (tasks read WAL segments and write parts there)::

    job 1: G decode tasks     read and verify inputs, forward, split off future rows,
                              order by prefix, write runs, return metadata (with the
                              number of updates decoded) and a sample
    driver                    cut the sampled keys into chunks, chunks into P parts
    job 2: P + B write tasks  per part: every run's rows of each chunk, sorted,
                              consolidated, written; per bucket group: pending files

A step whose input is at most ``JobTuning.single_task_bytes`` runs as one task that does
all of it in memory (job 1 only, no runs), which is what keeps the common small
conversion cheap. Either way the tasks report how many updates they decoded
(:attr:`StepOutput.input_rows`, the conversions' ``lamina_job_input_rows_total``): decode
tasks in their metadata, a single task in a tally row next to its parts' rows. Only the
attempts whose output the driver collects are counted, so a retried task counts once.

Why not Spark's shuffle and sort: measured on 10M updates (docs/performance.md), the
JVM's share of the former design (``repartitionByRange`` + ``sortWithinPartitions`` between
two ``mapInArrow`` stages) was most of the step: Arrow-to-UnsafeRow conversion, a sampling
pass that decoded the input twice, TimSort with full-row comparisons on prefix ties, and
UnsafeRow-to-Arrow conversion back; the step ran at 0.30 of DuckDB's throughput. Arrow's
own sort, adaptive to presorted runs, and neighbour-comparison consolidation on sorted
rows do the same work in a fraction of the CPU time.

*Decode.* The driver never reads data. It cuts the inputs into work items: WAL segments
into byte ranges of whole records (it walks the 9-byte frame headers through a read-only
mmap, only when a segment is bigger than a task's share), and Parquet parts (consumed
pending parts, merge parents) whole. Items are packed into G task groups by size. A decode
task verifies what it reads the way the readers do: every frame's CRC32C, the segment
header (which must be exactly the one the relation and sequence number produce), the first
record being PROGRESS(lower) and the last PROGRESS(upper) of the planned span, each update
record's schema; Parquet parts through :func:`lamina.trace.batch.read_part` (size, CRC32C,
row count). Then (:func:`prepare`) rows at or past the plan's upper become future rows,
with the column ``_bucket``, the lower end of their pending bucket
(:func:`lamina.trace.pending.bucket_of`, vectorized); the other rows' times below
``since`` are forwarded to it; both get the column ``_prefix``, an int64 non-decreasing in
the first sort column (:func:`order_prefix`). The task orders its batch rows by prefix and
its future rows by bucket (stable numpy sorts), writes each as one record batch of an Arrow
IPC file (a *run*) under ``batches/<batch id>.scratch/``, and returns where they are, the
future rows' bucket ranges, how many updates it decoded, and every ``chunk_rows / 32``-th
batch row's key (the sample; more often in a small step, so that every part it will write
has 32 sampled keys).

*Cuts.* The order of a batch is (key columns, other columns, time) ascending with nulls
first (NaN right after the nulls), as :func:`lamina.consolidate.sort`. The driver sorts the
sampled keys and cuts them into C chunks of about ``chunk_rows`` rows (at least P), and
the chunks into P consecutive groups, the parts; P is sized from the input bytes
(``JobTuning.part_bytes``). A cut is a full key: chunk ``j`` holds the rows above cut
``j - 1`` and at or below cut ``j``, so rows equal in (row, time) always share a chunk and
concatenating the parts in order gives the globally sorted batch.

*Write.* A part's task memory-maps every run and, for each cut, finds the run's rows on
either side: a numpy binary search on the prefix, then a vectorized comparison of the full
key for the rows sharing the cut's prefix (:func:`at_or_below`). Chunk by chunk it
concatenates the runs' slices, sorts them (numpy on the prefix, which merges the presorted
slices, then Arrow's multi-key sort, which is nearly linear on such input), consolidates
them (:func:`consolidate_sorted`: runs of equal neighbours summed, exact int64 sums, the
reference's own :func:`lamina.consolidate.consolidate_updates` where that cannot be
proven) and appends them to ``TraceLayout.batch_part(batch_id, part index)`` through
:func:`lamina.trace.batch.write_part` (temp file, fsync, rename, directory fsync). Bucket
tasks do the same for groups of pending buckets, one fresh pending file per bucket (a
bucket never straddles tasks). Empty parts are not written. A part's task decompresses
every run's record batches that overlap the part's key range, so its memory is about its
part's rows: the decode tasks cut their runs into batches of about a quarter of what a run
holds for one part (:func:`run_batch_rows`), which bounds the excess to about half the
part however many runs the step has (batches keep at least ``MIN_RUN_BATCH_ROWS`` rows, so
for runs too short for that the excess is at most two such batches per run). Per decode
task, memory is its input share.

*Retries and cleanup.* Run files are written to a temp name and renamed, and named by
group, so a retried or speculative decode task rewrites the same run with the same rows. A
retried write task rewrites the same batch part path (same content) and new pending files
(the lost attempt's are unnamed garbage). The driver deletes the scratch directory when
the step ends, whether it succeeded or not; one left by a crashed driver holds no file a
state names and is collected like any garbage.

*Errors.* A lamina error raised in a task travels to the driver as a typed record
(:class:`TaskError`: format version, class name, message, path and byte offset), JSON in
base64 between markers in the task's exception text, the only thing Spark carries back.
The driver rebuilds the error from the record's fields (:meth:`TaskError.rebuild`):
CorruptionError as itself (it quarantines the relation), a cancel as JobCancelledError,
anything else as JobError naming relation, step and the task's error class (retried).
Everything else Spark or Py4J reports becomes JobError with its root cause. A cancelled
job raises :class:`lamina.errors.JobCancelledError`; each of a step's jobs checks for a
cancel first. The in-process executor (:mod:`lamina.compacter.inprocess`) maps its errors
through the same record, so both executors fail alike.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import math
import mmap
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lamina.consolidate import (
    INT64_MAX,
    INT64_MIN,
    consolidate_updates,
    forward,
    sum_adjacent,
)
from lamina.errors import (
    CorruptionError,
    JobCancelledError,
    JobError,
    LaminaError,
)
from lamina.frontier import MAX_TIME
from lamina.fs import FileSystem
from lamina.layout import TraceLayout
from lamina.schema import TIME, RelationMeta
from lamina.trace.batch import PartFile, read_part, write_part
from lamina.trace.pending import bucket_of
from lamina.trace.plan import ConversionPlan, MergePlan
from lamina.trace.reference import pending_path
from lamina.trace.state import PendingPart
from lamina.trace.trace import Trace
from lamina.wal.reader import SegmentSpan
from lamina.wal.record import (
    HEADER,
    HEADER_SIZE,
    MAX_PAYLOAD,
    BadFrame,
    RecordType,
    corrupt,
    decode_frontier,
    decode_updates,
    encode_updates,
    read_frame,
)
from lamina.wal.segment import encode_header

BUCKET = "__lamina_bucket"
"""Run column of future rows: the lower end of the row's pending bucket (uint64).
(:func:`aux_columns` renames it away from any row column.)"""
PREFIX = "__lamina_prefix"
"""Run column: an int64 that orders like the first sort column (see :func:`order_prefix`).
It leads every ordering, so sorting and searching runs is mostly integer work."""

TIME_SHIFT = 1 << 63
"""Bucket lows (uint64) travel to the driver in a Spark bigint column, shifted by this."""
_TASK_MARK = "LAMINA-TASK-ERROR<"
_TASK_MARK_RE = re.compile(r"LAMINA-TASK-ERROR<([A-Za-z0-9+/=]+)>")
PARQUET_EXPANSION = 4
"""Parquet parts are compressed; their bytes count this many times when sizing tasks."""
SAMPLES_PER_CHUNK = 32
"""Decode tasks sample every ``chunk_rows / SAMPLES_PER_CHUNK``-th row for the cuts, and
at least this many rows per part the step will write."""


@dataclass(frozen=True)
class JobTuning:
    """How a step is cut into tasks. Defaults suit a laptop and small clusters."""

    single_task_bytes: int = 8 << 20
    """Inputs up to this size run as one task with no shuffle."""
    split_bytes: int = 32 << 20
    """Largest input share of one decode task (a WAL segment is split beyond it)."""
    min_split_bytes: int = 1 << 20
    """Smallest input share of one decode task."""
    part_bytes: int = 32 << 20
    """Input bytes per written part: the number of write partitions is the input over this."""
    max_parts: int = 256
    """At most this many write partitions (parts of one batch)."""
    chunk_rows: int = 1 << 18
    """Rows a write task sorts and consolidates at a time (written as Parquet row groups of
    ``lamina.trace.batch.ROW_GROUP_ROWS`` rows, with statistics, for key lookups)."""


DEFAULT_TUNING = JobTuning()


# --- work items ----------------------------------------------------------------------------

@dataclass(frozen=True)
class WalRange:
    """Records ``[start, end)`` (byte offsets, record-aligned) of a finished segment."""

    path: str
    seq: int
    start: int
    end: int
    first: bool
    last: bool
    lower: int
    upper: int

    @property
    def weight(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class PartInput:
    """A Parquet part (pending part or batch part) read whole by one task."""

    part: PartFile

    @property
    def weight(self) -> int:
        return self.part.bytes * PARQUET_EXPANSION


WorkItem = WalRange | PartInput


def segment_ranges(span: SegmentSpan, relation: str, target: int) -> list[WalRange]:
    """Cut a finished segment into record-aligned byte ranges of about ``target`` bytes.

    Only frame headers are read (through a read-only mmap); checksums are verified by the
    tasks. A frame whose length runs past the end of the file stops the walk: the rest of
    the file becomes the last range, and the task reading it reports the damage with its
    offset."""
    path = Path(span.path)
    start = len(encode_header(relation, span.seq))
    size = path.stat().st_size
    cuts = [start]
    if size - start > target:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            off = start
            while off + HEADER_SIZE <= size:
                length, _, _ = HEADER.unpack_from(mm, off)
                end = off + HEADER_SIZE + length
                if length > MAX_PAYLOAD or end > size:
                    break
                off = end
                if off - cuts[-1] >= target and off < size:
                    cuts.append(off)
    cuts.append(max(size, start))
    return [WalRange(path=str(path), seq=span.seq, start=a, end=b, first=i == 0,
                     last=i == len(cuts) - 2, lower=span.lower, upper=span.upper)
            for i, (a, b) in enumerate(itertools.pairwise(cuts))]


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


# --- bucket mapping (vectorized, shared by tasks and tests) ------------------------------------

def bucket_lows(times: pa.Array | pa.ChunkedArray, upper: int) -> pa.Array | pa.ChunkedArray:
    """``bucket_of(t, upper)[0]`` for every ``t >= upper`` (uint64 in, uint64 out): the
    highest bit ``k`` where ``t`` and ``upper`` differ, found by binary search, then ``t``
    with its bits below ``k`` cleared (``t == upper`` gives ``k = 0``, i.e. ``t``)."""
    x = pc.bit_wise_xor(times, pa.scalar(upper, pa.uint64()))
    k: Any = pa.scalar(0, pa.uint64())
    for s in (32, 16, 8, 4, 2, 1):
        shifted = pc.shift_right(x, pa.scalar(s, pa.uint64()))
        moved = pc.not_equal(shifted, pa.scalar(0, pa.uint64()))
        x = pc.if_else(moved, shifted, x)
        k = pc.add(k, pc.if_else(moved, pa.scalar(s, pa.uint64()), pa.scalar(0, pa.uint64())))
    return pc.shift_left(pc.shift_right(times, k), k)


def _view(array: pa.Array, type_: pa.DataType) -> pa.Array:
    """The 8-byte values of ``array`` (float64 or fixed_size_binary(8)) read as ``type_``."""
    return pa.Array.from_buffers(type_, len(array), [None, array.buffers()[1]],
                                 offset=array.offset)


def order_prefix(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """An int64 per value, non-decreasing in the batch order of the column (nulls first,
    then NaN, then values; -0.0 equals 0.0): null is INT64_MIN; integers, dates,
    timestamps and bools are their value; floats and decimals (as float64, which rounds
    monotonically) map their IEEE bits order-preservingly, NaN to INT64_MIN + 1; strings
    and binaries are their first 7 bytes, big-endian. Ties are broken by the full sort
    keys, so only the monotony matters."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    t = column.type
    nulls = pc.is_null(column)
    if pa.types.is_integer(t) or pa.types.is_date(t) or pa.types.is_timestamp(t) \
            or pa.types.is_boolean(t):
        if pa.types.is_date(t) or pa.types.is_timestamp(t):
            column = column.view(pa.int32() if t == pa.date32() else pa.int64())
        values = pc.cast(column, pa.int64())
    elif pa.types.is_floating(t) or pa.types.is_decimal(t):
        x = pc.fill_null(pc.cast(column, pa.float64()), 0.0)
        x = pc.if_else(pc.equal(x, 0.0), 0.0, x)  # -0.0 is 0.0; NaN is handled below
        bits = _view(x, pa.int64())
        flipped = pc.bit_wise_xor(bits, pa.scalar(INT64_MAX, pa.int64()))
        values = pc.if_else(pc.less(bits, 0), flipped, bits)
        values = pc.if_else(pc.fill_null(pc.is_nan(x), False),
                            pa.scalar(INT64_MIN + 1, pa.int64()), values)
    elif t in (pa.string(), pa.binary(), pa.large_string(), pa.large_binary()):
        raw = pc.fill_null(column.cast(pa.binary()), b"")
        head = pc.binary_slice(raw, 0, 7)
        padded = pc.binary_join_element_wise(pa.scalar(b"\0", pa.binary()), head,
                                             pa.scalar(b"\0" * 7, pa.binary()), b"")
        eight = pc.binary_reverse(pc.binary_slice(padded, 0, 8)).cast(pa.binary(8))
        values = pc.cast(_view(eight, pa.uint64()), pa.int64())
    else:  # pragma: no cover - schema.py admits no other type
        values = pa.nulls(len(column), pa.int64())
        nulls = pc.is_valid(column)
    return pc.if_else(nulls, pa.scalar(INT64_MIN, pa.int64()), values)


# --- task context (pickled into the tasks) ------------------------------------------------------

@dataclass(frozen=True)
class StepContext:
    """Everything a task of one step needs besides its own work item."""

    trace_dir: str
    relation: str
    update_schema: pa.Schema
    row_columns: tuple[str, ...]
    sort_columns: tuple[str, ...]
    prefix: str
    """Name of the prefix column of run tables (distinct from every row column)."""
    bucket: str
    """Name of the bucket column of future run tables (likewise)."""
    since: int
    upper: int | None
    """Split point of a conversion; None for a merge (every row belongs to the batch)."""
    batch_id: str
    context: str
    scratch: str
    """Directory of the step's runs, relative to the trace directory."""
    sample_every: int
    """A decode task samples every ``sample_every``-th batch row for the cuts..."""
    min_samples: int
    """...but at least this many rows (when it has them), so that a small step still has
    enough sampled keys for its parts."""
    parts: int
    """The most batch parts the step writes (sizes the record batches of runs)."""
    groups: tuple[tuple[WorkItem, ...], ...]

    @property
    def sort_keys(self) -> list[tuple[str, str] | tuple[str, str, str]]:
        """The batch order with the prefix in front (Arrow sort keys)."""
        return [(self.prefix, "ascending"),
                *((c, "ascending", "at_start") for c in self.sort_columns),
                (TIME, "ascending")]

    @property
    def key_columns(self) -> list[str]:
        """The columns of a row's full sort key: prefix, sort columns, time."""
        return [self.prefix, *self.sort_columns, TIME]


META_FIELDS = [("bucket", pa.int64()), ("part_index", pa.int32()), ("path", pa.string()),
               ("rows", pa.int64()), ("bytes", pa.int64()), ("crc32c", pa.int64()),
               ("input_rows", pa.int64())]
META_DDL = ("bucket bigint, part_index int, path string, rows bigint, bytes bigint, "
            "crc32c bigint, input_rows bigint")
"""What write tasks and single tasks return: one row per written part (``input_rows``
0), and from a single task also one *tally* row (``path`` null) whose ``input_rows`` is the
number of updates the task decoded."""
RUN_FIELDS = [("group", pa.int64()), ("info", pa.string()), ("sample", pa.binary())]
RUN_DDL = "group bigint, info string, sample binary"


class TaskFailure(RuntimeError):
    """A lamina error raised in a task, carried to the driver in its message."""


@dataclass(frozen=True)
class TaskError:
    """A lamina error as data: what a task sends the driver instead of the exception."""

    FORMAT = 1

    type: str
    """The error's class name (``CorruptionError``, ``StorageError``, ...)."""
    message: str
    """The message without the location (``CorruptionError.reason``)."""
    path: str | None = None
    offset: int | None = None

    @classmethod
    def of(cls, exc: LaminaError) -> TaskError:
        if isinstance(exc, CorruptionError):
            return cls(type=type(exc).__name__, message=exc.reason,
                       path=str(exc.path) if exc.path is not None else None,
                       offset=exc.offset)
        return cls(type=type(exc).__name__, message=str(exc))

    def encode(self) -> str:
        doc = {"format": self.FORMAT, "type": self.type, "message": self.message,
               "path": self.path, "offset": self.offset}
        return base64.b64encode(json.dumps(doc).encode()).decode()

    @classmethod
    def decode(cls, blob: str) -> TaskError:
        doc = json.loads(base64.b64decode(blob))
        if doc.get("format") != cls.FORMAT:
            raise JobError(f"a Spark task reported an error in format {doc.get('format')!r}, "
                           f"this driver reads format {cls.FORMAT}: run one lamina version "
                           "on the driver and the executors")
        offset = doc.get("offset")
        return cls(type=str(doc["type"]), message=str(doc["message"]), path=doc.get("path"),
                   offset=int(offset) if offset is not None else None)

    def rebuild(self, context: str) -> LaminaError:
        """The error the driver raises: corruption as itself (it quarantines the
        relation), anything else as a retryable JobError. (A diff sum outside int64 raises
        nothing here: steps store it as a carry, lamina.consolidate.)"""
        if self.type == CorruptionError.__name__:
            return CorruptionError(self.message, path=self.path, offset=self.offset)
        if self.type == JobCancelledError.__name__:
            return JobCancelledError(f"{context} was cancelled: {self.message}")
        return JobError(f"{context} failed: {self.type}: {self.message} (nothing was "
                        "committed; the step is retried from its inputs)")


def task_error(exc: LaminaError, context: str) -> LaminaError:
    """What the driver raises for ``exc`` raised by a step's work (in a Spark task or in
    process): the same as if it had travelled as a :class:`TaskError`."""
    return TaskError.of(exc).rebuild(context)


def _encode_failure(exc: LaminaError) -> TaskFailure:
    return TaskFailure(f"{_TASK_MARK}{TaskError.of(exc).encode()}> "
                       f"{type(exc).__name__}: {exc}")


def _guarded(fn: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]
             ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        try:
            yield from fn(batches)
        except LaminaError as exc:
            raise _encode_failure(exc) from exc
    return run


def _task_ids(batches: Iterator[pa.RecordBatch]) -> Iterator[int]:
    """The ids of ``spark.range`` rows a task received (one per task here)."""
    for rb in batches:
        yield from rb.column(0).to_pylist()


# --- decode tasks ----------------------------------------------------------------------------

def _pread(fd: int, size: int, offset: int) -> bytes:
    chunks: list[bytes] = []
    while size > 0:
        chunk = os.pread(fd, size, offset)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def wal_tables(item: WalRange, relation: str, schema: pa.Schema) -> Iterator[pa.Table]:
    """Verify and decode the records of one range of a finished segment."""
    path = Path(item.path)
    with path.open("rb") as f:
        if item.first:
            expected = encode_header(relation, item.seq)
            if _pread(f.fileno(), len(expected), 0) != expected:
                raise corrupt(path, 0, f"segment header is damaged or does not name relation "
                                       f"{relation!r} and sequence {item.seq}")
        data = _pread(f.fileno(), item.end - item.start, item.start)
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
            try:
                table = decode_updates(rec.payload)
            except ValueError as exc:
                raise corrupt(path, at, str(exc)) from exc
            if not table.schema.equals(schema):
                raise corrupt(path, at, f"update record schema {table.schema} does not match "
                                        "the relation")
            yield table
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


def read_group(group: Sequence[WorkItem], ctx: StepContext) -> pa.Table:
    """Every update of one task group, verified (update schema)."""
    trace_dir = Path(ctx.trace_dir)
    tables: list[pa.Table] = []
    for item in group:
        if isinstance(item, WalRange):
            tables.extend(wal_tables(item, ctx.relation, ctx.update_schema))
        else:
            tables.append(read_part(trace_dir, item.part))
    if not tables:
        return ctx.update_schema.empty_table()
    return pa.concat_tables(tables)


def prepare(table: pa.Table, ctx: StepContext) -> tuple[pa.Table, pa.Table]:
    """Split updates into batch rows (times below ``since`` forwarded) and future rows (at
    or past the upper), and add the prefix column to both and the bucket column (the lower
    end of the pending bucket, uint64) to the future rows."""
    future = ctx.update_schema.empty_table()
    past = table
    if ctx.upper is not None and table.num_rows:
        mask = pc.greater_equal(table.column(TIME), pa.scalar(ctx.upper, pa.uint64()))
        if pc.any(mask).as_py():
            future = table.filter(mask)
            past = table.filter(pc.invert(mask))
    past = forward(past, ctx.since)
    first = ctx.sort_columns[0]
    past = past.append_column(ctx.prefix, order_prefix(past.column(first)))
    lows: Any = pa.array([], pa.uint64())
    if future.num_rows:
        assert ctx.upper is not None
        lows = bucket_lows(future.column(TIME), ctx.upper)
    future = future.append_column(ctx.prefix, order_prefix(future.column(first)))
    future = future.append_column(ctx.bucket, lows)
    return past, future


def by_lead(table: pa.Table, lead: str) -> pa.Table:
    """``table`` in the order of its integer column ``lead`` (stable; no copy when it is in
    order already)."""
    if table.num_rows <= 1:
        return table
    values = table.column(lead).to_numpy()
    if bool((values[1:] >= values[:-1]).all()):
        return table
    return table.take(np.argsort(values, kind="stable"))


def sort_rows(table: pa.Table, keys: Sequence[Any], lead: str) -> pa.Table:
    """``table`` sorted by ``keys`` (Arrow sort keys) whose first is the integer column
    ``lead``. Ordering by ``lead`` first (a numpy sort) makes Arrow's multi-key sort, which
    adapts to presorted runs, several times faster than on rows in random order."""
    if table.num_rows <= 1:
        return table
    table = by_lead(table, lead)
    return table.take(pc.sort_indices(table, sort_keys=list(keys)))


# --- full sort keys (cuts between chunks) -----------------------------------------------------

Key = tuple[Any, ...]
"""A row's full sort key as Python values: ``(prefix, *sort column values, time)`` where a
sort column value ``v`` is ``(2, v)``, NaN ``(1,)`` and null ``(0,)``. Python orders these
tuples exactly like the batch order (nulls first, then NaN, then numbers)."""


def _comparable(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A column whose Python values (``as_py``) order like Arrow sorts the column: dates and
    timestamps as their integers; other supported types compare correctly as they are."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    t = column.type
    if pa.types.is_date32(t):
        return column.view(pa.int32())
    if pa.types.is_timestamp(t) or pa.types.is_date64(t):
        return column.view(pa.int64())
    return column


def row_keys(table: pa.Table, ctx: StepContext) -> list[Key]:
    """The full sort key of every row of a (small) table."""
    columns = [_comparable(table.column(c)).to_pylist() for c in ctx.sort_columns]
    floats = [pa.types.is_floating(table.schema.field(c).type) for c in ctx.sort_columns]
    out: list[Key] = []
    prefixes, times = table.column(ctx.prefix).to_pylist(), table.column(TIME).to_pylist()
    for i, (prefix, t) in enumerate(zip(prefixes, times, strict=True)):
        values: list[Any] = [prefix]
        for column, is_float in zip(columns, floats, strict=True):
            v = column[i]
            values.append((0,) if v is None else (1,) if is_float and math.isnan(v)
                          else (2, v))
        values.append(t)
        out.append(tuple(values))
    return out


def at_or_below(rows: pa.Table, key: Key, ctx: StepContext) -> np.ndarray:
    """Which of ``rows`` (any order, all with ``key``'s prefix) are at or below ``key`` in
    the batch order: a vectorized lexicographic comparison of the sort columns and time."""
    n = rows.num_rows
    below = np.zeros(n, dtype=bool)
    equal = np.ones(n, dtype=bool)
    names = [*ctx.sort_columns, TIME]
    for name, want in zip(names, (*key[1:-1], (2, key[-1])), strict=True):
        column = _comparable(rows.column(name))
        nulls = (pc.is_null(column).to_numpy(zero_copy_only=False) if column.null_count
                 else np.zeros(n, dtype=bool))
        is_float = pa.types.is_floating(column.type)
        nans = (pc.fill_null(pc.is_nan(column), False).to_numpy(zero_copy_only=False)
                if is_float else np.zeros(n, dtype=bool))
        if want[0] == 0:
            less, same = np.zeros(n, dtype=bool), nulls
        elif want[0] == 1:
            less, same = nulls, nans
        else:
            value = pa.scalar(want[1], column.type)
            less = pc.fill_null(pc.less(column, value), False).to_numpy(zero_copy_only=False)
            less = less | nulls | nans
            same = pc.fill_null(pc.equal(column, value), False).to_numpy(zero_copy_only=False)
        below |= equal & less
        equal &= same
        if not equal.any():
            break
    out: np.ndarray = below | equal
    return out


@dataclass(frozen=True)
class _Cut:
    """Where a key falls in a run ordered by prefix: rows ``[0, lo)`` have a smaller
    prefix, rows ``[hi, n)`` a greater one, and of the rows ``[lo, hi)`` (the key's prefix,
    in any order) ``mask`` marks those at or below the key."""

    lo: int
    hi: int
    mask: np.ndarray


def _cut(run: pa.Table, prefix: np.ndarray, key: Key, ctx: StepContext) -> _Cut:
    lo = int(np.searchsorted(prefix, key[0], "left"))
    hi = int(np.searchsorted(prefix, key[0], "right"))
    return _Cut(lo, hi, at_or_below(run.slice(lo, hi - lo), key, ctx))


def chunk_pieces(run: pa.Table, lower: _Cut | None, upper: _Cut | None) -> list[pa.Table]:
    """The rows of a run (ordered by prefix) above ``lower`` and at or below ``upper``
    (None: no bound)."""
    n = run.num_rows
    if lower is not None and upper is not None and lower.lo == upper.lo \
            and lower.hi == upper.hi and lower.hi > lower.lo:  # one prefix for both keys
        return [run.slice(lower.lo, lower.hi - lower.lo).filter(~lower.mask & upper.mask)]
    pieces = []
    if lower is not None and lower.hi > lower.lo:
        pieces.append(run.slice(lower.lo, lower.hi - lower.lo).filter(~lower.mask))
    start = 0 if lower is None else lower.hi
    end = n if upper is None else upper.lo
    if end > start:
        pieces.append(run.slice(start, end - start))
    if upper is not None and upper.hi > upper.lo:
        pieces.append(run.slice(upper.lo, upper.hi - upper.lo).filter(upper.mask))
    return [p for p in pieces if p.num_rows]


# --- consolidation of sorted rows ------------------------------------------------------------

def consolidate_sorted(table: pa.Table, ctx: StepContext) -> pa.Table:
    """Consolidate rows sorted by full key (extra columns are dropped): the same rows, in
    the same order, as :func:`lamina.consolidate.consolidate_updates`. Equal rows are
    adjacent, so :func:`lamina.consolidate.sum_adjacent` sums runs of neighbours without
    hashing or sorting again; where it declines (float row columns, sums that might leave
    int64) the reference function does it."""
    table = table.select(ctx.update_schema.names)
    out = sum_adjacent(table, [*ctx.row_columns, TIME])
    if out is not None:
        return out
    return consolidate_updates(table, ctx.row_columns, ctx.sort_columns, context=ctx.context)


# --- runs: what decode tasks leave for the write tasks -----------------------------------------

RUN_BATCH_ROWS = 1 << 16
"""Rows per record batch of a future run, and the most per batch of a batch-row run (a
write task decompresses only the batches its key range overlaps)."""
MIN_RUN_BATCH_ROWS = 1 << 10
"""The fewest rows per record batch of a batch-row run (see :func:`run_batch_rows`)."""
RUN_BATCHES_PER_PART = 4
"""A batch-row run is cut into about this many record batches per part of the step."""


def run_batch_rows(rows: int, parts: int) -> int:
    """Rows per record batch of a run of ``rows`` batch rows in a step writing ``parts``
    parts. A part's key range covers about ``1 / parts`` of every run, and its task
    decompresses every batch that range overlaps, i.e. its share plus at most one partial
    batch at either end. With batches of a quarter of that share, a write task holds about
    1.5 times its part's rows; with batches of a fixed size it would hold a batch of every
    run, which grows with the step (a step of G runs: G batches per task, so most of the
    input when runs are not much longer than a batch). Batches keep at least
    :data:`MIN_RUN_BATCH_ROWS` rows, which bounds the per-batch overhead."""
    share = math.ceil(rows / (RUN_BATCHES_PER_PART * max(1, parts)))
    return max(MIN_RUN_BATCH_ROWS, min(RUN_BATCH_ROWS, share))


@dataclass(frozen=True)
class Run:
    """A run file, relative to the trace directory, and for each of its record batches the
    first and last value of the column it is ordered by."""

    path: str
    spans: tuple[tuple[int, int], ...]

    def window(self, lower: Key | None, upper: Key | None) -> tuple[int, int] | None:
        """The batches (first, last) that may hold rows with a prefix from ``lower``'s to
        ``upper``'s (None: unbounded); None when no batch does."""
        hits = [i for i, (a, b) in enumerate(self.spans)
                if (lower is None or b >= lower[0]) and (upper is None or a <= upper[0])]
        return (hits[0], hits[-1]) if hits else None


def _write_run(trace_dir: Path, path: str, table: pa.Table, lead: str,
               batch_rows: int = RUN_BATCH_ROWS) -> Run:
    """Write rows ordered by the integer column ``lead`` as an Arrow IPC file of LZ4
    compressed batches of ``batch_rows`` rows. Not synced: a run only lives for its step,
    and a lost one fails the step, which is retried from its inputs. LZ4 makes the file a
    quarter of the size for a fraction of the cost of writing the rest."""
    final = trace_dir / path
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:12]}.tmp")
    table = table.combine_chunks()
    values = table.column(lead).to_numpy()
    spans = []
    options = pa.ipc.IpcWriteOptions(compression="lz4")
    with pa.OSFile(str(tmp), "wb") as sink, \
            pa.ipc.new_file(sink, table.schema, options=options) as writer:
        for start in range(0, table.num_rows, batch_rows):
            writer.write_table(table.slice(start, batch_rows), max_chunksize=batch_rows)
            end = min(start + batch_rows, table.num_rows)
            spans.append((int(values[start]), int(values[end - 1])))
    os.replace(tmp, final)
    return Run(path, tuple(spans))


def _read_run(trace_dir: Path, path: str, first: int, last: int) -> pa.Table:
    """Batches ``first`` to ``last`` (inclusive) of a run file."""
    reader = pa.ipc.open_file(pa.memory_map(str(trace_dir / path)))
    return pa.Table.from_batches([reader.get_batch(i) for i in range(first, last + 1)],
                                 schema=reader.schema)


def _bucket_runs(future: pa.Table, bucket: str) -> list[tuple[int, int, int]]:
    """(bucket lower end, start, length) of the runs of equal buckets of sorted rows."""
    if not future.num_rows:
        return []
    lows = future.column(bucket).to_numpy()
    starts = np.flatnonzero(np.concatenate([[True], lows[1:] != lows[:-1]]))
    ends = np.append(starts[1:], len(lows))
    return [(int(lows[s]), int(s), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def _prepared(gid: int, ctx: StepContext) -> tuple[pa.Table, pa.Table, int]:
    """A group's batch rows and future rows (:func:`prepare`), and how many updates it
    decoded (the input rows the step reports)."""
    decoded = read_group(ctx.groups[gid], ctx)
    past, future = prepare(decoded, ctx)
    return past, future, decoded.num_rows


def _decoded_group(gid: int, ctx: StepContext) -> tuple[pa.Table, pa.Table, int]:
    """A group's batch rows ordered by prefix, its future rows ordered by bucket (the
    write tasks sort each chunk and bucket fully), and how many updates it decoded."""
    past, future, decoded = _prepared(gid, ctx)
    return by_lead(past, ctx.prefix), by_lead(future, ctx.bucket), decoded


def _decoder(ctx: StepContext) -> Callable[[Iterator[pa.RecordBatch]],
                                           Iterator[pa.RecordBatch]]:
    schema = pa.schema(RUN_FIELDS)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        scratch = Path(ctx.trace_dir) / ctx.scratch
        scratch.mkdir(parents=True, exist_ok=True)
        for gid in _task_ids(batches):
            past, future, decoded = _decoded_group(gid, ctx)
            info: dict[str, Any] = {"rows": past.num_rows, "input_rows": decoded,
                                    "past": None, "spans": [],
                                    "future": None,
                                    "buckets": _bucket_runs(future, ctx.bucket)}
            trace_dir = Path(ctx.trace_dir)
            if past.num_rows:
                run_ = _write_run(trace_dir, f"{ctx.scratch}/run-{gid:05d}.arrow", past,
                                  ctx.prefix, run_batch_rows(past.num_rows, ctx.parts))
                info.update(past=run_.path, spans=run_.spans)
            if future.num_rows:
                info["future"] = _write_run(trace_dir, f"{ctx.scratch}/future-{gid:05d}.arrow",
                                            future, ctx.bucket).path
            step = max(1, min(ctx.sample_every, past.num_rows // ctx.min_samples))
            sample = past.select(ctx.key_columns).take(
                pa.array(np.arange(step // 2, past.num_rows, step)))
            yield pa.RecordBatch.from_pylist(
                [{"group": gid, "info": json.dumps(info),
                  "sample": encode_updates(sample)}],  # the sample as Arrow IPC
                schema=schema)
    return _guarded(run)


# --- write tasks -----------------------------------------------------------------------------

@dataclass(frozen=True)
class PartItem:
    """Write batch part ``index``: the chunks ``bounds`` delimit, from every run."""

    index: int
    runs: tuple[Run, ...]
    bounds: tuple[tuple[Any, ...] | None, ...]
    """Full keys delimiting the part's chunks: chunk ``j`` holds the rows above
    ``bounds[j]`` and at or below ``bounds[j + 1]``; None is the end of the order."""


@dataclass(frozen=True)
class BucketItem:
    """Write pending parts: for each bucket, its rows ``(path, start, length)`` of runs."""

    buckets: tuple[tuple[int, tuple[tuple[str, int, int], ...]], ...]


def _meta_row(bucket: int | None, index: int, part: PartFile) -> dict[str, Any]:
    return {"bucket": None if bucket is None else bucket - TIME_SHIFT, "part_index": index,
            "path": part.path, "rows": part.rows, "bytes": part.bytes, "crc32c": part.crc32c,
            "input_rows": 0}


def _tally_row(input_rows: int) -> dict[str, Any]:
    """The row of a single task that carries how many updates it decoded (no part)."""
    return {"bucket": None, "part_index": -1, "path": None, "rows": 0, "bytes": 0,
            "crc32c": 0, "input_rows": input_rows}


def _write_nonempty(ctx: StepContext, path: str, tables: Iterable[pa.Table]) -> PartFile | None:
    """Write the non-empty ``tables`` as one part, or nothing when all are empty."""
    rest = (t for t in tables if t.num_rows)
    first = next(rest, None)
    if first is None:
        return None
    return write_part(FileSystem(), Path(ctx.trace_dir), path, ctx.update_schema,
                      itertools.chain([first], rest))


def _part_chunks(item: PartItem, ctx: StepContext) -> Iterator[pa.Table]:
    trace_dir = Path(ctx.trace_dir)
    runs = []
    for r in item.runs:  # only the batches that may hold rows of this part
        window = r.window(item.bounds[0], item.bounds[-1])
        if window is not None:
            runs.append(_read_run(trace_dir, r.path, *window))
    cuts: list[list[_Cut | None]] = []
    for run in runs:
        prefix = run.column(ctx.prefix).to_numpy()
        cuts.append([None if b is None else _cut(run, prefix, b, ctx) for b in item.bounds])
    for j in range(len(item.bounds) - 1):
        pieces = [p for run, c in zip(runs, cuts, strict=True)
                  for p in chunk_pieces(run, c[j], c[j + 1])]
        if not pieces:
            continue
        yield consolidate_sorted(sort_rows(pa.concat_tables(pieces), ctx.sort_keys,
                                           ctx.prefix), ctx)


def _bucket_parts(item: BucketItem, ctx: StepContext) -> Iterator[tuple[int, PartFile]]:
    trace_dir = Path(ctx.trace_dir)
    for low, pieces in item.buckets:
        tables = []
        for path, start, length in pieces:
            first, last = start // RUN_BATCH_ROWS, (start + length - 1) // RUN_BATCH_ROWS
            rows = _read_run(trace_dir, path, first, last)
            tables.append(rows.slice(start - first * RUN_BATCH_ROWS, length))
        rows = sort_rows(pa.concat_tables(tables), ctx.sort_keys, ctx.prefix)
        part = _write_nonempty(ctx, pending_path(), [consolidate_sorted(rows, ctx)])
        if part is not None:
            yield low, part


def _writer(ctx: StepContext, items: Sequence[PartItem | BucketItem]
            ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    schema = pa.schema(META_FIELDS)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for i in _task_ids(batches):
            item = items[i]
            rows = []
            if isinstance(item, PartItem):
                part = _write_nonempty(ctx, TraceLayout.batch_part(ctx.batch_id, item.index),
                                       _part_chunks(item, ctx))
                if part is not None:
                    rows.append(_meta_row(None, item.index, part))
            else:
                rows.extend(_meta_row(low, 0, part) for low, part in _bucket_parts(item, ctx))
            if rows:
                yield pa.RecordBatch.from_pylist(rows, schema=schema)
    return _guarded(run)


def _single(ctx: StepContext) -> Callable[[Iterator[pa.RecordBatch]],
                                          Iterator[pa.RecordBatch]]:
    """The whole step in one task (small inputs): decode, sort, consolidate, write."""
    schema = pa.schema(META_FIELDS)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for gid in _task_ids(batches):
            past, future, decoded = _prepared(gid, ctx)
            past = sort_rows(past, ctx.sort_keys, ctx.prefix)
            future = sort_rows(future, [(ctx.bucket, "ascending"), *ctx.sort_keys], ctx.bucket)
            rows = [_tally_row(decoded)]
            part = _write_nonempty(ctx, TraceLayout.batch_part(ctx.batch_id, 0),
                                   [consolidate_sorted(past, ctx)])
            if part is not None:
                rows.append(_meta_row(None, 0, part))
            for low, start, length in _bucket_runs(future, ctx.bucket):
                pending = _write_nonempty(ctx, pending_path(),
                                          [consolidate_sorted(future.slice(start, length), ctx)])
                if pending is not None:
                    rows.append(_meta_row(low, 0, pending))
            yield pa.RecordBatch.from_pylist(rows, schema=schema)
    return _guarded(run)


# --- the driver side ---------------------------------------------------------------------------

def aux_columns(meta: RelationMeta) -> tuple[str, str]:
    """Names of the bucket and prefix columns, distinct from every row column (compared
    case-insensitively)."""
    taken = {n.lower() for n in meta.schema.names}
    names = []
    for base in (BUCKET, PREFIX):
        name = base
        while name.lower() in taken:
            name += "_"
        names.append(name)
    return names[0], names[1]


@dataclass(frozen=True)
class StepOutput:
    """What a step's tasks wrote: batch parts in order and pending parts by bucket, and how
    many updates they read."""

    parts: list[PartFile]
    pending: list[tuple[int, PartFile]]
    """(bucket lower end, file), in increasing bucket order."""
    input_rows: int
    """Updates the step's tasks decoded from its inputs (WAL segments and Parquet parts),
    before forwarding and consolidation; counted by the attempts whose output the driver
    collected, so a retried task is counted once."""


def _parallelism(spark: Any) -> int:
    return max(1, int(spark.sparkContext.defaultParallelism))


def _run_tasks(spark: Any, n: int, fn: Callable[[Iterator[pa.RecordBatch]],
                                                 Iterator[pa.RecordBatch]],
               ddl: str, check: Callable[[], None]) -> list[Any]:
    """Run ``fn`` in ``n`` tasks, task ``i`` receiving the id ``i``; the rows they yield."""
    check()
    rows: list[Any] = spark.range(0, n, 1, n).mapInArrow(fn, ddl).collect()
    return rows


def boundaries(samples: pa.Table, chunks: int, ctx: StepContext) -> list[tuple[Any, ...]]:
    """``chunks - 1`` full keys cutting the sampled rows into ``chunks`` equal shares."""
    if chunks <= 1 or not samples.num_rows:
        return []
    ordered = sort_rows(samples, ctx.sort_keys, ctx.prefix)
    m = ordered.num_rows
    return row_keys(ordered.take([min(m - 1, j * m // chunks) for j in range(1, chunks)]), ctx)


def _plan_writes(infos: list[dict[str, Any]], samples: pa.Table, ctx: StepContext,
                 n_write: int, tuning: JobTuning) -> list[PartItem | BucketItem]:
    """Write tasks for the runs the decode tasks left: ``n_write`` parts at most (fewer
    when there are fewer chunks), each cut into chunks of about ``chunk_rows`` rows, and
    the pending buckets packed into tasks of about ``chunk_rows`` rows."""
    runs = tuple(Run(str(i["past"]), tuple((int(a), int(b)) for a, b in i["spans"]))
                 for i in infos if i["past"] is not None)
    rows = sum(int(i["rows"]) for i in infos)
    items: list[PartItem | BucketItem] = []
    if rows:
        chunks = min(max(math.ceil(rows / tuning.chunk_rows), n_write), samples.num_rows + 1)
        parts = max(1, min(n_write, chunks))
        chunks = max(chunks, parts)
        cuts: list[tuple[Any, ...] | None] = [None, *boundaries(samples, chunks, ctx), None]
        cuts += [None] * (chunks + 1 - len(cuts))
        for p in range(parts):
            lo, hi = p * chunks // parts, (p + 1) * chunks // parts
            items.append(PartItem(index=p, runs=runs, bounds=tuple(cuts[lo:hi + 1])))
    by_bucket: dict[int, list[tuple[str, int, int]]] = {}
    for info in infos:
        for low, start, length in info["buckets"]:
            by_bucket.setdefault(int(low), []).append((str(info["future"]), start, length))
    group: list[tuple[int, tuple[tuple[str, int, int], ...]]] = []
    size = 0
    for low in sorted(by_bucket):
        pieces = tuple(by_bucket[low])
        n = sum(p[2] for p in pieces)
        if group and size + n > tuning.chunk_rows:
            items.append(BucketItem(tuple(group)))
            group, size = [], 0
        group.append((low, pieces))
        size += n
    if group:
        items.append(BucketItem(tuple(group)))
    return items


def run_step(spark: Any, trace: Trace, *, segments: Sequence[SegmentSpan],
             parts: Sequence[PartFile], since: int, upper: int | None, batch_id: str,
             context: str, tuning: JobTuning = DEFAULT_TUNING) -> StepOutput:
    """Run one step: read ``segments`` and ``parts``, forward batch rows below ``since``,
    split off rows at or past ``upper`` (None: no split) into pending buckets, consolidate,
    sort and write. Raises LaminaError subclasses only (see the module docstring)."""
    from lamina.compacter.spark import check_cancelled

    meta = trace.meta
    scratch = trace.dir / TraceLayout.scratch(batch_id)
    decoded = 0  # updates counted by decode tasks (single tasks report theirs in tally rows)
    try:
        sizes = [Path(s.path).stat().st_size for s in segments]
        total = sum(sizes) + sum(p.bytes * PARQUET_EXPANSION for p in parts)
        single = total <= tuning.single_task_bytes
        if single:
            share = max(total, 1)
            n_write = 1
        else:
            share = min(tuning.split_bytes, max(tuning.min_split_bytes,
                                                math.ceil(total / _parallelism(spark))))
            n_write = min(tuning.max_parts, max(1, math.ceil(total / tuning.part_bytes)))
        items: list[WorkItem] = []
        for span, size in zip(segments, sizes, strict=True):
            if size > share:
                items.extend(segment_ranges(span, meta.name, share))
            else:
                items.extend(segment_ranges(span, meta.name, size + 1))
        items.extend(PartInput(p) for p in parts)
        groups = tuple(pack(items, max(share, 1)))
        bucket, prefix = aux_columns(meta)
        ctx = StepContext(
            trace_dir=str(trace.dir), relation=meta.name, update_schema=meta.update_schema,
            row_columns=tuple(meta.row_columns), sort_columns=tuple(meta.sort_columns),
            prefix=prefix, bucket=bucket, since=since,
            upper=upper if upper is not None and upper <= MAX_TIME else None,
            batch_id=batch_id, context=context, scratch=scratch.relative_to(trace.dir).as_posix(),
            sample_every=max(1, tuning.chunk_rows // SAMPLES_PER_CHUNK),
            min_samples=max(1, math.ceil(SAMPLES_PER_CHUNK * n_write / len(groups))),
            parts=n_write,
            groups=groups)
        if single:
            rows = _run_tasks(spark, len(ctx.groups), _single(ctx), META_DDL,
                              check_cancelled)
        else:
            try:
                runs = _run_tasks(spark, len(ctx.groups), _decoder(ctx), RUN_DDL,
                                  check_cancelled)
                runs.sort(key=lambda r: int(r["group"]))
                infos = [json.loads(r["info"]) for r in runs]
                decoded = sum(int(i["input_rows"]) for i in infos)
                samples = pa.concat_tables(decode_updates(r["sample"]) for r in runs)  # Arrow IPC
                writes = _plan_writes(infos, samples, ctx, n_write, tuning)
                rows = _run_tasks(spark, len(writes), _writer(ctx, writes), META_DDL,
                                  check_cancelled) if writes else []
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    except LaminaError:
        raise
    except Exception as exc:  # Spark, Py4J, or the driver's own reads (OSError)
        raise translate(exc, context) from exc
    return _collect_output(rows, context, decoded)


def _collect_output(rows: list[Any], context: str, decoded: int = 0) -> StepOutput:
    parts: dict[int, PartFile] = {}
    pending: dict[int, PartFile] = {}
    input_rows = decoded
    for r in rows:
        input_rows += int(r["input_rows"] or 0)
        if r["path"] is None:  # a single task's tally row
            continue
        pf = PartFile(path=str(r["path"]), rows=int(r["rows"]), bytes=int(r["bytes"]),
                      crc32c=int(r["crc32c"]))
        if r["bucket"] is None:
            target, key = parts, int(r["part_index"])
        else:
            target, key = pending, int(r["bucket"]) + TIME_SHIFT  # back to unsigned
        if key in target:
            raise JobError(f"{context}: two tasks wrote the same part ({target[key].path} and "
                           f"{pf.path}); was speculative execution enabled?")
        target[key] = pf
    return StepOutput(parts=[parts[i] for i in sorted(parts)],
                      pending=[(lo, pending[lo]) for lo in sorted(pending)],
                      input_rows=input_rows)


@dataclass(frozen=True)
class ConversionResult:
    """What :func:`spark_convert` wrote and read (nothing of it committed yet)."""

    parts: list[PartFile]
    """The batch's parts, in order."""
    pending: list[PendingPart]
    """The new pending parts, one per bucket, in time order."""
    input_rows: int
    """Updates decoded: those of the plan's WAL segments plus the rows of the pending
    parts it consumes (future updates are thus counted once when they are first converted
    and again when the conversion that reaches their time brings them in)."""


def spark_convert(spark: Any, trace: Trace, plan: ConversionPlan, *,
                  tuning: JobTuning = DEFAULT_TUNING) -> ConversionResult:
    """Carry out a conversion plan as a Spark job; return the batch's parts, the new
    pending parts and the number of updates read. Nothing is committed: the caller passes
    ``result.parts`` and ``result.pending`` to ``Trace.commit_conversion``."""
    out = run_step(spark, trace, segments=plan.segments,
                   parts=[p.part for p in plan.consume], since=plan.since, upper=plan.upper,
                   batch_id=plan.batch_id,
                   context=f"conversion of {trace.meta.name!r} to {plan.upper}", tuning=tuning)
    pending = []
    for lo, part in out.pending:
        blo, bhi = bucket_of(lo, plan.upper)
        pending.append(PendingPart(blo, bhi, part))
    return ConversionResult(parts=out.parts, pending=pending, input_rows=out.input_rows)


def spark_merge(spark: Any, trace: Trace, plan: MergePlan, *,
                tuning: JobTuning = DEFAULT_TUNING) -> list[PartFile]:
    """Carry out a merge plan as a Spark job; return the merged batch's parts in order."""
    parents = [p for b in (plan.left, plan.right) for p in b.parts]
    if not parents:
        return []
    out = run_step(spark, trace, segments=(), parts=parents, since=plan.since, upper=None,
                   batch_id=plan.batch_id,
                   context=f"merge of {trace.meta.name!r} [{plan.lower}, {plan.upper})",
                   tuning=tuning)
    return out.parts


# --- error translation ---------------------------------------------------------------------------

def _error_text(exc: BaseException) -> str:
    parts = [str(exc)]
    java = getattr(exc, "java_exception", None)
    if java is not None:
        with contextlib.suppress(Exception):  # the gateway may be gone
            parts.append(str(java.toString()))
    return "\n".join(parts)


_CAUSE_RE = re.compile(r"^[\w.$]*(Error|Exception|Failure|Interrupted)\b[^\n]*", re.MULTILINE)


def root_cause(exc: BaseException) -> str:
    """One line naming what failed: a task's Python error, else Spark's or Py4J's message."""
    text = _error_text(exc)
    if "Traceback (most recent call last)" in text:
        lines = [m.group(0) for m in _CAUSE_RE.finditer(text)]
        if lines:
            return lines[-1][:500]
    for raw in text.splitlines():
        line = raw.strip().lstrip(": ").strip()
        if line and not line.startswith("An error occurred while calling"):
            return line[:500]
    return type(exc).__name__


def translate(exc: BaseException, context: str) -> LaminaError:
    """The lamina error for a failure reported by Spark or Py4J during ``context``."""
    text = _error_text(exc)
    match = _TASK_MARK_RE.search(text)
    if match:
        return TaskError.decode(match.group(1)).rebuild(f"{context} in a Spark task")
    if "SPARK_JOB_CANCELLED" in text or "cancelled part of cancelled job tags" in text:
        return JobCancelledError(f"{context} was cancelled: {root_cause(exc)}")
    return JobError(f"{context} failed in Spark: {root_cause(exc)} (nothing was committed; "
                    "the step can be retried from its inputs)")
