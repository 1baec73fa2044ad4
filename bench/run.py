"""Every benchmark, then the results table of docs/performance.md.

    .venv/bin/python -m bench.run [--scale 1.0] [--rounds 5] [--only NAME,...] [--verify]
    make bench                        # the same with the defaults

Runs each benchmark as its own process (``python -m bench.<name> ...``, in the order of
:data:`BENCHMARKS`), each writing ``bench/results/<name>.json`` and ``<name>.png``, then
renders the table of all results (figures, targets, the load average and the exact command
of each) between the markers ``<!-- bench:results -->`` and ``<!-- /bench:results -->`` of
docs/performance.md. ``--table`` only renders the table from the existing results.
``--scale 0.1`` gives a quick run on a tenth of the data (inputs are cached under
bench/.cache, generated on first use). With ``LAMINA_BENCH_RESULTS=DIR`` the results go
to DIR and docs/performance.md is left alone (a smoke run, or a run of older code).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.report import DEFAULT_RESULTS, RESULTS

BENCHMARKS = ("wal_append", "convert", "merge", "amplification", "recovery", "scaling",
              "peers", "reading", "ingest", "trace_storage", "fanout", "cold_read")
DOC = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
BEGIN, END = "<!-- bench:results -->", "<!-- /bench:results -->"


def round_ratios(lamina: dict[str, Any], base: dict[str, Any]) -> str:
    """The spread of lamina's speed-up over the rounds of a run, each round's contenders
    paired (they ran back to back): " (rounds LOW to HIGH)", or nothing for one round. The
    machine drifts by a tenth within minutes (docs/performance.md), so the ratio of the
    medians alone can hide how far one rerun may land from it."""
    pairs = [b / a for a, b in zip(lamina.get("seconds", []), base.get("seconds", []),
                                   strict=False) if a > 0]
    if len(pairs) < 2:
        return ""
    return f" (rounds {min(pairs):.2f} to {max(pairs):.2f})"


def arguments(name: str, scale: float, rounds: int, verify: bool) -> list[str]:
    if name == "wal_append":
        return ["--seconds", "10"]
    if name == "trace_storage":  # a tenth of convert's and merge's inputs (--scale 1: 0.1)
        return ["--scale", f"{scale / 10:g}", "--rounds", str(min(rounds, 3))]
    if name == "fanout":  # a tenth: N = 200 only, and a 2-minute steady cell of 200
        if scale < 1:
            return ["--cells", "200", "--steady-relations", "200", "--steady-seconds", "120"]
        return ["--rounds", str(min(rounds, 3))]
    if name == "cold_read":  # fresh processes: more rounds than the others, as they are short
        return ["--updates", str(round(1_000_000 * scale)), "--rounds", str(max(rounds, 5))]
    if name == "peers":  # the 1M cells (the 10M ones: --cells, see docs/performance.md)
        return ["--rounds", str(min(rounds, 3)), *(["--cells", "quick"] if scale < 1 else [])]
    args = ["--scale", str(scale)]
    if name != "amplification":
        args += ["--rounds", str(rounds)]
    if verify and name in ("convert", "merge"):
        args.append("--verify")
    return args


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"  # LAMINA_BENCH_RESULTS moves it
    if not path.exists():
        return None
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def _n(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _mib(v: int) -> str:
    return f"{v / 2**20:,.0f}"


def _ok(met: bool) -> str:
    return "yes" if met else "**no**"


def table() -> str:
    """The results as markdown, one row per measured figure."""
    rows: list[str] = []
    foot: list[str] = []

    def row(*cells: str) -> None:
        """benchmark, figure, lamina, baseline, ratio, target, met"""
        rows.append("| " + " | ".join(cells) + " |")

    def source(doc: dict[str, Any]) -> None:
        load = doc.get("load_average", {"before": ["?"], "after": ["?"]})
        foot.append(f"- `{doc['benchmark']}` ({doc['when']}, load average "
                    f"{load['before'][0]} before, {load['after'][0]} after, "
                    f"{doc.get('seconds', '?')} s): `{doc.get('command', '?')}`")

    if (doc := _load("wal_append")) is not None:
        row("WAL append", "updates/s, fsync per append", _n(doc["lamina"]["updates_per_s"]),
            f"raw write+fdatasync {_n(doc['raw']['updates_per_s'])}", f"{doc['ratio']}",
            ">= 0.8", _ok(doc["met"]["ratio"]))
        source(doc)
    for name, label in (("convert", "Conversion"), ("merge", "Merge")):
        if (doc := _load(name)) is None:
            continue
        c = doc["contenders"]
        for base, r in doc["ratios"].items():
            row(label, f"updates/s vs {base} (median of {doc['rounds']})",
                _n(c["lamina"]["updates_per_s"]), _n(c[base]["updates_per_s"]),
                f"{r['ratio']}{round_ratios(c['lamina'], c[base])}", f">= {r['target']}",
                _ok(r["met"]))
        source(doc)
    if (doc := _load("amplification")) is not None:
        a, t = doc["amplification"], doc["trace_size"]
        row("Write amplification", f"merge bytes / appended bytes, {a['appends']} appends, "
            "since fixed", f"{a['ratio']}", f"rows: {a['rows_ratio']}", f"{a['ratio']}",
            f"<= {a['bound']}", _ok(a["met"]))
        row("Trace size", f"trace bytes / snapshot bytes (worst of {len(t['series'])}), "
            "since follows upper", f"{t['worst_ratio']}", f"merges wrote {t['merge_ratio']}x "
            "the appended bytes", f"{t['worst_ratio']}", f"<= {t['target']}", _ok(t["met"]))
        source(doc)
    if (doc := _load("recovery")) is not None:
        s, p = doc["start_to_ready"], doc["snapshot"]
        row("Recovery", f"daemon start to ready, s ({s['batches']} batches, "
            f"{_mib(s['wal_bytes'])} MiB WAL)", f"{s['seconds']}",
            f"state files alone {s['state_read_seconds']}",
            f"{s['ratio_ready_to_state_read']}x (Spark start {s['spark_seconds']} s, "
            f"relations {s['relations_seconds']} s)", "-", "-")
        row("Snapshot", f"Relation.snapshot of {p['rows_read']:,} rows, s",
            f"{p['lamina_seconds']}", f"read_table+group_by {p['pyarrow_seconds']}",
            f"{p['ratio']}", f">= {p['target']}", _ok(p["met"]))
        source(doc)
    if (doc := _load("scaling")) is not None:
        c, up = doc["contenders"], doc["speedup_over_local1"]
        for name in c:
            row("Scaling", f"conversion updates/s, {name}", _n(c[name]["updates_per_s"]),
                _n(c["local[1]"]["updates_per_s"]), f"{up[name]}x local[1]", "-", "-")
        source(doc)
    for name, label in (("convert", "Conversion"), ("merge", "Merge")):
        if (doc := _load(name)) is None:
            continue
        for who, v in doc["contenders"].items():
            m = v["peak_rss_bytes"]
            row("Memory", f"{label}: peak RSS MiB of {who} (driver / JVM / Python workers)",
                f"{_mib(m['total'])}", f"{_mib(m['driver'])} / {_mib(m['jvm'])} / "
                f"{_mib(m['python_workers'])}", "-", "-", "-")
    if (doc := _load("reading")) is not None:
        sub, look, sp = doc["subscribe"], doc["lookup"], doc["spark"]
        row("Subscribe", f"seal -> Progress delivered, ms p50 / p99 ({sub['seals']} seals)",
            f"{sub['p50_ms']} / {sub['p99_ms']}", "-", "-", "-", "-")
        row("Lookup", f"{look['keys']} keys in {look['rows']:,} rows, s",
            f"{look['lookup_seconds']}", f"snapshot + filter {look['snapshot_filter_seconds']}",
            f"{look['ratio']}", f">= {look['target']}", _ok(look["met"]))
        row("Spark reader", f"read_snapshot of {sp['rows']:,} rows, s",
            f"{sp['read_snapshot_seconds']}",
            f"snapshot + createDataFrame {sp['snapshot_create_dataframe_seconds']}",
            f"{sp['ratio']}", "-", "-")
        if (out := doc.get("cli_output")) is not None:
            row("CLI output", f"lamina snapshot --format jsonl of {out['rows']:,} rows, s "
                "(process)", f"{out['cli_jsonl_seconds']}",
                f"snapshot in process {out['snapshot_seconds']}; csv {out['cli_csv_seconds']}",
                "-", "-", "-")
        source(doc)
    if (doc := _load("ingest")) is not None:
        sn, st, fr = doc["snapshot"], doc["streaming"], doc["freshness"]
        row("Ingest snapshot", f"PostgreSQL initial snapshot, rows/s ({sn['rows']:,} rows, "
            f"median of {sn['rounds']})", _n(sn["snapshot_rows_per_s"]),
            f"COPY TO STDOUT {_n(sn['copy_rows_per_s'])}", f"{sn['ratio']}",
            f">= {sn['target']}", _ok(sn["met"]))
        row("Ingest streaming", f"a pgbench backlog ({st['changes']:,} changes), changes/s",
            _n(st["lamina_changes_per_s"]),
            f"pg_recvlogical {_n(st['pg_recvlogical_changes_per_s'])}", f"{st['ratio']}",
            f">= {st['target']}", _ok(st["met"]))
        row("Ingest freshness", f"commit -> sealed under pgbench -n -c 4 -j 2 "
            f"({fr['pgbench']['tps']} tps), ms p50 / p99", f"{fr['p50_ms']} / {fr['p99_ms']}",
            "-", "-", f"p99 <= {fr['target_p99_ms']:.0f}", _ok(fr["met"]))
        source(doc)
    if (doc := _load("fanout")) is not None:
        for c in doc.get("burst", []):
            row("Fan-out", f"caught up after, s: {c['relations']:,} relations x "
                f"{c['rows_per_relation']:,} rows (median of {len(c['runs']['many'])})",
                f"{c['many_seconds']}", f"the same rows as one relation {c['one_seconds']}",
                f"{c['ratio']}", f"<= {c['target']}", _ok(c["met"]))
            if (i := c.get("idle")) is not None:
                row("Fan-out", f"daemon CPU with {c['relations']:,} idle relations, share "
                    "of a core", f"{i['daemon_cpu_share']}",
                    f"whole tree {i['tree_cpu_share']}", "-", f"< {i['target']}",
                    _ok(i["met"]))
        if (s := doc.get("steady")) is not None:
            row("Fan-out", f"conversion lag p99, s: {s['relations']:,} relations sealing "
                f"every {s['seal_period_seconds']:.0f} s for {s['seconds']:.0f} s",
                f"max {s['lag_p99_max']:.1f}, last third {s['lag_p99_last_third']:.1f}",
                f"segment age {s['segment_max_age_seconds']:.0f} s", "-",
                f"< {s['lag_target']:.0f}, not growing", _ok(s["met"]))
        source(doc)
    if (doc := _load("cold_read")) is not None:
        lam = doc["lamina"]
        for base in ("delta", "duckdb"):
            r = doc[f"ratio_vs_{base}"]
            row("Cold read", f"a fresh process imports, opens and reads the latest snapshot "
                f"({doc['updates']:,} updates, {doc['keys']:,} keys), ms (median of "
                f"{doc['rounds']})", f"{lam['total_ms']} (read {lam['read_ms']})",
                f"{base} {doc[base]['total_ms']} (read {doc[base]['read_ms']})",
                f"{r['value']}", f"<= {r['target']}", _ok(r["met"]))
        source(doc)
    head = ["| benchmark | figure | lamina | baseline | ratio | target | met |",
            "|---|---|---|---|---|---|---|"]
    return "\n".join([*head, *rows, "", "Runs (each figure comes from these):", "", *foot])


def update_doc(text: str, doc: Path = DOC, begin: str = BEGIN, end: str = END) -> bool:
    """Replace what stands between the ``begin`` and ``end`` markers of ``doc`` with
    ``text``; False (and nothing written) when the doc or a marker is missing."""
    if not doc.exists():
        return False
    content = doc.read_text()
    if begin not in content or end not in content:
        return False
    head, rest = content.split(begin, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{begin}\n{text}\n{end}{tail}")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", default=",".join(BENCHMARKS),
                        help="comma-separated subset of " + ", ".join(BENCHMARKS))
    parser.add_argument("--verify", action="store_true",
                        help="check lamina's conversion and merge outputs against the "
                             "reference executor")
    parser.add_argument("--table", action="store_true",
                        help="only render the table from the existing results")
    args = parser.parse_args(argv)
    failed = []
    if not args.table:
        for name in args.only.split(","):
            if name not in BENCHMARKS:
                parser.error(f"unknown benchmark {name!r}")
            cmd = [sys.executable, "-m", f"bench.{name}",
                   *arguments(name, args.scale, args.rounds, args.verify)]
            print(f"== {' '.join(cmd[1:])}", flush=True)
            started = time.monotonic()
            if subprocess.run(cmd, check=False).returncode != 0:
                failed.append(name)
            print(f"== {name}: {time.monotonic() - started:.0f} s", flush=True)
    text = table()
    print(text)
    if RESULTS.resolve() != DEFAULT_RESULTS.resolve():
        print(f"results in {RESULTS} (LAMINA_BENCH_RESULTS): {DOC} left as it is")
    elif update_doc(text):
        print(f"updated {DOC}")
        from bench import peers

        peers.update_doc(peers.table())  # its own table, between its own markers
        from bench import trace_storage

        trace_storage.update_doc(trace_storage.table())  # likewise
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
