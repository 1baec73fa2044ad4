"""Updates above a relation's sealed upper: what a killed coordinator appended last.

``append`` is durable on return and ``seal`` is a separate record, so a coordinator killed
between the two leaves updates at times ``>= upper`` in the WAL. They are acknowledged:
they become visible once the relation is sealed past them. The reclocker rewrites such a
time after a restart; to stay exactly once it must subtract what is already there, which
:func:`unsealed_updates` reads.

Where they are stored (the newest WAL segment, or the trace's pending parts once the
compacter converted that segment) is the read wing's business: this asks the public API,
``Relation.updates(upper, CLOSED)`` (lamina.read.unsealed), for every update at or above
the upper.
"""

from __future__ import annotations

import pyarrow as pa

from lamina.frontier import CLOSED
from lamina.store import Relation


def unsealed_updates(rel: Relation) -> pa.Table:
    """The updates of ``rel`` at times at or above its sealed upper (row columns, ``_time``,
    ``_diff``; consolidated, by key and time), wherever they are stored; an empty table
    when there are none. Raises :class:`~lamina.errors.StorageError` when files keep
    vanishing under the read."""
    return rel.updates(rel.upper, CLOSED)
