"""Streaming output of record batches for the command line: CSV, JSON lines, Parquet and
Arrow IPC, written batch by batch to a binary sink (memory stays one batch).

JSON lines are strict JSON (RFC 8259) on every line, and each type is written one way for
the whole file, whatever the values (docs/reading.md lists it for users):

========================  ===============================================================
integers, booleans        JSON numbers and literals (``-3``, ``true``)
finite floats             JSON numbers, shortest round-trip form (``0.1``, ``1e+20``)
NaN, infinities           the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``
strings                   JSON strings (UTF-8; control characters escaped)
binary                    base64 strings (RFC 4648, with padding)
timestamps                ISO 8601 strings, every digit of the column's unit
                          (``2024-01-31T12:00:00.000000`` for a relation's timestamp[us]),
                          ``Z`` appended for a timestamp with a timezone (the UTC time)
dates                     ``"2024-01-31"``
decimals                  strings with the column's scale (``"12.50"``): exact
lists, structs, maps      JSON arrays and objects (a map as ``[[key, value], ...]``) of
                          values written as above
null                      ``null``
========================  ===============================================================

The scalar types are encoded column-wise with Arrow compute (no Python object per value);
nested types go through :mod:`json` with the same rules. CSV writes binary columns as
base64 too (pyarrow's writer cannot write bytes that are not UTF-8), everything else as
pyarrow writes it.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import json
import math
from typing import IO, Any

import numpy as np
import pyarrow as pa

from lamina import columns

FORMATS = ("csv", "jsonl", "parquet", "arrow")

_SHORT_ESCAPES = {0x5C: "\\\\", 0x22: '\\"', 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t",
                  0x08: "\\b", 0x0C: "\\f"}
"""Bytes a JSON string must escape that have a short escape (backslash first: escapes
added later must not be doubled); every other byte below 0x20 becomes ``\\u00XX``."""


def _special_bytes(text: pa.Array) -> list[int]:
    """The bytes below 0x20, quotes and backslashes in a large_string array's values (one
    numpy pass over its data buffer: most text has none and needs no replacement),
    backslash first."""
    if len(text) == 0 or text.buffers()[2] is None:
        return []
    offsets = np.frombuffer(text.buffers()[1], dtype=np.int64)[text.offset:
                                                               text.offset + len(text) + 1]
    data = np.frombuffer(text.buffers()[2], dtype=np.uint8)[int(offsets[0]):int(offsets[-1])]
    found: list[int] = np.unique(data[(data < 0x20) | (data == 0x22) | (data == 0x5C)]).tolist()
    return sorted(found, key=lambda b: (b != 0x5C, b))


def _quoted(text: pa.Array) -> pa.Array:
    """Each string of a large_string array as a JSON string literal."""
    import pyarrow.compute as pc  # JSON lines only: the other formats need no kernel
    for byte in _special_bytes(text):
        escape = _SHORT_ESCAPES.get(byte, f"\\u{byte:04x}")
        text = pc.replace_substring(text, chr(byte), escape)
    return pc.binary_join_element_wise(_lit('"'), text, _lit('"'), _lit(""))


def _base64(col: pa.Array) -> pa.Array:
    return pa.array([None if v is None else base64.b64encode(v).decode("ascii")
                     for v in col.to_pylist()], pa.large_string())


def _json_values(col: pa.Array) -> pa.Array:
    """A large_string array of each value of ``col`` as JSON text."""
    import pyarrow.compute as pc

    t = col.type
    if pa.types.is_dictionary(t):
        col = pc.cast(col, t.value_type)
        t = col.type
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        text = pc.cast(col, pa.large_string())
    elif pa.types.is_floating(t):
        text = pc.cast(col, pa.large_string())
        if pc.any(pc.invert(pc.is_finite(col))).as_py():
            inf = columns.scalar(math.inf, t)
            for mask, json_text in ((pc.is_nan(col), '"NaN"'),
                                    (pc.equal(col, inf), '"Infinity"'),
                                    (pc.equal(col, pc.negate(inf)), '"-Infinity"')):
                text = pc.if_else(mask, _lit(json_text), text)
    elif _is_binary(t):
        text = _quoted(_base64(col))
    elif pa.types.is_timestamp(t):
        iso = pc.replace_substring(pc.cast(col, pa.large_string()), " ", "T",
                                   max_replacements=1)
        text = _quoted(iso)
    elif pa.types.is_nested(t):
        text = pa.array([None if v is None else json.dumps(_plain(v), allow_nan=False,
                                                            ensure_ascii=False,
                                                            separators=(",", ":"))
                         for v in col.to_pylist()], pa.large_string())
    else:  # strings, dates, times, decimals: Arrow's text form, quoted
        text = _quoted(pc.cast(col, pa.large_string()))
    return pc.fill_null(text, _lit("null"))


def _plain(v: Any) -> Any:
    """A Python value of a nested column made JSON-ready by the rules above."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else "Infinity" if v > 0 else "-Infinity"
    if isinstance(v, bytes):
        return base64.b64encode(v).decode("ascii")
    if isinstance(v, datetime.datetime):
        return v.strftime("%Y-%m-%dT%H:%M:%S.%f") + ("Z" if v.tzinfo is not None else "")
    if isinstance(v, datetime.date | datetime.time):
        return v.isoformat()
    if isinstance(v, decimal.Decimal):
        return format(v, "f")
    if isinstance(v, datetime.timedelta):
        return v.total_seconds()
    return v


def _lit(text: str) -> pa.Scalar:
    """``pa.scalar(text, pa.large_string())``, which imports pandas (lamina.columns)."""
    return columns.strings([text], pa.large_string())[0]


def jsonl(batch: pa.RecordBatch) -> bytes:
    """The rows of ``batch`` as JSON lines (the module docstring's rules)."""
    import pyarrow.compute as pc

    if batch.num_rows == 0:
        return b""
    parts: list[Any] = []
    for i, name in enumerate(batch.schema.names):
        parts.extend([_lit("{" if i == 0 else ","), _lit(json.dumps(name, ensure_ascii=False)),
                      _lit(":"), _json_values(batch.column(i))])
    parts.append(_lit("}\n"))
    lines = pc.binary_join_element_wise(*parts, _lit(""))
    if isinstance(lines, pa.ChunkedArray):
        lines = lines.combine_chunks()
    if not isinstance(lines, pa.Array):  # every part was a scalar: cannot happen with rows
        raise TypeError("jsonl: no column")
    offsets = np.frombuffer(lines.buffers()[1], dtype=np.int64)[lines.offset:
                                                                lines.offset + len(lines) + 1]
    data = lines.buffers()[2]
    out: bytes = data.to_pybytes()[int(offsets[0]):int(offsets[-1])]
    return out


def _is_binary(t: pa.DataType) -> bool:
    return bool(pa.types.is_binary(t) or pa.types.is_large_binary(t)
                or pa.types.is_binary_view(t) or pa.types.is_fixed_size_binary(t))


def csv_schema(schema: pa.Schema) -> pa.Schema:
    """The schema CSV is written with: binary columns as (base64) strings."""
    return pa.schema([pa.field(f.name, pa.large_string(), f.nullable) if _is_binary(f.type)
                      else f for f in schema])


def csv_batch(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """``batch`` with its binary columns as base64 strings (:func:`csv_schema`)."""
    if schema.equals(batch.schema):
        return batch
    cols = [_base64(c) if _is_binary(c.type) else c for c in batch.columns]
    return pa.RecordBatch.from_arrays(cols, schema=schema)


class BatchWriter:
    """Writes record batches of one schema to ``sink`` in ``fmt``; ``close`` finishes the
    file (Parquet footer, IPC end of stream)."""

    def __init__(self, sink: IO[bytes], schema: pa.Schema, fmt: str) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}")
        self.sink, self.schema, self.fmt = sink, schema, fmt
        self._writer: Any = None
        if fmt == "csv":
            import pyarrow.csv as pcsv

            self.schema = csv_schema(schema)
            self._writer = pcsv.CSVWriter(sink, self.schema)
        elif fmt == "parquet":
            import pyarrow.parquet as pq

            self._writer = pq.ParquetWriter(sink, schema)
        elif fmt == "arrow":
            self._writer = pa.ipc.new_stream(sink, schema)

    def write(self, batch: pa.RecordBatch | pa.Table) -> None:
        batches = batch.to_batches() if isinstance(batch, pa.Table) else [batch]
        for b in batches:
            if self.fmt == "jsonl":
                self.sink.write(jsonl(b))
            elif self.fmt == "csv":
                self._writer.write_batch(csv_batch(b, self.schema))
            else:
                self._writer.write_batch(b)

    def progress(self, upper: int) -> None:
        """A subscription's Progress marker: a ``{"_progress": U}`` line (jsonl), a
        ``# progress U`` line (csv), an empty batch with the metadata
        ``lamina.progress = U`` (arrow)."""
        if self.fmt == "jsonl":
            self.sink.write(b'{"_progress":%d}\n' % upper)
        elif self.fmt == "csv":
            self.sink.write(b"# progress %d\n" % upper)
        elif self.fmt == "arrow":
            self._writer.write_batch(pa.RecordBatch.from_pylist([], self.schema),
                                     custom_metadata={"lamina.progress": str(upper)})
        else:
            raise ValueError("parquet output has no progress markers")
        self.sink.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self.sink.flush()
