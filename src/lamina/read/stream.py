"""The streaming snapshot: consolidated rows at ``as_of`` in key order, in bounded memory.

Every source of a snapshot is sorted by the relation's sort columns (key columns, then the
other row columns): each trace batch (its parts in order, each sorted by row and time), each
pending part, and the WAL tail once it is sorted (it is read whole: it is the part of the
log the compacter has not converted yet). :func:`snapshot_batches` merges them k ways:

1. every source that has no buffered rows reads its next chunk (about
   :data:`CHUNK_BYTES` of decoded rows, ``_time <= as_of`` kept, equal neighbours
   already summed);
2. the *bound* is the smallest of the last rows buffered by the sources that are not
   exhausted: no source can later produce a row below it (a source whose buffer holds only
   rows equal to its last one reads on first, so the bound always lets a row out);
3. every source gives up its buffered rows below the bound (a binary search on its sorted
   buffer); those are sorted together, equal rows summed, zero sums dropped, and emitted
   as one record batch.

Equal rows are never split across two emissions (a row below the bound leaves with every
row equal to it), so each emitted row is final. Memory: one chunk per batch and pending part plus
the WAL tail, whatever the relation's size; the output equals
:func:`lamina.read.snapshot.snapshot` row for row.

The files are opened (and their CRC32C checked, streaming) before the first row is
produced. The reader holds a lease on the state it pinned until it is exhausted, closed or
garbage-collected (renewed meanwhile, lamina.trace.lease), so the compacter collects none of
its files however slowly it is consumed, on a local trace and on S3 alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa

from lamina import columns, kernels
from lamina.consolidate import consolidate, sort, sum_adjacent
from lamina.datadir import RelationFiles
from lamina.read.view import PinnedView, filter_times, pin, resolve_as_of
from lamina.schema import DIFF, TIME, RelationMeta
from lamina.trace.batch import OpenPart

CHUNK_BYTES = 8 << 20
"""About how many decoded bytes a source reads at a time (:func:`chunk_rows`). Each round
of the merge costs a fixed number of Arrow calls, so larger chunks merge faster: the
streamed snapshot of the cold-read benchmark's 1M updates took about a third less time
at 8 MiB (about 210,000 of its rows) than in chunks of 32,768 rows (docs/performance.md,
"The streamed snapshot's chunks")."""
MAX_CHUNK_ROWS = 1 << 18
"""At most this many rows a chunk, whatever the estimate of their width says (a
dictionary-encoded column's stored bytes understate its decoded ones)."""


def chunk_rows(row_bytes: int) -> int:
    """Rows a chunk of a source whose rows take about ``row_bytes`` bytes holds: about
    :data:`CHUNK_BYTES`, at least one row, at most :data:`MAX_CHUNK_ROWS`."""
    return max(1, min(MAX_CHUNK_ROWS, CHUNK_BYTES // max(1, row_bytes)))


def output_schema(meta: RelationMeta) -> pa.Schema:
    """Row columns and ``_diff``, nullable, no metadata: what snapshots return."""
    return pa.schema([pa.field(f.name, f.type) for f in meta.schema]
                     + [pa.field(DIFF, pa.int64())])


def _order_value(v: Any) -> tuple[Any, ...]:
    """Python ordering consistent with Arrow's ascending sort, nulls first (then NaN)."""
    if v is None:
        return (0,)
    if isinstance(v, float) and math.isnan(v):
        return (1,)
    return (2, v)


def _row_key(table: pa.Table, i: int, cols: Sequence[str]) -> tuple[Any, ...]:
    row = table.slice(i, 1).select(list(cols)).to_pylist()[0]
    return tuple(_order_value(row[c]) for c in cols)


def _count_below(table: pa.Table, bound: tuple[Any, ...], cols: Sequence[str]) -> int:
    """How many leading rows of the sorted ``table`` are below ``bound``."""
    n: int = table.num_rows
    if n == 0 or _row_key(table, n - 1, cols) < bound:
        return n
    lo, hi = 0, n - 1  # the answer is in [lo, hi]: row hi is at or above the bound
    while lo < hi:
        mid = (lo + hi) // 2
        if _row_key(table, mid, cols) < bound:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _presum(rows: pa.Table, meta: RelationMeta) -> pa.Table:
    summed = sum_adjacent(rows, meta.row_columns)
    return rows if summed is None else summed


def _part_chunks(parts: Sequence[tuple[OpenPart, bool]], meta: RelationMeta,
                 as_of: int) -> Iterator[pa.Table]:
    untimed = [*meta.row_columns, DIFF]
    for part, whole in parts:
        # a part whose every time is at or below as_of is read without _time, as the
        # snapshot reads it (its decoding was about a sixth of the part's)
        names = untimed if whole else [*meta.row_columns, TIME, DIFF]
        rows = chunk_rows(part.file.row_bytes(names))
        for rb in part.file.iter_batches(batch_size=rows, columns=names):
            t = pa.Table.from_batches([rb])
            if not whole:
                t = filter_times(t, 0, as_of).drop_columns([TIME])
            t = _presum(t, meta)
            if t.num_rows:
                yield t


def _sources(view: PinnedView, meta: RelationMeta, as_of: int) -> list[Iterator[pa.Table]]:
    """One sorted source per batch (its parts in key order), one per pending part, and
    the WAL tail."""
    by_part = dict(view.parts(0, as_of))
    sources = [_part_chunks([(p, by_part[p]) for p in parts], meta, as_of)
               for _, parts in view.batches]
    sources.extend(_part_chunks([(p, False)], meta, as_of) for _, p in view.pending)
    if view.wal:
        tail = pa.concat_tables(view.wal).drop_columns([TIME])
        tail = _presum(sort(tail, meta.sort_columns), meta)
        rows = chunk_rows(-(-tail.nbytes // max(1, tail.num_rows)))
        sources.append(iter([tail.slice(i, rows) for i in range(0, tail.num_rows, rows)]))
    return sources


def merge_sorted(sources: list[Iterator[pa.Table]], meta: RelationMeta,
                 schema: pa.Schema, context: str) -> Iterator[pa.RecordBatch]:
    """The k-way merge of the module docstring over sorted ``sources`` of rows + _diff."""
    cols = meta.sort_columns
    buffers: list[pa.Table] = [columns.empty_table(schema)] * len(sources)
    live = [True] * len(sources)
    while True:
        tails = []
        for i, src in enumerate(sources):
            # refill until the buffer holds a row below its last one (rows equal to the
            # last may continue in the next chunk) or the source is exhausted
            while live[i] and (not buffers[i].num_rows or _row_key(buffers[i], 0, cols)
                               == _row_key(buffers[i], buffers[i].num_rows - 1, cols)):
                nxt = next(src, None)
                if nxt is None:
                    live[i] = False
                else:
                    nxt = kernels.cast_table(nxt, schema)
                    buffers[i] = pa.concat_tables([buffers[i], nxt]) \
                        if buffers[i].num_rows else nxt
            if live[i]:
                tails.append(_row_key(buffers[i], buffers[i].num_rows - 1, cols))
        if not any(b.num_rows for b in buffers):
            return
        bound = min(tails) if tails else None
        pieces = []
        for i, b in enumerate(buffers):
            n = b.num_rows if bound is None else _count_below(b, bound, cols)
            if n:
                pieces.append(b.slice(0, n))
                buffers[i] = b.slice(n)
        table = pa.concat_tables(pieces)
        out = sum_adjacent(table if len(pieces) == 1 else sort(table, cols), meta.row_columns)
        if out is None:
            out = consolidate(table, meta.row_columns, cols, context=context)
        if out.num_rows:
            yield from pa.Table.from_arrays(out.columns, schema=schema).to_batches()


def snapshot_batches(files: RelationFiles, as_of: object, *, upper: int,
                     since: int) -> pa.RecordBatchReader:
    """A reader of the consolidated rows at ``as_of`` (None: the latest readable time) in
    key order (see the module docstring). The files are opened now; they are closed, and
    the lease released, when the reader is exhausted, closed or garbage-collected."""
    meta = files.meta
    at = resolve_as_of(files, as_of, upper=upper, since=since)
    view = pin(files, 0, at, what="snapshot_reader")
    schema = output_schema(meta)

    def batches() -> Iterator[pa.RecordBatch]:
        try:
            yield from merge_sorted(_sources(view, meta, at), meta, schema,
                                    f"snapshot of {meta.name!r} at {at}")
        finally:
            view.close()

    return pa.RecordBatchReader.from_batches(schema, batches())
