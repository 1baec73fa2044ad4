"""Cold read: a fresh process that only opens a store and reads its latest snapshot, against
a fresh process reading the same rows from a Delta Lake table, with ``deltalake`` and with
DuckDB (``read_parquet`` over the table's data files).

    .venv/bin/python -m bench.cold_read [--updates 1000000] [--keys 50000] [--rounds 7]

**Data.** ``--updates`` updates over ``--keys`` keys (``id``, ``item``, ``qty``): the first
round inserts every key, each later round replaces the rows of half the keys at random
(a retraction and an insertion each), sealed after every round. The lamina store is
compacted as the daemon leaves it: every finished segment converted and the batches
merged (the reference executor, so no JVM is involved in building it); what the last
segment holds stays in the WAL. The Delta table holds the same latest rows, written once
(Delta's best case: one file, no deletion vectors).

**Measured**, each in a new interpreter, alternating contenders round by round: the time
from the first import of the library to the rows in hand (``import`` included: a
first-time read pays it) and, apart, the read call alone. Reported: the median of
``--rounds`` and the lamina / baseline ratio (target <= 1, issue 23). Each child also
reports whether pandas was imported. lamina's modules are byte-compiled first, as an
installed lamina's are (:func:`compile_lamina`).

Writes bench/results/cold_read.json and cold_read.png.
"""

from __future__ import annotations

import argparse
import compileall
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from bench import report
from bench.dataset import CACHE
from bench.procs import median

NAME = "cold_read"
FORMAT = 1
TARGET = 1.0
SCHEMA = pa.schema([("id", pa.int64()), ("item", pa.string()), ("qty", pa.int64())])

# Each child prints one JSON line: {"total": s, "read": s, "rows": n, "pandas": bool}.
CHILDREN = {
    "lamina": """
import time, sys, json
t0 = time.perf_counter()
from lamina import Store
with Store.open(sys.argv[1], read_only=True) as store:
    rel = store.relation("t")
    t1 = time.perf_counter()
    out = rel.snapshot()
t2 = time.perf_counter()
print(json.dumps({"total": t2 - t0, "read": t2 - t1, "rows": out.num_rows,
                  "pandas": "pandas" in sys.modules}))
""",
    "delta": """
import time, sys, json
t0 = time.perf_counter()
from deltalake import DeltaTable
t1 = time.perf_counter()
out = DeltaTable(sys.argv[1]).to_pyarrow_table()
t2 = time.perf_counter()
print(json.dumps({"total": t2 - t0, "read": t2 - t1, "rows": out.num_rows,
                  "pandas": "pandas" in sys.modules}))
""",
    "duckdb": """
import time, sys, json
t0 = time.perf_counter()
import duckdb
t1 = time.perf_counter()
out = duckdb.sql(f"SELECT * FROM read_parquet('{sys.argv[1]}/*.parquet')").arrow()
out = out.read_all() if hasattr(out, "read_all") else out  # a reader since DuckDB 1.4
t2 = time.perf_counter()
print(json.dumps({"total": t2 - t0, "read": t2 - t1, "rows": out.num_rows,
                  "pandas": "pandas" in sys.modules}))
""",
}


def _round(rng: np.random.Generator, ids: np.ndarray, t: int,
           current: dict[int, int] | None) -> pa.Table:
    """Insert ``ids`` at time ``t`` (retracting their current rows when ``current``)."""
    qty = rng.integers(0, 1000, len(ids))
    cols: dict[str, list[Any]] = {"id": [], "item": [], "qty": [], "_diff": []}
    if current is not None:
        cols["id"].append(ids)
        cols["item"].append(np.array([f"item-{i % 997}" for i in ids.tolist()], dtype=object))
        cols["qty"].append(np.array([current[i] for i in ids.tolist()], dtype=np.int64))
        cols["_diff"].append(np.full(len(ids), -1, dtype=np.int64))
    cols["id"].append(ids)
    cols["item"].append(np.array([f"item-{i % 997}" for i in ids.tolist()], dtype=object))
    cols["qty"].append(qty)
    cols["_diff"].append(np.ones(len(ids), dtype=np.int64))
    if current is not None:
        current.update(zip(ids.tolist(), qty.tolist(), strict=True))
    n = sum(len(a) for a in cols["id"])
    return pa.table({"id": np.concatenate(cols["id"]),
                     "item": pa.array(np.concatenate(cols["item"]), pa.string()),
                     "qty": np.concatenate(cols["qty"]),
                     "_time": pa.array(np.full(n, t, dtype=np.uint64)),
                     "_diff": np.concatenate(cols["_diff"])})


def build(root: Path, updates: int, keys: int) -> tuple[Path, Path]:
    """The lamina store and the Delta table of the same latest rows, built once per size."""
    from deltalake import write_deltalake

    from lamina import Store
    from lamina.compacter.executors import reference
    from lamina.datadir import DataDir
    from lamina.trace.plan import plan_conversion, plan_merge
    from lamina.trace.trace import Trace
    from lamina.wal.reader import segment_spans

    store_dir, delta_dir = root / "lamina", root / "delta"
    done = root / "done"
    if done.exists():
        return store_dir, delta_dir
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rng = np.random.default_rng(23)
    all_ids = np.arange(keys, dtype=np.int64)
    current = {i: 0 for i in range(keys)}
    with Store.open(store_dir, segment_bytes=8 << 20, fsync="never") as store:
        rel = store.create_relation("t", SCHEMA, key=["id"])
        first = _round(rng, all_ids, 0, None)
        current.update(zip(all_ids.tolist(), first.column("qty").to_pylist(), strict=True))
        rel.append(first)
        written, t = first.num_rows, 1
        rel.seal(t)
        while written < updates:
            ids = np.sort(rng.choice(all_ids, keys // 2, replace=False))
            batch = _round(rng, ids, t, current)
            rel.append(batch)
            written += batch.num_rows
            t += 1
            rel.seal(t)
    layout = DataDir(store_dir)
    files = layout.relation("t")
    trace = Trace.open(layout.trace_store("t"), files.meta)
    for span in list(segment_spans(layout.wal_dir("t"), "t",
                                   after=trace.state.converted_through)):
        reference.convert(trace, plan_conversion(trace.state, [span]))
        while (plan := plan_merge(trace.state)) is not None:
            reference.merge(trace, plan)
    trace.delete_converted_segments(layout.wal_dir("t"))
    latest = pa.table({"id": all_ids,
                       "item": pa.array([f"item-{i % 997}" for i in range(keys)]),
                       "qty": pa.array([current[i] for i in range(keys)], pa.int64())})
    write_deltalake(str(delta_dir), latest)
    done.write_text("ok\n")
    return store_dir, delta_dir


def _child(who: str, path: Path) -> dict[str, Any]:
    """One cold read in a new interpreter. Its result line counts even when the process
    then dies at exit: ``deltalake`` 1.x now and then aborts while the interpreter shuts
    down ("terminate called without an active exception"), after the read is done."""
    out = subprocess.run([sys.executable, "-c", CHILDREN[who], str(path)], check=False,
                         capture_output=True, text=True, timeout=300)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if not lines:
        raise SystemExit(f"the {who} read failed (exit {out.returncode}): {out.stderr[-2000:]}")
    doc: dict[str, Any] = json.loads(lines[-1])
    doc["exit_code"] = out.returncode
    return doc


def compile_lamina() -> None:
    """Byte-compile lamina's modules as installing its wheel does (pip compiles what it
    installs; ``deltalake`` and ``duckdb`` arrive compiled), so that no child compiles them:
    with the source tree on the path and ``PYTHONDONTWRITEBYTECODE`` set, as in this
    repository's sandboxes, the warm-up child writes no ``.pyc`` and every child compiled
    lamina's 30-odd modules again, 70 to 100 ms of a cold read (2026-11-28) that an
    installed lamina never pays. ``compileall`` writes them whatever that variable says."""
    import lamina

    root = Path(lamina.__file__).parent
    if not compileall.compile_dir(str(root), quiet=1):
        raise SystemExit(f"byte-compiling {root} failed")


def measure(store_dir: Path, delta_dir: Path, rounds: int) -> dict[str, Any]:
    paths = {"lamina": store_dir, "delta": delta_dir, "duckdb": delta_dir}
    runs: dict[str, list[dict[str, Any]]] = {who: [] for who in CHILDREN}
    compile_lamina()
    for who in CHILDREN:  # warm the page cache
        _child(who, paths[who])
    for r in range(rounds):
        for who in CHILDREN:
            runs[who].append(_child(who, paths[who]))
        print(f"  round {r + 1}/{rounds}: " + ", ".join(
            f"{w} {runs[w][-1]['total'] * 1e3:.0f} ms" for w in CHILDREN), flush=True)
    rows = {w: {x["rows"] for x in runs[w]} for w in CHILDREN}
    if len({n for s in rows.values() for n in s}) != 1:
        raise SystemExit(f"the contenders read different row counts: {rows}")
    out: dict[str, Any] = {
        w: {"total_ms": round(median([x["total"] for x in runs[w]]) * 1e3, 1),
            "read_ms": round(median([x["read"] for x in runs[w]]) * 1e3, 1),
            "pandas_imported": any(x["pandas"] for x in runs[w]),
            "aborted_at_exit": sum(x["exit_code"] != 0 for x in runs[w]),
            "rows": runs[w][0]["rows"]} for w in CHILDREN}
    for base in ("delta", "duckdb"):
        ratio = out["lamina"]["total_ms"] / out[base]["total_ms"]
        out[f"ratio_vs_{base}"] = {"value": round(ratio, 3), "target": TARGET,
                                   "met": ratio <= TARGET}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.cold_read", description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    run = report.Run(NAME, argv)
    store_dir, delta_dir = build(CACHE / f"cold_read-{args.updates}-{args.keys}",
                                 args.updates, args.keys)
    result = measure(store_dir, delta_dir, args.rounds)
    doc = {"format": FORMAT, "updates": args.updates, "keys": args.keys,
           "rounds": args.rounds, **result}
    path = report.write_result(NAME, run.document(doc))
    report.bar_chart(NAME, f"first read in a fresh process ({args.updates:,} updates, "
                     f"{args.keys:,} keys)",
                     [("import + open + read (ms)", {w: result[w]["total_ms"] for w in CHILDREN}),
                      ("read call alone (ms)", {w: result[w]["read_ms"] for w in CHILDREN})],
                     ylabel="ms")
    for base in ("delta", "duckdb"):
        r = result[f"ratio_vs_{base}"]
        print(f"lamina {result['lamina']['total_ms']} ms vs {base} {result[base]['total_ms']} "
              f"ms: ratio {r['value']} (target <= {TARGET}): {'met' if r['met'] else 'not met'}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
