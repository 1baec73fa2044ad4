"""The ``lamina`` command line (README, Command line): the parser, and the one handler every
command runs under.

Commands live by what they do: the daemons here (``serve``, ``ingest`` and ``drill`` hand
over to their packages, imported when they run: they need lamina's extras), reads in
:mod:`lamina.cli.reading` (``snapshot``, ``lookup``, ``subscribe``), the relation catalogue
in :mod:`lamina.cli.relations` (``relations``, ``describe``, ``drop``) and the checks in
:mod:`lamina.cli.report` (``status``, ``verify``); where output goes and what progress it
shows: :mod:`lamina.cli.output`; the data directory: :mod:`lamina.cli.datadir`.

Every command honours ``LAMINA_DATA_DIR`` (``--data-dir`` wins; default ``./lamina-data``),
except ``drill``, whose directory is a scratch directory it fills and kills in, never a
store's. Reads open the store read-only (:meth:`lamina.Store.open`), so a mistyped path
creates nothing.

Errors are one line on standard error, never a traceback (:func:`main`). Exit codes: 0
success; 1 a problem was found (verify, drill) or the command failed; 2 bad usage or
configuration; 130 interrupted (Ctrl-C; 143 SIGTERM while writing ``--output``); 141
standard output closed early (``| head``: the
command stops quietly, as a Unix tool killed by SIGPIPE would).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence

from lamina import __version__, failpoints
from lamina.cli import reading, relations, report
from lamina.cli.datadir import DATA_DIR_ENV, DEFAULT_DATA_DIR
from lamina.cli.output import Interrupted
from lamina.errors import ConfigError, LaminaError

TRACEBACK_ENV = "LAMINA_TRACEBACK"
"""Set to 1 to see the traceback of an unexpected error (a bug) instead of one line."""

EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141

_EXTRA_OF_MODULE = {"obstore": "s3", "psycopg2": "postgres"}
_EXTRA_OF_COMMAND = {"serve": "compacter", "drill": "compacter", "ingest": "ingest"}
"""Which of pyproject.toml's extras a missing module, or else a command, needs."""


def _data_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", default=None, help=f"data directory (default: ${DATA_DIR_ENV}, "
                   f"else ./{DEFAULT_DATA_DIR})")


def _as_of_arg(p: argparse.ArgumentParser, what: str = "time to read at") -> None:
    p.add_argument("--as-of", default="latest", metavar="T",
                   help=f"{what}: an integer time, or 'latest' (the default: the latest "
                   "readable time, the relation's upper minus one)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lamina", description="Durable, compacting store "
                                     "for timestamped update streams.")
    parser.add_argument("--version", action="version", version=f"lamina {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the compacter daemon")
    serve.add_argument("--config", help="TOML settings file")
    _data_dir_arg(serve)
    serve.add_argument("--spark-master", help="Spark master URL (default local[*])")
    serve.add_argument("--http", help="HOST:PORT for metrics and health "
                       "(default 127.0.0.1:9740)")

    ingest = sub.add_parser("ingest", help="run the ingestion service (sources into "
                            "relations, exactly once)")
    ingest.add_argument("--config", help="TOML file with [[sources]] (required)")
    _data_dir_arg(ingest)
    ingest.add_argument("--http", help="HOST:PORT for metrics, health and /v1/sources "
                        "(default 127.0.0.1:9741)")
    resync = ingest.add_subparsers(dest="ingest_command").add_parser(
        "resync", help="read one table of a source afresh and write the difference")
    resync.add_argument("--config", required=True, help="TOML file with [[sources]]")
    resync.add_argument("source")
    resync.add_argument("table", help="upstream table (public.orders) or its relation")
    _data_dir_arg(resync)
    resync.add_argument("--http", help="HOST:PORT of the running lamina ingest, if any")

    status = sub.add_parser("status", help="per-relation frontiers, backlog and trace size")
    _data_dir_arg(status)
    status.add_argument("--json", action="store_true", help="print a JSON array")

    rels = sub.add_parser("relations", help="list the relations: name, key, columns, frontiers")
    _data_dir_arg(rels)
    rels.add_argument("--json", action="store_true", help="print a JSON array")

    describe = sub.add_parser("describe", help="one relation: schema, key, frontiers, trace, "
                              "backlog, quarantine")
    describe.add_argument("relation")
    _data_dir_arg(describe)
    describe.add_argument("--json", action="store_true", help="print a JSON object")

    drop = sub.add_parser("drop", help="drop a relation and all its data (needs --yes)")
    drop.add_argument("relation")
    _data_dir_arg(drop)
    drop.add_argument("--yes", action="store_true",
                      help="confirm: the relation's updates are gone for good")

    snap = sub.add_parser("snapshot", help="print a relation's contents at a time")
    snap.add_argument("relation")
    _as_of_arg(snap)
    _data_dir_arg(snap)
    snap.add_argument("--format", choices=("csv", "jsonl", "parquet", "arrow"), default="csv")
    snap.add_argument("--output", help="file to write, whole or not at all (default: "
                      "standard output)")

    subs = sub.add_parser("subscribe", help="stream a relation's snapshot, then its changes "
                          "as the upper advances (until CLOSED, SIGINT or SIGTERM)")
    subs.add_argument("relation")
    _as_of_arg(subs, "time of the first snapshot (with --no-snapshot: the last progress "
               "received minus one)")
    subs.add_argument("--no-snapshot", action="store_true",
                      help="resume: skip the snapshot, deliver updates after --as-of")
    _data_dir_arg(subs)
    subs.add_argument("--format", choices=("jsonl", "csv", "arrow"), default="jsonl")

    look = sub.add_parser("lookup", help="the rows with the given keys at a time")
    look.add_argument("relation")
    look.add_argument("keys", nargs="+", metavar="KEY",
                      help="one key per argument: a one-column key's value as it is "
                      "(commas included); a key of several columns as a JSON array in key "
                      "order or a JSON object by column, e.g. '[7, \"a,b\"]'")
    _as_of_arg(look)
    _data_dir_arg(look)
    look.add_argument("--format", choices=("csv", "jsonl", "parquet", "arrow"),
                      default="csv")
    look.add_argument("--output", help="file to write, whole or not at all (default: "
                      "standard output)")

    verify = sub.add_parser("verify", help="check every checksum and invariant")
    _data_dir_arg(verify)

    drill = sub.add_parser("drill", help="restart-recovery drill against an oracle")
    drill.add_argument("--data-dir", default=None, help="an empty scratch directory for the "
                       f"drill (default: a temporary one; ${DATA_DIR_ENV} is not used: the "
                       "drill never runs on a store's data directory)")
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
    drill.add_argument("--relations", type=int, default=None,
                       help="relations written in all, spread over the coordinators "
                       "(default: one each); many relations make the daemon run packs")
    drill.add_argument("--coordinators", type=int, default=2,
                       help="coordinator workloads killed in parallel, one relation each "
                       "(default 2)")
    drill.add_argument("--executor", choices=["spark", "inprocess", "mixed"],
                       default="spark",
                       help="the executor of the daemon's lives (default spark: a JVM start "
                       "per life); mixed runs Spark where the kill is about Spark (packs, "
                       "one random kill, the final daemon) and the in-process executor for "
                       "the other fail points, which both executors share")
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
    """Run one command; every failure ends as one line on standard error and an exit code
    (the module docstring), never a traceback."""
    code = _run(argv)
    try:  # a reader that went away is noticed here, not in the interpreter's last flush
        sys.stdout.flush()
    except (OSError, ValueError):
        _silence_stdout()
        code = code or EXIT_BROKEN_PIPE
    return code


def _run(argv: Sequence[str] | None) -> int:
    command = "lamina"
    try:
        args = build_parser().parse_args(argv)
        command = args.command
        failpoints.load_env()  # a malformed LAMINA_FAILPOINTS is a start-up error (exit 2)
        return _COMMANDS[args.command](args)
    except ConfigError as exc:
        return _fail(exc, 2)
    except LaminaError as exc:
        return _fail(exc, 1)
    except Interrupted as exc:  # SIGTERM while writing --output
        return _fail(f"interrupted ({exc})", 128 + exc.signum)
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_INTERRUPTED)
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except ModuleNotFoundError as exc:
        module = (exc.name or "").partition(".")[0]
        extra = _EXTRA_OF_MODULE.get(module) or _EXTRA_OF_COMMAND.get(command)
        if extra is None or not module:
            return _unexpected(command, exc)
        return _fail(f"'lamina {command}' needs lamina's optional dependencies "
                     f"'{extra}' ({module} is missing): pip install 'lamina[{extra}]'", 1)
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        return _fail(f"{exc.strerror or exc}{where}", 1)
    except SystemExit as exc:  # argparse: usage errors (2), --help and --version (0)
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        return _fail(exc.code, 1)
    except Exception as exc:
        return _unexpected(command, exc)


def _unexpected(command: str, exc: Exception) -> int:
    """An exception lamina does not translate is a bug: one line naming it, or the whole
    traceback with ``LAMINA_TRACEBACK=1``."""
    if os.environ.get(TRACEBACK_ENV) == "1":
        raise exc
    return _fail(f"unexpected error in 'lamina {command}' (a bug; please report it, with "
                 f"the traceback {TRACEBACK_ENV}=1 shows): {type(exc).__name__}: "
                 f"{' '.join(str(exc).split())[:300]}", 1)


def _fail(error: object, code: int) -> int:
    """Print ``lamina: <error>`` as one line on standard error; return ``code``."""
    text = " ".join(str(error).split())
    with contextlib.suppress(OSError):  # stderr itself gone: the exit code is what is left
        print(f"lamina: {text}", file=sys.stderr, flush=True)
    return code


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so the interpreter's final flush
    does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _serve(args: argparse.Namespace) -> int:
    from lamina.compacter.logs import configure_logging
    from lamina.compacter.settings import load_settings

    settings = load_settings(args.config, overrides={
        "data_dir": args.data_dir, "spark_master": args.spark_master, "http": args.http})
    configure_logging(settings.log_format, settings.log_level)
    import uvloop

    from lamina.compacter.daemon import Daemon

    return int(uvloop.run(Daemon(settings).run()))


def _ingest(args: argparse.Namespace) -> int:
    from lamina.compacter.logs import configure_logging
    from lamina.ingest.settings import load_settings as load_ingest_settings

    if args.ingest_command == "resync":
        from lamina.ingest.resync_cli import run

        return run(args)
    if args.config is None:
        raise ConfigError("lamina ingest needs --config FILE (a TOML file with [[sources]])")
    settings = load_ingest_settings(args.config, overrides={
        "data_dir": args.data_dir, "http": args.http})
    configure_logging(settings.log_format, settings.log_level)
    import uvloop

    from lamina.ingest.service import IngestService

    return int(uvloop.run(IngestService(settings).run()))


def _drill(args: argparse.Namespace) -> int:
    from lamina.drill import run_drill_cli

    return run_drill_cli(args)


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": _serve,
    "ingest": _ingest,
    "drill": _drill,
    "status": report.status,
    "verify": report.verify,
    "relations": relations.relations,
    "describe": relations.describe,
    "drop": relations.drop,
    "snapshot": reading.snapshot,
    "lookup": reading.lookup,
    "subscribe": reading.subscribe,
}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
