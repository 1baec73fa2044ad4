"""Conversion and merge steps as Spark jobs: the production executor of trace plans.

:func:`spark_convert` and :func:`spark_merge` carry out a
:class:`~lamina.trace.plan.ConversionPlan` / :class:`~lamina.trace.plan.MergePlan` and
return the written files; the caller commits them (``Trace.commit_conversion`` /
``Trace.commit_merge``). For the same plan and inputs the output is identical, row for row
and in order, to the in-process reference executor :mod:`lamina.trace.reference`; the
tests compare the two.

Stages of one step (a single Spark action, plus the range partitioner's sampling job when
the output has several parts)::

    spark.range(G, numPartitions=G)          one row per decode task, no data
      -> mapInArrow(decode)                  tasks read inputs, yield Arrow batches
      -> repartitionByRange(P, order)        P > 1 (repartition(1) when G > 1, P == 1;
                                             nothing when G == P == 1)
      -> sortWithinPartitions(order)
      -> mapInArrow(write)                   tasks consolidate and write Parquet parts
      -> collect()                           part metadata only: (path, rows, bytes, crc)

*Decode.* The driver never reads data. It cuts the inputs into work items: WAL segments
into byte ranges of whole records (it walks the 9-byte frame headers through a read-only
mmap, only when a segment is bigger than a task's share), and Parquet parts (consumed
pending parts, merge parents) whole. Items are packed into G task groups by size. A decode
task verifies what it reads the way the readers do: every frame's CRC32C, the segment
header (which must be exactly the one the relation and sequence number produce), the first
record being PROGRESS(lower) and the last PROGRESS(upper) of the planned span, each update
record's schema; Parquet parts through :func:`lamina.trace.batch.read_part` (size, CRC32C,
row count). It then maps rows to Spark: ``_time`` (uint64, which Spark lacks) becomes the
signed long ``t XOR 2**63``, which orders the same; times of rows below the plan's upper
that are below ``since`` are forwarded to ``since``; and a future row (time at or past
the upper) gets the column ``_bucket``, the lower end of its pending bucket
(:func:`lamina.trace.pending.bucket_of`, vectorized), also shifted; batch rows have a null
``_bucket``. Finally a column ``_prefix``: a long non-decreasing in the first sort column
(:func:`order_prefix`; ``INT64_MAX`` for future rows). Spark's sort compares rows by a
prefix of the first sort key only; with ``_prefix`` leading every ordering most
comparisons are one long comparison (without it, a sort led by the mostly-null
``_bucket`` fell back to full row comparisons and cost a third of a conversion).

*Partition and sort.* The order of a batch is (key columns, other columns, time) ascending
with nulls first, as :func:`lamina.consolidate.sort`. Spark sorts NaN above every number
while Arrow puts it right after the nulls, so a float column is preceded by a rank
(null, NaN, number) in every Spark ordering. The step's rows are range-partitioned by
``(_prefix, _bucket, order if _bucket is null)`` and sorted within partitions by
``(_prefix, _bucket, order)``: batch rows (null bucket) are spread over partitions by their
order, so concatenating the partitions' parts in partition order gives the globally sorted
batch; all rows of one future bucket share one partition key ``(INT64_MAX, bucket, nulls)``,
so a bucket never straddles partitions and becomes one pending file, and the future rows
of a partition come after its batch rows, bucket by bucket. P is sized from the input
bytes (``JobTuning.part_bytes``); a small step (``JobTuning.single_task_bytes``) runs as a
single task with no shuffle at all, which is what makes the common small conversion cheap.

*Write.* A writer task streams its sorted partition: rows equal in (row, time) are
adjacent, so it consolidates a chunk at a time with the reference's own
:func:`lamina.consolidate.consolidate_updates` (exact decimal sums, DiffOverflowError
instead of a wrap, zero sums dropped), holding back the rows tied with a chunk's last row
for the next chunk. Batch rows go to ``batch_part_path(batch_id, partition index)``, each
bucket to a fresh pending file, through :func:`lamina.trace.batch.write_part` (temp file,
fsync, rename, directory fsync). Empty parts are not written. A retried task rewrites the
same batch part path (same content) and new pending files (the lost attempt's are
unnamed garbage, collected later). Memory per task is bounded by a chunk
(``JobTuning.chunk_rows``) plus one Arrow batch; only part metadata reaches the driver.

*Errors.* Lamina errors raised in a task travel to the driver as a marker with their
type, message, path and offset; the driver raises CorruptionError or DiffOverflowError
again, and JobError (naming relation, step and root cause) for everything else Spark or
Py4J reports. A cancelled job raises :class:`lamina.compacter.spark.JobCancelledError`.
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from lamina.consolidate import consolidate_updates
from lamina.errors import CorruptionError, DiffOverflowError, JobError, LaminaError
from lamina.fs import FileSystem
from lamina.schema import DIFF, TIME, RelationMeta
from lamina.trace.batch import PartFile, batch_part_path, read_part, write_part
from lamina.trace.pending import bucket_of
from lamina.trace.plan import ConversionPlan, MergePlan, SegmentSpan
from lamina.trace.reference import pending_path
from lamina.trace.state import PendingPart
from lamina.trace.trace import Trace
from lamina.wal.record import (
    HEADER,
    HEADER_SIZE,
    MAX_PAYLOAD,
    BadFrame,
    RecordType,
    corrupt,
    decode_frontier,
    decode_updates,
    read_frame,
)
from lamina.wal.segment import encode_header

BUCKET = "__lamina_bucket"
"""Spark column: the shifted lower end of a future row's pending bucket; null for batch rows.
(Named ``_bucket`` in the docs; :func:`aux_columns` renames it away from any row column.)"""
PREFIX = "__lamina_prefix"
"""Spark column: a long that orders like the first sort column (see :func:`order_prefix`),
``INT64_MAX`` for future rows. It leads every Spark ordering so that Spark's sort compares
most rows by its cheap prefix, which it takes from the first sort key only."""
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

TIME_SHIFT = 1 << 63
MAX_TIME = 2**64 - 1
_SHIFT = pa.scalar(TIME_SHIFT, pa.uint64())
_TASK_MARK = "LAMINA-TASK-ERROR<"
_TASK_MARK_RE = re.compile(r"LAMINA-TASK-ERROR<([A-Za-z0-9+/=]+)>")
PARQUET_EXPANSION = 4
"""Parquet parts are compressed; their bytes count this many times when sizing tasks."""


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
    """Rows a writer task consolidates at a time."""


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


# --- time and bucket mapping (vectorized, shared by tasks and tests) --------------------------

def to_signed(times: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """uint64 times to Spark longs, order-preserving: ``t XOR 2**63`` read as signed."""
    return pc.cast(pc.bit_wise_xor(times, _SHIFT), pa.int64(), safe=False)


def to_unsigned(values: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """The inverse of :func:`to_signed`."""
    return pc.bit_wise_xor(pc.cast(values, pa.uint64(), safe=False), _SHIFT)


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


# --- task contexts (pickled into the tasks) ---------------------------------------------------

@dataclass(frozen=True)
class DecodeContext:
    trace_dir: str
    relation: str
    update_schema: pa.Schema
    out_schema: pa.Schema
    since: int
    upper: int | None
    """Split point of a conversion; None for a merge (every row belongs to the batch)."""
    prefix_column: str
    groups: tuple[tuple[WorkItem, ...], ...]
    batch_rows: int


@dataclass(frozen=True)
class WriteContext:
    trace_dir: str
    update_schema: pa.Schema
    row_columns: tuple[str, ...]
    sort_columns: tuple[str, ...]
    batch_id: str
    context: str
    chunk_rows: int


META_FIELDS = [("bucket", pa.int64()), ("part_index", pa.int32()), ("path", pa.string()),
               ("rows", pa.int64()), ("bytes", pa.int64()), ("crc32c", pa.int64())]
META_DDL = "bucket bigint, part_index int, path string, rows bigint, bytes bigint, crc32c bigint"


class TaskFailure(RuntimeError):
    """A lamina error raised in a task, carried to the driver in its message."""


def _encode_failure(exc: LaminaError) -> TaskFailure:
    message = str(exc)
    doc: dict[str, Any] = {"type": type(exc).__name__, "message": message}
    if isinstance(exc, CorruptionError) and exc.path is not None:
        where = f" [{exc.path}" + (f" at byte {exc.offset}" if exc.offset is not None
                                   else "") + "]"
        doc.update(message=message.removesuffix(where), path=str(exc.path),
                   offset=exc.offset)
    blob = base64.b64encode(json.dumps(doc).encode()).decode()
    return TaskFailure(f"{_TASK_MARK}{blob}> {type(exc).__name__}: {message}")


def _guarded(fn: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]
             ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        try:
            yield from fn(batches)
        except LaminaError as exc:
            raise _encode_failure(exc) from exc
    return run


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


def shape_for_spark(table: pa.Table, ctx: DecodeContext) -> pa.Table:
    """Updates (update schema) to the Spark-side schema: signed time, forwarding of batch
    rows below ``since``, and the bucket of future rows."""
    times = table.column(TIME)
    future = None
    if ctx.upper is not None and table.num_rows:
        future = pc.greater_equal(times, pa.scalar(ctx.upper, pa.uint64()))
        if not pc.any(future).as_py():
            future = None
    if ctx.since > 0 and table.num_rows:
        since = pa.scalar(min(ctx.since, MAX_TIME), pa.uint64())
        below = pc.less(times, since)
        if future is not None:
            below = pc.and_(below, pc.invert(future))
        times = pc.if_else(below, since, times)
    prefix = order_prefix(table.column(ctx.prefix_column))
    if future is None:
        bucket: Any = pa.nulls(table.num_rows, pa.int64())
    else:
        assert ctx.upper is not None
        lows = to_signed(bucket_lows(table.column(TIME), ctx.upper))
        bucket = pc.if_else(future, lows, pa.scalar(None, pa.int64()))
        prefix = pc.if_else(future, pa.scalar(INT64_MAX, pa.int64()), prefix)
    columns = [table.column(f.name) for f in ctx.update_schema if f.name not in (TIME, DIFF)]
    out = pa.Table.from_arrays([*columns, to_signed(times), table.column(DIFF), bucket, prefix],
                               names=ctx.out_schema.names)
    return out.cast(ctx.out_schema)


def _decoder(ctx: DecodeContext) -> Callable[[Iterator[pa.RecordBatch]],
                                              Iterator[pa.RecordBatch]]:
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        trace_dir = Path(ctx.trace_dir)
        for rb in batches:
            for gid in rb.column(0).to_pylist():
                for item in ctx.groups[gid]:
                    tables: Iterable[pa.Table]
                    if isinstance(item, WalRange):
                        tables = wal_tables(item, ctx.relation, ctx.update_schema)
                    else:
                        tables = [read_part(trace_dir, item.part)]
                    for table in tables:
                        yield from shape_for_spark(table, ctx).to_batches(
                            max_chunksize=ctx.batch_rows)
    return _guarded(run)


# --- write tasks -----------------------------------------------------------------------------

_START = object()


def _runs(bucket: pa.Array) -> Iterator[tuple[int | None, int, int]]:
    """(value, start, length) of the runs of equal values (nulls included) of ``bucket``."""
    if bucket.null_count == len(bucket):
        yield None, 0, len(bucket)
        return
    ree = pc.run_end_encode(bucket)
    start = 0
    for end, value in zip(ree.run_ends.to_pylist(), ree.values.to_pylist(), strict=True):
        yield value, start, end - start
        start = end


def unshape(batch: pa.RecordBatch | pa.Table, schema: pa.Schema) -> pa.Table:
    """Spark-side rows back to the update schema (drops ``_bucket``, unsigned time)."""
    columns = [batch.column(f.name) for f in schema if f.name not in (TIME, DIFF)]
    table = pa.Table.from_arrays(
        [*columns, to_unsigned(batch.column(TIME)), batch.column(DIFF)], names=schema.names)
    return table.cast(schema)


def tied_with_last(table: pa.Table, columns: Sequence[str]) -> pa.Array:
    """Mask of the rows equal to the last row in every column of ``columns`` (nulls equal
    nulls, NaN equals NaN, -0.0 equals 0.0): rows that may consolidate with it."""
    mask: Any = None
    last = table.num_rows - 1
    for name in columns:
        col = table.column(name)
        value = col[last]
        if not value.is_valid:
            m = pc.is_null(col)
        elif pa.types.is_floating(col.type) and math.isnan(value.as_py()):
            m = pc.fill_null(pc.is_nan(col), False)
        else:
            m = pc.fill_null(pc.equal(col, value), False)
        mask = m if mask is None else pc.and_(mask, m)
    return mask


def consolidated_groups(batches: Iterable[pa.RecordBatch], ctx: WriteContext
                        ) -> Iterator[tuple[int | None, pa.Table]]:
    """Consolidate a sorted partition chunk by chunk: ``(bucket, rows)`` in order, where
    ``bucket`` is None for batch rows and the shifted bucket lower end for future rows."""
    group: object = _START
    buffer: list[pa.Table] = []
    rows = 0
    limit = ctx.chunk_rows
    key = [*ctx.row_columns, TIME]

    def done(tables: list[pa.Table]) -> pa.Table:
        return consolidate_updates(pa.concat_tables(tables), ctx.row_columns,
                                   ctx.sort_columns, context=ctx.context)

    for rb in batches:
        if not rb.num_rows:
            continue
        bucket = rb.column(len(ctx.row_columns) + 2)  # row columns, _time, _diff, bucket
        for value, start, length in _runs(bucket):
            piece = unshape(rb.slice(start, length), ctx.update_schema)
            if value != group:
                if buffer:
                    assert group is None or isinstance(group, int)
                    yield group, done(buffer)
                buffer, rows, limit, group = [], 0, ctx.chunk_rows, value
            buffer.append(piece)
            rows += length
            if rows >= limit:
                whole = pa.concat_tables(buffer)
                held = tied_with_last(whole, key)
                rest = whole.filter(pc.invert(held))
                hold = whole.filter(held)
                if rest.num_rows:
                    yield value, done([rest])
                buffer, rows = [hold], hold.num_rows
                limit = max(ctx.chunk_rows, 2 * rows)
    if buffer:
        assert group is None or isinstance(group, int)
        yield group, done(buffer)


def _writer(ctx: WriteContext) -> Callable[[Iterator[pa.RecordBatch]],
                                           Iterator[pa.RecordBatch]]:
    meta_schema = pa.schema(META_FIELDS)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        task = TaskContext.get()
        index = task.partitionId() if task is not None else 0
        fs = FileSystem()
        trace_dir = Path(ctx.trace_dir)
        for bucket, items in itertools.groupby(consolidated_groups(batches, ctx),
                                               key=itemgetter(0)):
            tables = (t for _, t in items if t.num_rows)
            first = next(tables, None)
            if first is None:
                continue
            path = batch_part_path(ctx.batch_id, index) if bucket is None else pending_path()
            part = write_part(fs, trace_dir, path, ctx.update_schema,
                              itertools.chain([first], tables))
            yield pa.RecordBatch.from_pylist(
                [{"bucket": bucket, "part_index": index, "path": part.path, "rows": part.rows,
                  "bytes": part.bytes, "crc32c": part.crc32c}], schema=meta_schema)
    return _guarded(run)


# --- the driver side ---------------------------------------------------------------------------

def aux_columns(meta: RelationMeta) -> tuple[str, str]:
    """Names of the bucket and prefix columns, distinct from every row column (compared
    case-insensitively, as Spark may)."""
    taken = {n.lower() for n in meta.schema.names}
    names = []
    for base in (BUCKET, PREFIX):
        name = base
        while name.lower() in taken:
            name += "_"
        names.append(name)
    return names[0], names[1]


def _spark_types(meta: RelationMeta) -> tuple[Any, pa.Schema]:
    from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
    from pyspark.sql.types import LongType, StructField, StructType

    bucket, prefix = aux_columns(meta)
    rows = from_arrow_schema(meta.schema, prefer_timestamp_ntz=True)
    schema = StructType([*rows.fields, StructField(TIME, LongType(), True),
                         StructField(DIFF, LongType(), True),
                         StructField(bucket, LongType(), True),
                         StructField(prefix, LongType(), True)])
    return schema, to_arrow_schema(schema, timezone="UTC", prefers_large_types=False)


def _order(meta: RelationMeta) -> list[Any]:
    """Spark expressions whose ascending, nulls-first order is the batch order of
    :func:`lamina.consolidate.sort` (a float column is preceded by its rank: null, NaN,
    number, because Spark sorts NaN last and Arrow right after the nulls)."""
    from pyspark.sql import functions as F

    exprs: list[Any] = []
    for name in meta.sort_columns:
        c = F.col(name)
        if pa.types.is_floating(meta.schema.field(name).type):
            exprs.append(F.when(c.isNull(), 0).when(F.isnan(c), 1).otherwise(2))
        exprs.append(c)
    exprs.append(F.col(TIME))
    return exprs


@dataclass(frozen=True)
class StepOutput:
    """What a step's tasks wrote: batch parts in order and pending parts by bucket."""

    parts: list[PartFile]
    pending: list[tuple[int, PartFile]]
    """(bucket lower end, file), in increasing bucket order."""


def _parallelism(spark: Any) -> int:
    return max(1, int(spark.sparkContext.defaultParallelism))


def run_step(spark: Any, trace: Trace, *, segments: Sequence[SegmentSpan],
             parts: Sequence[PartFile], since: int, upper: int | None, batch_id: str,
             context: str, tuning: JobTuning = DEFAULT_TUNING) -> StepOutput:
    """Run one step: read ``segments`` and ``parts``, forward batch rows below ``since``,
    split off rows at or past ``upper`` (None: no split) into pending buckets, consolidate,
    sort and write. Raises LaminaError subclasses only (see the module docstring)."""
    from lamina.compacter.spark import check_cancelled

    meta = trace.meta
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
        groups = pack(items, max(share, 1))
        spark_schema, arrow_schema = _spark_types(meta)
        dctx = DecodeContext(trace_dir=str(trace.dir), relation=meta.name,
                             update_schema=meta.update_schema, out_schema=arrow_schema,
                             since=since, upper=upper if upper is not None and upper <= MAX_TIME
                             else None, prefix_column=meta.sort_columns[0],
                             groups=tuple(groups), batch_rows=1 << 16)
        wctx = WriteContext(trace_dir=str(trace.dir), update_schema=meta.update_schema,
                            row_columns=tuple(meta.row_columns),
                            sort_columns=tuple(meta.sort_columns), batch_id=batch_id,
                            context=context, chunk_rows=tuning.chunk_rows)
        rows = _execute(spark, dctx, wctx, spark_schema, order=_order(meta), n_write=n_write,
                        split=dctx.upper is not None, check=check_cancelled)
    except LaminaError:
        raise
    except Exception as exc:  # Spark, Py4J, or the driver's own reads (OSError)
        raise translate(exc, context) from exc
    return _collect_output(rows, context)


def _execute(spark: Any, dctx: DecodeContext, wctx: WriteContext, spark_schema: Any, *,
             order: list[Any], n_write: int, split: bool,
             check: Callable[[], None]) -> list[Any]:
    from pyspark.sql import functions as F

    n_groups = len(dctx.groups)
    decoded = spark.range(0, n_groups, 1, n_groups).mapInArrow(_decoder(dctx), spark_schema)
    bucket, prefix = (F.col(n) for n in dctx.out_schema.names[-2:])
    if split:  # a bucket's rows share one partition key: (INT64_MAX, bucket, nulls)
        sort_exprs = [prefix.asc(), bucket.asc_nulls_first(),
                      *(e.asc_nulls_first() for e in order)]
        part_exprs = [prefix.asc(), bucket.asc_nulls_first(),
                      *(F.when(bucket.isNull(), e).asc_nulls_first() for e in order)]
    else:
        sort_exprs = part_exprs = [prefix.asc(), *(e.asc_nulls_first() for e in order)]
    if n_groups == 1 and n_write == 1:
        shaped = decoded
    elif n_write == 1:
        shaped = decoded.repartition(1)
    else:
        shaped = decoded.repartitionByRange(n_write, *part_exprs)
    written = shaped.sortWithinPartitions(*sort_exprs).mapInArrow(_writer(wctx), META_DDL)
    check()
    rows: list[Any] = written.collect()
    return rows


def _collect_output(rows: list[Any], context: str) -> StepOutput:
    parts: dict[int, PartFile] = {}
    pending: dict[int, PartFile] = {}
    for r in rows:
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
                      pending=[(lo, pending[lo]) for lo in sorted(pending)])


def spark_convert(spark: Any, trace: Trace, plan: ConversionPlan, *,
                  tuning: JobTuning = DEFAULT_TUNING) -> tuple[list[PartFile],
                                                               list[PendingPart]]:
    """Carry out a conversion plan as a Spark job; return the batch's parts (in order) and
    the new pending parts (one per bucket, in time order). Nothing is committed."""
    out = run_step(spark, trace, segments=plan.segments,
                   parts=[p.part for p in plan.consume], since=plan.since, upper=plan.upper,
                   batch_id=plan.batch_id,
                   context=f"conversion of {trace.meta.name!r} to {plan.upper}", tuning=tuning)
    pending = []
    for lo, part in out.pending:
        blo, bhi = bucket_of(lo, plan.upper)
        pending.append(PendingPart(blo, bhi, part))
    return out.parts, pending


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
    from lamina.compacter.spark import JobCancelledError

    text = _error_text(exc)
    match = _TASK_MARK_RE.search(text)
    if match:
        doc = json.loads(base64.b64decode(match.group(1)))
        kind, message = str(doc.get("type")), str(doc.get("message"))
        if kind == "CorruptionError":
            return CorruptionError(message, path=doc.get("path"), offset=doc.get("offset"))
        if kind == "DiffOverflowError":
            return DiffOverflowError(message)
        return JobError(f"{context} failed in a Spark task: {kind}: {message}")
    if "SPARK_JOB_CANCELLED" in text or "cancelled part of cancelled job tags" in text:
        return JobCancelledError(f"{context} was cancelled: {root_cause(exc)}")
    return JobError(f"{context} failed in Spark: {root_cause(exc)} (nothing was committed; "
                    "the step can be retried from its inputs)")
