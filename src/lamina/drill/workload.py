"""A coordinator workload for drills and end-to-end tests (run as a subprocess).

It writes relation ``drill`` (``id`` int64 key, ``val`` string) with a seeded random mix of
inserts, retractions, multi-diff updates, future updates (times beyond the upper),
seals and compaction advances, recording each operation in the ack log (see
lamina.drill.oracle) with an fsync before and after the call. Restarted after a kill, it
continues from the frontiers the store reports.

    python -m lamina.drill.workload DATA_DIR ACK_LOG --seed 1 --ops 200 [--segment-bytes N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from lamina.errors import RelationNotFoundError
from lamina.store import Relation, Store

RELATION = "drill"
SCHEMA = pa.schema([("id", pa.int64()), ("val", pa.string())])
VALUES = ["a", "b", "c", "d"]


class AckLog:
    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, rec: dict[str, Any]) -> None:
        os.write(self._fd, (json.dumps(rec) + "\n").encode())
        os.fsync(self._fd)


def _next_op(path: Path) -> int:
    if not path.exists():
        return 1
    last = 0
    for line in path.read_text().splitlines():
        try:
            last = max(last, int(json.loads(line)["op"]))
        except (ValueError, KeyError):
            continue
    return last + 1


def run(data_dir: Path, ack_path: Path, *, seed: int, ops: int, segment_bytes: int,
        pause: float = 0.0) -> None:
    op = _next_op(ack_path)
    rng = random.Random(seed * 1_000_003 + op)
    log = AckLog(ack_path)
    with Store.open(data_dir, segment_bytes=segment_bytes) as store:
        try:
            rel = store.relation(RELATION)
        except RelationNotFoundError:
            rel = store.create_relation(RELATION, SCHEMA, key=["id"])
        live: list[tuple[int, str]] = []
        for _ in range(ops):
            op = _step(rel, rng, op, log, live)
            if pause:
                time.sleep(pause)
    print("workload done", flush=True)


def _step(rel: Relation, rng: random.Random, op: int, log: AckLog,
          live: list[tuple[int, str]]) -> int:
    upper, since = rel.upper, rel.since
    roll = rng.random()
    if roll < 0.6:
        rows: list[list[Any]] = [[-op, "marker", upper, 1]]
        for _ in range(rng.randint(1, 40)):
            kind = rng.random()
            t = upper + (rng.randint(1, 64) if rng.random() < 0.1 else rng.randint(0, 2))
            if kind < 0.5 or not live:
                row = (rng.randint(0, 500), rng.choice(VALUES))
                live.append(row)
                rows.append([row[0], row[1], t, rng.choice([1, 1, 2])])
            else:
                row = live[rng.randrange(len(live))]
                rows.append([row[0], row[1], t, -1])
        log.write({"op": op, "intent": "append", "rows": rows})
        rel.append(pa.table({"id": pa.array([r[0] for r in rows], pa.int64()),
                             "val": [r[1] for r in rows],
                             "_time": pa.array([r[2] for r in rows], pa.uint64()),
                             "_diff": pa.array([r[3] for r in rows], pa.int64())}))
    elif roll < 0.9:
        value = upper + rng.randint(1, 3)
        log.write({"op": op, "intent": "seal", "value": value})
        rel.seal(value)
    else:
        value = rng.randint(since, upper)
        log.write({"op": op, "intent": "since", "value": value})
        rel.allow_compaction(value)
    log.write({"op": op, "ack": True})
    return op + 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("data_dir", type=Path)
    ap.add_argument("ack_log", type=Path)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ops", type=int, default=200)
    ap.add_argument("--segment-bytes", type=int, default=8192)
    ap.add_argument("--pause", type=float, default=0.0)
    args = ap.parse_args()
    run(args.data_dir, args.ack_log, seed=args.seed, ops=args.ops,
        segment_bytes=args.segment_bytes, pause=args.pause)


if __name__ == "__main__":
    main()
