"""The stream every contender of bench/peers.py ingests: generated once per cell from a
seed, cached under ``bench/.cache/peers/<cell>/``.

A keyed relation of rows ``(id int64, qty int64)``, key ``id``. The stream is ``updates``
updates in ``appends`` appends; append ``i`` holds updates at time ``i`` only, and its
progress record says no update below ``i + 1`` will come (lamina: ``seal(i + 1)``; Delta:
an app transaction of version ``i + 1``). A fraction ``retractions`` of each append's
updates are retractions (``_diff = -1``) of rows live before the append, drawn at random
from the live multiset (so a retraction never makes a count negative); the rest are
inserts of a random ``id`` in ``[0, keys)`` with a random ``qty`` in ``[0, 100)`` (so a
key has several rows and the same row may be inserted twice). Within an append a row may
appear as an insert and as a retraction; the contenders consolidate as they must.

Files: ``stream.arrow`` (Arrow IPC file, one record batch per append, columns ``id``,
``qty``, ``_time`` uint64, ``_diff`` int64), ``expected.json`` (the checksum of the rows
live at the end, :func:`checksum`) and ``done.json`` (written last: a complete cache).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bench.dataset import CACHE

SCHEMA = pa.schema([("id", pa.int64()), ("qty", pa.int64())])
UPDATE_SCHEMA = pa.schema([*SCHEMA, ("_time", pa.uint64()), ("_diff", pa.int64())])
KEY = ["id"]
ROWS = ["id", "qty"]
QTY_VALUES = 100
FORMAT = 1


@dataclass(frozen=True)
class Cell:
    """One cell of the benchmark's grid."""

    name: str
    updates: int
    appends: int
    keys: int
    retractions: float = 0.2
    seed: int = 15

    @property
    def per_append(self) -> int:
        return self.updates // self.appends

    @property
    def root(self) -> Path:
        return CACHE / "peers" / self.name


CELLS = {c.name: c for c in (
    Cell("quick", 20_000, 20, 2_000),
    Cell("1m-k200-50k", 1_000_000, 200, 50_000),
    Cell("1m-k200-1m", 1_000_000, 200, 1_000_000),
    Cell("1m-k2000-50k", 1_000_000, 2_000, 50_000),
    Cell("1m-k2000-1m", 1_000_000, 2_000, 1_000_000),
    Cell("1m-churn", 1_000_000, 2_000, 5_000, retractions=0.45),
    Cell("10m-k200-50k", 10_000_000, 200, 50_000),
    Cell("10m-k200-1m", 10_000_000, 200, 1_000_000),
    Cell("10m-k2000-50k", 10_000_000, 2_000, 50_000),
    Cell("10m-k2000-1m", 10_000_000, 2_000, 1_000_000),
    Cell("10m-churn", 10_000_000, 2_000, 5_000, retractions=0.45),
)}
"""The grid: ``<updates>-k<appends>-<keys>``; ``churn``: 45% retractions over 5,000 keys
(the live set stays small and most of what is written is later cancelled)."""


def checksum(rows: pa.Table) -> str:
    """SHA-256 of the live rows ``(id, qty, count)``, sorted, as int64 little-endian."""
    t = rows.select(["id", "qty", "count"]).cast(
        pa.schema([("id", pa.int64()), ("qty", pa.int64()), ("count", pa.int64())]))
    t = t.filter(pc.not_equal(t["count"], 0)).sort_by([("id", "ascending"),
                                                        ("qty", "ascending")])
    h = hashlib.sha256()
    for name in ("id", "qty", "count"):
        h.update(t[name].to_numpy().astype("<i8").tobytes())
    return h.hexdigest()


def _generate(cell: Cell, path: Path) -> dict[str, object]:
    rng = np.random.default_rng(cell.seed)
    cap = cell.updates + 1
    live_id = np.empty(cap, dtype=np.int64)
    live_qty = np.empty(cap, dtype=np.int64)
    n_live = 0
    schema = UPDATE_SCHEMA
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        left = cell.updates
        for i in range(cell.appends):
            n = cell.per_append if i < cell.appends - 1 else left
            left -= n
            r = min(round(n * cell.retractions), n_live)
            pos = rng.choice(n_live, r, replace=False) if r else np.empty(0, np.int64)
            ret_id, ret_qty = live_id[pos].copy(), live_qty[pos].copy()
            # swap-remove the retracted rows from the live multiset, O(r)
            tail = np.arange(n_live - r, n_live)
            keep = tail[~np.isin(tail, pos)]
            holes = pos[pos < n_live - r]
            live_id[holes], live_qty[holes] = live_id[keep], live_qty[keep]
            n_live -= r
            k = n - r
            ins_id = rng.integers(0, cell.keys, k, dtype=np.int64)
            ins_qty = rng.integers(0, QTY_VALUES, k, dtype=np.int64)
            live_id[n_live:n_live + k], live_qty[n_live:n_live + k] = ins_id, ins_qty
            n_live += k
            order = rng.permutation(n)
            ids = np.concatenate([ins_id, ret_id])[order]
            qty = np.concatenate([ins_qty, ret_qty])[order]
            diff = np.concatenate([np.ones(k, np.int64), -np.ones(r, np.int64)])[order]
            writer.write_batch(pa.record_batch(
                [pa.array(ids), pa.array(qty), pa.array(np.full(n, i, np.uint64)),
                 pa.array(diff)], schema=schema))
    live = pa.table({"id": live_id[:n_live], "qty": live_qty[:n_live]})
    counts = live.group_by(ROWS).aggregate([("id", "count")]).rename_columns(
        ["id", "qty", "count"])
    return {"checksum": checksum(counts), "live_rows": int(counts.num_rows),
            "live_updates": n_live}


def ensure(cell: Cell) -> dict[str, object]:
    """Generate the cell's stream unless a complete cache is there; its expected.json."""
    root = cell.root
    doc = {"format": FORMAT, **asdict(cell)}
    marker = root / "done.json"
    root.parent.mkdir(parents=True, exist_ok=True)
    # one generator at a time (two test workers may ask for the same cell at once)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (marker.exists() and json.loads(marker.read_text()) == doc):
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            started = time.monotonic()
            (root / "expected.json").write_text(
                json.dumps(_generate(cell, root / "stream.arrow")))
            marker.write_text(json.dumps(doc))
            print(f"generated {cell.name}: {cell.updates:,} updates in {cell.appends} "
                  f"appends ({time.monotonic() - started:.0f} s)", file=sys.stderr,
                  flush=True)
    out: dict[str, object] = json.loads((root / "expected.json").read_text())
    return out


def appends(cell: Cell) -> Iterator[pa.Table]:
    """The cell's appends in order, each an update table (memory-mapped)."""
    source = pa.memory_map(str(cell.root / "stream.arrow"))
    reader = pa.ipc.open_file(source)
    for i in range(reader.num_record_batches):
        yield pa.Table.from_batches([reader.get_batch(i)])
