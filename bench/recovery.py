"""Recovery: daemon start to ready, and reading a snapshot.

    .venv/bin/python -m bench.recovery [--scale 1.0] [--rounds 5]

1. **Start to ready.** A data directory (generated once under ``bench/.cache``) with 50
   relations, each with a trace of 10 batches (levels 9 down to 0, so no merge is due; 500
   batches in all) and ``256 MiB * scale`` of finished but unconverted WAL segments spread
   over them, plus one converted segment each that recovery deletes. Every round copies it
   afresh, starts ``lamina serve --spark-master local[2]`` and polls ``/readyz`` every 20 ms
   until it answers 200, then stops the daemon. Reported: spawn to ready, and from its JSON
   log the phases: interpreter and imports (spawn to ``daemon.starting``), the Spark
   session (to the first ``relation.recovered``) and the relations' recovery (to
   ``daemon.ready``); and the same directory's state files read alone in process (every
   relation's newest state loaded and parsed, ``StateStore.load_latest``), with the ratios
   of the daemon's times to it. The page cache is warm (the copy was just written).
2. **Snapshot.** ``Relation.snapshot(1999)`` of the merge input (:func:`bench.dataset.
   merge_input`: two batches, ``10M * scale`` rows over ``1M * scale`` rows) against
   pyarrow's ``read_table`` of the same Parquet files plus a ``group_by`` of the row columns
   summing the diffs, alternating which goes first. Target: the baseline's time over
   lamina's >= 0.7.

Writes bench/results/recovery.json and recovery.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench import report
from bench.dataset import CACHE, SCHEMA, merge_input
from bench.procs import median, serve_ready, start_serve, stop_group
from lamina import Store
from lamina.datadir import DataDir
from lamina.fs import FileSystem
from lamina.layout import TraceLayout
from lamina.objstore.local import LocalObjectStore
from lamina.schema import RelationMeta
from lamina.trace.batch import BatchDesc, new_id, write_part
from lamina.trace.state import StateStore, TraceState

NAME = "recovery"
RELATIONS = 50
BATCHES = 10
WAL_BYTES = 256 << 20
SNAPSHOT_TARGET = 0.7
FORMAT = 1


def _tiny_batch(trace_dir: Path, meta: RelationMeta, lower: int, level: int) -> BatchDesc:
    ids = np.arange(10, dtype=np.int64)
    table = pa.Table.from_arrays(
        [pa.array(ids), pa.array([f"i{i}" for i in range(10)]), pa.array(ids),
         pa.array(np.full(10, lower, dtype=np.uint64)), pa.array(np.ones(10, dtype=np.int64))],
        schema=meta.update_schema)
    bid = new_id("b")
    part = write_part(LocalObjectStore(trace_dir), TraceLayout.batch_part(bid, 0),
                      meta.update_schema, [table])
    return BatchDesc(id=bid, lower=lower, upper=lower + 100, since=0, level=level,
                     parts=(part,))


def _updates(rng: np.random.Generator, n: int, t: int) -> pa.Table:
    ids = rng.integers(0, 1_000_000, n, dtype=np.int64)
    return pa.table({"id": ids, "item": pa.array([f"item-{i % 1000}" for i in ids.tolist()]),
                     "qty": ids % 97, "_time": pa.array(np.full(n, t, dtype=np.uint64)),
                     "_diff": np.ones(n, dtype=np.int64)})


def recovery_input(scale: float) -> Path:
    """The start-to-ready data directory (module docstring), generated on first use."""
    root = CACHE / f"recovery-{scale:g}"
    doc = {"format": FORMAT, "relations": RELATIONS, "batches": BATCHES,
           "wal_bytes": round(WAL_BYTES * scale)}
    marker = root / "done.json"
    if marker.exists() and json.loads(marker.read_text()) == doc:
        return root
    shutil.rmtree(root, ignore_errors=True)
    started = time.monotonic()
    rng = np.random.default_rng(13)
    per_relation = round(WAL_BYTES * scale) // RELATIONS
    layout = DataDir(root)
    for r in range(RELATIONS):
        name = f"rel{r:02d}"
        with Store.open(root, fsync="never", segment_bytes=4096) as store:
            rel = store.create_relation(name, SCHEMA, key=["id"])
            pairs = _updates(rng, 100, 0)
            neg = pairs.set_column(4, "_diff", pa.array(-np.ones(100, dtype=np.int64)))
            rel.append(pa.concat_tables([pairs, neg]))  # cancels: the batches hold it all
            rel.seal(BATCHES * 100)  # finishes segment 1, which the trace has converted
            meta = rel.meta
        trace_dir = layout.trace_dir(name)
        batches = tuple(_tiny_batch(trace_dir, meta, 100 * i, BATCHES - 1 - i)
                        for i in range(BATCHES))
        StateStore(LocalObjectStore(trace_dir)).publish(
            TraceState.empty(name, meta.relation_id).next(
                upper=BATCHES * 100, converted_through=1, batches=batches))
        with Store.open(root, fsync="never", segment_bytes=1 << 20) as store:
            rel = store.relation(name)
            t = BATCHES * 100
            written = 0
            while written < per_relation:
                table = _updates(rng, 5000, t)
                rel.append(table)
                t += 1
                rel.seal(t)
                written = sum(p.stat().st_size for p in layout.wal_dir(name).glob("*.wal"))
        with Store.open(root, fsync="never", segment_bytes=4096) as store:
            store.relation(name).seal(t + 1)  # finishes the last segment
    marker.write_text(json.dumps(doc))
    print(f"generated {root} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    return root


def _log_times(log: Path) -> dict[str, float]:
    """Timestamps (epoch seconds) of the daemon's start-up events in its JSON log."""
    out: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        name = event.get("event")
        when = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
        if name == "daemon.starting":
            out.setdefault("starting", when)
        elif name == "relation.recovered":
            out.setdefault("first_recovered", when)
        elif name == "daemon.ready":
            out["ready"] = when
            out["recovery_seconds_metric"] = float(event.get("duration_seconds", 0.0))
    return out


def start_to_ready(source: Path, work: Path) -> dict[str, Any]:
    """One daemon start on a fresh copy of ``source``."""
    data = work / "data"
    shutil.rmtree(data, ignore_errors=True)
    shutil.copytree(source, data)
    log = work / "daemon.log"
    spawned = time.time()
    started = time.monotonic()
    proc, port = start_serve(data, log, master="local[2]",
                             env={"LAMINA_SHUTDOWN_GRACE_SECONDS": "0"})
    try:
        ready = None
        while ready is None and proc.poll() is None and time.monotonic() - started < 300:
            if serve_ready(port):
                ready = time.monotonic() - started
            time.sleep(0.02)
    finally:
        stop_group(proc, 120)
    if ready is None:
        raise RuntimeError(f"the daemon did not become ready; see {log}")
    times = _log_times(log)
    return {"seconds": ready, "interpreter_seconds": times["starting"] - spawned,
            "spark_seconds": times["first_recovered"] - times["starting"],
            "relations_seconds": times["ready"] - times["first_recovered"],
            "recovery_seconds_metric": times["recovery_seconds_metric"]}


def read_states(root: Path) -> float:
    """Seconds to load and parse every relation's newest trace state."""
    layout = DataDir(root)
    fs = FileSystem()
    started = time.monotonic()
    for name in layout.relation_names():
        state = StateStore(layout.trace_store(name, fs)).load_latest()
        assert state is not None
    return time.monotonic() - started


def snapshot_race(scale: float, rounds: int) -> dict[str, Any]:
    inp = merge_input(scale)
    files = sorted(inp.trace_dir.glob("batches/*/*.parquet"))
    rows = sum(int(pq.ParquetFile(f).metadata.num_rows) for f in files)
    group = inp.meta.row_columns
    times: dict[str, list[float]] = {"lamina": [], "pyarrow": []}
    out_rows = {}
    with Store.open(inp.root) as store:
        rel = store.relation(inp.meta.name)

        def lamina() -> int:
            return int(rel.snapshot(1999).num_rows)

        def pyarrow() -> int:
            table = pq.read_table([str(f) for f in files])
            return int(table.group_by(group).aggregate([("_diff", "sum")]).num_rows)

        lamina()
        pyarrow()  # warm: page cache, allocator
        for r in range(rounds):
            order = [("lamina", lamina), ("pyarrow", pyarrow)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                started = time.monotonic()
                out_rows[name] = fn()
                times[name].append(time.monotonic() - started)
    lam, base = median(times["lamina"]), median(times["pyarrow"])
    return {"rows_read": rows, "rows_out": out_rows,
            "seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
            "lamina_seconds": round(lam, 3), "pyarrow_seconds": round(base, 3),
            "ratio": round(base / lam, 3), "target": SNAPSHOT_TARGET,
            "met": base / lam >= SNAPSHOT_TARGET}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recovery",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    run = report.Run(NAME, argv)
    source = recovery_input(args.scale)
    work = CACHE / "work" / NAME
    work.mkdir(parents=True, exist_ok=True)
    try:
        starts = []
        for r in range(args.rounds):
            starts.append(start_to_ready(source, work))
            print(f"  round {r + 1}/{args.rounds}: ready after {starts[-1]['seconds']:.2f} s",
                  file=sys.stderr, flush=True)
        states = [read_states(work / "data") for _ in range(max(5, args.rounds))]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    wal = sum(p.stat().st_size for p in source.glob("wal/*/*.wal"))
    keys = ("seconds", "interpreter_seconds", "spark_seconds", "relations_seconds",
            "recovery_seconds_metric")
    ready: dict[str, Any] = {k: round(median([s[k] for s in starts]), 3) for k in keys}
    state_s = median(states)
    ready.update({"state_read_seconds": round(state_s, 4),
                  "ratio_ready_to_state_read": round(ready["seconds"] / state_s, 1),
                  "ratio_relations_to_state_read": round(ready["relations_seconds"] / state_s,
                                                         1),
                  "relations": RELATIONS, "batches": RELATIONS * BATCHES, "wal_bytes": wal,
                  "rounds": [{k: round(v, 3) for k, v in s.items()} for s in starts]})
    print(f"start to ready: {ready['seconds']:.2f} s (Spark {ready['spark_seconds']:.2f} s, "
          f"relations {ready['relations_seconds']:.3f} s); state files alone "
          f"{state_s * 1000:.1f} ms", flush=True)
    snap = snapshot_race(args.scale, args.rounds)
    print(f"snapshot: lamina {snap['lamina_seconds']} s, read_table + group_by "
          f"{snap['pyarrow_seconds']} s: {snap['ratio']}x (target >= {SNAPSHOT_TARGET}): "
          f"{'met' if snap['met'] else 'MISSED'}", flush=True)
    doc = run.document({"scale": args.scale, "start_to_ready": ready, "snapshot": snap})
    report.write_result(NAME, doc)
    report.bar_chart(NAME, "Recovery and snapshot", [
        ("daemon start to ready (s)", {"lamina total": ready["seconds"],
                                       "of it Spark": ready["spark_seconds"],
                                       "of it relations": ready["relations_seconds"],
                                       "state files alone": state_s}),
        ("snapshot (s)", {"lamina": snap["lamina_seconds"],
                          "read_table+group_by": snap["pyarrow_seconds"]}),
    ], ylabel="seconds", note=f"{RELATIONS * BATCHES} batches, {wal / 2**20:.0f} MiB WAL; "
                              f"snapshot of {snap['rows_read']:,} rows; load "
                              f"{doc['load_average']['before'][0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
