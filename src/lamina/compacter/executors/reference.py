"""The reference executor of conversion and merge plans, with pyarrow, in this process.

This is the reference the Spark jobs (lamina.compacter.step) are tested against: given the
same plan and inputs both produce the same batch rows, in the same order, and the same
pending buckets. It holds a step's input in memory, so the daemon uses Spark instead
(or, with ``executor = "inprocess"``, runs it in threads:
:mod:`lamina.compacter.executors.inprocess`). :func:`convert` and :func:`merge` also commit
the step, which is what the trace tests use to drive a trace without a daemon.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from lamina import columns
from lamina.consolidate import consolidate_updates, forward
from lamina.frontier import CLOSED
from lamina.layout import TraceLayout
from lamina.schema import TIME, RelationMeta
from lamina.trace.batch import PartFile, read_part, write_part
from lamina.trace.pending import new_pending_path, split_by_bucket
from lamina.trace.plan import ConversionPlan, MergePlan
from lamina.trace.state import PendingPart, TraceState
from lamina.trace.trace import Trace
from lamina.wal.reader import segment_updates
from lamina.wal.segment import SegmentFile


def conversion_input(trace: Trace, plan: ConversionPlan) -> pa.Table:
    meta = trace.meta
    tables: list[pa.Table] = []
    for span in plan.segments:
        seg = SegmentFile(Path(span.path), span.seq, finished=True)
        tables.extend(segment_updates(seg, meta.name, meta.update_schema))
    tables.extend(read_part(trace.store, p.part) for p in plan.consume)
    return pa.concat_tables(tables) if tables else meta.update_schema.empty_table()


def split_at(table: pa.Table, upper: int) -> tuple[pa.Table, pa.Table]:
    """(updates before ``upper``, future updates at or after it)."""
    if upper == CLOSED:
        return table, table.schema.empty_table()
    below = pc.less(table.column(TIME), columns.scalar(upper, pa.uint64()))
    return table.filter(below), table.filter(pc.invert(below))


def run_conversion(trace: Trace, plan: ConversionPlan, updates: pa.Table | None = None
                   ) -> tuple[list[PartFile], list[PendingPart]]:
    """Write the plan's batch and pending parts; ``updates`` is its
    :func:`conversion_input` when the caller already read it."""
    meta = trace.meta
    if updates is None:
        updates = conversion_input(trace, plan)
    past, future = split_at(updates, plan.upper)
    ctx = f"conversion of {meta.name!r} to {plan.upper}"
    batch = consolidate_updates(forward(past, plan.since), meta.row_columns,
                                meta.sort_columns, context=ctx)
    schema = meta.update_schema
    parts = []
    if batch.num_rows:
        parts.append(write_part(trace.store, TraceLayout.batch_part(plan.batch_id, 0),
                                schema, [batch]))
    future = consolidate_updates(future, meta.row_columns, meta.sort_columns, context=ctx)
    pending = [PendingPart(lo, hi, write_part(trace.store, new_pending_path(), schema, [t]))
               for lo, hi, t in split_by_bucket(future, plan.upper)]
    return parts, pending


def convert(trace: Trace, plan: ConversionPlan) -> TraceState:
    parts, pending = run_conversion(trace, plan)
    return trace.commit_conversion(plan, parts, pending)


def merged_rows(trace: Trace, plan: MergePlan, meta: RelationMeta) -> pa.Table:
    tables = [read_part(trace.store, p) for b in (plan.left, plan.right)
              for p in b.parts]
    table = pa.concat_tables(tables) if tables else meta.update_schema.empty_table()
    return consolidate_updates(forward(table, plan.since), meta.row_columns, meta.sort_columns,
                               context=f"merge of {meta.name!r} [{plan.lower}, {plan.upper})")


def run_merge(trace: Trace, plan: MergePlan) -> list[PartFile]:
    table = merged_rows(trace, plan, trace.meta)
    if not table.num_rows:
        return []
    return [write_part(trace.store, TraceLayout.batch_part(plan.batch_id, 0),
                       trace.meta.update_schema, [table])]


def merge(trace: Trace, plan: MergePlan) -> TraceState:
    return trace.commit_merge(plan, run_merge(trace, plan))
