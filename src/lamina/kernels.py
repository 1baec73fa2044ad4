"""Arrow compute kernels, called without ``pyarrow.compute``.

``import pyarrow.compute`` costs 40 to 65 ms in a fresh process: it builds a Python
wrapper, with a docstring, for every function in Arrow's registry. The functions
themselves are in ``pyarrow._compute`` (under 10 ms), whose ``call_function`` those
wrappers end in. A process that opens a store and reads a snapshot or a lookup pays for
the import before it reads a row, so every module that ``import lamina`` loads, and the
read path behind it (lamina.read, lamina.consolidate), calls its kernels here instead;
``tests/test_columns.py`` checks in a fresh interpreter that snapshots and a lookup leave
``pyarrow.compute`` unimported, and ``tests/test_kernels.py`` that each function here
gives what its ``pyarrow.compute`` namesake gives. Elsewhere (the compacter, ingestion,
the command line) ``pyarrow.compute`` is the better read and costs nothing extra.

Beware the methods of Arrow objects that call it behind the scenes: ``Table.filter``,
``take``, ``cast``, ``sort_by`` and the like import ``pyarrow.compute`` on first use. The
read path calls :func:`filter`, :func:`take` and :func:`cast_table` here instead.

Each function is the ``pyarrow.compute`` function of the same name with the options
lamina uses, and returns what that one returns. ``pyarrow._compute`` is private to
pyarrow, which pyproject.toml pins to one major version; ``call_function`` and the
options classes are the public ones, re-exported by ``pyarrow.compute``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import pyarrow as pa
from pyarrow import _compute

Data: TypeAlias = pa.Array | pa.ChunkedArray | pa.Table | pa.RecordBatch
"""What the kernels take: Arrow arrays and tables (and scalars where a function takes one)."""

_AGGREGATE = _compute.ScalarAggregateOptions(skip_nulls=True, min_count=1)


def _call(name: str, *args: Any, options: Any = None) -> Any:
    return _compute.call_function(name, list(args), options)


def less(a: Any, b: Any) -> Any:
    return _call("less", a, b)


def less_equal(a: Any, b: Any) -> Any:
    return _call("less_equal", a, b)


def greater(a: Any, b: Any) -> Any:
    return _call("greater", a, b)


def greater_equal(a: Any, b: Any) -> Any:
    return _call("greater_equal", a, b)


def not_equal(a: Any, b: Any) -> Any:
    return _call("not_equal", a, b)


def and_(a: Any, b: Any) -> Any:
    return _call("and", a, b)


def or_(a: Any, b: Any) -> Any:
    return _call("or", a, b)


def xor(a: Any, b: Any) -> Any:
    return _call("xor", a, b)


def invert(a: Any) -> Any:
    return _call("invert", a)


def is_null(a: Any) -> Any:
    return _call("is_null", a)


def if_else(cond: Any, a: Any, b: Any) -> Any:
    return _call("if_else", cond, a, b)


def cast(values: Any, target: pa.DataType) -> Any:
    """``pyarrow.compute.cast(values, target, safe=True)``: ArrowInvalid where a value
    would change."""
    return _call("cast", values, options=_compute.CastOptions.safe(target))


def cast_table(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``Table.cast(schema)``: each column cast safely to its field's type where the types
    differ, the schema's nullability and metadata taken. ValueError where the column names
    differ or a column with nulls would become non-nullable."""
    if table.schema.equals(schema):
        return table
    if table.schema.names != schema.names:
        raise ValueError(f"target schema's field names {schema.names} do not match the "
                         f"table's {table.schema.names}")
    for col, field in zip(table.columns, schema, strict=True):
        if not field.nullable and col.null_count:
            raise ValueError(f"Casting field {field.name!r} with null values to non-nullable")
    return pa.Table.from_arrays(
        [col if col.type == field.type else cast(col, field.type)
         for col, field in zip(table.columns, schema, strict=True)], schema=schema)


def min_max(values: pa.Array | pa.ChunkedArray) -> tuple[pa.Scalar, pa.Scalar]:
    """The least and greatest value, nulls skipped (both null scalars when none is
    left)."""
    lo, hi = _call("min_max", values, options=_AGGREGATE).values()
    return lo, hi


def sum(values: pa.Array | pa.ChunkedArray) -> pa.Scalar:
    """The sum, nulls skipped (a null scalar when none is left)."""
    return _call("sum", values, options=_AGGREGATE)


def count_distinct(values: pa.Array | pa.ChunkedArray) -> int:
    """How many distinct values, a null counting as one."""
    return int(_call("count_distinct", values,
                     options=_compute.CountOptions(mode="all")).as_py())


def filter(data: Data, mask: Any) -> Any:
    """The rows where ``mask`` is true (a null in the mask drops the row)."""
    return _call("filter", data, mask)


def take(data: Data, indices: Any) -> Any:
    """The rows at ``indices`` (checked against the bounds)."""
    return _call("take", data, indices, options=_compute.TakeOptions(boundscheck=True))


def sort_indices(table: pa.Table, order: Sequence[str]) -> pa.Array:
    """The indices that sort ``table`` by the columns of ``order``, ascending, nulls first
    (stable)."""
    keys = [(c, "ascending", "at_start") for c in order]
    return _call("sort_indices", table, options=_compute.SortOptions(sort_keys=keys))


def unique(values: pa.Array) -> pa.Array:
    """The distinct values, in the order they first appear."""
    return _call("unique", values)


def is_in(values: Any, value_set: pa.Array) -> Any:
    """Whether each value is in ``value_set``; a null matches a null in it."""
    return _call("is_in", values,
                 options=_compute.SetLookupOptions(value_set=value_set, skip_nulls=False))
