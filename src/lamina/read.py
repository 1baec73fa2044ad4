"""The read path: one consistent view of a relation at ``as_of``.

A relation's updates live in three places at once: trace batches (converted and merged),
the trace's pending area (future updates) and WAL segments the trace has not converted
yet. The trace state names the last converted segment, so a reader takes

    trace state version N  +  segments with a sequence number above N's converted_through

and gets every acknowledged update exactly once. The state is read *before* the segments
are listed, and the listed tail must start right after ``converted_through``: if it does
not, the compacter converted and deleted segments after the state was read, and the
reader starts over (listing first would let a conversion hide a newer segment).

The compacter may publish version N+1, delete segments and collect batch files meanwhile;
a reader that finds a file gone starts over from a fresh state (files named by kept
versions outlive a grace period, so a retry succeeds).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from lamina.consolidate import consolidate, sort, sum_adjacent
from lamina.errors import AsOfOutOfRangeError, InvalidArgumentError, StorageError
from lamina.layout import Layout
from lamina.schema import TIME, RelationMeta
from lamina.wal.reader import frontiers, segment_updates
from lamina.wal.record import CLOSED
from lamina.wal.segment import list_segments

_RETRIES = 20


def relation_frontiers(wal_dir: Path, relation: str) -> tuple[int, int]:
    return frontiers(wal_dir, relation)


def check_as_of(name: str, as_of: object, *, upper: int, since: int) -> int:
    if isinstance(as_of, bool) or not isinstance(as_of, int):
        raise InvalidArgumentError(f"as_of must be an int, got {type(as_of).__name__}")
    if not since <= as_of < upper:
        up = "CLOSED" if upper == CLOSED else str(upper)
        raise AsOfOutOfRangeError(
            f"relation {name!r}: as_of {as_of} is outside [since, upper) = [{since}, {up}); "
            + ("history before since was compacted away" if as_of < since
               else "times at or after the upper may still change; seal further first"))
    return as_of


def _filter(table: pa.Table, as_of: int) -> pa.Table:
    return table.filter(pc.less_equal(table.column(TIME), pa.scalar(as_of, pa.uint64())))


def _stored(layout: Layout, meta: RelationMeta, as_of: int
            ) -> tuple[list[pa.Table], list[pa.Table]]:
    """The relation's updates with ``_time <= as_of``: from the trace (batch and pending
    parts, each sorted by row and time) and from the WAL tail (in append order)."""
    from lamina.trace.view import trace_updates  # the trace builds on this module

    for _ in range(_RETRIES):
        try:
            parts, converted_through = trace_updates(layout, meta, as_of)
            tail = [s for s in list_segments(layout.wal_dir(meta.name))
                    if s.seq > converted_through]
            if [s.seq for s in tail] != list(range(converted_through + 1,
                                                   converted_through + 1 + len(tail))):
                continue  # segments were converted and deleted after the state was read
            wal = [_filter(t, as_of) for seg in tail
                   for t in segment_updates(seg, meta.name, meta.update_schema)]
        except FileNotFoundError:
            continue
        return parts, wal
    raise StorageError(f"relation {meta.name!r}: files kept vanishing while reading; is "
                       "garbage collection running with a zero grace period?")


def updates_at(layout: Layout, meta: RelationMeta, as_of: int) -> pa.Table:
    """Every stored update of the relation with ``_time <= as_of`` (not consolidated)."""
    parts, wal = _stored(layout, meta, as_of)
    if not parts and not wal:
        return meta.update_schema.empty_table()
    return pa.concat_tables([*parts, *wal])


def _loose(table: pa.Table) -> pa.Table:
    """The same columns with nullable fields and no metadata, as consolidation returns."""
    return pa.Table.from_arrays(table.columns, names=table.column_names)


def snapshot(layout: Layout, meta: RelationMeta, as_of: int, *, upper: int,
             since: int) -> pa.Table:
    """The consolidated rows at ``as_of``, ordered by the sort columns.

    Trace parts are sorted by row (then time), so each is first summed run by run
    (:func:`lamina.consolidate.sum_adjacent`: neighbour comparisons, no hashing), which
    usually leaves about one row per distinct row and part; those sorted runs (and the WAL
    tail) are then merged by one sort, which Arrow does fast on presorted runs, and summed
    run by run again. Where ``sum_adjacent`` declines (float row columns, sums that could
    leave int64) :func:`lamina.consolidate.consolidate` hashes instead; the rows are the
    same either way."""
    as_of = check_as_of(meta.name, as_of, upper=upper, since=since)
    parts, wal = _stored(layout, meta, as_of)  # only times at or before as_of
    tables = []
    adjacent = True
    for t in parts:
        rows = _loose(t.drop_columns([TIME]))
        summed = sum_adjacent(rows, meta.row_columns)
        adjacent = adjacent and summed is not None
        tables.append(rows if summed is None else summed)
    tables.extend(_loose(t.drop_columns([TIME])) for t in wal)
    table = pa.concat_tables(tables) if tables else \
        _loose(meta.update_schema.empty_table().drop_columns([TIME]))
    if adjacent:  # the parts' sums are sorted runs: sorting them is cheaper than hashing
        out = sum_adjacent(sort(table, meta.sort_columns), meta.row_columns)
        if out is not None:
            return out
    return consolidate(table, meta.row_columns, meta.sort_columns,
                       context=f"snapshot of {meta.name!r} at {as_of}")
