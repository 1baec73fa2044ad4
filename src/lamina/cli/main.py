"""The ``lamina`` command line (README, Command line): serve, status, snapshot, verify, drill.

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

from lamina import failpoints
from lamina.errors import ConfigError, LaminaError
from lamina.frontier import fmt

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

    ingest = sub.add_parser("ingest", help="run the ingestion service (sources into "
                            "relations, exactly once)")
    ingest.add_argument("--config", required=True, help="TOML file with [[sources]]")
    _data_dir_arg(ingest, None)
    ingest.add_argument("--http", help="HOST:PORT for metrics, health and /v1/sources "
                        "(default 127.0.0.1:9741)")

    status = sub.add_parser("status", help="per-relation frontiers, backlog and trace size")
    _data_dir_arg(status)
    status.add_argument("--json", action="store_true", help="print a JSON array")

    snap = sub.add_parser("snapshot", help="print a relation's contents at a time")
    snap.add_argument("relation")
    snap.add_argument("--as-of", type=int, required=True, help="time to read at")
    _data_dir_arg(snap)
    snap.add_argument("--format", choices=("csv", "jsonl", "parquet", "arrow"), default="csv")
    snap.add_argument("--output", help="file to write (default: standard output)")

    subs = sub.add_parser("subscribe", help="stream a relation's snapshot, then its changes "
                          "as the upper advances (until CLOSED, SIGINT or SIGTERM)")
    subs.add_argument("relation")
    subs.add_argument("--as-of", type=int, required=True, help="time of the first snapshot "
                      "(with --no-snapshot: the last progress received minus one)")
    subs.add_argument("--no-snapshot", action="store_true",
                      help="resume: skip the snapshot, deliver updates after --as-of")
    _data_dir_arg(subs)
    subs.add_argument("--format", choices=("jsonl", "csv", "arrow"), default="jsonl")

    look = sub.add_parser("lookup", help="the rows with the given keys at a time")
    look.add_argument("relation")
    look.add_argument("keys", nargs="+", metavar="KEY",
                      help="key values; a multi-column key as comma-separated values")
    look.add_argument("--as-of", type=int, required=True, help="time to read at")
    _data_dir_arg(look)
    look.add_argument("--format", choices=("csv", "jsonl", "parquet", "arrow"),
                      default="csv")

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
    drill.add_argument("--trace-url", default=None,
                       help="keep the drill's traces here (s3://bucket/prefix; credentials "
                       "and endpoint from the AWS environment) instead of under the data "
                       "directory")
    drill.add_argument("--ingest", choices=["files"], default=None,
                       help="drill `lamina ingest` instead: a files source fed by a writer, "
                       "killed at random and at the ingest.* fail points, the daemon running")
    drill.add_argument("--no-daemon", action="store_true",
                       help="with --ingest: do not run the compacter daemon alongside")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        failpoints.load_env()  # a malformed LAMINA_FAILPOINTS is a start-up error (exit 2)
        if args.command == "serve":
            return _serve(args)
        if args.command == "ingest":
            return _ingest(args)
        if args.command == "status":
            return _status(args)
        if args.command == "snapshot":
            return _snapshot(args)
        if args.command == "subscribe":
            return _subscribe(args)
        if args.command == "lookup":
            return _lookup(args)
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


def _ingest(args: argparse.Namespace) -> int:
    from lamina import failpoints
    from lamina.compacter.logs import configure_logging
    from lamina.ingest.settings import load_settings as load_ingest_settings

    failpoints.load_env()
    settings = load_ingest_settings(args.config, overrides={
        "data_dir": args.data_dir, "http": args.http})
    configure_logging(settings.log_format, settings.log_level)
    import uvloop

    from lamina.ingest.service import IngestService

    return int(uvloop.run(IngestService(settings).run()))


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
    return "-" if v is None else fmt(v) if isinstance(v, int) else str(v)


def _open_output(path: str | None) -> Any:
    """The binary sink for ``--output`` (standard output when None); an unwritable path is
    a one-line error."""
    if path is None:
        return sys.stdout.buffer
    try:
        return open(path, "wb")
    except OSError as exc:
        raise LaminaError(f"cannot write --output {path}: {exc.strerror or exc}; pass a path "
                          "in an existing, writable directory") from None


def _write_out(args: argparse.Namespace, reader: Any, schema: Any) -> int:
    from lamina.cli.encode import BatchWriter

    sink = _open_output(getattr(args, "output", None))
    try:
        writer = BatchWriter(sink, schema, args.format)
        for batch in reader:
            writer.write(batch)
        writer.close()
    except BrokenPipeError:  # the reader of standard output went away (| head)
        _silence_stdout()
        return 0
    except OSError as exc:
        raise LaminaError(f"cannot write the output: {exc.strerror or exc}") from None
    finally:
        if sink is not sys.stdout.buffer:
            sink.close()
    return 0


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so the interpreter's final flush
    does not fail again."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _snapshot(args: argparse.Namespace) -> int:
    from lamina.store import Store

    with Store.open(_require_data_dir(args.data_dir)) as store:
        reader = store.relation(args.relation).snapshot_reader(args.as_of)
        return _write_out(args, reader, reader.schema)


def _lookup(args: argparse.Namespace) -> int:
    import pyarrow as pa

    from lamina.store import Store

    with Store.open(_require_data_dir(args.data_dir)) as store:
        rel = store.relation(args.relation)
        key = list(rel.key)
        if not key:
            raise LaminaError(f"relation {args.relation!r} has no key columns; use "
                              "'lamina snapshot'")
        values: list[list[str]] = [[] for _ in key]
        for text in args.keys:
            fields = text.split(",") if len(key) > 1 else [text]
            if len(fields) != len(key):
                raise ConfigError(f"key {text!r} has {len(fields)} values; relation "
                                  f"{args.relation!r} has key columns {key}: pass "
                                  "comma-separated values in that order")
            for i, v in enumerate(fields):
                values[i].append(v)
        try:
            keys = pa.table({k: pa.array(v, pa.string()).cast(rel.schema.field(k).type)
                             for k, v in zip(key, values, strict=True)})
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise ConfigError(f"keys {args.keys} do not parse as the key columns "
                              f"{[str(rel.schema.field(k)) for k in key]}: {exc}") from None
        table = rel.lookup(keys, args.as_of)
    return _write_out(args, table.to_batches(), table.schema)


def _subscribe(args: argparse.Namespace) -> int:
    import signal
    import threading

    from lamina.cli.encode import BatchWriter
    from lamina.store import Store
    from lamina.subscribe import Progress

    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    with Store.open(_require_data_dir(args.data_dir)) as store:
        rel = store.relation(args.relation)
        items = rel.subscribe(args.as_of, snapshot=not args.no_snapshot, stop=stop)
        import pyarrow as pa

        from lamina.schema import TIME

        schema = pa.schema([pa.field(f.name, f.type) for f in rel.meta.update_schema
                            if f.name != TIME]).insert(len(rel.schema),
                                                       pa.field(TIME, pa.uint64()))
        writer = BatchWriter(sys.stdout.buffer, schema, args.format)
        try:
            for item in items:
                if isinstance(item, Progress):
                    writer.progress(item.upper)
                else:
                    writer.write(pa.Table.from_arrays(item.columns, schema=schema))
            writer.close()
        except BrokenPipeError:
            _silence_stdout()
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
