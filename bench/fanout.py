"""Fan-out: the same rows as one relation and as N relations, and a thousand relations at
steady state.

    .venv/bin/python -m bench.fanout [--cells 200,1000] [--rows 1000] [--rounds 3]
                                     [--steady-relations 1000] [--steady-seconds 600]
                                     [--idle-seconds 60] [--only burst,steady]

**Burst cells** (``--cells``, N relations of ``--rows`` rows each). Two data directories
hold the same ``N * rows`` rows: ``one`` as a single relation written in N appends of
``rows`` rows, ``many`` as N relations of one append each; every relation is sealed to 1
and the store closed (so every segment is finished), as a new user fills a store and
then starts the daemon. Each directory is copied afresh per round and ``lamina serve``
runs on it with the Spark master of ``make run`` (``local[*]``); the time is taken from
the daemon's own JSON log: from ``daemon.ready`` to the last ``conversion.committed``
that brings a relation's trace upper to its sealed upper (1), i.e. until every relation
has caught up. Reported: the medians of ``--rounds`` rounds (the two sides alternating
which goes first) and their ratio many/one (target: <= 3 at N = 1,000),
and how many Spark jobs each run took (``lamina_spark_jobs_total`` from ``/metrics``).
After the last round of the largest cell the daemon of ``many`` is left idle for
``--idle-seconds`` and its CPU is measured: the daemon's own process (target: under 5%
of a core with 1,000 idle relations) and its whole tree (the Spark JVM too).

**Steady cell** (``--steady-relations``, ``--steady-seconds``). One coordinator keeps
``R`` relations busy: each relation appends 100 rows and seals every 10 s (R / 10
relation writes a second, spread evenly), ``segment_max_age_seconds = 60``, while the
daemon runs. Every 10 s the bench scrapes ``lamina_conversion_lag_seconds`` of every
relation from ``/metrics`` and keeps the p99 and maximum across relations. Target: the
p99 stays under 2 x 60 s and does not grow (the p99 of the last third of the run is not
above the first third's by more than a segment age). Reported with the daemon tree's peak
RSS and CPU seconds.

Writes bench/results/fanout.json and fanout.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa

from bench import report
from bench.dataset import CACHE
from bench.procs import MemorySampler, median, serve_ready, start_serve, stop_group
from lamina import Store

NAME = "fanout"
FORMAT = 1
SCHEMA = pa.schema([("id", pa.int64()), ("item", pa.string()), ("qty", pa.int64())])
RATIO_TARGET = 3.0
IDLE_CPU_TARGET = 0.05
STEADY_SEGMENT_AGE = 60.0
STEADY_PERIOD = 10.0
STEADY_ROWS = 100
MASTER = "local[*]"


def _rows(lo: int, n: int, t: int = 0) -> pa.Table:
    ids = np.arange(lo, lo + n, dtype=np.int64)
    return pa.table({"id": ids, "item": pa.array([f"item-{i % 1000}" for i in ids.tolist()]),
                     "qty": ids % 97, "_time": pa.array(np.full(n, t, dtype=np.uint64)),
                     "_diff": np.ones(n, dtype=np.int64)})


def fill(root: Path, relations: int, rows: int, appends: int) -> None:
    """``relations`` relations: relation ``r`` gets ``appends`` appends of ``rows`` rows
    each (ids never repeat across relations), then seal(1); the store is closed, so every
    segment is finished."""
    with Store.open(root, fsync="never") as store:
        for r in range(relations):
            rel = store.create_relation(f"t{r:05d}", SCHEMA, key=["id"])
            for a in range(appends):
                rel.append(_rows((r * appends + a) * rows, rows))
            rel.seal(1)
            rel.close()


def cell_input(kind: str, n: int, rows: int) -> Path:
    """The filled data directory of one side of a burst cell, generated once."""
    root = CACHE / "fanout" / f"{kind}-{n}x{rows}"
    done = root / ".complete"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        if kind == "one":
            fill(root, 1, rows, n)
        else:
            fill(root, n, rows, 1)
        done.touch()
    return root


class LogWatch:
    """Follows a daemon's JSON log: when it was ready, and which relations caught up."""

    def __init__(self, path: Path, relations: int, upper: int) -> None:
        self.path = path
        self.want = relations
        self.upper = upper
        self.ready: float | None = None
        self.caught: dict[str, float] = {}
        self._pos = 0

    def poll(self) -> None:
        with self.path.open("rb") as f:
            f.seek(self._pos)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._pos += end
        for line in data[:end].splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            name = ev.get("event")
            if name == "daemon.ready" and self.ready is None:
                self.ready = _ts(ev["timestamp"])
            elif name == "conversion.committed" and ev.get("upper") == self.upper:
                self.caught.setdefault(ev["relation"], _ts(ev["timestamp"]))

    @property
    def done(self) -> bool:
        return len(self.caught) >= self.want

    def seconds(self) -> float:
        assert self.ready is not None
        return max(self.caught.values()) - self.ready


def _ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        return str(resp.read().decode())


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``/metrics`` parsed into name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(scrape_text(port)):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def _total(metrics: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(v for _, v in metrics.get(name, []))


def tree_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of the process ``pid`` and of each of its descendants."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out[p.pid] = t.user + t.system
    return out


def cpu_shares(pid: int, before: dict[int, float], after: dict[int, float],
               wall: float) -> tuple[float, float]:
    """The share of a core the process ``pid`` used between two :func:`tree_cpu` samples,
    and its tree's (processes present in both, plus those started meanwhile)."""
    own = (after.get(pid, 0.0) - before.get(pid, 0.0)) / wall
    tree = sum(v - before.get(p, 0.0) for p, v in after.items()) / wall
    return round(own, 4), round(tree, 4)


def burst_run(src: Path, relations: int, work: Path, *, idle_seconds: float = 0.0,
              timeout: float = 3600.0) -> dict[str, Any]:
    """One round of a burst cell: copy ``src``, serve it, time ready -> caught up."""
    data = work / "data"
    shutil.rmtree(data, ignore_errors=True)
    shutil.copytree(src, data)
    log = work / "serve.log"
    proc, port = start_serve(data, log, master=MASTER,
                             env={"LAMINA_SHUTDOWN_GRACE_SECONDS": "5"})
    watch = LogWatch(log, relations, upper=1)
    out: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + timeout
        while not watch.done:
            if proc.poll() is not None:
                raise RuntimeError(f"lamina serve exited with {proc.returncode}; see {log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(watch.caught)} of {relations} relations caught up "
                                   f"after {timeout} s; see {log}")
            time.sleep(0.1)
            watch.poll()
        out["seconds"] = round(watch.seconds(), 3)
        while not serve_ready(port):
            time.sleep(0.1)
        metrics = scrape(port)
        out["spark_jobs"] = int(_total(metrics, "lamina_spark_jobs_total"))
        out["conversions"] = int(sum(v for labels, v in metrics.get("lamina_jobs_total", [])
                                     if labels.get("kind") == "conversion"
                                     and labels.get("outcome") == "success"))
        if idle_seconds > 0:
            time.sleep(min(idle_seconds, 30))  # let merges and a first GC settle
            before = tree_cpu(proc.pid)
            t0 = time.monotonic()
            time.sleep(idle_seconds)
            after = tree_cpu(proc.pid)
            own, tree = cpu_shares(proc.pid, before, after, time.monotonic() - t0)
            text = scrape_text(port)
            out["idle"] = {"seconds": idle_seconds, "daemon_cpu_share": own,
                           "tree_cpu_share": tree, "target": IDLE_CPU_TARGET,
                           "met": own < IDLE_CPU_TARGET,
                           "scrape_bytes": len(text.encode()),
                           "relation_series": sum(1 for line in text.splitlines()
                                                  if 'relation="' in line)}
    finally:
        stop_group(proc, 60)
    return out


def burst(cells: list[int], rows: int, rounds: int, idle_seconds: float) -> list[dict[str, Any]]:
    work = CACHE / "work" / "fanout"
    out = []
    for n in cells:
        sides = {kind: cell_input(kind, n, rows) for kind in ("one", "many")}
        runs: dict[str, list[dict[str, Any]]] = {"one": [], "many": []}
        for r in range(rounds):
            order = ("one", "many") if r % 2 == 0 else ("many", "one")
            for kind in order:
                last = r == rounds - 1 and kind == "many" and n == max(cells)
                res = burst_run(sides[kind], 1 if kind == "one" else n, work,
                                idle_seconds=idle_seconds if last else 0.0)
                runs[kind].append(res)
                print(f"  N={n} {kind:>4} round {r + 1}/{rounds}: {res['seconds']:.2f} s, "
                      f"{res['spark_jobs']} Spark jobs", file=sys.stderr, flush=True)
        one = median([x["seconds"] for x in runs["one"]])
        many = median([x["seconds"] for x in runs["many"]])
        cell: dict[str, Any] = {
            "relations": n, "rows_per_relation": rows, "rows": n * rows,
            "one_seconds": one, "many_seconds": many, "ratio": round(many / one, 3),
            "target": RATIO_TARGET, "met": many / one <= RATIO_TARGET, "runs": runs}
        idle = next((x["idle"] for x in runs["many"] if "idle" in x), None)
        if idle is not None:
            cell["idle"] = idle
        out.append(cell)
    return out


def _coordinator(root: Path, relations: int, stop: threading.Event,
                 errors: list[BaseException]) -> None:
    """Every relation appends STEADY_ROWS rows and seals every STEADY_PERIOD seconds,
    the relations spread evenly over the period; times are wall-clock milliseconds."""
    try:
        with Store.open(root, segment_max_age_seconds=STEADY_SEGMENT_AGE) as store:
            rels = [store.relation(f"t{r:05d}") for r in range(relations)]
            start = time.monotonic()
            tick = 0
            while not stop.is_set():
                for i, rel in enumerate(rels):
                    due = start + tick * STEADY_PERIOD + i * STEADY_PERIOD / relations
                    delay = due - time.monotonic()
                    if delay > 0 and stop.wait(delay):
                        return
                    t = max(int(time.time() * 1000), rel.upper)
                    rel.append(_rows(i * 1_000_000 + tick * STEADY_ROWS, STEADY_ROWS, t))
                    rel.seal(t + 1)
                tick += 1
    except BaseException as exc:
        errors.append(exc)


def steady(relations: int, seconds: float, work: Path) -> dict[str, Any]:
    data = work / "steady"
    shutil.rmtree(data, ignore_errors=True)
    with Store.open(data, fsync="never") as store:
        for r in range(relations):
            store.create_relation(f"t{r:05d}", SCHEMA, key=["id"]).close()
    log = work / "steady-serve.log"
    proc, port = start_serve(data, log, master=MASTER,
                             env={"LAMINA_SHUTDOWN_GRACE_SECONDS": "5"})
    stop = threading.Event()
    errors: list[BaseException] = []
    coord = threading.Thread(target=_coordinator, args=(data, relations, stop, errors))
    samples: list[dict[str, float]] = []
    try:
        while not serve_ready(port):
            if proc.poll() is not None:
                raise RuntimeError(f"lamina serve exited; see {log}")
            time.sleep(0.2)
        cpu0 = tree_cpu(proc.pid)
        t0 = time.monotonic()
        coord.start()
        with MemorySampler(proc.pid, interval=1.0) as memory:
            while time.monotonic() - t0 < seconds and not errors:
                time.sleep(STEADY_PERIOD)
                metrics = scrape(port)
                lags = sorted(v for _, v in metrics.get("lamina_conversion_lag_seconds", []))
                pending = _total(metrics, "lamina_wal_pending_segments")
                if lags:
                    samples.append({"t": round(time.monotonic() - t0, 1),
                                    "p99": lags[min(len(lags) - 1, int(0.99 * len(lags)))],
                                    "max": lags[-1], "segments_pending": pending})
                    print(f"  steady t={samples[-1]['t']:6.0f}s lag p99 "
                          f"{samples[-1]['p99']:6.1f}s max {lags[-1]:6.1f}s "
                          f"pending segments {pending:.0f}", file=sys.stderr, flush=True)
        wall = time.monotonic() - t0
        own, tree = cpu_shares(proc.pid, cpu0, tree_cpu(proc.pid), wall)
        peaks = dict(memory.peaks)
    finally:
        stop.set()
        if coord.is_alive():
            coord.join()
        stop_group(proc, 60)
    if errors:
        raise RuntimeError(f"the steady coordinator failed: {errors[0]!r}")
    third = max(1, len(samples) // 3)
    first = max(s["p99"] for s in samples[:third])
    last = max(s["p99"] for s in samples[-third:])
    p99 = max(s["p99"] for s in samples)
    return {"relations": relations, "seconds": round(wall, 1),
            "segment_max_age_seconds": STEADY_SEGMENT_AGE, "seal_period_seconds": STEADY_PERIOD,
            "rows_per_seal": STEADY_ROWS, "lag_p99_max": p99, "lag_p99_first_third": first,
            "lag_p99_last_third": last, "lag_target": 2 * STEADY_SEGMENT_AGE,
            "met": p99 < 2 * STEADY_SEGMENT_AGE and last <= first + STEADY_SEGMENT_AGE,
            "daemon_cpu_share": own, "tree_cpu_share": tree,
            "peak_rss_bytes": peaks, "samples": samples}


def plot(doc: dict[str, Any]) -> None:
    groups = [(f"N={c['relations']}", {"one relation": c["one_seconds"],
                                       "N relations": c["many_seconds"]})
              for c in doc.get("burst", [])]
    if groups:
        report.bar_chart(NAME, "caught up after: the same rows as 1 and as N relations",
                         groups, ylabel="seconds", note=f"lamina serve, Spark {MASTER}",
                         targets=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.fanout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", default="200,1000")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--steady-relations", type=int, default=1000)
    parser.add_argument("--steady-seconds", type=float, default=600.0)
    parser.add_argument("--only", default="burst,steady")
    args = parser.parse_args(argv)
    run = report.Run(NAME, argv)
    only = set(args.only.split(","))
    doc: dict[str, Any] = {"format": FORMAT, "master": MASTER}
    if "burst" in only:
        cells = [int(c) for c in args.cells.split(",") if c]
        doc["burst"] = burst(cells, args.rows, args.rounds, args.idle_seconds)
        for c in doc["burst"]:
            print(f"N={c['relations']}: one {c['one_seconds']:.2f} s, many "
                  f"{c['many_seconds']:.2f} s, ratio {c['ratio']} (target <= {RATIO_TARGET}): "
                  f"{'met' if c['met'] else 'MISSED'}")
            if "idle" in c:
                i = c["idle"]
                print(f"  idle: daemon CPU {i['daemon_cpu_share']:.1%} of a core (tree "
                      f"{i['tree_cpu_share']:.1%}); /metrics {i['scrape_bytes']:,} bytes, "
                      f"{i['relation_series']:,} relation series")
    if "steady" in only:
        doc["steady"] = steady(args.steady_relations, args.steady_seconds,
                               CACHE / "work" / "fanout")
        s = doc["steady"]
        print(f"steady {s['relations']} relations, {s['seconds']:.0f} s: conversion lag p99 "
              f"max {s['lag_p99_max']:.1f} s (first third {s['lag_p99_first_third']:.1f}, "
              f"last third {s['lag_p99_last_third']:.1f}; target < {s['lag_target']:.0f}): "
              f"{'met' if s['met'] else 'MISSED'}; daemon CPU {s['daemon_cpu_share']:.1%}, "
              f"tree {s['tree_cpu_share']:.1%}, peak RSS "
              f"{s['peak_rss_bytes']['total'] / 2**20:,.0f} MiB")
    path = report.write_result(NAME, run.document(doc))
    plot(doc)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
