"""The source interface every ingestion source implements.

A *source* reads an upstream system in that system's own order: its *offsets* (an int LSN
for PostgreSQL, ``[file, byte]`` for the files source). Offsets are totally ordered and
JSON-serialisable; a source turns them to and from text with :meth:`Source.encode_offset`
and :meth:`Source.decode_offset` (the text is what the ``<source>.remap`` relation stores).

A source emits three kinds of :data:`Event` from :meth:`Source.poll`:

- :class:`Transaction`: one upstream transaction, at its offset, with the changes per
  upstream table (row columns plus ``_diff``: ``+1`` for a new row, ``-1`` for an old row).
  The reclocker writes it at the first binding time ``T`` with ``offset < F(T)`` and never
  splits it across two lamina times.
- :class:`Upper`: every transaction with an offset below this one was emitted already.
  Uppers never go backwards.
- :class:`Stall`: a definite error. ``table`` names the upstream table concerned (only its
  output stalls) or is ``None`` (the whole source stalls). A stall never skips data: the
  source emits nothing more for that table.

``open(resume)`` positions the source at ``resume`` (an offset previously given by an
:class:`Upper`): the first transaction it emits has an offset ``>= resume``. With
``resume=None`` (first start) the source emits its initial snapshot, if it has one, as
transactions before its first :class:`Upper`.

Re-reading must be deterministic where it matters: a transaction re-read after a restart
has the same offset and changes, so it lands at the same lamina time. A source that groups
its input into transactions freely (the files source batches lines) must not let a
transaction span an upper it reported before; the framework tells it which with the
optional method below.

Optional methods (looked up with ``getattr``; a source may leave them out):

- ``set_barriers(offsets: list[Offset]) -> None``: called before :meth:`Source.open`
  with the uppers of the durable bindings that will be replayed; no transaction may start
  below one of them and reach past it.
- ``replays_from_start: bool`` (attribute): ``True`` when ``open(None)`` re-reads the same
  offsets with the same contents every time (the files source), so an output added later
  is filled by replaying from the start. Absent or ``False`` (PostgreSQL: ``open(None)``
  takes a new snapshot at a new offset): ``open(None)`` is called only while no output
  holds data, and an output that holds none while others do is stalled.
- ``lag_offsets() -> int | None``: how many offsets upstream is ahead of the source's
  upper (bytes not read, WAL bytes not received); exported as
  ``lamina_source_lag_offsets``. Called from the source's thread after each poll, so it
  should reuse what the poll learned rather than ask upstream again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa

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


@dataclass(frozen=True)
class Transaction:
    """One upstream transaction; never split across two lamina times."""

    offset: Offset
    """Its position; reclocked to the first binding ``T`` with ``offset < F(T)``."""
    changes: Mapping[str, pa.Table]
    """Upstream table -> row columns plus ``_diff`` (int64): ``+row``, ``-old row``."""


@dataclass(frozen=True)
class Upper:
    """The source's upper: every transaction with an offset below this was emitted."""

    offset: Offset


@dataclass(frozen=True)
class Stall:
    """A definite error; ``table`` ``None`` stalls the whole source."""

    table: str | None
    error: str
    hint: str


Event = Transaction | Upper | Stall


@runtime_checkable
class Source(Protocol):
    """What the ingestion framework drives; one thread per source calls these in turn."""

    name: str

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

    def encode_offset(self, offset: Offset) -> str:
        """The offset as text (stored in the remap relation)."""
        ...

    def decode_offset(self, text: str) -> Offset:
        """The inverse of :meth:`encode_offset`."""
        ...

    def close(self) -> None:
        """Release upstream resources; the source may be opened again afterwards."""
        ...
