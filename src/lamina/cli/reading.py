"""``lamina snapshot``, ``lamina lookup`` and ``lamina subscribe``: reads, written as CSV,
JSON lines, Parquet or Arrow (lamina.cli.encode) to standard output or a file.

``--as-of`` is an integer time, ``latest`` (the default: the latest readable time, the
API's ``as_of=None``), or, for a relation whose times are epoch milliseconds (every
ingested relation), an ISO-8601 timestamp with its timezone (``2026-11-26T17:00:00Z``):
:func:`parse_as_of`.

Lookup keys (:func:`parse_keys`): one key per argument. For a one-column key the argument is
the value as it is, commas and all (``lamina lookup users 'Smith, J.'``); for a key of
several columns, a JSON array in key order or a JSON object by column name
(``'[7, "a,b"]'``, ``'{"region": "eu", "id": 7}'``). Text is parsed as the column's type
(``7``, ``2024-01-31``, ``2024-01-31T12:00:00``, ``12.50``, ``true``); a JSON number must
fit the column's type exactly; a binary column takes the text's UTF-8 bytes.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Iterable
from datetime import datetime
from types import FrameType

import numpy as np
import pyarrow as pa

from lamina import columns, kernels
from lamina.cli.datadir import open_store
from lamina.cli.encode import BatchWriter
from lamina.cli.output import Progress, is_terminal, output
from lamina.errors import ConfigError, InvalidArgumentError
from lamina.read.subscribe import Progress as SubscriptionProgress
from lamina.schema import TIME
from lamina.store import Relation

LATEST = "latest"


def parse_as_of(rel: Relation, text: str) -> int | datetime | None:
    """``--as-of`` as the API takes it: None for ``latest`` (the relation's latest readable
    time, checked by the read), an int, or for a relation of epoch milliseconds a
    timezone-aware datetime."""
    if text == LATEST:
        return None
    try:
        return int(text)
    except ValueError:
        pass
    if rel.meta.time_unit == "ms":
        try:
            when = datetime.fromisoformat(text)
        except ValueError:
            when = None
        if when is not None and when.tzinfo is not None:
            return when
        raise ConfigError(f"--as-of {text!r} is not a time: pass an integer (epoch "
                          "milliseconds), an ISO-8601 timestamp with its timezone "
                          f"(2026-11-26T17:00:00Z) or '{LATEST}'")
    raise ConfigError(f"--as-of {text!r} is not a time: pass an integer time or "
                      f"'{LATEST}'")


def _refuse_binary_on_terminal(args: argparse.Namespace) -> None:
    if args.format in ("parquet", "arrow") and args.output is None and \
            is_terminal(sys.stdout):
        raise ConfigError(f"--format {args.format} is binary; pass --output FILE or "
                          "redirect standard output")


def _write(args: argparse.Namespace, batches: Iterable[pa.RecordBatch], schema: pa.Schema,
           what: str) -> int:
    """Write ``batches`` in ``--format`` to ``--output`` (whole or not at all) or standard
    output, with progress on a terminal."""
    target = args.output or "standard output"
    rows = 0
    # the live bar stays off when the rows themselves go to the terminal
    bar = args.output is not None or not is_terminal(sys.stdout)
    with Progress(f"reading {what}", bar=bar) as progress, output(args.output) as sink:
        writer = BatchWriter(sink, schema, args.format)
        for batch in batches:
            writer.write(batch)
            rows += batch.num_rows
            progress.advance(batch.num_rows)
        writer.close()
    progress.finish(f"wrote {rows:,} rows to {target}")
    return 0


def snapshot(args: argparse.Namespace) -> int:
    _refuse_binary_on_terminal(args)
    with open_store(args) as store:
        rel = store.relation(args.relation)
        as_of = parse_as_of(rel, args.as_of)
        reader = rel.snapshot_reader(as_of)
        return _write(args, reader, reader.schema, f"{rel.name} at {args.as_of}")


def lookup(args: argparse.Namespace) -> int:
    _refuse_binary_on_terminal(args)
    with open_store(args) as store:
        rel = store.relation(args.relation)
        keys = parse_keys(rel, args.keys)
        as_of = parse_as_of(rel, args.as_of)
        table = rel.lookup(keys, as_of)
    return _write(args, table.to_batches(), table.schema, f"{rel.name} at {args.as_of}")


def parse_keys(rel: Relation, texts: list[str]) -> pa.Table:
    """The keys of ``lamina lookup`` as a table of the key columns (the module docstring);
    a key that does not parse is a one-line ConfigError naming the column and its type."""
    key = list(rel.key)
    if not key:
        raise InvalidArgumentError(f"relation {rel.name!r} has no key columns; use "
                                   "'lamina snapshot'")
    values: dict[str, list[object]] = {k: [] for k in key}
    for text in texts:
        row = [text] if len(key) == 1 else _composite(rel, key, text)
        for k, v in zip(key, row, strict=True):
            values[k].append(v)
    return pa.table({k: _key_column(rel, k, vs) for k, vs in values.items()})


def _composite(rel: Relation, key: list[str], text: str) -> list[object]:
    usage = (f"relation {rel.name!r} has the key columns {key}: pass each key as a JSON "
             f"array in that order or a JSON object by column, e.g. "
             f"'{json.dumps(['...'] * len(key))}'")
    try:
        doc = json.loads(text)
    except ValueError:
        raise ConfigError(f"keys do not parse: {text!r} is not JSON; {usage}") from None
    if isinstance(doc, dict) and sorted(doc) == sorted(key):
        return [doc[k] for k in key]
    if isinstance(doc, list) and len(doc) == len(key):
        return list(doc)
    raise ConfigError(f"keys do not parse: {text!r} does not name every key column once; "
                      f"{usage}")


def _key_column(rel: Relation, name: str, values: list[object]) -> pa.Array:
    t = rel.schema.field(name).type
    out = []
    for v in values:
        try:
            if v is None:
                out.append(pa.nulls(1, t))
            elif isinstance(v, str):  # from buffers: pa.array would import pandas
                out.append(kernels.cast(columns.strings([v]), t))
            elif isinstance(v, bool | int | float):  # bool, int64, uint64 or float64
                out.append(kernels.cast(columns.array(np.array([v])), t))
            else:
                raise TypeError(type(v).__name__)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            raise ConfigError(f"keys do not parse: {json.dumps(v, ensure_ascii=False)} is "
                              f"not a value of key column {name!r} ({t})") from None
    return pa.concat_arrays(out)


def subscribe(args: argparse.Namespace) -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    with open_store(args) as store:
        rel = store.relation(args.relation)
        as_of = parse_as_of(rel, args.as_of)
        items = rel.subscribe(as_of, snapshot=not args.no_snapshot, stop=stop)
        schema = pa.schema([pa.field(f.name, f.type) for f in rel.meta.update_schema
                            if f.name != TIME]).insert(len(rel.schema),
                                                       pa.field(TIME, pa.uint64()))
        writer = BatchWriter(sys.stdout.buffer, schema, args.format)
        for item in items:
            if isinstance(item, SubscriptionProgress):
                writer.progress(item.upper)
            else:
                writer.write(pa.Table.from_arrays(item.columns, schema=schema))
        writer.close()
    return 0
