"""Relation metadata (``relation.json``) and the validation of what users hand in.

``relation.json`` lives in the relation's WAL directory and is written atomically once, at
``create_relation``. It is a :class:`RelationMeta` as JSON::

    {"format_version": 1, "name": "orders", "relation_id": "<32 hex>",
     "schema": "<base64 Arrow IPC schema>", "columns": ["id: int64", ...],
     "key": ["id"], "created_at": "2026-11-21T22:29:18Z"}

and, for a relation that records the unit of its times (``time_unit``, lamina.frontier:
``"ms"`` for epoch milliseconds), format version 2 with one more field,
``"time_unit": "ms"``. **The format version rule**: a file is written in the lowest version
that holds it (1 without a time unit, 2 with one), and this lamina reads both; a lamina
that knows only version 1 still reads every relation without a time unit and refuses one
with a unit, whose times it would not read as instants.

``relation_id`` tells incarnations of one name apart: a relation dropped and created again
gets a new id, and trace state of the old one is never read as the new one's.

Row column types are those every part of the pipeline (Arrow IPC, Parquet, Spark) orders
and groups the same way: signed integers, float32/float64 (not float16: Arrow cannot sort
it and Spark has no such type), bool, string, binary, date32, timestamp[us] and decimal128.
``_time`` (uint64) and ``_diff`` (int64) are reserved.

**The diff bound.** An appended ``_diff`` must satisfy ``|_diff| <= MAX_DIFF = 2**62``;
:func:`check_diffs` refuses a table with any other value (DiffOutOfRangeError, naming the
update and the bound) before anything is written. Why a bound, and why this one:

- every accepted diff can be retracted by appending its negation (``-(2**63)``, which
  int64 holds but whose negation it does not, is refused);
- a value near the int64 edge is nearly always a bug upstream (an ``INT64_MAX`` sentinel,
  a wrapped subtraction): refused at append it is named with its row while the caller can
  still fix it, instead of surfacing later as an overflowing sum;
- any two accepted diffs sum to at most ``2**63`` in magnitude, so the issue's case (two
  appends of ``2**63 - 1``) is refused, yet 2**62 leaves room for multiplicities far
  beyond any count of real rows.

No per-update bound can keep *sums* inside int64: one row at one time can be appended
any number of times, and forwarding by ``since`` folds many times into one. Sums are
therefore exact everywhere (decimal128 where int64 could wrap); stored batches keep a sum
outside int64 as a carry, and only a result that must be an int64, a snapshot's
``_diff``, raises DiffOverflowError, with the other rows attached (:mod:`lamina.consolidate`).
"""

from __future__ import annotations

import base64
import json
import re
import sys
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property

import numpy as np
import pyarrow as pa

from lamina import kernels
from lamina.errors import (
    CorruptionError,
    DiffOutOfRangeError,
    InvalidArgumentError,
    InvalidNameError,
    SchemaError,
)
from lamina.frontier import TIME_UNITS

FORMAT_VERSION = 2
"""The newest ``relation.json`` version this lamina writes and reads (module docstring)."""
FORMAT_VERSIONS = (1, 2)
TIME = "_time"
DIFF = "_diff"
RESERVED = (TIME, DIFF)
NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")


def all_nullable(schema: pa.Schema) -> pa.Schema:
    """``schema`` with every top-level field nullable (what ``pa.table()`` makes)."""
    return pa.schema([f.with_nullable(True) for f in schema], metadata=schema.metadata)


def validate_name(name: object) -> str:
    """Return ``name`` if it is a valid relation name, else raise InvalidNameError."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name in (".", ".."):
        raise InvalidNameError(
            f"invalid relation name {name!r}: use 1 to 64 characters of a-z, 0-9, '_', '.' "
            "and '-', starting with a letter or digit (never a path)")
    return name


def _supported(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_signed_integer(t) or t in (pa.float32(), pa.float64())
        or pa.types.is_boolean(t)
        or t in (pa.string(), pa.binary(), pa.date32())
        or (pa.types.is_timestamp(t) and t.unit == "us")
        or pa.types.is_decimal128(t))


@dataclass(frozen=True)
class RelationMeta:
    """The immutable description of a relation."""

    name: str
    relation_id: str
    schema: pa.Schema
    key: tuple[str, ...]
    created_at: str
    time_unit: str | None = None
    """What the relation's times count: ``"ms"`` (epoch milliseconds) or None (plain
    integers); lamina.frontier."""
    format_version: int = 1

    @classmethod
    def new(cls, name: str, schema: pa.Schema,
            key: list[str] | tuple[str, ...] | None,
            time_unit: str | None = None) -> RelationMeta:
        validate_name(name)
        if time_unit is not None and time_unit not in TIME_UNITS:
            raise InvalidArgumentError(f"time_unit must be one of {list(TIME_UNITS)} or None "
                                       f"(plain integers), got {time_unit!r}")
        if not isinstance(schema, pa.Schema):
            raise SchemaError(f"schema must be a pyarrow.Schema, got {type(schema).__name__}")
        if len(schema) == 0:
            raise SchemaError("schema has no columns; a relation needs at least one row column")
        names = schema.names
        if len(set(names)) != len(names):
            raise SchemaError(f"schema has duplicate column names: {names}")
        for f in schema:
            if f.name in RESERVED:
                raise SchemaError(f"column name {f.name!r} is reserved for lamina "
                                  f"({TIME} and {DIFF} are added to every update)")
            if not _supported(f.type):
                raise SchemaError(
                    f"column {f.name!r} has type {f.type}, which lamina does not store; use a "
                    "signed integer, float32, float64, bool, string, binary, date32, "
                    "timestamp[us] or decimal128 type")
        key_t = tuple(key or ())
        for k in key_t:
            if k not in names:
                raise SchemaError(f"key column {k!r} is not in the schema {names}")
        if len(set(key_t)) != len(key_t):
            raise SchemaError(f"key columns repeat: {list(key_t)}")
        clean = pa.schema([pa.field(f.name, f.type, f.nullable) for f in schema])
        return cls(name=name, relation_id=uuid.uuid4().hex, schema=clean, key=key_t,
                   created_at=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                   time_unit=time_unit, format_version=1 if time_unit is None else 2)

    @property
    def row_columns(self) -> list[str]:
        return list(self.schema.names)

    @property
    def sort_columns(self) -> list[str]:
        """Batch order: key columns, then the other row columns."""
        return list(self.key) + [n for n in self.schema.names if n not in self.key]

    @cached_property
    def update_schema(self) -> pa.Schema:
        return self.schema.append(pa.field(TIME, pa.uint64(), False)).append(
            pa.field(DIFF, pa.int64(), False))

    @cached_property
    def loose_update_schema(self) -> pa.Schema:
        """``update_schema`` with every field nullable: what ``pa.table()`` makes of
        updates built by hand (the fast path of :func:`conform_updates`)."""
        return all_nullable(self.update_schema)

    @cached_property
    def non_nullable_updates(self) -> tuple[int, ...]:
        """The positions of ``update_schema``'s non-nullable fields."""
        return tuple(i for i, f in enumerate(self.update_schema) if not f.nullable)

    def to_json(self) -> bytes:
        doc = {
            "format_version": self.format_version,
            "name": self.name,
            "relation_id": self.relation_id,
            "schema": base64.b64encode(self.schema.serialize().to_pybytes()).decode(),
            "columns": [f"{f.name}: {f.type}" for f in self.schema],
            "key": list(self.key),
            "created_at": self.created_at,
        }
        if self.format_version >= 2:
            doc["time_unit"] = self.time_unit
        return (json.dumps(doc, indent=2) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, path: object = None) -> RelationMeta:
        try:
            doc = json.loads(data)
            version = int(doc["format_version"])
            if version not in FORMAT_VERSIONS:
                raise CorruptionError(f"relation.json has format version {version}; this "
                                      f"lamina reads versions {list(FORMAT_VERSIONS)}",
                                      path=str(path))
            unit = doc["time_unit"] if version >= 2 else None
            if unit is not None and unit not in TIME_UNITS:
                raise CorruptionError(f"relation.json has time unit {unit!r}; this lamina "
                                      f"knows {list(TIME_UNITS)}", path=str(path))
            schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(doc["schema"])))
            return cls(name=validate_name(doc["name"]), relation_id=str(doc["relation_id"]),
                       schema=schema, key=tuple(doc["key"]), created_at=str(doc["created_at"]),
                       time_unit=unit, format_version=version)
        except CorruptionError:
            raise
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError,
                pa.ArrowException, pa.ArrowIOError) as exc:  # ArrowIOError: an OSError
            raise CorruptionError(f"relation.json is unreadable: {exc}", path=str(path)) from exc


UPDATE_INPUTS = ("a pyarrow Table, RecordBatch or RecordBatchReader, an object exporting the "
                 "Arrow C stream (__arrow_c_stream__: polars, DuckDB) or a pandas DataFrame")


def to_table(data: object) -> pa.Table:
    """``data`` as a ``pa.Table``: a Table or RecordBatch as it is; a pandas DataFrame
    through ``pa.Table.from_pandas`` (a named index becomes a column, an unnamed one is
    dropped); anything else that exports the Arrow C stream (``__arrow_c_stream__``: a
    RecordBatchReader, polars, DuckDB results) read whole. pandas is never imported here: a
    DataFrame exists only once its caller imported pandas. Anything else, or an input the
    conversion refuses, raises SchemaError."""
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    pd = sys.modules.get("pandas")
    try:
        if pd is not None and isinstance(data, pd.DataFrame):
            named = any(n is not None for n in data.index.names)
            return pa.Table.from_pandas(data, preserve_index=named)
        if hasattr(data, "__arrow_c_stream__"):
            return pa.RecordBatchReader.from_stream(data).read_all()
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise SchemaError(f"updates of type {type(data).__name__} could not be converted to "
                          f"Arrow: {' '.join(str(exc).split())[:300]}") from exc
    raise SchemaError(f"updates must be {UPDATE_INPUTS}; got {type(data).__name__}")


def conform_updates(meta: RelationMeta, data: object) -> pa.Table:
    """Check ``data`` (what :func:`to_table` takes) against the relation and return it as a
    table of exactly ``meta.update_schema`` (columns reordered, types cast where the cast is
    lossless: :func:`_castable`). Raises SchemaError naming the offending column."""
    table = checked_updates(meta, data)
    if table.schema.equals(meta.update_schema, check_metadata=True):
        return table
    return pa.Table.from_arrays(table.columns, schema=meta.update_schema)


def checked_updates(meta: RelationMeta, data: object) -> pa.Table:
    """As :func:`conform_updates`, but a table that is right but for its fields being
    nullable (``meta.loose_update_schema``, what ``pa.table()`` makes of updates built by
    hand) comes back as it is, its non-nullable columns checked for nulls, instead of
    copied under ``meta.update_schema``: ``Relation.append`` passes it on to the WAL
    writer, which encodes it under the relation's schema (lamina.wal.log). That copy was
    most of an append's conforming (docs/performance.md, "WAL append"). A table with
    schema or field metadata is still copied under ``meta.update_schema``, without it."""
    table = to_table(data)
    want = meta.update_schema
    schema = table.schema
    if schema.equals(want) or schema.equals(meta.loose_update_schema):
        # The common case, decided in C: right names, order and types. Only nulls in
        # non-nullable columns remain to be checked.
        for i in meta.non_nullable_updates:
            col = table.column(i)
            if col.null_count:
                raise _nulls_error(want.field(i), col)
        if schema.equals(want, check_metadata=True) or schema.equals(
                meta.loose_update_schema, check_metadata=True):
            return table
        # metadata (the schema's, as pandas sets, or a field's) never reaches a record
        return pa.Table.from_arrays(table.columns, schema=want)
    have = set(table.column_names)
    missing = [n for n in want.names if n not in have]
    extra = [n for n in table.column_names if n not in want.names]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing columns {missing}")
        if extra:
            parts.append(f"unexpected columns {extra}")
        raise SchemaError(f"updates for relation {meta.name!r} do not match its schema: "
                          f"{'; '.join(parts)} (expected {want.names})")
    if len(set(table.column_names)) != len(table.column_names):
        raise SchemaError(f"updates repeat a column: {table.column_names}")
    columns = []
    for field in want:
        col = table.column(field.name)
        if col.type != field.type:
            if not _castable(col.type, field.type):
                raise SchemaError(f"column {field.name!r} has type {col.type}, relation "
                                  f"{meta.name!r} expects {field.type}")
            try:
                col = kernels.cast(col, field.type)
            except pa.ArrowInvalid as exc:
                raise SchemaError(f"column {field.name!r} cannot be converted from {col.type} "
                                  f"to {field.type} without loss: {exc}") from exc
        if not field.nullable and col.null_count:
            raise _nulls_error(field, col)
        columns.append(col)
    return pa.Table.from_arrays(columns, schema=want)


_least, _most = np.minimum.reduce, np.maximum.reduce

MAX_DIFF = 2**62
"""The largest ``|_diff|`` an append accepts (see the module docstring)."""
_SHOWN = 300  # characters of an offending update quoted in an error message


def check_diffs(meta: RelationMeta, table: pa.Table) -> pa.Table:
    """Return ``table`` (a conformed update table) if every ``_diff`` lies in
    ``[-MAX_DIFF, MAX_DIFF]``; else raise DiffOutOfRangeError naming the first offending
    update (its index, row, time and diff), how many there are, and the bound."""
    # by position (a conformed table ends with _time, _diff), numpy over the value buffers
    # (no nulls: _diff is not nullable) and its ufuncs' reductions called directly: per
    # append, Arrow's function dispatch for min_max cost several times the pass, and every
    # call counts in the append loop, where caches are cold (docs/performance.md)
    chunks = [np.frombuffer(c.buffers()[1], np.int64, len(c), c.offset * 8)
              for c in table.column(table.num_columns - 1).chunks if len(c)]
    for values in chunks:
        if _least(values) < -MAX_DIFF or _most(values) > MAX_DIFF:
            break
    else:
        return table
    values = np.concatenate(chunks)
    bad = (values < -MAX_DIFF) | (values > MAX_DIFF)
    index = int(np.argmax(bad))
    update = table.slice(index, 1).to_pylist()[0]
    diff = update.pop(DIFF)
    shown = repr(update)
    if len(shown) > _SHOWN:
        shown = shown[:_SHOWN] + "...}"
    count = int(bad.sum())
    raise DiffOutOfRangeError(
        f"updates for relation {meta.name!r}: update {index} {shown} has {DIFF} {diff}, "
        f"outside the per-update bound [-2**62, 2**62]"
        + (f" ({count - 1} more updates are outside it too)" if count > 1 else "")
        + "; nothing was written. A value that large is usually a sentinel or a wrapped "
        "number upstream; split a real multiplicity that large into several updates")


def _nulls_error(field: pa.Field, col: pa.ChunkedArray) -> SchemaError:
    return SchemaError(f"column {field.name!r} holds {col.null_count} nulls but is not "
                       "nullable")


def _castable(src: pa.DataType, dst: pa.DataType) -> bool:
    """Casts accepted on input, each checked so that no value changes (``safe=True``):
    integer to integer (range-checked), timestamp units of one timezone (a value that needs
    finer than ``dst``'s unit is refused), decimal to decimal (precision and scale
    checked), the large and view variants of string and binary (what polars and pandas
    export), dictionary-encoded columns to their values; nothing that changes meaning."""
    if pa.types.is_dictionary(src):
        return bool(src.value_type == dst) or _castable(src.value_type, dst)
    if pa.types.is_integer(src) and pa.types.is_integer(dst):
        return True
    if pa.types.is_timestamp(src) and pa.types.is_timestamp(dst):
        return bool(src.tz == dst.tz)
    if pa.types.is_decimal(src) and pa.types.is_decimal(dst):
        return True
    pairs = {(pa.large_string(), pa.string()), (pa.large_binary(), pa.binary()),
             (pa.string_view(), pa.string()), (pa.binary_view(), pa.binary()),
             (pa.null(), dst)}
    return (src, dst) in pairs
