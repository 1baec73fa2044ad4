"""PostgreSQL column types -> Arrow types, and the parsing of their text format.

Both ``pgoutput`` and ``COPY ... (FORMAT csv)`` hand values over in the type's text output
format; the source's sessions set ``DateStyle=ISO``, ``TimeZone=UTC``,
``IntervalStyle=postgres``, ``extra_float_digits=3`` and ``bytea_output=hex`` so that the
text is unambiguous and floats round-trip. A column of text values becomes one Arrow array
at a time (:func:`to_arrow`), through Arrow's vectorised casts where there is one.

========================  =========================  ==========================================
PostgreSQL                Arrow                      notes
========================  =========================  ==========================================
smallint (int2)           int16
integer (int4)            int32
bigint (int8)             int64
oid                       int64                      unsigned 32-bit upstream
numeric(p, s), p <= 38    decimal128(p, s)           ``NaN`` cannot be stored: stalls the table
numeric (unconstrained)   string                     arbitrary precision, NaN and +-Infinity
                                                     kept exactly as PostgreSQL prints them;
                                                     also numeric(p, s) with p > 38 or s < 0
real (float4)             float32                    NaN and +-Infinity kept
double precision (float8) float64                    NaN and +-Infinity kept
boolean                   bool
text, varchar(n),         string                     ``char(n)`` keeps its blank padding
char(n)/bpchar, "char",
name
bytea                     binary                     from the hex output format
date                      date32                     ``infinity`` and BC dates stall the table
time                      string                     ``HH:MM:SS[.ffffff]``: lamina stores no
                                                     time-of-day type
timestamp                 timestamp[us]              ``infinity`` and BC stall the table
timestamptz               timestamp[us, tz=UTC]      the instant, in UTC
uuid                      string                     canonical lower-case ``8-4-4-4-12`` form
json, jsonb               string                     the document's text (jsonb: normalised)
arrays (``int4[]``, ...)  string                     PostgreSQL's array literal, ``{1,2,NULL}``
anything else             string                     the type's text output (interval, inet,
                                                     money, enums, ranges, timetz, ...)
========================  =========================  ==========================================

A domain maps as its base type. Every column is nullable in Arrow (a NOT NULL constraint
can be dropped upstream at any time).
"""

from __future__ import annotations

import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import pyarrow as pa
import pyarrow.compute as pc

from lamina.errors import SourceStalledError

__all__ = ["SESSION_SETTINGS", "PgType", "arrow_type", "to_arrow"]

SESSION_SETTINGS: Final = {
    "DateStyle": "ISO",
    "TimeZone": "UTC",
    "IntervalStyle": "postgres",
    "extra_float_digits": "3",
    "bytea_output": "hex",
    "client_encoding": "UTF8",
}
"""Settings every session of the source runs with (the text formats above assume them)."""

BOOL, BYTEA, CHAR, NAME, INT8, INT2, INT4, TEXT, OID = 16, 17, 18, 19, 20, 21, 23, 25, 26
JSON, FLOAT4, FLOAT8, BPCHAR, VARCHAR = 114, 700, 701, 1042, 1043
DATE, TIME, TIMESTAMP, TIMESTAMPTZ, NUMERIC, UUID, JSONB = 1082, 1083, 1114, 1184, 1700, 2950, 3802

_FIXED: Final[dict[int, pa.DataType]] = {
    BOOL: pa.bool_(), BYTEA: pa.binary(), INT2: pa.int16(), INT4: pa.int32(),
    INT8: pa.int64(), OID: pa.int64(), FLOAT4: pa.float32(), FLOAT8: pa.float64(),
    DATE: pa.date32(), TIMESTAMP: pa.timestamp("us"), TIMESTAMPTZ: pa.timestamp("us", "UTC"),
}


@dataclass(frozen=True)
class PgType:
    """A column's type as the catalog has it (a domain already resolved to its base)."""

    oid: int
    typmod: int = -1
    name: str = ""
    """The type's name, for messages (``format_type`` output)."""

    @property
    def arrow(self) -> pa.DataType:
        return arrow_type(self.oid, self.typmod)


def numeric_precision_scale(typmod: int) -> tuple[int, int] | None:
    """``(precision, scale)`` of a ``numeric(p, s)`` typmod; None when unconstrained."""
    if typmod < 4:
        return None
    raw = typmod - 4
    precision = (raw >> 16) & 0xFFFF
    scale = raw & 0x7FF
    if scale & 0x400:  # PostgreSQL 15 allows a negative scale, 11-bit two's complement
        scale -= 0x800
    return precision, scale


def arrow_type(oid: int, typmod: int = -1) -> pa.DataType:
    """The Arrow type a column of this PostgreSQL type is stored as (see the table above)."""
    if oid in _FIXED:
        return _FIXED[oid]
    if oid == NUMERIC:
        ps = numeric_precision_scale(typmod)
        if ps is not None and 1 <= ps[0] <= 38 and 0 <= ps[1] <= ps[0]:
            return pa.decimal128(*ps)
    return pa.string()


def _bad(pg: PgType, values: pa.Array, target: pa.DataType, why: str) -> SourceStalledError:
    sample = _first_bad(values, target)
    return SourceStalledError(
        f"a {pg.name or f'type {pg.oid}'} value {sample!r} cannot be stored as Arrow "
        f"{target} ({why})",
        hint="lamina stalls rather than skip a row: change the value upstream (or the "
             "column's type, e.g. to text) and re-create this output from a new snapshot")


def _first_bad(values: pa.Array, target: pa.DataType) -> str | None:
    for v in values.to_pylist():
        if v is None:
            continue
        try:
            pc.cast(pa.array([v], pa.string()), target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return str(v)
    return None


def _bytea_at_once(strings: pa.Array) -> pa.Array | None:
    """bytea hex text (``\\x0aff``) as binary, every value decoded by one
    ``binascii.unhexlify`` of the column's concatenated digits; None when a value is not
    plain hex of an even length (the caller then decodes value by value, to name the bad
    one)."""
    n = len(strings)
    filled = pc.fill_null(strings, "\\x")
    if n == 0 or not pc.all(pc.starts_with(filled, "\\x")).as_py():
        return None
    digits = pc.utf8_slice_codeunits(filled, 2)
    if pc.any(pc.not_equal(pc.bit_wise_and(pc.utf8_length(digits), 1), 0)).as_py():
        return None
    _, offsets_buf, data_buf = digits.buffers()
    offsets = pa.Array.from_buffers(pa.int32(), n + 1, [None, offsets_buf],
                                    offset=digits.offset)
    first, last = offsets[0].as_py(), offsets[n].as_py()
    try:  # strict: hex digits only, nothing skipped
        decoded = binascii.unhexlify(memoryview(data_buf)[first:last]
                                     if data_buf is not None else b"")
    except ValueError:  # binascii.Error
        return None
    halved = pc.cast(pc.divide(pc.subtract(offsets, first), 2), pa.int32())
    values = pa.Array.from_buffers(pa.binary(), n, [None, halved.buffers()[1],
                                                    pa.py_buffer(decoded)],
                                   offset=halved.offset)
    if not strings.null_count:
        return values
    return pc.if_else(pc.is_null(strings), pa.scalar(None, pa.binary()), values)


def _parse_bytea(text: str) -> bytes:
    if not text.startswith("\\x"):
        raise ValueError(f"bytea text {text[:20]!r} is not in the hex format")
    return bytes.fromhex(text[2:])


def to_arrow(values: Sequence[str | None] | pa.Array, pg: PgType) -> pa.Array:
    """Text values of one column (None = NULL) as an Arrow array of ``pg.arrow``.

    Raises :class:`SourceStalledError` when a value cannot be represented (``NaN`` in a
    decimal column, ``infinity`` or a BC date in a date column, ...).
    """
    target = pg.arrow
    strings = values if isinstance(values, pa.Array) else pa.array(values, pa.string())
    if strings.type != pa.string():
        strings = strings.cast(pa.string())
    if target == pa.string():
        return strings
    if target == pa.bool_():
        ok = pc.is_in(strings, value_set=pa.array(["t", "f"]))
        if not pc.all(pc.or_kleene(ok, pc.is_null(strings))).as_py():
            raise _bad(pg, strings.filter(pc.invert(ok)), target, "expected 't' or 'f'")
        return pc.equal(strings, "t")
    if target == pa.binary():
        try:
            fast = _bytea_at_once(strings)
            if fast is not None:
                return fast
            return pa.array([None if v is None else _parse_bytea(v)
                             for v in strings.to_pylist()], pa.binary())
        except ValueError as e:
            raise SourceStalledError(
                f"a bytea value cannot be decoded: {e}",
                hint="the source's sessions set bytea_output=hex; check that no setting on "
                     "the role or database overrides it") from None
    try:
        return pc.cast(strings, target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        why = str(e).splitlines()[0]
        raise _bad(pg, strings, target, why) from None
