"""A runnable coordinator: writes an order stream into a lamina data directory.

Run the daemon in one terminal (``make run``) and this in another::

    .venv/bin/python examples/coordinator.py --data-dir lamina-data --seconds 10

Each tick it inserts a few orders, retracts some older ones (diff -1), schedules a few
"future" updates (times beyond the current upper, legal and applied only once their time
is sealed), seals the tick, and lets history older than ten ticks be compacted. At the end
it prints the snapshot at the last sealed time; ``lamina status`` shows the compacter
catching up.
"""

from __future__ import annotations

import argparse
import random
import time

import pyarrow as pa

from lamina import Store
from lamina.errors import RelationNotFoundError

SCHEMA = pa.schema([("id", pa.int64()), ("item", pa.string()), ("qty", pa.int32())])
ITEMS = ["apple", "pear", "plum", "fig", "kiwi"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default="lamina-data")
    ap.add_argument("--relation", default="orders")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rows-per-tick", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    # Small segments so that the compacter has finished segments to convert quickly.
    with Store.open(args.data_dir, segment_bytes=1 << 20) as store:
        try:
            rel = store.relation(args.relation)
        except RelationNotFoundError:
            rel = store.create_relation(args.relation, SCHEMA, key=["id"])
        live: list[tuple[int, str, int]] = []
        next_id = 1
        deadline = time.monotonic() + args.seconds
        ticks = 0
        while time.monotonic() < deadline:
            t = rel.upper
            rows: list[tuple[int, str, int, int, int]] = []
            for _ in range(args.rows_per_tick):
                row = (next_id, rng.choice(ITEMS), rng.randint(1, 9))
                next_id += 1
                live.append(row)
                rows.append((*row, t, 1))
            for _ in range(args.rows_per_tick // 5):
                if live:
                    row = live.pop(rng.randrange(len(live)))
                    rows.append((*row, t, -1))
            for _ in range(args.rows_per_tick // 20):
                rows.append((next_id, "preorder", 1, t + rng.randint(1, 50), 1))
                next_id += 1
            rel.append(pa.table({
                "id": [r[0] for r in rows], "item": [r[1] for r in rows],
                "qty": pa.array([r[2] for r in rows], pa.int32()),
                "_time": pa.array([r[3] for r in rows], pa.uint64()),
                "_diff": [r[4] for r in rows]}))
            rel.seal(t + 1)
            if t >= 10:
                rel.allow_compaction(t - 10)
            ticks += 1
        snap = rel.snapshot(rel.upper - 1)
        print(f"{ticks} ticks written; relation {rel.name!r} has upper {rel.upper}, since "
              f"{rel.since}, {snap.num_rows} live rows at {rel.upper - 1}")


if __name__ == "__main__":
    main()
