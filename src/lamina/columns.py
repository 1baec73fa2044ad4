"""Arrow scalars and arrays to and from numpy without pandas.

pyarrow imports pandas, when it is installed, the first time a conversion has to ask
whether an object is a pandas one: ``pa.scalar(5, pa.uint64())``, ``pa.array`` of a list
or of a numpy array, ``Schema.empty_table()``, a compute function given a Python number,
``to_numpy``. That import takes half a second, more than a whole cold snapshot, so the
read path (lamina.read, lamina.consolidate and what they call) builds its scalars and
arrays here instead, from buffers, which never asks (tests/test_columns.py runs every
read of the API in a fresh interpreter and checks that pandas stays unimported).

Only primitive types and strings without nulls are handled: what the read path makes
itself, the reading commands' JSON literals and keys (lamina.cli), and the drill's
coordinators (lamina.drill.workload: a coordinator restarted a hundred times in a drill
paid the import each time). Arrays read from Parquet are already
Arrow and need none of this.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

_NUMPY_OF = {pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32,
             pa.int64(): np.int64, pa.uint8(): np.uint8, pa.uint16(): np.uint16,
             pa.uint32(): np.uint32, pa.uint64(): np.uint64, pa.float32(): np.float32,
             pa.float64(): np.float64}


def array(values: np.ndarray[Any, Any], type: pa.DataType | None = None) -> pa.Array:
    """A numpy array of numbers or booleans as an Arrow array (no nulls; copied only to
    make it contiguous, or to pack booleans into bits)."""
    if values.dtype == np.bool_:
        bits = np.packbits(values, bitorder="little")
        return pa.Array.from_buffers(pa.bool_(), len(values), [None, pa.py_buffer(bits)])
    target = type if type is not None else pa.from_numpy_dtype(values.dtype)
    if target not in _NUMPY_OF:
        raise TypeError(f"columns.array: {target} is not a primitive numeric type")
    data = np.ascontiguousarray(values, dtype=_NUMPY_OF[target])
    return pa.Array.from_buffers(target, len(data), [None, pa.py_buffer(data)])


def strings(values: list[str], type: pa.DataType | None = None) -> pa.Array:
    """Python strings (no nulls) as an Arrow string array, built from its buffers:
    ``pa.string()`` (the default: 32-bit offsets, under 2 GiB of UTF-8 in all) or
    ``pa.large_string()``."""
    target = pa.string() if type is None else type
    if target not in (pa.string(), pa.large_string()):
        raise TypeError(f"columns.strings: {target} is not string or large_string")
    encoded = [v.encode() for v in values]
    offsets = np.zeros(len(encoded) + 1,
                       dtype=np.int64 if target == pa.large_string() else np.int32)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    return pa.Array.from_buffers(target, len(encoded),
                                 [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))])


def empty_table(schema: pa.Schema) -> pa.Table:
    """``schema.empty_table()``, which builds its columns from Python lists and so imports
    pandas: a table of ``schema`` with no rows, one empty chunk per column."""
    return pa.Table.from_arrays([pa.nulls(0, field.type) for field in schema], schema=schema)


def scalar(value: int | float, type: pa.DataType) -> pa.Scalar:
    """``pa.scalar(value, type)`` for a number."""
    return array(np.array([value], dtype=_NUMPY_OF[type]), type)[0]


def numpy(values: pa.Array | pa.ChunkedArray) -> np.ndarray[Any, Any]:
    """A numeric or boolean Arrow array without nulls as a numpy array (zero-copy for one
    chunk of numbers; booleans are unpacked from bits)."""
    if isinstance(values, pa.ChunkedArray):
        chunks = [numpy(c) for c in values.chunks]
        if len(chunks) == 1:
            return chunks[0]
        dtype = np.bool_ if values.type == pa.bool_() else _NUMPY_OF[values.type]
        return np.concatenate(chunks) if chunks else np.empty(0, dtype=dtype)
    if values.null_count:
        raise ValueError("columns.numpy: the array holds nulls")
    n, offset = len(values), values.offset
    buf = values.buffers()[1]
    if values.type == pa.bool_():
        if buf is None:
            return np.empty(0, dtype=np.bool_)
        bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8), bitorder="little")
        return bits[offset:offset + n].astype(np.bool_)
    if values.type not in _NUMPY_OF:
        raise TypeError(f"columns.numpy: {values.type} is not a primitive numeric type")
    dtype = _NUMPY_OF[values.type]
    if buf is None:
        return np.empty(0, dtype=dtype)
    out: np.ndarray[Any, Any] = np.frombuffer(buf, dtype=dtype, count=offset + n)[offset:]
    return out
