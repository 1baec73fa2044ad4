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

from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc

from lamina.consolidate import consolidate, merge_runs
from lamina.errors import AsOfOutOfRangeError, InvalidArgumentError, StorageError
from lamina.frontier import as_time, fmt
from lamina.layout import Layout
from lamina.schema import TIME, RelationMeta
from lamina.trace.view import Footers, PinnedView, current_state, open_view
from lamina.wal.reader import segment_updates
from lamina.wal.segment import SegmentFile, list_segments

_RETRIES = 20


def check_as_of(name: str, as_of: object, *, upper: int, since: int) -> int:
    if isinstance(as_of, bool) or not isinstance(as_of, int):
        raise InvalidArgumentError(f"as_of must be an int, got {type(as_of).__name__}")
    if not since <= as_of < upper:
        raise AsOfOutOfRangeError(
            f"relation {name!r}: as_of {as_of} is outside [since, upper) = "
            f"[{since}, {fmt(upper)}); "
            + ("history before since was compacted away" if as_of < since
               else "times at or after the upper may still change; seal further first"))
    return as_of


def filter_times(table: pa.Table, lo: int, hi: int) -> pa.Table:
    """The rows of an update table with ``lo <= _time <= hi`` (``hi`` may be a frontier's
    ``CLOSED``, which bounds nothing)."""
    times = table.column(TIME)
    keep = pc.less_equal(times, pa.scalar(as_time(hi), pa.uint64()))
    if lo > 0:
        keep = pc.and_(pc.greater_equal(times, pa.scalar(lo, pa.uint64())), keep)
    return table.filter(keep)


def pin(layout: Layout, meta: RelationMeta, lo: int, hi: int, *,
        verify: bool = True, footers: Footers | None = None,
        segments: Callable[[SegmentFile], list[pa.Table]] | None = None) -> PinnedView:
    """Open, with the state-first protocol above, every file that may hold updates with
    times in ``[lo, hi]``: the trace's batch and pending parts (kept open, read lazily;
    :meth:`PinnedView.parts` says which need a time filter) and the WAL tail (decoded now,
    by ``segments`` if given, filtered to ``[lo, hi]``). Close the view when done."""
    for _ in range(_RETRIES):
        try:
            state = current_state(layout, meta)
            converted_through = state.converted_through if state is not None else 0
            tail = [s for s in list_segments(layout.wal_dir(meta.name))
                    if s.seq > converted_through]
            if [s.seq for s in tail] != list(range(converted_through + 1,
                                                   converted_through + 1 + len(tail))):
                continue  # segments were converted and deleted after the state was read
            wal = []
            for seg in tail:
                decoded = segments(seg) if segments is not None else \
                    segment_updates(seg, meta.name, meta.update_schema)
                for t in decoded:
                    kept = filter_times(t, lo, hi)
                    if kept.num_rows:
                        wal.append(kept)
            batches, pending = open_view(layout, meta, state, lo, hi, verify=verify,
                                         footers=footers)
        except FileNotFoundError:
            continue
        return PinnedView(state, batches, pending, wal)
    raise StorageError(f"relation {meta.name!r}: files kept vanishing while reading; is "
                       "garbage collection running with a zero grace period?")


def _stored(layout: Layout, meta: RelationMeta, as_of: int, *, times: bool = True
            ) -> tuple[list[pa.Table], list[pa.Table]]:
    """The relation's updates with ``_time <= as_of``: from the trace (batch and pending
    parts, each sorted by row and time) and from the WAL tail (in append order); without
    the ``_time`` column if not ``times`` (then a part that needs no time filter is read
    without it)."""
    untimed = [c for c in meta.update_schema.names if c != TIME]
    parts = []
    with pin(layout, meta, 0, as_of) as view:
        for p, whole in view.parts(0, as_of):
            if whole:
                parts.append(p.file.read(columns=None if times else untimed))
                continue
            kept = filter_times(p.file.read(), 0, as_of)
            parts.append(kept if times else kept.drop_columns([TIME]))
        wal = view.wal if times else [t.drop_columns([TIME]) for t in view.wal]
    return parts, wal


def updates_at(layout: Layout, meta: RelationMeta, as_of: int) -> pa.Table:
    """Every stored update of the relation with ``_time <= as_of`` (not consolidated)."""
    parts, wal = _stored(layout, meta, as_of)
    if not parts and not wal:
        return meta.update_schema.empty_table()
    return pa.concat_tables([t.cast(meta.update_schema) for t in [*parts, *wal]])


def loose(table: pa.Table) -> pa.Table:
    """The same columns with nullable fields and no metadata, as consolidation returns."""
    return pa.Table.from_arrays(table.columns, names=table.column_names)


def snapshot(layout: Layout, meta: RelationMeta, as_of: int, *, upper: int,
             since: int) -> pa.Table:
    """The consolidated rows at ``as_of``, ordered by the sort columns.

    Trace parts are sorted by row (then time), so each is first summed run by run
    (:func:`lamina.consolidate.sum_adjacent`: neighbour comparisons, no hashing), which
    usually leaves about one row per distinct row and part; those sorted runs (and the WAL
    tail) are then merged by one sort, which Arrow does fast on presorted runs, and summed
    run by run again, one key range per core (:func:`lamina.consolidate.merge_runs`).
    Where ``sum_adjacent`` declines (float row columns, sums that could leave int64)
    :func:`lamina.consolidate.consolidate` hashes instead; the rows are the same either way.

    A row whose exact sum at ``as_of`` lies outside int64 (batches may keep such a sum as
    a carry) raises DiffOverflowError naming it; the error's ``rest`` is this snapshot
    without the offending rows and ``overflows`` those rows with their exact sums, so the
    rest of the relation stays readable and nothing is dropped silently."""
    as_of = check_as_of(meta.name, as_of, upper=upper, since=since)
    parts, wal = _stored(layout, meta, as_of, times=False)  # times at or before as_of
    runs = [loose(t) for t in parts]
    tail = [loose(t) for t in wal]
    out = merge_runs(runs, tail, meta.row_columns, meta.sort_columns, workers=pa.cpu_count())
    if out is not None:
        return out
    table = pa.concat_tables([*runs, *tail]) if runs or tail else \
        loose(meta.update_schema.empty_table().drop_columns([TIME]))
    return consolidate(table, meta.row_columns, meta.sort_columns,
                       context=f"snapshot of {meta.name!r} at {as_of}")
