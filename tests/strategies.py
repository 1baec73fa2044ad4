"""Hypothesis strategies shared by the WAL and store suites: random relation schemas over
every row type lamina supports, and random update batches that fit them."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import strategies as st

from lamina.frontier import CLOSED, MAX_TIME
from lamina.schema import RelationMeta

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

frontiers = st.one_of(st.integers(0, MAX_TIME), st.just(CLOSED), st.sampled_from(
    [0, 1, MAX_TIME, MAX_TIME - 1, 2**32, 2**63]))
"""Any frontier, including the empty frontier ``CLOSED`` (2**64)."""


@st.composite
def row_types(draw: st.DrawFn) -> pa.DataType:
    """One of the row column types lamina accepts."""
    kind = draw(st.sampled_from(["int8", "int16", "int32", "int64", "float32", "float64",
                                 "bool", "string", "binary", "date32", "ts", "ts_utc",
                                 "decimal"]))
    if kind == "decimal":
        precision = draw(st.integers(1, 38))
        return pa.decimal128(precision, draw(st.integers(0, precision)))
    return {
        "int8": pa.int8(), "int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(),
        "float32": pa.float32(), "float64": pa.float64(), "bool": pa.bool_(),
        "string": pa.string(), "binary": pa.binary(), "date32": pa.date32(),
        "ts": pa.timestamp("us"), "ts_utc": pa.timestamp("us", tz="UTC"),
    }[kind]


def values_of(t: pa.DataType) -> st.SearchStrategy[Any]:
    """Python values that pyarrow converts to ``t`` without loss."""
    if pa.types.is_integer(t):
        bits = t.bit_width
        return st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    if t == pa.float32():
        return st.floats(width=32)
    if t == pa.float64():
        return st.floats()
    if pa.types.is_boolean(t):
        return st.booleans()
    if t == pa.string():
        return st.text(max_size=20)
    if t == pa.binary():
        return st.binary(max_size=20)
    if t == pa.date32():
        return st.dates()
    if pa.types.is_timestamp(t):
        return st.integers(INT64_MIN, INT64_MAX)  # raw microseconds, full range
    if pa.types.is_decimal(t):
        bound = 10**t.precision - 1
        return st.integers(-bound, bound).map(lambda i: Decimal(f"{i}e-{t.scale}"))  # exact
    raise AssertionError(f"no strategy for {t}")


@st.composite
def schemas(draw: st.DrawFn, max_columns: int = 6) -> pa.Schema:
    """A random relation schema (never using the reserved names)."""
    names = draw(st.lists(st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True),
                          min_size=1, max_size=max_columns, unique=True))
    return pa.schema([pa.field(n, draw(row_types()), nullable=draw(st.booleans()))
                      for n in names])


@st.composite
def batches(draw: st.DrawFn, meta: RelationMeta, *, min_rows: int = 0, max_rows: int = 20,
            times: st.SearchStrategy[int] | None = None) -> pa.Table:
    """A table of ``meta.update_schema`` with random rows; nulls only where nullable."""
    n = draw(st.integers(min_rows, max_rows))
    columns: list[pa.Array] = []
    for field in meta.schema:
        vals = values_of(field.type)
        if field.nullable:
            vals = st.one_of(st.none(), vals)
        columns.append(pa.array(draw(st.lists(vals, min_size=n, max_size=n)), field.type))
    time_values = times if times is not None else st.integers(0, MAX_TIME)
    columns.append(pa.array(draw(st.lists(time_values, min_size=n, max_size=n)), pa.uint64()))
    columns.append(pa.array(draw(st.lists(st.integers(INT64_MIN, INT64_MAX), min_size=n,
                                          max_size=n)), pa.int64()))
    return pa.Table.from_arrays(columns, schema=meta.update_schema)


def same_table(a: pa.Table, b: pa.Table) -> bool:
    """Equal schemas and bit-identical values (NaN payloads and -0.0 included), which
    ``Table.equals`` cannot say for floats holding NaN."""
    if not a.schema.equals(b.schema) or a.num_rows != b.num_rows:
        return False
    for name in a.column_names:
        x, y = a.column(name).combine_chunks(), b.column(name).combine_chunks()
        if x.type == pa.float32():
            x, y = x.view(pa.int32()), y.view(pa.int32())
        elif x.type == pa.float64():
            x, y = x.view(pa.int64()), y.view(pa.int64())
        if not x.equals(y):
            return False
    return True


def rows_with_times(table: pa.Table) -> list[tuple[object, ...]]:
    """The rows of an update table as tuples (for multiset comparisons), floats by bits."""
    cols = []
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if col.type in (pa.float32(), pa.float64()):
            col = col.view(pa.int32() if col.type == pa.float32() else pa.int64())
        elif pa.types.is_timestamp(col.type) or col.type == pa.date32():
            col = pc.cast(col, pa.int64() if pa.types.is_timestamp(col.type) else pa.int32())
        cols.append(col.to_pylist())
    return list(zip(*cols, strict=True))
