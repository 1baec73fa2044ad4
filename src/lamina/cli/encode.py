"""Streaming output of record batches for the command line: CSV, JSON lines, Parquet and
Arrow IPC, written batch by batch to a binary sink (memory stays one batch).

JSON lines are encoded column-wise with Arrow compute (no Python object per value):
integers, finite floats and booleans as JSON numbers and literals, every other type as its
Arrow string cast in a JSON string (dates ``2024-01-31``, timestamps
``2024-01-31 12:00:00.000000``, decimals ``12.50``), nulls as ``null``. A batch that
holds anything this cannot encode exactly (non-finite floats, control characters other
than tab/newline/CR, binary that is not UTF-8) is encoded with :mod:`json` instead, values
through ``str`` as before.
"""

from __future__ import annotations

import json
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

FORMATS = ("csv", "jsonl", "parquet", "arrow")


_ESCAPES = {0x5C: ("\\", "\\\\"), 0x22: ('"', '\\"'), 0x0A: ("\n", "\\n"),
            0x0D: ("\r", "\\r"), 0x09: ("\t", "\\t")}
"""Bytes a JSON string must escape that have a short escape, backslash first."""


def _special_bytes(text: pa.Array) -> list[int]:
    """The bytes below 0x20, quotes and backslashes in a large_string array's values (one
    numpy pass over its data buffer: most text has none and needs no replacement), in
    the order of :data:`_ESCAPES` first."""
    if len(text) == 0 or text.buffers()[2] is None:
        return []
    offsets = np.frombuffer(text.buffers()[1], dtype=np.int64)[text.offset:
                                                               text.offset + len(text) + 1]
    data = np.frombuffer(text.buffers()[2], dtype=np.uint8)[int(offsets[0]):int(offsets[-1])]
    found = np.unique(data[(data < 0x20) | (data == 0x22) | (data == 0x5C)]).tolist()
    return sorted(found, key=lambda b: (list(_ESCAPES).index(b) if b in _ESCAPES else 99, b))


def _json_values(col: pa.Array) -> pa.Array | None:
    """A string array of each value as JSON text, or None when this encoding would not be
    exact."""
    t = col.type
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        text = pc.cast(col, pa.large_string())
    elif pa.types.is_floating(t):
        if pc.all(pc.is_finite(col)).as_py() not in (True, None):
            return None
        text = pc.cast(col, pa.large_string())
    else:
        try:
            text = pc.cast(col, pa.large_string())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None
        special = _special_bytes(text)
        if special - _ESCAPES.keys():
            return None  # control characters without a short escape: the json fallback
        for byte in special:  # backslash first, so later escapes are not doubled
            a, b = _ESCAPES[byte]
            text = pc.replace_substring(text, a, b)
        text = pc.binary_join_element_wise(_lit('"'), text, _lit('"'), _lit(""))
    return pc.fill_null(text, _lit("null"))


def _lit(text: str) -> pa.Scalar:
    return pa.scalar(text, pa.large_string())


def jsonl(batch: pa.RecordBatch) -> bytes:
    """The rows of ``batch`` as JSON lines."""
    if batch.num_rows == 0:
        return b""
    parts: list[Any] = []
    for i, name in enumerate(batch.schema.names):
        values = _json_values(batch.column(i))
        if values is None:
            return "".join(json.dumps(r, default=str) + "\n"
                           for r in batch.to_pylist()).encode()
        parts.extend([_lit("{" if i == 0 else ","), _lit(json.dumps(name)), _lit(":"), values])
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

            self._writer = pcsv.CSVWriter(sink, schema)
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
