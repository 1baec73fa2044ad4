"""Child process of tests/wal/test_crash.py: appends batches until it is killed.

Usage: ``python crash_child.py DATA_DIR FIRST_BATCH_ID SEED``

Opens relation "crash" (columns batch, row, pad; created by the parent) with fsync
"always" and 4 KiB segments, prints ``ready``, then loops: append one batch whose rows all
carry a unique batch id (rows 0..n-1), print the id after ``append`` returned (the
acknowledgement the parent holds lamina to), then often seal one step further (which
rotates segments) and now and then move the compaction frontier. Some batches are at
future times. It never exits on its own: the parent SIGKILLs it.

The test forks it from a :class:`lamina.forkserver.ForkServer` that imported this module
(:func:`forked`), so that a child starts in milliseconds, not in the quarter of a second of
CPU an interpreter takes to import lamina and pyarrow; kept free of pytest imports.
"""

from __future__ import annotations

import random
import sys

import pyarrow as pa

from lamina import Store

RELATION = "crash"
SCHEMA = pa.schema([("batch", pa.int64()), ("row", pa.int64()), ("pad", pa.string())])


def main(data_dir: str, first_id: int, seed: int) -> None:
    rng = random.Random(seed)
    store = Store.open(data_dir, segment_bytes=4096, fsync="always")
    rel = store.relation(RELATION)
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    batch_id = first_id
    while True:
        n = rng.randint(1, 40)
        upper = rel.upper
        t = upper + rng.choice((0, 0, 0, 1, 7))  # sometimes a future update
        rel.append(pa.table({
            "batch": pa.array([batch_id] * n, pa.int64()),
            "row": pa.array(range(n), pa.int64()),
            "pad": pa.array(["p" * rng.randint(0, 60)] * n, pa.string()),
            "_time": pa.array([t] * n, pa.uint64()),
            "_diff": pa.array([1] * n, pa.int64()),
        }))
        out.write(f"{batch_id}\n")
        out.flush()
        batch_id += 1
        r = rng.random()
        if r < 0.6:
            rel.seal(upper + 1)
        if r < 0.1:
            rel.allow_compaction(max(rel.since, rel.upper - 2))


def forked(argv: list[str]) -> None:
    """The fork server's target: ``argv`` as the command line's."""
    main(argv[0], int(argv[1]), int(argv[2]))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
