"""pgoutput row changes of one table, kept as the raw messages, turned into Arrow columns
once per binding, column by column across all of them (numpy), not value by value.

While streaming, the source only reads the first bytes of an ``Insert``, ``Update`` or
``Delete`` (its type, relation oid and tuple marker: see
:func:`~lamina.ingest.postgres.pgoutput.change_header`) and keeps the message itself.
:func:`to_columns` then walks the tuples of every message at once (the layout of
:mod:`~lamina.ingest.postgres.pgoutput`): for column ``c`` of every tuple, its kind byte
(``t`` text, ``n`` NULL, ``u`` unchanged TOAST), its length and where its bytes are; the
next column starts after them. Rows come out in message order, an update's old row
(``-1``) before its new one (``+1``); an unchanged TOASTed value of a new row is the old
row's. Each column becomes one Arrow ``string`` array, its values copied out of the
messages by one Arrow ``take`` and checked as UTF-8, for
:func:`~lamina.ingest.postgres.types.to_arrow`.

Anything the vectorised walk does not expect (a binary value, a tuple of another width,
an unchanged value with no old row to take it from, a length that runs past its message)
sends the whole batch through the per-message decoder
(:func:`~lamina.ingest.postgres.pgoutput.decode`), which either decodes it or names the
problem (:class:`~lamina.errors.SourceStalledError`: the output stalls before the
binding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
import pyarrow as pa

from lamina.errors import SourceProtocolError, SourceStalledError
from lamina.ingest.postgres import pgoutput

__all__ = ["to_columns"]

_TEXT, _NULL, _UNCHANGED = ord("t"), ord("n"), ord("u")
_INSERT, _DELETE = ord("I"), ord("D")
_TUPLE_AT: Final = 6
"""Where the first tuple of a change starts: type byte, relation oid (4), marker."""

_Walk = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""Per column and tuple: start, length, kind byte; and where each tuple ends."""


def to_columns(messages: Sequence[bytes], width: int, *, table: str,
               ) -> tuple[list[pa.Array], pa.Array]:
    """The row columns (``string``) and ``_diff`` of ``messages`` (Insert / Update with the
    old row / Delete with the old row) of a table of ``width`` columns."""
    fast = _vectorised(messages, width)
    return fast if fast is not None else _one_by_one(messages, width, table)


def _vectorised(messages: Sequence[bytes], width: int,
                ) -> tuple[list[pa.Array], pa.Array] | None:
    n = len(messages)
    if n == 0:
        return [pa.array([], pa.string()) for _ in range(width)], pa.array([], pa.int64())
    sizes = np.fromiter(map(len, messages), np.int64, n)
    ends = np.cumsum(sizes)
    bases = ends - sizes
    data = pa.py_buffer(b"".join(messages))
    buf = np.frombuffer(data, np.uint8)
    tags = buf[bases]
    has_old = tags != _INSERT
    has_new = tags != _DELETE
    old = _walk(buf, bases[has_old] + _TUPLE_AT, ends[has_old], width)
    if old is None:
        return None
    new_at = bases + _TUPLE_AT
    updates = has_old & has_new
    after_old = old[3][updates[has_old]]
    if after_old.size and (np.any(after_old >= ends[updates])
                           or np.any(buf[np.minimum(after_old, len(buf) - 1)] != ord("N"))):
        return None
    new_at[updates] = after_old + 1
    new = _walk(buf, new_at[has_new], ends[has_new], width)
    if new is None or np.any(new[3] != ends[has_new]) or np.any(
            old[3][~has_new[has_old]] != ends[~has_new]):
        return None                         # bytes left over: not the layout expected
    counts = has_old.astype(np.int64) + has_new
    first = np.cumsum(counts) - counts
    old_rows = first[has_old]
    new_rows = first[has_new] + has_old[has_new]
    rows = int(counts.sum())
    # for each new row of an update, the index of its old row among the old tuples
    old_of_new = np.cumsum(has_old)[has_new] - 1
    new_has_old = has_old[has_new]
    columns = []
    for c in range(width):
        start = np.empty(rows, np.int64)
        length = np.empty(rows, np.int64)
        kind = np.empty(rows, np.uint8)
        if np.any(old[2][c] == _UNCHANGED):
            return None
        nstart, nlength, nkind = new[0][c].copy(), new[1][c].copy(), new[2][c].copy()
        toast = nkind == _UNCHANGED
        if np.any(toast):
            if np.any(toast & ~new_has_old):
                return None
            src = old_of_new[toast]
            nstart[toast] = old[0][c][src]
            nlength[toast] = old[1][c][src]
            nkind[toast] = old[2][c][src]
        start[old_rows], length[old_rows], kind[old_rows] = old[0][c], old[1][c], old[2][c]
        start[new_rows], length[new_rows], kind[new_rows] = nstart, nlength, nkind
        column = _strings(data, start, length, kind == _NULL)
        if column is None:
            return None
        columns.append(column)
    diffs = np.empty(rows, np.int64)
    diffs[old_rows] = -1
    diffs[new_rows] = 1
    return columns, pa.array(diffs)


def _walk(buf: np.ndarray, at: np.ndarray, limit: np.ndarray, width: int) -> _Walk | None:
    """The tuples starting at ``at`` (each ending by ``limit``), all at once."""
    k = len(at)
    starts = np.empty((width, k), np.int64)
    lengths = np.zeros((width, k), np.int64)
    kinds = np.empty((width, k), np.uint8)
    if k == 0:
        return starts, lengths, kinds, at
    last = len(buf) - 1
    if np.any(at + 2 > limit):
        return None
    ncols = (buf[at].astype(np.int64) << 8) | buf[at + 1]
    if np.any(ncols != width):
        return None
    pos = at + 2
    for c in range(width):
        if np.any(pos >= limit):
            return None
        kind = buf[pos]
        text = kind == _TEXT
        if not np.all(text | (kind == _NULL) | (kind == _UNCHANGED)):
            return None
        if np.any(text & (pos + 5 > limit)):
            return None
        p = np.where(text, np.minimum(pos + 1, last - 3), 0)
        length = ((buf[p].astype(np.int64) << 24) | (buf[p + 1].astype(np.int64) << 16)
                  | (buf[p + 2].astype(np.int64) << 8) | buf[p + 3])
        length = np.where(text, length, 0)
        if np.any(length >= 1 << 31):       # a negative Int32
            return None
        starts[c] = np.where(text, pos + 5, pos + 1)   # NULL, unchanged: empty, in place
        lengths[c] = length
        kinds[c] = kind
        pos = pos + 1 + np.where(text, 4 + length, 0)
        if np.any(pos > limit):
            return None
    return starts, lengths, kinds, pos


def _strings(data: pa.Buffer, start: np.ndarray, length: np.ndarray,
             null: np.ndarray) -> pa.Array | None:
    """One ``string`` array of the values at ``start``/``length`` in ``data`` (None when
    they are not UTF-8). Values normally lie in order with other bytes between them:
    ``data`` is then read as an array whose elements are, in turn, a value and the gap
    after it, and Arrow's ``take`` of every other element copies the values out. (An
    unchanged TOAST value taken from the old row breaks the order: then the bytes are
    gathered by index.)"""
    n = len(start)
    if n == 0:
        return pa.array([], pa.string())
    length = np.where(null, 0, length)
    bounds = np.empty(2 * n, np.int64)
    bounds[0::2] = start
    bounds[1::2] = start + length
    validity = pa.py_buffer(np.packbits(~null, bitorder="little")) if null.any() else None
    if np.all(bounds[1:] >= bounds[:-1]):
        gaps = np.ones(2 * n - 1, bool)
        gaps[0::2] = ~null
        wide = data.size >= 1 << 31
        both = pa.Array.from_buffers(
            pa.large_string() if wide else pa.string(), 2 * n - 1,
            [pa.py_buffer(np.packbits(gaps, bitorder="little")),
             pa.py_buffer(bounds if wide else bounds.astype(np.int32)), data])
        values = both.take(pa.array(np.arange(0, 2 * n - 1, 2)))
    else:
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(length, out=offsets[1:])
        if offsets[-1] >= 1 << 31:
            return None
        index = np.repeat(start - offsets[:-1], length) + np.arange(offsets[-1])
        picked = np.frombuffer(data, np.uint8)[index]
        values = pa.Array.from_buffers(pa.string(), n, [
            validity, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(picked)])
    try:
        values.validate(full=True)
        return values.cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowCapacityError):
        return None


def _one_by_one(messages: Sequence[bytes], width: int, table: str,
                ) -> tuple[list[pa.Array], pa.Array]:
    """The same by :func:`~lamina.ingest.postgres.pgoutput.decode`, message by message;
    SourceStalledError naming a change that cannot be stored."""
    values: list[tuple[pgoutput.Value, ...]] = []
    diffs: list[int] = []
    for data in messages:
        try:
            msg = pgoutput.decode(data)
        except SourceProtocolError as e:
            raise SourceStalledError(f"a change of {table}: {e}",
                                     hint="report it with the log; meanwhile `lamina ingest "
                                          "resync` the table", table=table) from e
        old = msg.old.values if isinstance(msg, pgoutput.Update | pgoutput.Delete) and \
            msg.old is not None else None
        new = msg.new.values if isinstance(msg, pgoutput.Insert | pgoutput.Update) else None
        if new is not None and old is not None:
            new = tuple(o if v is pgoutput.Unchanged else v
                        for v, o in zip(new, old, strict=False))
        for row, diff in ((old, -1), (new, 1)):
            if row is None:
                continue
            if len(row) != width or any(not isinstance(v, str | None) for v in row):
                raise SourceStalledError(
                    f"a change of {table} has {len(row)} columns, or an unchanged TOAST "
                    f"value lamina cannot fill in, or a binary value, where {width} text "
                    "columns were expected",
                    hint="the table changed shape upstream: run `lamina ingest resync`",
                    table=table)
            values.append(row)
            diffs.append(diff)
    columns = list(zip(*values, strict=True)) if values else [() for _ in range(width)]
    return ([pa.array(col, pa.string()) for col in columns],
            pa.array(diffs, pa.int64()))
