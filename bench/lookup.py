"""Key lookups against a full snapshot + filter, on a 10M-row relation.

    .venv/bin/python -m bench.lookup [--scale 1.0] [--rounds 5] [--keys 100]

The relation (``10M * scale`` distinct rows: ``id`` int64 key, ``item`` string, ``qty``
int64) is a trace of two batches written by the reference writer
(lamina.trace.batch.write_part, so with the row groups and statistics the Spark write tasks
also write): ``[0, 1000)`` with 80% of the rows in 8 parts (key ranges, as a Spark merge
leaves them) and ``[1000, 2000)`` with 20% in 2 parts, plus a WAL tail of 10,000 updates
(5,000 retractions of existing rows and 5,000 new rows), sealed at 2001. Cached under
``bench/.cache/lookup-<scale>``.

Measured, median of ``--rounds``, interleaved: ``Relation.lookup`` of ``--keys`` random keys
(a tenth of them in the WAL tail) at 2000, and ``Relation.snapshot(2000)`` filtered with
``is_in`` to the same keys; the rows must agree. The relation handle's first lookup, which
parses the parts' footers into its key index, is timed apart (``first_lookup_seconds``).
Target: lookup >= 50x faster.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bench.dataset import CACHE, _cached
from lamina import Store
from lamina.fs import FileSystem
from lamina.layout import Layout, TraceLayout
from lamina.objstore.local import LocalObjectStore
from lamina.trace.batch import ROW_GROUP_ROWS, BatchDesc, new_id, write_part
from lamina.trace.state import StateStore, TraceState

NAME = "lookup"
RELATION = "bench"
SCHEMA = pa.schema([("id", pa.int64()), ("item", pa.string()), ("qty", pa.int64())])
ROWS = 10_000_000
TAIL = 10_000
TARGET = 50.0


def _rows(ids: np.ndarray, t: int) -> pa.Table:
    n = len(ids)
    items = pc.binary_join_element_wise("item-", pc.cast(pa.array(ids % 99991), pa.string()), "")
    return pa.table({"id": pa.array(ids), "item": items, "qty": pa.array(ids * 7 % 1000),
                     "_time": pa.array(np.full(n, t, dtype=np.uint64)),
                     "_diff": pa.array(np.ones(n, dtype=np.int64))})


def lookup_input(scale: float) -> Path:
    """The relation of the module docstring, generated on first use."""
    rows = max(1000, round(ROWS * scale))
    root = CACHE / f"lookup-{scale:g}"

    def build() -> None:
        with Store.open(root, fsync="never") as store:
            rel = store.create_relation(RELATION, SCHEMA, key=["id"])
            rel.seal(2000)
            meta = rel.meta
            trace_dir = Layout(root).trace_dir(RELATION)
            fs = FileSystem()
            rng = np.random.default_rng(3)
            perm = rng.permutation(rows).astype(np.int64) * 3  # ids with gaps: absent keys
            cut = rows * 8 // 10
            batches = []
            for (lower, upper), unsorted, nparts in (((0, 1000), perm[:cut], 8),
                                                     ((1000, 2000), perm[cut:], 2)):
                ids = np.sort(unsorted)
                bid = new_id("b")
                parts = []
                for i, chunk in enumerate(np.array_split(ids, nparts)):
                    parts.append(write_part(LocalObjectStore(trace_dir, fs),
                                            TraceLayout.batch_part(bid, i),
                                            meta.update_schema, [_rows(chunk, lower)]))
                batches.append(BatchDesc(id=bid, lower=lower, upper=upper, since=0, level=0,
                                         parts=tuple(parts)))
            state = TraceState.empty(RELATION, meta.relation_id).next(
                upper=2000, batches=tuple(batches))
            StateStore(LocalObjectStore(trace_dir, fs)).publish(state)
            gone = _rows(rng.choice(perm, TAIL // 2, replace=False), 2000)
            gone = gone.set_column(4, "_diff", pa.array(np.full(TAIL // 2, -1, np.int64)))
            new = _rows(np.arange(TAIL // 2, dtype=np.int64) * 3 + 1, 2000)
            rel.append(pa.concat_tables([gone, new]))
            rel.seal(2001)

    _cached(root, {"rows": rows, "tail": TAIL, "format": 1, "row_group_rows": ROW_GROUP_ROWS},
            build, f"{rows:,} rows")
    return root


def lookup_race(scale: float, rounds: int, nkeys: int) -> dict[str, Any]:
    root = lookup_input(scale)
    rows = max(1000, round(ROWS * scale))
    rng = np.random.default_rng(5)
    with Store.open(root) as store:
        rel = store.relation(RELATION)
        look, snap = [], []
        t0 = time.perf_counter()  # the first lookup of a handle parses the parts' footers
        rel.lookup({"id": rng.integers(0, rows, nkeys) * 3}, 2000)
        cold = time.perf_counter() - t0
        for r in range(rounds):
            keys = np.concatenate([rng.integers(0, rows, nkeys - nkeys // 10) * 3,
                                   rng.integers(0, TAIL // 2, nkeys // 10) * 3 + 1])
            t0 = time.perf_counter()
            got = rel.lookup({"id": keys}, 2000)
            look.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            full = rel.snapshot(2000)
            want = full.filter(pc.is_in(full.column("id"), pa.array(keys)))
            snap.append(time.perf_counter() - t0)
            if got.to_pylist() != want.to_pylist():
                raise SystemExit("lookup and snapshot + filter disagree")
            print(f"  round {r + 1}/{rounds}: lookup {look[-1] * 1000:.1f} ms "
                  f"({got.num_rows} rows), snapshot + filter {snap[-1]:.2f} s "
                  f"({full.num_rows:,} rows)", file=sys.stderr, flush=True)
    lookup_s, snap_s = statistics.median(look), statistics.median(snap)
    ratio = round(snap_s / lookup_s, 1)
    return {"rows": rows, "keys": nkeys, "lookup_seconds": round(lookup_s, 4),
            "first_lookup_seconds": round(cold, 4),
            "ratio_per_round_median": round(statistics.median(
                s / x for s, x in zip(snap, look, strict=True)), 1),
            "lookup_p_max_seconds": round(max(look), 4),
            "snapshot_filter_seconds": round(snap_s, 3), "ratio": ratio, "target": TARGET,
            "met": ratio >= TARGET}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lookup",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keys", type=int, default=100)
    args = parser.parse_args(argv)
    res = lookup_race(args.scale, args.rounds, args.keys)
    print(f"lookup of {res['keys']} keys in {res['rows']:,} rows: {res['lookup_seconds']} s; "
          f"snapshot + filter {res['snapshot_filter_seconds']} s: {res['ratio']}x "
          f"(target >= {TARGET}): {'met' if res['met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
