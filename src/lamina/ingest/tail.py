"""Updates above a relation's sealed upper: what a killed coordinator appended last.

``append`` is durable on return and ``seal`` is a separate record, so a coordinator killed
between the two leaves updates at times ``>= upper`` in the WAL. They are acknowledged:
they become visible once the relation is sealed past them. The reclocker rewrites such a
time after a restart; to stay exactly once it must subtract what is already there, which
:func:`unsealed_updates` reads.

Where they can be: the ingest service appends a time ``T`` and then seals ``T + 1`` before
anything else, so they usually sit in the newest WAL segment; but the compacter converts
segments whole, so once such a segment is converted (and deleted) its updates at or above
the upper sit in the trace's pending parts. :func:`unsealed_updates` therefore reads the
same consistent view as every reader (:func:`lamina.read.pin`: trace state first, then the
WAL tail after its ``converted_through``), restricted to times at or above the upper; a
listing that keeps changing under it is a :class:`~lamina.errors.StorageError`, as on the
read path.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from lamina.frontier import MAX_TIME
from lamina.read import pin
from lamina.schema import TIME
from lamina.store import Relation


def unsealed_updates(rel: Relation) -> pa.Table:
    """The updates of ``rel`` at times at or above its sealed upper (row columns, ``_time``,
    ``_diff``), wherever they are stored (WAL tail, trace pending parts); an empty table
    when there are none. Raises :class:`~lamina.errors.StorageError` when files keep
    vanishing under the read (see :func:`lamina.read.pin`)."""
    upper = rel.upper
    meta = rel.meta
    if upper > MAX_TIME:
        return meta.update_schema.empty_table()      # closed: nothing can be above it
    lo = pa.scalar(upper, pa.uint64())
    tables: list[pa.Table] = []
    with pin(rel.store.layout, meta, upper, MAX_TIME) as view:
        parts = [p for _, ps in view.batches for p in ps] + [p for _, p in view.pending]
        for p in parts:
            t = p.file.read()
            t = t.filter(pc.greater_equal(t.column(TIME), lo))
            if t.num_rows:
                tables.append(t)
        tables.extend(view.wal)             # already restricted to [upper, MAX_TIME]
    if not tables:
        return meta.update_schema.empty_table()
    return pa.concat_tables([t.select(meta.update_schema.names).cast(meta.update_schema)
                             for t in tables])
