"""The source interface every ingestion source implements.

A *source* reads an upstream system in that system's own order: its *offsets* (an int LSN
for PostgreSQL, ``[file, byte]`` for the files source). Offsets are totally ordered and
JSON-serialisable; a source turns them to and from text with :meth:`Source.encode_offset`
and :meth:`Source.decode_offset` (the text is what the ``<source>.remap`` relation stores).

A source emits three kinds of :data:`Event` from :meth:`Source.poll`:

- :class:`Transaction`: one upstream transaction, at its offset, with the changes per
  upstream table (row columns plus ``_diff``: ``+1`` for a new row, ``-1`` for an old row),
  the tables it truncated, and when it committed. The reclocker writes it at the first
  binding time ``T`` with ``offset < F(T)`` and never splits it across two lamina times.
  Changes come either as Arrow tables or as spans (:data:`~lamina.ingest.changes.Span`) of
  a :class:`~lamina.ingest.changes.ChangeBuffer` (changes kept as they came, turned into
  Arrow once per binding, for all the transactions it takes).
- :class:`Upper`: every transaction with an offset below this one was emitted already.
  Uppers never go backwards. ``time`` (when the source knows it): every upstream commit
  made before that time lies below the offset (it feeds ``lag_seconds``).
- :class:`Stall`: a definite error. ``table`` names the upstream table concerned (only its
  output stalls) or is ``None`` (the whole source stalls). ``offset``: the stall concerns
  the stream from that offset on (the output takes every binding whose upper is at or
  below it and stalls at the next; an output already past it ignores it, as on a replay);
  ``None`` means now (the output stalls at once). A stall never skips data.

``open(resume)`` positions the source at ``resume`` (an offset previously given by an
:class:`Upper`): the first transaction it emits has an offset ``>= resume``. With
``resume=None`` (first start) the source emits its initial snapshot, if it has one, as
transactions before its first :class:`Upper`.

Re-reading must be deterministic where it matters: a transaction re-read after a restart
has the same offset and changes, so it lands at the same lamina time. A source that groups
its input into transactions freely (the files source batches lines) must not let a
transaction span an upper it reported before: :meth:`Source.set_barriers` says which.

Everything here is declared on :class:`Source` (no optional methods): a source without an
initial snapshot to re-read says so with ``replays_from_start``, one without a notion of
backlog returns ``None`` from :meth:`Source.lag_offsets`. A source that can take a fresh
snapshot of one table beside its stream (PostgreSQL) also implements :class:`Resyncable`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import pyarrow as pa

if TYPE_CHECKING:
    from lamina.ingest.changes import Span

Offset = Any
"""A source's own totally ordered, JSON-serialisable offset."""


@dataclass(frozen=True)
class TableSpec:
    """One upstream table, as discovered (or declared) by the source."""

    upstream: str
    """The upstream name, e.g. ``public.orders``, or the files source's name."""
    schema: pa.Schema
    """Row columns, upstream types mapped to Arrow (no ``_time``/``_diff``)."""
    key: tuple[str, ...]
    """The upstream primary key columns."""


@dataclass(slots=True)
class Transaction:
    """One upstream transaction; never split across two lamina times. (Not a frozen
    dataclass only because one is made per upstream transaction, and a frozen one costs
    five times as much to make: treat it as immutable.)"""

    offset: Offset
    """Its position; reclocked to the first binding ``T`` with ``offset < F(T)``."""
    changes: Mapping[str, pa.Table | Span]
    """Upstream table -> row columns plus ``_diff`` (int64): ``+row``, ``-old row``; for a
    table in ``truncated``, only the changes made after its (last) TRUNCATE."""
    truncated: frozenset[str] = frozenset()
    """Upstream tables this transaction truncated: every row an output holds before the
    transaction is retracted (``on_truncate = "retract"``) or the output stalls."""
    commit_time: float | None = None
    """When it committed upstream, Unix seconds by :meth:`Source.clock` (None: unknown,
    e.g. an initial snapshot)."""


@dataclass(frozen=True)
class Upper:
    """The source's upper: every transaction with an offset below this was emitted."""

    offset: Offset
    time: float | None = None
    """Every upstream commit made before this time (by :meth:`Source.clock`) lies below
    ``offset``; None when the source cannot tell (the previous one still holds)."""


@dataclass(frozen=True)
class Stall:
    """A definite error; ``table`` ``None`` stalls the whole source."""

    table: str | None
    error: str
    hint: str
    offset: Offset | None = None
    """The stream position the error concerns (None: now); see the module docstring."""


Event = Transaction | Upper | Stall


@runtime_checkable
class Source(Protocol):
    """What the ingestion framework drives; one thread per source calls these in turn
    (:meth:`clock` also from other threads)."""

    name: str

    replays_from_start: bool
    """``True`` when ``open(None)`` re-reads the same offsets with the same contents every
    time (the files source), so an output added later is filled by replaying from the
    start. ``False`` (PostgreSQL: ``open(None)`` takes a new snapshot at a new offset):
    ``open(None)`` is called only while no output holds data, and an output that holds
    none while others do is stalled (until ``lamina ingest resync`` fills it)."""

    def set_barriers(self, offsets: list[Offset]) -> None:
        """Called before :meth:`open` with the uppers of the durable bindings that will be
        replayed: no transaction may start below one of them and reach past it. A source
        whose transactions are upstream's own (PostgreSQL) has nothing to do."""
        ...

    def open(self, resume: Offset | None) -> dict[str, TableSpec]:
        """Connect and position at ``resume``.

        ``None``: first start; the source emits its initial snapshot, if any, as
        transactions before its first :class:`Upper`. Returns the tables by upstream name.
        Raises :class:`lamina.errors.SourceTransientError` (retried) or
        :class:`lamina.errors.SourceStalledError` (definite).
        """
        ...

    def poll(self, timeout: float) -> list[Event]:
        """Block up to ``timeout`` seconds; return what arrived (may be empty).

        Raises :class:`lamina.errors.SourceTransientError` for errors worth retrying
        (connection lost); the framework then closes and re-opens the source.
        """
        ...

    def commit(self, offset: Offset) -> None:
        """Every output holds all offsets ``< offset`` durably: upstream may release them."""
        ...

    def lag_offsets(self) -> int | None:
        """How many offsets upstream is ahead of the source's upper (bytes not read, WAL
        bytes not received), exported as ``lamina_source_lag_offsets``; None when the
        source cannot tell. Called after each poll, so it reuses what the poll learned."""
        ...

    def clock(self) -> float:
        """Now, in Unix seconds, by the clock of :attr:`Transaction.commit_time` and
        :attr:`Upper.time` (PostgreSQL: the server's, as its messages show it). Called from
        any thread; must not block."""
        ...

    def encode_offset(self, offset: Offset) -> str:
        """The offset as text (stored in the remap relation)."""
        ...

    def decode_offset(self, text: str) -> Offset:
        """The inverse of :meth:`encode_offset`."""
        ...

    def close(self) -> None:
        """Release upstream resources; the source may be opened again afterwards."""
        ...


@dataclass(frozen=True)
class TableSnapshot:
    """One table read afresh, consistent with a position of the source's stream."""

    spec: TableSpec
    rows: pa.Table
    """Row columns plus ``_diff`` (``+1`` per row)."""
    offset: Offset
    """Every transaction below it is in ``rows``, none at or above it."""


@runtime_checkable
class Resyncable(Protocol):
    """A source that can read one table again, consistently with its stream, without
    touching its own position upstream (``lamina ingest resync``)."""

    def snapshot_table(self, upstream: str) -> TableSnapshot:
        """A fresh snapshot of ``upstream`` (the source need not be open; nothing of its
        stream position changes). Raises :class:`lamina.errors.SourceStalledError` with
        the remedy when the table cannot be read (or SourceTransientError)."""
        ...
