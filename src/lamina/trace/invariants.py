"""Invariants of a trace (docs/architecture.md, trace invariants), checked on load, after every
step and by verify.

State invariants (cheap, checked on every load and publication):

1. Batches are contiguous and non-overlapping: ``b[i].upper == b[i+1].lower``; the first
   starts at 0 and the last ends at the state's ``upper``.
2. Every batch is non-empty in time: ``lower < upper``.
3. Levels are non-increasing from oldest to newest.
4. Every batch's ``since`` is at most the state's ``since``; ``since <= upper``.
5. Pending parts lie at or above the upper: ``upper <= lower < part upper``.
6. Ids and file paths are unique.

Data invariants (read every file; ``lamina verify`` and tests):

7. Every time in a batch is in ``[lower, upper)`` or equals the batch's ``since``
   (forwarded); pending times lie in their part's range.
8. Rows are sorted by (key, other row columns, time) and consolidated: no two equal
   (row, time) except the carry of an exact sum outside int64
   (:func:`lamina.consolidate.carries_only`), no zero diff.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from lamina import columns
from lamina.consolidate import carries_only, sort
from lamina.errors import CorruptionError
from lamina.frontier import CLOSED
from lamina.layout import TraceLayout
from lamina.schema import DIFF, TIME, RelationMeta
from lamina.trace.batch import read_part
from lamina.trace.state import TraceState

if TYPE_CHECKING:
    from lamina.objstore.base import ObjectStore


def check_state(state: TraceState, where: str | None = None) -> None:
    """Raise CorruptionError if a state invariant (1-6) is broken."""

    def fail(msg: str) -> None:
        raise CorruptionError(f"trace of {state.relation!r} version {state.version}: {msg}",
                              path=where)

    if state.since > state.upper:
        fail(f"since {state.since} is beyond the upper {state.upper}")
    expected_lower = 0
    prev_level: int | None = None
    for b in state.batches:
        if b.lower != expected_lower:
            fail(f"batch {b.id} starts at {b.lower}, expected {expected_lower} (gap or overlap)")
        if not b.lower < b.upper:
            fail(f"batch {b.id} is empty in time: [{b.lower}, {b.upper})")
        if prev_level is not None and b.level > prev_level:
            fail(f"batch {b.id} has level {b.level} after a batch of level {prev_level}")
        if b.since > state.since:
            fail(f"batch {b.id} has since {b.since} beyond the trace since {state.since}")
        if b.level < 0:
            fail(f"batch {b.id} has negative level {b.level}")
        expected_lower, prev_level = b.upper, b.level
    if expected_lower != state.upper:
        fail(f"batches end at {expected_lower}, the state's upper is {state.upper}")
    for p in state.pending:
        if not state.upper <= p.lower < p.upper:
            fail(f"pending part {p.part.path} covers [{p.lower}, {p.upper}), not at or above "
                 f"the upper {state.upper}")
    ids = [b.id for b in state.batches]
    paths = [p.path for b in state.batches for p in b.parts] + [p.part.path for p in state.pending]
    if len(set(ids)) != len(ids) or len(set(paths)) != len(paths):
        fail("batch ids or file paths repeat")


def check_rows(table: pa.Table, meta: RelationMeta, *, lower: int, upper: int,
               since: int | None, what: str, path: str | None = None) -> None:
    """Raise CorruptionError if the rows of a batch or pending part break invariants 7-8."""
    if table.num_rows == 0:
        return
    # here, not at the top: ``lamina snapshot`` and the other reading commands import this
    # module (through lamina.verify) and need none of pyarrow.compute (lamina.kernels)
    import pyarrow.compute as pc

    times = table.column(TIME)
    in_range = pc.greater_equal(times, columns.scalar(lower, pa.uint64()))
    if upper != CLOSED:
        in_range = pc.and_(in_range, pc.less(times, columns.scalar(upper, pa.uint64())))
    if since is not None:
        in_range = pc.or_(in_range, pc.equal(times, columns.scalar(since, pa.uint64())))
    if not pc.all(in_range).as_py():
        bad = table.filter(pc.invert(in_range)).column(TIME)[0].as_py()
        raise CorruptionError(f"{what}: time {bad} outside [{lower}, {upper})"
                              + (f" and not the since {since}" if since is not None else ""),
                              path=path)
    if pc.any(pc.equal(table.column(DIFF), columns.scalar(0, pa.int64()))).as_py():
        raise CorruptionError(f"{what}: holds a zero diff", path=path)
    order = [*meta.sort_columns, TIME]
    if not sort(table, order).equals(table):
        raise CorruptionError(f"{what}: rows are not ordered by (key, row, time)", path=path)
    if (table.group_by(order).aggregate([]).num_rows != table.num_rows
            and not carries_only(table, order)):  # a carry: an exact sum outside int64
        raise CorruptionError(f"{what}: not consolidated (a row repeats at one time)", path=path)


def check_data(store: ObjectStore, state: TraceState, meta: RelationMeta) -> None:
    """Read every file the state names and check invariants 7-8 (and the checksums)."""
    for b in state.batches:
        tables = [read_part(store, p) for p in b.parts]
        if tables:
            check_rows(pa.concat_tables(tables), meta, lower=b.lower, upper=b.upper,
                       since=b.since, what=f"batch {b.id}",
                       path=store.location(TraceLayout.batch_dir(b.id)))
    for pp in state.pending:
        check_rows(read_part(store, pp.part), meta, lower=pp.lower, upper=pp.upper,
                   since=None, what=f"pending part {pp.part.path}",
                   path=store.location(pp.part.path))
