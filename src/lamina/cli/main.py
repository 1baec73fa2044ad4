"""The ``lamina`` command line (DESIGN §3): serve, status, snapshot, verify, drill.

Exit codes: 0 success; 1 a problem was found (verify, drill) or the command failed;
2 bad usage or configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lamina.errors import ConfigError, LaminaError

DEFAULT_DATA_DIR = "lamina-data"


def _data_dir_arg(p: argparse.ArgumentParser, default: str | None = DEFAULT_DATA_DIR) -> None:
    p.add_argument("--data-dir", default=default,
                   help=f"data directory (default: {default or 'from config'})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lamina", description="Durable, compacting store "
                                     "for timestamped update streams.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the compacter daemon")
    serve.add_argument("--config", help="TOML settings file")
    _data_dir_arg(serve, None)
    serve.add_argument("--spark-master", help="Spark master URL (default local[*])")
    serve.add_argument("--http", help="HOST:PORT for metrics and health "
                       "(default 127.0.0.1:9740)")

    status = sub.add_parser("status", help="per-relation frontiers, backlog and trace size")
    _data_dir_arg(status)
    status.add_argument("--json", action="store_true", help="print a JSON array")

    snap = sub.add_parser("snapshot", help="print a relation's contents at a time")
    snap.add_argument("relation")
    snap.add_argument("--as-of", type=int, required=True, help="time to read at")
    _data_dir_arg(snap)
    snap.add_argument("--format", choices=("csv", "jsonl", "parquet"), default="csv")
    snap.add_argument("--output", help="file to write (default: standard output)")

    verify = sub.add_parser("verify", help="check every checksum and invariant")
    _data_dir_arg(verify)

    drill = sub.add_parser("drill", help="restart-recovery drill against an oracle")
    _data_dir_arg(drill, None)
    drill.add_argument("--kills", type=int, default=20,
                       help="SIGKILLs to deliver, coordinator and daemon (default 20)")
    drill.add_argument("--seed", type=int, default=None,
                       help="seed of the kill schedule and workload (default: random)")
    drill.add_argument("--report", help="write the JSON report here")
    drill.add_argument("--daemon-share", type=float, default=0.1,
                       help="fraction of the kills aimed at the daemon (default 0.1; each "
                       "daemon kill costs a Spark start-up)")
    drill.add_argument("--max-seconds", type=float, default=None,
                       help="stop killing in time to finish within about this long")
    drill.add_argument("--coordinators", type=int, default=2,
                       help="coordinator workloads killed in parallel, one relation each "
                       "(default 2)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "status":
            return _status(args)
        if args.command == "snapshot":
            return _snapshot(args)
        if args.command == "verify":
            return _verify(args)
        if args.command == "drill":
            from lamina.drill import run_drill_cli

            code: int = run_drill_cli(args)
            return code
    except ConfigError as exc:
        print(f"lamina: {exc}", file=sys.stderr)
        return 2
    except LaminaError as exc:
        print(f"lamina: {exc}", file=sys.stderr)
        return 1
    return 2


def _require_data_dir(path: str) -> Path:
    root = Path(path)
    if not (root / "wal").is_dir():
        raise LaminaError(f"{root} is not a lamina data directory (no wal/ inside); pass "
                          "--data-dir")
    return root


def _serve(args: argparse.Namespace) -> int:
    from lamina.compacter.logs import configure_logging
    from lamina.compacter.settings import load_settings

    settings = load_settings(args.config, overrides={
        "data_dir": args.data_dir, "spark_master": args.spark_master, "http": args.http})
    configure_logging(settings.log_format, settings.log_level)
    from lamina.compacter.daemon import Daemon

    try:
        import uvloop

        return int(uvloop.run(Daemon(settings).run()))
    except ImportError:  # pragma: no cover - uvloop is a dependency
        import asyncio

        return asyncio.run(Daemon(settings).run())


def _status(args: argparse.Namespace) -> int:
    from lamina.layout import Layout
    from lamina.status import KEYS, store_status

    rows = store_status(Layout(_require_data_dir(args.data_dir)))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"lamina status: {args.data_dir}")
    for k in KEYS:
        table.add_column(k, overflow="fold")
    for r in rows:
        table.add_row(*(_cell(r[k]) for k in KEYS))
    Console(width=200).print(table)
    return 0


def _cell(v: Any) -> str:
    if isinstance(v, dict):
        return " ".join(f"L{k}:{n}" for k, n in v.items()) or "-"
    if v == 2**64:
        return "CLOSED"
    return "-" if v is None else str(v)


def _snapshot(args: argparse.Namespace) -> int:
    import pyarrow as pa

    from lamina.store import Store

    with Store.open(_require_data_dir(args.data_dir)) as store:
        table = store.relation(args.relation).snapshot(args.as_of)
    out_path = Path(args.output) if args.output else None
    if args.format == "parquet":
        import pyarrow.parquet as pq

        if out_path is None:
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink)
            sys.stdout.buffer.write(sink.getvalue().to_pybytes())
        else:
            pq.write_table(table, out_path)
        return 0
    if args.format == "csv":
        import pyarrow.csv as pcsv

        sink = pa.BufferOutputStream()
        pcsv.write_csv(table, sink)
        data = sink.getvalue().to_pybytes()
    else:
        data = "".join(json.dumps(row, default=str) + "\n" for row in table.to_pylist()).encode()
    if out_path is None:
        sys.stdout.buffer.write(data)
    else:
        out_path.write_bytes(data)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from lamina.layout import Layout
    from lamina.verify import verify_store

    reports = verify_store(Layout(_require_data_dir(args.data_dir)))
    bad = 0
    for r in reports:
        state = "OK" if r.ok else "PROBLEM"
        print(f"{state:8} {r.name}: {r.segments} segments, {r.batches} batches, "
              f"{r.files} files")
        for p in r.problems:
            print(f"  problem: {p}")
        for n in r.notes:
            print(f"  note: {n}")
        bad += not r.ok
    print(f"{len(reports)} relations checked, {bad} with problems")
    return 1 if bad else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
