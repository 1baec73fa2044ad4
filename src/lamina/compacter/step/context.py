"""The step context: everything a task of one step needs besides its own work item.

A :class:`StepContext` is built by the driver (:func:`lamina.compacter.step.driver.run_step`)
and pickled into every task of the step (cloudpickle carries it inside the task function),
so it holds plain data only: the relation's trace store (an
:class:`~lamina.objstore.base.ObjectStore`, which pickles as its URL and settings without
credentials; an ``s3://`` store builds its client lazily in each task process, after
PySpark forked it), object keys relative to it, the relation's schema and columns, the
step's frontiers, and the work items of every decode group (a task picks its own by its
id).

Run tables carry two columns besides the update columns: the *prefix* (an int64 ordering
like the first sort column, :func:`lamina.trace.order.order_prefix`) and, for future rows,
the *bucket* (the lower end of the row's pending bucket, uint64). Their names
(:func:`aux_columns`) differ from every row column, compared case-insensitively.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from lamina.compacter.step.runs import RunCompression
from lamina.compacter.step.work import WorkItem
from lamina.objstore.base import ObjectStore
from lamina.schema import TIME, RelationMeta

BUCKET = "__lamina_bucket"
"""Run column of future rows: the lower end of the row's pending bucket (uint64).
(:func:`aux_columns` renames it away from any row column.)"""
PREFIX = "__lamina_prefix"
"""Run column: an int64 that orders like the first sort column (see
:func:`lamina.trace.order.order_prefix`). It leads every ordering, so sorting and searching
runs is mostly integer work."""


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
class StepContext:
    """Everything a task of one step needs besides its own work item."""

    store: ObjectStore
    """The relation's trace: where tasks read parts and write runs and parts."""
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
    """Key prefix of the step's runs in the trace store."""
    sample_every: int
    """A decode task samples every ``sample_every``-th batch row for the cuts..."""
    min_samples: int
    """...but at least this many rows (when it has them), so that a small step still has
    enough sampled keys for its parts."""
    parts: int
    """The most batch parts the step writes (sizes the record batches of runs)."""
    groups: tuple[tuple[WorkItem, ...], ...]
    run_compression: RunCompression = "lz4"
    """The codec the decode tasks write their runs with (``JobTuning.run_compression``,
    ``auto`` resolved for this step: :func:`lamina.compacter.step.runs.run_codec`)."""

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
