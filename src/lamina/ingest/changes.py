"""Changes on their way from a source to the outputs: column builders across transactions,
cut into one Arrow table per table per binding.

A source that reads its stream change by change (PostgreSQL) does not build Arrow tables
per transaction (a few rows each: most of the cost would be Arrow's fixed cost per call,
and Python's per value). It appends each change, in whatever form it has (PostgreSQL: the
raw pgoutput message), as an *item* to the :class:`ChangeBuffer` of its table, and a
:class:`~lamina.ingest.source.Transaction` names its items of a table as a :data:`Span`
``(buffer, start, end)``. Item numbers are absolute (counted from the buffer's creation), so a
span stays valid while earlier items are released.

When a binding is written the runner takes every buffered transaction below its upper at
once: :func:`gather` groups their changes by table, in order; :meth:`Gathered.table` turns
one table's spans into a single Arrow table (consecutive spans of one buffer are one
range, converted by one call of the source's ``convert``, which can work column-wise on
all of them); then :func:`release` lets the buffers drop the items of the transactions
taken. Tables a source hands over whole (the files source, an initial snapshot) pass
through as they are.

TRUNCATE: a transaction lists the tables it truncated (``Transaction.truncated``), its
changes of such a table being those made after the truncate. :func:`gather` keeps only
what follows the last truncate of a table among the transactions taken and marks it
(``Gathered.truncated``): the output then retracts what it held before the binding (or
stalls, as its ``on_truncate`` says).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import pyarrow as pa

from lamina.ingest.source import Transaction
from lamina.schema import DIFF

Convert = Callable[[Sequence[Any]], list[pa.Array]]
"""Items (in order) -> the arrays of the buffer's schema: every row column, then
``_diff``. Raises :class:`lamina.errors.SourceStalledError` naming what cannot be
stored."""


class ChangeBuffer:
    """One upstream table's changes across transactions, not yet Arrow."""

    __slots__ = ("base", "convert", "items", "schema")

    def __init__(self, schema: pa.Schema, convert: Convert) -> None:
        self.schema = schema.append(pa.field(DIFF, pa.int64()))
        """Row columns plus ``_diff``: the schema of what :meth:`table` returns."""
        self.convert = convert
        self.items: list[Any] = []
        """The changes as the source has them (sources append to it directly)."""
        self.base = 0
        """The absolute number of ``items[0]``."""

    @property
    def end(self) -> int:
        """The absolute number of the next item."""
        return self.base + len(self.items)

    def table(self, ranges: Sequence[tuple[int, int]]) -> pa.Table:
        """The changes of ``ranges`` (absolute ``[start, end)``, in order) as one table."""
        items: list[Any] = []
        for start, end in ranges:
            if start < self.base:
                raise ValueError(f"items {start}..{end} were released (first kept: "
                                 f"{self.base})")
            items += self.items[start - self.base:end - self.base]
        return pa.Table.from_arrays(self.convert(items), schema=self.schema)

    def release(self, end: int) -> None:
        """Forget the items below ``end``."""
        if end > self.base:
            cut = min(end, self.end) - self.base
            del self.items[:cut]
            self.base += cut


Span: TypeAlias = tuple[ChangeBuffer, int, int]
"""``(buffer, start, end)``: items ``[start, end)`` of a buffer, one transaction's changes
of one table. A plain tuple: one is made per table per transaction."""



@dataclass
class Gathered:
    """One table's changes in the transactions of one binding, in order, after the last
    TRUNCATE among them."""

    parts: list[pa.Table | Span] = field(default_factory=list)
    truncated: bool = False

    def table(self) -> pa.Table | None:
        """The changes as one Arrow table (None when there are none); raises what the
        source's ``convert`` raises for a value that cannot be stored."""
        tables: list[pa.Table] = []
        run: list[tuple[int, int]] = []
        buffer: ChangeBuffer | None = None
        for part in self.parts:
            if isinstance(part, tuple):
                buf, start, end = part
                if buf is not buffer and buffer is not None and run:
                    tables.append(buffer.table(run))
                    run = []
                buffer = buf
                if run and run[-1][1] == start:
                    run[-1] = (run[-1][0], end)
                else:
                    run.append((start, end))
            else:
                if buffer is not None and run:
                    tables.append(buffer.table(run))
                    run = []
                tables.append(part)
        if buffer is not None and run:
            tables.append(buffer.table(run))
        tables = [t for t in tables if t.num_rows]
        if not tables:
            return None
        if len(tables) == 1:
            return tables[0]
        return pa.concat_tables(tables, promote_options="permissive")


def gather(txns: Iterable[Transaction]) -> dict[str, Gathered]:
    """The changes of ``txns`` (in offset order) by upstream table."""
    out: dict[str, Gathered] = {}
    for t in txns:
        for table in t.truncated:
            out[table] = Gathered(truncated=True)
        for table, part in t.changes.items():
            g = out.get(table)
            if g is None:
                g = out[table] = Gathered()
            g.parts.append(part)
    return out


def release(txns: Iterable[Transaction]) -> None:
    """Let the buffers forget the items of ``txns`` (taken, or skipped, in order): once per
    buffer, up to the end of its last span (spans of one buffer only grow)."""
    ends: dict[ChangeBuffer, int] = {}
    for t in txns:
        for part in t.changes.values():
            if isinstance(part, tuple):
                ends[part[0]] = part[2]
    for buf, end in ends.items():
        buf.release(end)
