"""The snapshot: the consolidated rows at ``as_of``, in memory (``Relation.snapshot``).

Rows of integer (and boolean) columns whose value ranges pack into one uint64 are
merged by one numpy sort of those packed keys, every part and the WAL tail together, and
decoded once (:mod:`lamina.packed`). Otherwise: trace parts are sorted by row (then
time), so each is first summed run by run
(:func:`lamina.consolidate.sum_adjacent`: neighbour comparisons, no hashing), which usually
leaves about one row per distinct row and part; those sorted runs (and the WAL tail) are
then merged by one sort, which Arrow does fast on presorted runs, and summed run by run
again, one key range per core (:func:`lamina.consolidate.merge_runs`). Where
``sum_adjacent`` declines (float row columns, sums that could leave int64)
:func:`lamina.consolidate.consolidate` hashes instead; the rows are the same either way.

A part whose every time is at or below ``as_of`` is read without its ``_time`` column;
the others are read whole and filtered. Every part is checked against its CRC32C first
(:class:`lamina.trace.batch.OpenPart`). Parts are decoded one per core at a time: Arrow
decodes a part's columns in parallel, but one string column can keep a core busy while
the other waits (a first snapshot of the cold-read store on 2 cores: 0.130 to 0.136 s
one part at a time, 0.119 to 0.123 s side by side; docs/performance.md).
"""

from __future__ import annotations

import pyarrow as pa

from lamina.columns import empty_table
from lamina.consolidate import consolidate, consolidate_updates, merge_runs
from lamina.datadir import RelationFiles
from lamina.hugepages import small_pages
from lamina.read.view import filter_times, pin, resolve_as_of
from lamina.schema import TIME, RelationMeta
from lamina.threads import map_on_threads
from lamina.trace.batch import OpenPart


def loose(table: pa.Table) -> pa.Table:
    """The same columns with nullable fields and no metadata, as consolidation returns."""
    return pa.Table.from_arrays(table.columns, names=table.column_names)


def _stored(files: RelationFiles, as_of: int) -> tuple[list[pa.Table], list[pa.Table]]:
    """The relation's updates with ``_time <= as_of``, without the ``_time`` column: from
    the trace (batch and pending parts, each sorted by row and time) and from the WAL tail
    (in append order)."""
    untimed = [c for c in files.meta.update_schema.names if c != TIME]

    def read(part: tuple[OpenPart, bool]) -> pa.Table:
        p, whole = part
        if whole:
            return p.file.read(columns=untimed)
        return filter_times(p.file.read(), 0, as_of).drop_columns([TIME])

    with pin(files, 0, as_of, what="snapshot") as view:
        parts = map_on_threads(read, list(view.parts(0, as_of)), name="decode",
                               workers=pa.cpu_count())
        wal = [t.drop_columns([TIME]) for t in view.wal]
    return parts, wal


def snapshot(files: RelationFiles, as_of: object, *, upper: int, since: int) -> pa.Table:
    """The consolidated rows at ``as_of`` (None: the latest readable time; the rules of
    :func:`lamina.read.view.resolve_as_of`), ordered by the sort columns (module
    docstring).

    A row whose exact sum at ``as_of`` lies outside int64 (batches may keep such a sum as
    a carry) raises DiffOverflowError naming it; the error's ``rest`` is this snapshot
    without the offending rows and ``overflows`` those rows with their exact sums, so the
    rest of the relation stays readable and nothing is dropped silently."""
    meta = files.meta
    at = resolve_as_of(files, as_of, upper=upper, since=since)
    with small_pages():  # the decoded parts too, not only the merge (lamina.hugepages)
        parts, wal = _stored(files, at)  # times at or before as_of
        return consolidated(meta, parts, wal, context=f"snapshot of {meta.name!r} at {at}",
                            workers=pa.cpu_count())


def consolidated(meta: RelationMeta, parts: list[pa.Table], wal: list[pa.Table], *,
                 context: str, workers: int = 1, timed: bool = False) -> pa.Table:
    """The consolidated rows of untimed updates: ``parts`` each sorted by row (trace parts,
    or rows filtered out of them in order), ``wal`` in any order. The sorted runs are
    merged (:func:`lamina.consolidate.merge_runs`, on ``workers`` threads); where that
    declines, a hash consolidation does it (``context`` names the read in its errors).
    Its temporaries go without huge pages meanwhile, numpy's and Arrow's
    (:mod:`lamina.hugepages`).

    With ``timed``, the updates keep ``_time`` (parts sorted by row, then time) and are
    consolidated per row and time, as :func:`lamina.consolidate.consolidate_updates` does:
    ``Relation.updates`` (lamina.read.unsealed)."""
    runs = [loose(t) for t in parts]
    tail = [loose(t) for t in wal]
    extra = [TIME] if timed else []
    rows, order = [*meta.row_columns, *extra], [*meta.sort_columns, *extra]
    with small_pages():  # its temporaries (lamina.hugepages)
        out = merge_runs(runs, tail, rows, order, workers=workers)
        if out is not None:
            return out
        if runs or tail:
            table = pa.concat_tables([*runs, *tail])
        else:
            empty = empty_table(meta.update_schema)
            table = loose(empty if timed else empty.drop_columns([TIME]))
        if timed:
            return consolidate_updates(table, meta.row_columns, meta.sort_columns,
                                       context=context)
        return consolidate(table, meta.row_columns, meta.sort_columns, context=context)
