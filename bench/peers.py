"""Side by side with Delta Lake (delta-rs): the same keyed update stream into lamina and
into Delta tables, durable append to final bytes.

    .venv/bin/python -m bench.peers [--cells 1m-k200-50k,...] [--rounds 3]
                                    [--contenders lamina,delta,...] [--merge-budget 60]
    .venv/bin/python -m bench.peers --table      # re-render the docs table only

For every cell (:data:`bench.peers_stream.CELLS`; default the five 1M-update cells) the
stream is generated once from a seed and cached; then each round runs every contender
(:mod:`bench.peers_contenders`) in its own process on a fresh directory, the order
rotating from round to round. Each figure is the median over the rounds with its range
(min, max). The ratios lamina / durable Delta are held against the targets: durable append
throughput >= 3x, bytes on disk at the end <= 0.6x, latest snapshot read time <= 1x (the median
of five reads after the process's first, which is reported apart).

**Correctness gate**: every finished run's checksum of the latest snapshot must equal the
checksum of the rows the stream leaves live (computed when the stream is generated);
any mismatch fails the run (exit status 1, after the results are written with
``"gate": "failed"``). A contender that overruns ``--budget`` seconds of ingest stops
early (``--merge-budget`` for ``delta-merge``, whose MERGE slows down as the table grows);
it is reported with how far it got and its rate so far, and left out of the ratios.

Writes bench/results/peers.json (cells run before are kept, newer runs replace a cell),
peers.png, and the table between ``<!-- bench:peers -->`` and ``<!-- /bench:peers -->``
of docs/performance.md (unless ``LAMINA_BENCH_RESULTS`` moves the results).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.dataset import CACHE
from bench.peers_contenders import CONTENDERS, lag, maintenance_every
from bench.peers_stream import CELLS, ensure

NAME = "peers"
DEFAULT_CELLS = ("1m-k200-50k", "1m-k200-1m", "1m-k2000-50k", "1m-k2000-1m", "1m-churn")
TARGETS = {"throughput": (">=", 3.0), "end_bytes": ("<=", 0.6), "read_latest": ("<=", 1.0),
           "read_latest_first": ("<=", 1.0)}
"""lamina / durable Delta, per figure (issue 23 added the first read of a process)."""
PEAK_TARGET = ("<=", 1.5)
"""Peak bytes on disk during a run, lamina / durable Delta; held against every lamina
contender that keeps one version (``peak_bytes`` for ``lamina``, ``peak_bytes, WAL lz4``
and so on for the ones whose WAL is compressed; ``lamina-zstd`` also runs the daemon's
settings for a small disk, bench.peers_lamina.DAEMON_SETTINGS, and bounds its writer's WAL
backlog, bench.peers_lamina.WAL_BACKLOG_BYTES)."""
PEAK_CONTENDERS = ("lamina", "lamina-lz4", "lamina-zstd")
DOC = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
BEGIN, END = "<!-- bench:peers -->", "<!-- /bench:peers -->"
ROOT = Path(__file__).resolve().parents[1]
LABELS = {"lamina": "lamina", "lamina-default": "lamina, 8 versions kept (default)",
          "lamina-lz4": "lamina, WAL lz4", "lamina-zstd": "lamina, WAL zstd, small-disk daemon",
          "delta": "Delta durable", "delta-nofsync": "Delta, no fsync",
          "delta-merge": "Delta MERGE (keyed)"}


ORDER = {c: i for i, c in enumerate(CONTENDERS)}
"""Where each contender's rows go in the table (the order of ``CONTENDERS``)."""


class GateError(Exception):
    """A contender's snapshot differs from the stream's live rows."""


def run_child(contender: str, cell: str, work: Path, budget: float) -> dict[str, Any]:
    """One run of ``contender`` in its own process; a failed run is tried once more (the
    tree is shared with other work: a half-edited module must not lose a whole cell),
    so a contender that fails twice fails the benchmark."""
    try:
        return _run_child(contender, cell, work, budget)
    except RuntimeError as exc:
        print(f"  {exc}: trying once more", file=sys.stderr, flush=True)
        time.sleep(10)
        return _run_child(contender, cell, work, budget)


def _run_child(contender: str, cell: str, work: Path, budget: float) -> dict[str, Any]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log = work.parent / f"{work.name}.log"
    with log.open("wb") as err:
        proc = subprocess.run([sys.executable, "-m", "bench.peers_contenders", contender, cell,
                               str(work), str(budget)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=err, text=True, timeout=budget * 3 + 900, check=False)
    shutil.rmtree(work, ignore_errors=True)
    if proc.returncode != 0:
        err_text = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{contender} on {cell} exited {proc.returncode}: {err_text}")
    doc: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return doc


def _get(doc: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        doc = doc[part]
    return doc


FIGURES = {
    "throughput": "updates_per_s", "latency_p50_ms": "latency.p50_ms",
    "latency_p99_ms": "latency.p99_ms", "latency_max_ms": "latency.max_ms",
    "latency_growth": "latency.growth", "ingest_seconds": "ingest_seconds",
    "append_write_bytes": "append_write_bytes",
    "maintenance_cpu_seconds": "maintenance_cpu_seconds",
    "maintenance_write_bytes": "maintenance_write_bytes", "end_bytes": "end_bytes",
    "peak_bytes": "peak_bytes", "end_files": "end_files", "peak_files": "peak_files",
    "read_latest": "read_latest_seconds", "read_latest_first": "read_latest_first_seconds",
    "read_old": "read_old_seconds",
    "recovery_seconds": "recovery.seconds", "lost_acked": "recovery.lost_acked",
}
"""Summarized figures: name -> path in a run's answer."""


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and range of every figure over a contender's finished runs."""
    from bench.procs import median

    for r in runs:
        r["updates_per_s"] = round(r["updates"] / r["ingest_seconds"])
    done = [r for r in runs if r["finished"]]
    out: dict[str, Any] = {"runs": len(runs), "finished": len(done)}
    if not done:  # cut short by the budget: how far it got, and how fast
        out["appends_before_budget"] = [r["appends"] for r in runs]
        out["updates_per_s_before_budget"] = [r["updates_per_s"] for r in runs]
        out["last"] = runs[-1]
        return out
    for name, path in FIGURES.items():
        values = [_get(r, path) for r in done]
        if any(v is None for v in values):
            out[name] = None
            continue
        out[name] = {"median": round(median(values), 4), "min": min(values),
                     "max": max(values)}
    out["time_travel_half_answers"] = all(r["time_travel_half"]["answers"] for r in done)
    out["checksums"] = sorted({r["checksum"] for r in done})
    if "caught_up" in done[0]:
        out["caught_up"] = all(r["caught_up"] for r in done)
        out["settled"] = all(r.get("settled", False) for r in done)
        out["settle_seconds"] = [r.get("settle_seconds") for r in done]
        out["catch_up_seconds"] = [r["catch_up_seconds"] for r in done]
    out["last"] = done[-1]
    return out


def gate(contenders: dict[str, Any], expected: str) -> dict[str, list[str]]:
    """The contenders whose finished runs gave another checksum than ``expected`` (the
    stream's live rows), with the checksums they gave; empty when all agree."""
    return {c: s["checksums"] for c, s in contenders.items()
            if s["finished"] and s["checksums"] != [expected]}


def ratios(contenders: dict[str, Any]) -> dict[str, Any]:
    """lamina / durable Delta for each target figure, medians of the rounds."""
    base = contenders.get("delta", {})
    wanted = [("lamina", name, name, op_target) for name, op_target in TARGETS.items()]
    wanted += [(c, "peak_bytes", "peak_bytes" if c == "lamina" else
                f"peak_bytes, {LABELS[c].removeprefix('lamina, ')}", PEAK_TARGET)
               for c in PEAK_CONTENDERS]
    out: dict[str, Any] = {}
    for contender, fig, label, (op, target) in wanted:
        lam = contenders.get(contender, {})
        if not lam.get(fig) or not base.get(fig):
            continue
        r = lam[fig]["median"] / base[fig]["median"]
        out[label] = {"ratio": round(r, 3), "target": f"{op} {target}",
                      "met": r >= target if op == ">=" else r <= target}
    return out


def run_cell(cell_name: str, contenders: list[str], rounds: int, budgets: dict[str, float]
             ) -> dict[str, Any]:
    cell = CELLS[cell_name]
    expected = ensure(cell)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
    work = CACHE / "work" / f"{NAME}-{os.getpid()}"  # tests may run one alongside
    loads = [report.load_average()]
    for r in range(rounds):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        for c in order:
            started = time.monotonic()
            answer = run_child(c, cell_name, work / c, budgets[c])
            runs[c].append(answer)
            print(f"  {cell_name} round {r + 1}/{rounds} {c:>14}: ingest "
                  f"{answer['ingest_seconds']:8.2f} s, {answer['end_bytes'] / 2**20:8.1f} MiB "
                  f"at the end, read {answer['read_latest_seconds']:.3f} s "
                  f"({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
        loads.append(report.load_average())
    shutil.rmtree(work, ignore_errors=True)
    summary = {c: summarize(rs) for c, rs in runs.items()}
    bad = gate(summary, str(expected["checksum"]))
    return {"cell": {"updates": cell.updates, "appends": cell.appends, "keys": cell.keys,
                     "retractions": cell.retractions, "seed": cell.seed,
                     "maintenance_every": maintenance_every(cell), "lag": lag(cell)},
            "expected": expected, "rounds": rounds, "contenders": summary,
            "ratios": ratios(summary), "gate": "failed" if bad else "passed",
            "gate_mismatches": bad, "load_average_per_round": loads}


def keep_earlier(result: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any]:
    """A cell's new result, with the contenders of its ``previous`` result that this run
    did not run kept as they were (a rerun of some contenders leaves the others' figures
    in place). Each kept one is named in ``earlier`` with the run it comes from; the
    gate stays this run's own, and the ratios are taken over all of them (a ratio may set
    a contender of this run against one of an earlier run, as the table's notes say)."""
    if previous is None:
        return result
    earlier = dict(previous.get("earlier", {}))
    kept = {c: s for c, s in previous["contenders"].items() if c not in result["contenders"]}
    for c in kept:
        earlier.setdefault(c, {"when": previous["when"], "command": previous["command"]})
    contenders = {**result["contenders"], **kept}
    return {**result, "contenders": contenders, "ratios": ratios(contenders),
            "earlier": {c: e for c, e in earlier.items() if c in kept}}


def _by_run(earlier: dict[str, Any]) -> dict[tuple[str, str], list[str]]:
    """The kept contenders of a cell grouped by the run they come from, oldest first."""
    runs: dict[tuple[str, str], list[str]] = {}
    for c in CONTENDERS:
        if c in earlier:
            runs.setdefault((earlier[c]["when"], earlier[c]["command"]), []).append(c)
    return dict(sorted(runs.items()))


def _load(results: Path) -> dict[str, Any] | None:
    path = results / f"{NAME}.json"
    if not path.exists():
        return None
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def _mib(v: float) -> str:
    return f"{v / 2**20:,.1f}"


def _fig(s: dict[str, Any], name: str, fmt: str = "{:,.0f}") -> str:
    v = s.get(name)
    if v is None:
        return "-"
    return f"{fmt.format(v['median'])} ({fmt.format(v['min'])} to {fmt.format(v['max'])})"


def table(results: Path = report.RESULTS) -> str:
    """The peers results as markdown: one row per cell and contender, then the ratios."""
    doc = _load(results)
    if doc is None:
        return "No results yet: run `.venv/bin/python -m bench.peers`."
    head = ["| cell | contender | updates/s | append p50 / p99 / max ms (growth) | "
            "maintenance CPU s / MiB written | MiB on disk end (peak) | files end | "
            "latest read s; first in process | read at since s | half-run time travel | "
            "recovery s |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows, ratio_rows, foot = [], [], []
    for name, cell in doc["cells"].items():
        earlier = cell.get("earlier", {})
        for c, s in sorted(cell["contenders"].items(), key=lambda cs: ORDER.get(cs[0], 99)):
            label = LABELS.get(c, c) + (f" (run of {earlier[c]['when'][:16]}Z)"
                                        if c in earlier else "")
            if not s["finished"]:
                rows.append(f"| {name} | {label} | stopped by the budget after "
                            f"{s['appends_before_budget']} of {cell['cell']['appends']} "
                            f"appends, at {s['updates_per_s_before_budget']} updates/s "
                            f"| - | - | - | - | - | - | - | - |")
                continue
            lat = (f"{s['latency_p50_ms']['median']:.2f} / {s['latency_p99_ms']['median']:.1f}"
                   f" / {s['latency_max_ms']['median']:.0f} "
                   f"({s['latency_growth']['median']:.2f}x)")
            old = "-" if s["read_old"] is None else f"{s['read_old']['median']:.3f}"
            first = "-" if s.get("read_latest_first") is None else \
                f"{s['read_latest_first']['median']:.3f}"
            rows.append(
                f"| {name} | {label} | {_fig(s, 'throughput')} | {lat} | "
                f"{s['maintenance_cpu_seconds']['median']:.1f} / "
                f"{_mib(s['maintenance_write_bytes']['median'])} | "
                f"{_mib(s['end_bytes']['median'])} ({_mib(s['peak_bytes']['median'])}) | "
                f"{s['end_files']['median']:.0f} | {_fig(s, 'read_latest', '{:.3f}')}; "
                f"first {first} | "
                f"{old} | {'yes' if s['time_travel_half_answers'] else 'no'} | "
                f"{s['recovery_seconds']['median']:.3f} |")
        # from the summaries, so a target added later is shown for earlier runs too
        for fig, r in ratios(cell["contenders"]).items():
            ratio_rows.append(f"| {name} | {fig} | {r['ratio']} | {r['target']} | "
                              f"{'yes' if r['met'] else '**no**'} |")
        load = cell["load_average"]
        foot.append(f"- `{name}` ({cell['when']}, {cell['rounds']} rounds, gate "
                    f"{cell['gate']}, load average {load['before'][0]} before, "
                    f"{load['after'][0]} after, {cell['seconds']} s): `{cell['command']}`"
                    + "".join(f"; {', '.join(f'`{c}`' for c in names)} from the run "
                              f"of {when}: `{command}`"
                              for (when, command), names in _by_run(earlier).items()))
    ratio_head = ["| cell | figure (lamina / Delta durable) | ratio | target | met |",
                  "|---|---|---|---|---|"]
    return "\n".join([*head, *rows, "", *ratio_head, *ratio_rows, "",
                      "Runs (each figure is the median of the rounds, range in brackets):",
                      "", *foot])


def update_doc(text: str, doc: Path = DOC) -> bool:
    """The peers table between its own markers (bench.run.update_doc does the work)."""
    from bench import run

    return run.update_doc(text, doc, BEGIN, END)


def plot(doc: dict[str, Any]) -> Path:
    groups = []
    targets: list[float | None] = []
    for fig, label in (("throughput", "append throughput"), ("end_bytes", "bytes at end"),
                       ("read_latest", "latest read time")):
        bars = {name: cell["ratios"][fig]["ratio"] for name, cell in doc["cells"].items()
                if fig in cell["ratios"]}
        op, target = TARGETS[fig]
        groups.append((f"{label}: lamina / Delta (target {op} {target})", bars))
        targets.append(target)
    return report.bar_chart(NAME, "lamina against durable Delta Lake, per cell", groups,
                            ylabel="ratio", note="medians of interleaved rounds; load "
                            "average per cell in peers.json; dashed: the target",
                            targets=targets)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--cells", default=",".join(DEFAULT_CELLS),
                        help="comma-separated subset of " + ", ".join(CELLS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--budget", type=float, default=900.0,
                        help="seconds of ingest before a contender is stopped")
    parser.add_argument("--merge-budget", type=float, default=60.0,
                        help="the same for delta-merge (MERGE slows down as the table grows)")
    parser.add_argument("--table", action="store_true", help="only re-render the docs table")
    args = parser.parse_args(argv)
    failed = False
    if not args.table:
        contenders = args.contenders.split(",")
        for c in contenders:
            if c not in CONTENDERS:
                parser.error(f"unknown contender {c!r}")
        for cell in args.cells.split(","):
            if cell not in CELLS:
                parser.error(f"unknown cell {cell!r}")
            run = report.Run(NAME, argv)
            budgets = {c: args.merge_budget if c == "delta-merge" else args.budget
                       for c in contenders}
            result = run.document(run_cell(cell, contenders, args.rounds, budgets))
            doc = _load(report.RESULTS) or {"benchmark": NAME, "cells": {}}
            result = doc["cells"][cell] = keep_earlier(result, doc["cells"].get(cell))
            doc.update({k: result[k] for k in ("when", "command", "load_average", "machine")})
            report.write_result(NAME, doc)
            plot(doc)
            for fig, r in result["ratios"].items():
                print(f"{cell}: {fig} lamina / Delta durable {r['ratio']} ({r['target']}): "
                      f"{'met' if r['met'] else 'MISSED'}", flush=True)
            if result["gate"] != "passed":
                print(f"{cell}: CORRECTNESS GATE FAILED: {result['gate_mismatches']} != "
                      f"{result['expected']['checksum']}", file=sys.stderr, flush=True)
                failed = True
    text = table()
    print(text)
    if report.RESULTS.resolve() == report.DEFAULT_RESULTS.resolve() and update_doc(text):
        print(f"updated {DOC}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
