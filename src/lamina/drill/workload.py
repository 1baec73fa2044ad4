"""A coordinator workload for drills and end-to-end tests (run as a subprocess).

It writes relation ``drill`` (or ``--relation``; ``id`` int64 key, ``val`` string) with a
seeded random mix of inserts, retractions, multi-diff updates, future updates (times
beyond the upper), seals and compaction advances, recording each operation in the ack log
(see lamina.drill.oracle) with an fsync before and after the call. Restarted after a kill, it
continues from the frontiers the store reports and from the next operation number.

With ``--relations K`` (K > 1) it writes K relations, ``<relation>.0`` to
``<relation>.<K-1>`` (:func:`relation_names`), each operation on one of them picked at
random; an operation's intent names its relation (``"rel"``), and operation numbers count
across all of them.

Every append carries a marker row ``(id = -op, val = "marker")`` at the append's lowest
time (the upper when it was made), so the data itself tells whether an append whose
acknowledgement was lost to a kill reached the log, and how often.

It prints ``ready`` once the store is open (the drill times its kills from there) and
``workload done`` at the end. ``--final`` ends with a seal beyond every time written so
far (future updates lie at most ``FUTURE_SPAN`` past the upper of their append), so every
update becomes readable.

    python -m lamina.drill.workload DATA_DIR ACK_LOG --seed 1 --ops 200 [--segment-bytes N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from lamina import columns
from lamina.errors import RelationNotFoundError
from lamina.store import Relation, Store

RELATION = "drill"
SCHEMA = pa.schema([("id", pa.int64()), ("val", pa.string())])
VALUES = ["a", "b", "c", "d"]
FUTURE_SPAN = 64
MAX_ROWS = 16


class AckLog:
    """The ack log, written with one ``write`` and an ``fsync`` per line. A line torn by a
    kill is ended on the next open, so the next line stays parseable."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            self.write_raw(b"\n")

    def write_raw(self, data: bytes) -> None:
        os.write(self._fd, data)
        os.fsync(self._fd)

    def write(self, rec: dict[str, Any]) -> None:
        self.write_raw((json.dumps(rec) + "\n").encode())


def next_op(path: Path) -> int:
    """The operation number after the last one in the ack log (read from its tail: op
    numbers only grow)."""
    if not path.exists():
        return 1
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        window = 1 << 16
        while True:
            f.seek(max(0, size - window))
            lines = f.read().splitlines()
            for line in reversed(lines):
                try:
                    return int(json.loads(line)["op"]) + 1
                except (ValueError, KeyError, TypeError):
                    continue
            if window >= size:
                return 1
            window *= 4


def relation_names(relation: str = RELATION, relations: int = 1) -> list[str]:
    """The relations a workload writes: ``relation`` itself, or ``relations`` of them."""
    if relations <= 1:
        return [relation]
    return [f"{relation}.{j}" for j in range(relations)]


def run(data_dir: Path, ack_path: Path, *, seed: int, ops: int, segment_bytes: int,
        pause: float = 0.0, first_op: int | None = None, final: bool = False,
        relation: str = RELATION, relations: int = 1) -> None:
    op = next_op(ack_path) if first_op is None else first_op
    rng = random.Random(seed * 1_000_003 + op)
    log = AckLog(ack_path)
    with Store.open(data_dir, segment_bytes=segment_bytes) as store:
        rels = []
        for name in relation_names(relation, relations):
            try:
                rels.append(store.relation(name))
            except RelationNotFoundError:
                rels.append(store.create_relation(name, SCHEMA, key=["id"]))
        print("ready", flush=True)
        live: dict[str, list[tuple[int, str]]] = {r.name: [] for r in rels}
        for _ in range(ops):
            rel = rels[rng.randrange(len(rels))] if len(rels) > 1 else rels[0]
            op = _step(rel, rng, op, log, live[rel.name], tag=relations > 1)
            if pause:
                time.sleep(pause)
        if final:
            for rel in rels:
                value = rel.upper + FUTURE_SPAN + 1
                log.write(_intent(op, rel, relations > 1, intent="seal", value=value))
                rel.seal(value)
                log.write({"op": op, "ack": True})
                op += 1
    print("workload done", flush=True)


def _intent(op: int, rel: Relation, tag: bool, **fields: Any) -> dict[str, Any]:
    """An ack-log intent; with ``tag`` it names its relation."""
    return {"op": op, **({"rel": rel.name} if tag else {}), **fields}


def _step(rel: Relation, rng: random.Random, op: int, log: AckLog,
          live: list[tuple[int, str]], *, tag: bool = False) -> int:
    upper, since = rel.upper, rel.since
    roll = rng.random()
    if roll < 0.6:
        rows: list[list[Any]] = [[-op, "marker", upper, 1]]
        for _ in range(rng.randint(1, MAX_ROWS)):
            kind = rng.random()
            t = upper + (rng.randint(1, FUTURE_SPAN) if rng.random() < 0.1
                         else rng.randint(0, 2))
            if kind < 0.5 or not live:
                row = (rng.randint(0, 500), rng.choice(VALUES))
                live.append(row)
                rows.append([row[0], row[1], t, rng.choice([1, 1, 2])])
            else:
                row = live[rng.randrange(len(live))]
                rows.append([row[0], row[1], t, -1])
        log.write(_intent(op, rel, tag, intent="append", rows=rows))
        # built from buffers (lamina.columns): pa.array of Python values imports pandas,
        # a second of every coordinator life's start
        rel.append(pa.Table.from_arrays(
            [columns.array(np.array([r[0] for r in rows], dtype=np.int64)),
             columns.strings([r[1] for r in rows]),
             columns.array(np.array([r[2] for r in rows], dtype=np.uint64)),
             columns.array(np.array([r[3] for r in rows], dtype=np.int64))],
            names=["id", "val", "_time", "_diff"]))
    elif roll < 0.9:
        value = upper + rng.randint(1, 3)
        log.write(_intent(op, rel, tag, intent="seal", value=value))
        rel.seal(value)
    else:
        value = rng.randint(since, upper)
        log.write(_intent(op, rel, tag, intent="since", value=value))
        rel.allow_compaction(value)
    log.write({"op": op, "ack": True})
    return op + 1


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lamina.drill.workload")
    ap.add_argument("data_dir", type=Path)
    ap.add_argument("ack_log", type=Path)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ops", type=int, default=200)
    ap.add_argument("--segment-bytes", type=int, default=8192)
    ap.add_argument("--pause", type=float, default=0.0)
    ap.add_argument("--first-op", type=int, default=None)
    ap.add_argument("--relation", default=RELATION)
    ap.add_argument("--relations", type=int, default=1,
                    help="write this many relations, <relation>.0 ... (default: one)")
    ap.add_argument("--final", action="store_true",
                    help="end with a seal beyond every time written")
    args = ap.parse_args(argv)
    run(args.data_dir, args.ack_log, seed=args.seed, ops=args.ops,
        segment_bytes=args.segment_bytes, pause=args.pause, first_op=args.first_op,
        final=args.final, relation=args.relation, relations=args.relations)


if __name__ == "__main__":
    main()
