"""The trace side of the read path (see lamina.read): the updates a reader takes from
trace batches and pending parts, and the last WAL segment they already cover."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from lamina.fs import FileSystem
from lamina.layout import Layout
from lamina.schema import TIME, RelationMeta
from lamina.trace.batch import read_part
from lamina.trace.state import StateStore, TraceState


def current_state(layout: Layout, meta: RelationMeta) -> TraceState | None:
    """The newest trace state of this incarnation of the relation, if any."""
    state = StateStore(layout.trace_dir(meta.name), FileSystem()).load_latest()
    if state is None or state.relation_id != meta.relation_id:
        return None
    return state


def trace_updates(layout: Layout, meta: RelationMeta,
                  as_of: int) -> tuple[list[pa.Table], int]:
    """Updates with ``_time <= as_of`` from the newest trace state, and the sequence number
    of the last WAL segment that state has converted. FileNotFoundError means a file was
    collected under the reader: retry."""
    state = current_state(layout, meta)
    if state is None:
        return [], 0
    trace_dir = layout.trace_dir(meta.name)
    bound = pa.scalar(as_of, pa.uint64())
    tables: list[pa.Table] = []
    for b in state.batches:
        if b.lower <= as_of:
            for p in b.parts:
                t = read_part(trace_dir, p)
                # a batch's times are below its upper or forwarded to its since (<= as_of)
                whole = b.upper - 1 <= as_of
                tables.append(t if whole else t.filter(pc.less_equal(t[TIME], bound)))
    for pp in state.pending:
        if pp.lower <= as_of:
            t = read_part(trace_dir, pp.part)
            tables.append(t.filter(pc.less_equal(t[TIME], bound)))
    return tables, state.converted_through
