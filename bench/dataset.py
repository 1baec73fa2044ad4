"""The update workloads of the Spark benchmarks, generated once and cached.

    .venv/bin/python -m bench.dataset [--scale 1.0]     # generate (or reuse) the caches

*Conversion input* (:func:`conversion_input`): ``10M * scale`` updates over
``1M * scale`` distinct rows, appended through :class:`lamina.Store` (fsync "never") in
appends of 10,000 updates, each append followed by a seal 10 time units later, into WAL
segments of the default size (64 MiB). Row: ``id`` (int64 key), ``item`` (string, 12
characters, a function of ``id``) and ``qty`` (int64, a function of ``id``), so distinct
ids are distinct rows. Per append: 20% of the updates are retractions (diff -1); half of
them retract an insert of the same append at the same time (they consolidate to zero and
vanish), the other half a random row. 5% have future times (at or beyond the append's
seal: a few units up to about 2**30 ahead). A last seal (with a tiny rotation target)
finishes the last segment, so every segment is finished and one conversion covers them
all (the daemon's job limits, 64 segments and 1 GiB, are not reached).

*Merge input* (:func:`merge_input`): two adjacent level-0 trace batches of
``5M * scale`` consolidated updates each, times ``[0, 1000)`` and ``[1000, 2000)``, over the
same ``1M * scale`` rows, 20% retractions, published as a trace state with
``since = 1000`` (logical compaction lagging one batch behind the upper), so the merge
forwards the left batch's times to 1000 and consolidates. The relation's WAL is sealed at
2000 with since 1000 and holds no updates, so ``Relation.snapshot`` reads the two batches
(bench/recovery.py uses it so).

Both live under ``bench/.cache/`` (gitignored) keyed by scale; a ``done.json`` written last
marks a complete cache.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lamina import Store
from lamina.consolidate import consolidate_updates
from lamina.fs import FileSystem
from lamina.layout import Layout, TraceLayout
from lamina.objstore.local import LocalObjectStore
from lamina.schema import RelationMeta
from lamina.trace.batch import BatchDesc, new_id, write_part
from lamina.trace.state import StateStore, TraceState
from lamina.wal.reader import SegmentSpan, segment_spans

CACHE = Path(__file__).parent / ".cache"
SCHEMA = pa.schema([("id", pa.int64()), ("item", pa.string()), ("qty", pa.int64())])
KEY = ["id"]
RELATION = "bench"
PER_APPEND = 10_000
TIME_STEP = 10
UPDATES = 10_000_000
KEYS = 1_000_000
RETRACTIONS = 0.2
FUTURE = 0.05
MERGE_UPDATES = 5_000_000
MERGE_SINCE = 1000
FORMAT = 3
"""Of the cached inputs; bumped when what they hold changes, also when the merge input's
parts would be encoded differently (lamina.trace.batch.parquet_options), so that the
merge reads parents as the daemon now writes them. 3: plain item strings."""


@dataclass(frozen=True)
class Input:
    """A cached data directory with one relation."""

    root: Path
    meta: RelationMeta
    updates: int
    keys: int

    @property
    def layout(self) -> Layout:
        return Layout(self.root)

    @property
    def wal_dir(self) -> Path:
        return self.layout.wal_dir(RELATION)

    @property
    def trace_dir(self) -> Path:
        return self.layout.trace_dir(RELATION)

    def spans(self) -> list[SegmentSpan]:
        """The finished segments as the compacter describes them (all unconverted)."""
        return list(segment_spans(self.wal_dir, RELATION))

    def wal_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.wal_dir.glob("*.wal"))


def _items(keys: int) -> pa.Array:
    ids = pa.array(np.arange(keys, dtype=np.int64))
    digits = pc.utf8_lpad(pc.cast(ids, pa.string()), 7, "0")
    return pc.binary_join_element_wise("item-", digits, "")


def _rows(ids: np.ndarray, items: pa.Array) -> list[pa.Array]:
    return [pa.array(ids), items.take(pa.array(ids)), pa.array((ids * 7919) % 100_003)]


def _future_offsets(rng: np.random.Generator, n: int) -> np.ndarray:
    """How far ahead of the seal a future update lies: near (0..9), medium, far."""
    kind = rng.integers(0, 3, n)
    near = rng.integers(0, 10, n)
    medium = rng.integers(10, 100_000, n)
    far = rng.integers(100_000, 1 << 30, n)
    return np.where(kind == 0, near, np.where(kind == 1, medium, far)).astype(np.uint64)


def _append_table(rng: np.random.Generator, items: pa.Array, keys: int, n: int,
                  lower: int) -> pa.Table:
    upper = lower + TIME_STEP
    ids = rng.integers(0, keys, n, dtype=np.int64)
    times = rng.integers(lower, upper, n, dtype=np.uint64)
    future = rng.random(n) < FUTURE
    times = np.where(future, upper + _future_offsets(rng, n), times).astype(np.uint64)
    diffs = np.ones(n, dtype=np.int64)
    retract = rng.random(n) < RETRACTIONS
    diffs[retract] = -1
    # half of the retractions undo an insert of this append at its time (they cancel)
    inserts = np.flatnonzero(~retract)
    undo = np.flatnonzero(retract)
    undo = undo[rng.random(len(undo)) < 0.5]
    if len(inserts) and len(undo):
        src = inserts[rng.integers(0, len(inserts), len(undo))]
        ids[undo] = ids[src]
        times[undo] = times[src]
    return pa.Table.from_arrays([*_rows(ids, items), pa.array(times, pa.uint64()),
                                 pa.array(diffs)],
                                schema=RelationMeta.new(RELATION, SCHEMA, KEY).update_schema)


def warm_scale(scale: float) -> float:
    """The input a contender warms up on: a tenth of the measured one, but big enough to
    take the same code paths (lamina runs inputs under 8 MiB as a single task)."""
    return max(scale / 10, min(scale, 0.1))


def _done(root: Path, doc: dict[str, object]) -> bool:
    marker = root / "done.json"
    return marker.exists() and json.loads(marker.read_text()) == doc


def _mark(root: Path, doc: dict[str, object]) -> None:
    (root / "done.json").write_text(json.dumps(doc))


def _cached(root: Path, doc: dict[str, object], build: Callable[[], None],
            what: str | None) -> None:
    """Run ``build`` to fill ``root`` unless a complete cache made from ``doc`` is there
    (anything else there is removed first); say so on stderr unless ``what`` is None."""
    if _done(root, doc):
        return
    if root.exists():
        shutil.rmtree(root)
    started = time.monotonic()
    build()
    _mark(root, doc)
    if what is not None:
        print(f"generated {what} in {root} ({time.monotonic() - started:.0f} s)",
              file=sys.stderr, flush=True)


def _meta(root: Path) -> RelationMeta:
    path = Layout(root).wal_dir(RELATION) / "relation.json"
    return RelationMeta.from_json(path.read_bytes(), path)


def conversion_input(scale: float = 1.0, *, log: bool = True) -> Input:
    """The conversion workload (module docstring), generated on first use."""
    updates, keys = round(UPDATES * scale), max(1, round(KEYS * scale))
    root = CACHE / f"convert-{scale:g}"
    doc: dict[str, object] = {"format": FORMAT, "updates": updates, "keys": keys,
                              "per_append": PER_APPEND}

    def build() -> None:
        rng = np.random.default_rng(7)
        items = _items(keys)
        with Store.open(root, fsync="never") as store:
            rel = store.create_relation(RELATION, SCHEMA, key=KEY)
            lower = 0
            left = updates
            while left > 0:
                n = min(PER_APPEND, left)
                rel.append(_append_table(rng, items, keys, n, lower))
                lower += TIME_STEP
                rel.seal(lower)
                left -= n
        # reopened with a tiny rotation target, the next seal finishes the open segment
        with Store.open(root, fsync="never", segment_bytes=4096) as store:
            store.relation(RELATION).seal(lower + 1)

    _cached(root, doc, build, f"{updates:,} updates" if log else None)
    return Input(root=root, meta=_meta(root), updates=updates, keys=keys)


def _batch_table(rng: np.random.Generator, items: pa.Array, meta: RelationMeta, *,
                 keys: int, n: int, lower: int, upper: int) -> pa.Table:
    """``n`` updates in ``[lower, upper)``, consolidated (so a batch of about n rows)."""
    ids = rng.integers(0, keys, n, dtype=np.int64)
    times = rng.integers(lower, upper, n, dtype=np.uint64)
    diffs = np.where(rng.random(n) < RETRACTIONS, -1, 1).astype(np.int64)
    table = pa.Table.from_arrays([*_rows(ids, items), pa.array(times, pa.uint64()),
                                  pa.array(diffs)], schema=meta.update_schema)
    return consolidate_updates(table, meta.row_columns, meta.sort_columns, context="bench")


def merge_input(scale: float = 1.0, *, log: bool = True) -> Input:
    """The merge workload (module docstring): a trace with two level-0 batches."""
    per, keys = round(MERGE_UPDATES * scale), max(1, round(KEYS * scale))
    root = CACHE / f"merge-{scale:g}"
    doc: dict[str, object] = {"format": FORMAT, "updates": per, "keys": keys,
                              "since": MERGE_SINCE}

    def build() -> None:
        with Store.open(root, fsync="never") as store:
            rel = store.create_relation(RELATION, SCHEMA, key=KEY)
            rel.seal(2000)  # the WAL's frontiers match the trace's: snapshots can read it
            rel.allow_compaction(MERGE_SINCE)
        meta = _meta(root)
        trace_dir = Layout(root).trace_dir(RELATION)
        fs = FileSystem()
        rng = np.random.default_rng(11)
        items = _items(keys)
        batches = []
        for lower, upper in ((0, 1000), (1000, 2000)):
            table = _batch_table(rng, items, meta, keys=keys, n=per, lower=lower,
                                 upper=upper)
            bid = new_id("b")
            part = write_part(LocalObjectStore(trace_dir, fs), TraceLayout.batch_part(bid, 0),
                              meta.update_schema, [table])
            batches.append(BatchDesc(id=bid, lower=lower, upper=upper, since=0, level=0,
                                     parts=(part,)))
        state = TraceState.empty(RELATION, meta.relation_id).next(
            upper=2000, since=MERGE_SINCE, batches=tuple(batches))
        StateStore(LocalObjectStore(trace_dir, fs)).publish(state)

    _cached(root, doc, build, f"two batches of {per:,} updates" if log else None)
    return Input(root=root, meta=_meta(root), updates=2 * per, keys=keys)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dataset", description=__doc__)
    parser.add_argument("--scale", type=float, default=1.0)
    args = parser.parse_args(argv)
    conv = conversion_input(args.scale)
    print(f"conversion: {conv.root} {conv.wal_bytes() / 1e6:.0f} MB in "
          f"{len(conv.spans())} segments")
    merge = merge_input(args.scale)
    print(f"merge: {merge.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
