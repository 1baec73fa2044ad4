"""Every read of the public API, for the cold-read test (tests/test_columns.py), which runs
them in a fresh interpreter and in its own process. Imports only what a reader would."""

from __future__ import annotations

import threading

import pyarrow as pa

from lamina.store import Relation


def every_read(rel: Relation) -> list[int]:
    """Rows of: the latest snapshot, one at time 2, a lookup, the streamed snapshot, the
    whole history of updates, the updates from time 2 on, and a subscription from time 2
    that stops once it has caught up."""
    caught_up = threading.Event()
    caught_up.set()
    return [rel.snapshot().num_rows, rel.snapshot(as_of=2).num_rows,
            rel.lookup({"id": [0, 1, 2, 3]}).num_rows,
            rel.snapshot_reader().read_all().num_rows,
            rel.updates().num_rows, rel.updates(2, rel.upper).num_rows,
            sum(t.num_rows for t in rel.subscribe(as_of=2, stop=caught_up)
                if isinstance(t, pa.Table))]
