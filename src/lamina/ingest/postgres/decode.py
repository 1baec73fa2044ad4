"""Streaming changes: ``pgoutput`` messages into transactions of not-yet-decoded changes.

Rows are not decoded here: each live table has a
:class:`~lamina.ingest.changes.ChangeBuffer` of its raw change messages, and a
:class:`~lamina.ingest.source.Transaction` names its messages there as spans; the runner
cuts one Arrow table per table per binding, column by column
(:mod:`~lamina.ingest.postgres.rows`). Per message (:func:`~lamina.ingest.postgres.pgoutput.
decode_fast` for the ones every transaction has, :func:`~lamina.ingest.postgres.pgoutput.
decode` for the rest):

- ``Begin``: a transaction starts, at the commit LSN and commit time it carries.
- ``Insert`` ``+new``; ``Delete`` ``-old``; ``Update`` ``-old, +new`` (an unchanged
  TOASTed value of the new row, which PostgreSQL does not send, taken from the old row,
  which ``REPLICA IDENTITY FULL`` logs whole): kept whole.
- ``Truncate``: the table is marked truncated in the transaction and its rows of the
  transaction so far are left out (the output retracts what it held, or stalls: the
  runner's choice, ``on_truncate``).
- ``Relation``: the columns the following changes of a table have. While they differ from
  the columns found at open (a column added, dropped, renamed or retyped to another Arrow
  type) the table's rows are left out and a stall is reported; once they match again
  (a replay reaching the stream after the change the output was resynced for) its rows
  flow again.
- ``Commit``: the transaction is emitted (if it changed or truncated a live table), and
  the source's upper moves to its end LSN.

A problem seen here is a :class:`~lamina.ingest.source.Stall` of its table *at the
transaction's commit LSN*: the output takes every binding below it and stalls before the
one holding it, so a transaction is never written in part; an output already past it (a
replay after a resync) ignores it. Problems: an ``UPDATE`` without the old row or a
``DELETE`` with only the old key (no ``REPLICA IDENTITY FULL``), columns that changed.
A tuple that cannot be decoded (another width, an unchanged TOAST value with no old row)
is found when the binding is cut, and stalls the output before that binding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from lamina.errors import SourceProtocolError
from lamina.ingest.changes import ChangeBuffer, Span
from lamina.ingest.postgres import pgoutput
from lamina.ingest.postgres.catalog import FULL_HINT, PgTable
from lamina.ingest.postgres.types import PgType
from lamina.ingest.reclock import RESYNC_HINT
from lamina.ingest.source import Event, Stall, Transaction

__all__ = ["StreamDecoder", "pg_unix_seconds"]

_PG_EPOCH_UNIX: Final = 946_684_800
"""2000-01-01 UTC, PostgreSQL's epoch, in Unix seconds."""

_BEGIN, _COMMIT, _INSERT, _UPDATE, _OLD_ROW = (ord(c) for c in "BCIUO")
_NONE: Final[frozenset[str]] = frozenset()


def pg_unix_seconds(micros: int) -> float:
    """A pgoutput timestamp (microseconds since 2000-01-01 UTC) in Unix seconds."""
    return micros / 1e6 + _PG_EPOCH_UNIX


@dataclass(slots=True)
class _Live:
    table: PgTable
    buffer: ChangeBuffer
    upstream: str
    fits: bool = True
    """Whether the stream's columns (the last Relation message) are the ones found at
    open; rows are left out while they are not."""


class StreamDecoder:
    """Turns one session's pgoutput messages into events; :meth:`take` hands them over."""

    def __init__(self, tables: dict[str, PgTable], *, source: str) -> None:
        self.source = source
        self._by_oid = {t.oid: _Live(t, t.buffer(), t.upstream) for t in tables.values()}
        self.events: list[Event] = []
        self.in_txn = False
        self.last_commit: tuple[int, float] | None = None
        """``(end LSN, commit time)`` of the newest transaction decoded."""
        self._lsn = 0
        self._time = 0.0
        self._starts: dict[str, tuple[ChangeBuffer, int]] = {}
        """Per table touched by the transaction: its buffer and first row in it."""
        self._truncated: set[str] = set()
        self._stalled: set[str] = set()       # tables stalled in this transaction

    def forget(self, oid: int) -> None:
        """Stop decoding a table (stalled for good: gone, not published)."""
        self._by_oid.pop(oid, None)

    def take(self) -> list[Event]:
        out, self.events = self.events, []
        return out

    def drain(self, read: Callable[[], Any], limit: int) -> bool:
        """Decode the messages ``read()`` returns (psycopg2's ``read_message``: objects
        with ``payload`` and ``data_start``) until it returns None (then True) or
        ``limit`` rows were added (False). The streaming hot path: one loop, the messages
        every transaction has handled in it."""
        by_oid = self._by_oid
        fast = pgoutput.decode_fast
        changes = pgoutput.CHANGE_TAGS
        oid_at = pgoutput.CHANGE_OID.unpack_from
        starts = self._starts
        rows = 0
        while rows < limit:
            msg = read()
            if msg is None:
                return True
            payload = msg.payload
            tag = payload[0]
            if tag in changes and len(payload) >= 8:   # decode_fast's, inline: the most
                live = by_oid.get(oid_at(payload, 1)[0])  # frequent messages by far
                if live is None or not live.fits:
                    continue
                if tag != _INSERT and payload[5] != _OLD_ROW:
                    self._no_old_row(live, tag)
                    continue
                items = live.buffer.items
                if live.upstream not in starts:
                    starts[live.upstream] = (live.buffer, live.buffer.base + len(items))
                items.append(payload)
                rows += 2 if tag == _UPDATE else 1
                continue
            got = fast(payload)
            if got is None:
                self._message(pgoutput.decode(payload, lsn=msg.data_start))
                continue
            tag, a, b = got
            if tag == _BEGIN:
                self.in_txn = True
                self._lsn = a
                self._time = pg_unix_seconds(b)
                starts = self._starts = {}
                self._truncated = set()
                self._stalled = set()
            elif tag == _COMMIT:
                self._commit(a, b)
        return False

    def _no_old_row(self, live: _Live, tag: int) -> None:
        what = "an UPDATE of {} came without the old row" if tag == _UPDATE else \
            "a DELETE of {} came with only the old key"
        self._stall(live, what.format(live.upstream) + ": the table does not have "
                    "REPLICA IDENTITY FULL", FULL_HINT)

    def _message(self, msg: pgoutput.PgMessage) -> None:
        """The messages :func:`~lamina.ingest.postgres.pgoutput.decode_fast` leaves to
        :func:`~lamina.ingest.postgres.pgoutput.decode`."""
        if isinstance(msg, pgoutput.Relation):
            self._relation(msg)
        elif isinstance(msg, pgoutput.Truncate):
            for oid in msg.relation_oids:
                live = self._by_oid.get(oid)
                if live is not None:
                    self._truncated.add(live.table.upstream)
                    self._starts[live.table.upstream] = (live.buffer, live.buffer.end)
        elif isinstance(msg, pgoutput.Begin | pgoutput.Commit):  # with flags: none exist
            raise SourceProtocolError(f"pgoutput sent an unexpected {type(msg).__name__} "
                                      f"message: {msg}", message_type=type(msg).__name__)
        # Origin, Type, Message: nothing to store

    def _relation(self, msg: pgoutput.Relation) -> None:
        live = self._by_oid.get(msg.oid)
        if live is None:
            return
        got = [(c.name, c.type_oid, c.type_modifier) for c in msg.columns]
        have = live.table.columns
        fits = got == have or (
            [g[0] for g in got] == [c[0] for c in have]
            and all(g[1] == c[1] and PgType(g[1], g[2]).arrow == PgType(c[1], c[2]).arrow
                    for g, c in zip(got, have, strict=True)))
        if fits == live.fits:
            return
        live.fits = fits
        if not fits:
            self._stall(live, f"the columns of {live.table.upstream} changed upstream: "
                        f"{_describe(have)} became {_describe(got)}", RESYNC_HINT)

    def _stall(self, live: _Live, error: str, hint: str) -> None:
        upstream = live.table.upstream
        if upstream in self._stalled:
            return
        self._stalled.add(upstream)
        self.events.append(Stall(upstream, error,
                                 hint.format(source=self.source, table=upstream),
                                 offset=self._lsn))

    def _commit(self, commit_lsn: int, end_lsn: int) -> None:
        self.in_txn = False
        changes: dict[str, Span] = {}
        for upstream, (buf, start) in self._starts.items():
            end = buf.base + len(buf.items)
            if end > start:
                changes[upstream] = (buf, start, end)
        if changes or self._truncated:
            self.events.append(Transaction(commit_lsn, changes, frozenset(self._truncated)
                                           if self._truncated else _NONE, self._time))
        self.last_commit = (end_lsn, self._time)


def _describe(columns: list[tuple[str, int, int]]) -> str:
    return "(" + ", ".join(f"{n} oid {t}" + (f"({m})" if m >= 0 else "")
                           for n, t, m in columns) + ")"
