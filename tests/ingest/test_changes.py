"""Change buffers across transactions: spans of a buffer become one Arrow table per
binding, with one conversion for all of them; truncates keep only what follows; released
items are gone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pytest

from lamina.ingest.changes import ChangeBuffer, Span, gather, release
from lamina.ingest.source import Transaction

SCHEMA = pa.schema([pa.field("id", pa.int64()), pa.field("v", pa.string())])


def convert(items: Sequence[Any]) -> list[pa.Array]:
    """Items are (id, v, diff)."""
    return [pa.array([i[0] for i in items], pa.int64()), pa.array([i[1] for i in items]),
            pa.array([i[2] for i in items], pa.int64())]


def txn(buf: ChangeBuffer, offset: int, ids: list[int], truncated: bool = False,
        ) -> Transaction:
    start = buf.end
    buf.items.extend((i, f"v{i}", 1) for i in ids)
    changes: dict[str, Span] = {"t": (buf, start, buf.end)} if ids else {}
    return Transaction(offset, changes, truncated=frozenset({"t"} if truncated else ()))


def test_spans_of_many_transactions_become_one_table_converted_once() -> None:
    calls: list[int] = []

    def counted(items: Sequence[Any]) -> list[pa.Array]:
        calls.append(len(items))
        return convert(items)

    buf = ChangeBuffer(SCHEMA, counted)
    txns = [txn(buf, i, [i]) for i in range(5)]
    whole = pa.table({"id": pa.array([9], pa.int64()), "v": ["w"],
                      "_diff": pa.array([-1], pa.int64())})
    txns.append(Transaction(5, {"t": whole}))            # a table handed over whole
    got = gather(txns[:3])["t"].table()
    assert got is not None
    assert got.to_pydict() == {"id": [0, 1, 2], "v": ["v0", "v1", "v2"], "_diff": [1, 1, 1]}
    assert calls == [3]                                   # one conversion for 3 spans
    release(txns[:3])
    assert buf.base == 3
    assert len(buf.items) == 2
    with pytest.raises(ValueError, match="released"):
        gather(txns[:1])["t"].table()
    rest = gather(txns[3:])["t"].table()
    assert rest is not None
    assert rest.column("id").to_pylist() == [3, 4, 9]


def test_a_truncate_keeps_only_what_follows_it() -> None:
    buf = ChangeBuffer(SCHEMA, convert)
    g = gather([txn(buf, 1, [1, 2]), txn(buf, 2, [3], truncated=True), txn(buf, 3, [4])])
    assert g["t"].truncated
    got = g["t"].table()
    assert got is not None
    assert got.column("id").to_pylist() == [3, 4]
    only = gather([txn(buf, 4, [5]), txn(buf, 5, [], truncated=True)])["t"]
    assert only.truncated
    assert only.table() is None
