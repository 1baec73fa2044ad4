"""Helpers of the PostgreSQL tests: driving a PostgresSource by hand (collect events until a
condition holds), rows of a relation and of a table as multisets."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from lamina import Store
from lamina.ingest.changes import Gathered, Span
from lamina.ingest.postgres import PostgresSource
from lamina.ingest.source import Event, Stall, Transaction, Upper
from tests.ingest.postgres.server import PgServer


def arrow(part: pa.Table | Span) -> pa.Table:
    """A transaction's changes of one table as Arrow (a span converted on its own)."""
    got = Gathered([part]).table()
    return got if got is not None else pa.table({})


class Collector:
    """Every event a source emitted, in order, with views of them."""

    def __init__(self, src: PostgresSource) -> None:
        self.src = src
        self.events: list[Event] = []

    def poll_until(self, cond: Callable[[Collector], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond(self):
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met in {timeout}s; events: "
                                     f"{self.events[-10:]!r}")
            self.events.extend(self.src.poll(0.2))

    @property
    def transactions(self) -> list[Transaction]:
        return [e for e in self.events if isinstance(e, Transaction)]

    @property
    def stalls(self) -> list[Stall]:
        return [e for e in self.events if isinstance(e, Stall)]

    @property
    def upper(self) -> int:
        ups = [e.offset for e in self.events if isinstance(e, Upper)]
        return max(ups) if ups else -1

    def rows(self, table: str) -> list[tuple[object, ...]]:
        """(row..., diff) of every change to ``table``, in order."""
        out: list[tuple[object, ...]] = []
        for t in self.transactions:
            if table in t.changes:
                out.extend(tuple(r.values()) for r in arrow(t.changes[table]).to_pylist())
        return out

    def contents(self, table: str) -> dict[tuple[object, ...], int]:
        """The multiset the changes to ``table`` add up to (row -> count, zeros dropped)."""
        acc: dict[tuple[object, ...], int] = {}
        for r in self.rows(table):
            acc[r[:-1]] = acc.get(r[:-1], 0) + int(r[-1])  # type: ignore[call-overload]
        return {k: v for k, v in acc.items() if v}


def check_uppers(events: list[Event]) -> None:
    """Uppers never go back, and every transaction's offset is >= the upper before it."""
    upper = -1
    for e in events:
        if isinstance(e, Upper):
            assert e.offset >= upper, (e, upper)
            upper = e.offset
        elif isinstance(e, Transaction):
            assert e.offset >= upper, (e.offset, upper)


def table_rows(t: pa.Table) -> list[tuple[object, ...]]:
    return [tuple(r.values()) for r in t.to_pylist()]


def relation_rows(store: Store, relation: str) -> Counter[tuple[Any, ...]]:
    """A relation's newest readable rows as a multiset (empty before its first seal)."""
    rel = store.relation(relation)
    out: Counter[tuple[Any, ...]] = Counter()
    if rel.upper == 0:
        return out
    for r in rel.snapshot(rel.upper - 1).to_pylist():
        d = r.pop("_diff")
        out[tuple(r.values())] += d
    return out


def upstream_rows(pg: PgServer, table: str, cols: str) -> Counter[tuple[Any, ...]]:
    return Counter(pg.query(f"SELECT {cols} FROM {table}"))  # noqa: S608
