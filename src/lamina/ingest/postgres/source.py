"""The PostgreSQL source: logical replication (``pgoutput`` protocol 1) through a slot.

Offsets are LSNs (``int``; text ``16/B374D848``). A transaction's offset is its commit
record's LSN; after it the upper is the transaction's end LSN, and while the source is idle
the server's keepalives (the WAL the walsender has decoded, psycopg2's ``wal_end``) advance
the upper too, so that committing it lets the slot release WAL written by other tables and
databases. The pieces, one module each:

- :mod:`~lamina.ingest.postgres.connect`: connections, and which errors retry or stall;
- :mod:`~lamina.ingest.postgres.catalog`: discovery, the publication, the periodic check;
- :mod:`~lamina.ingest.postgres.slot`: the slot, checked or created;
- :mod:`~lamina.ingest.postgres.snapshot` (over :mod:`~lamina.ingest.postgres.spool`):
  tables read through an exported snapshot;
- :mod:`~lamina.ingest.postgres.decode`: pgoutput messages into transactions;
- :mod:`~lamina.ingest.postgres.frontier`: the upper reported, never past confirmed
  publication membership;
- :mod:`~lamina.ingest.postgres.feedback`: standby status updates;
- :mod:`~lamina.ingest.postgres.clock`: the server's clock.

Life of a source:

1. ``open(None)`` (first start): the publication ``FOR TABLE ...`` is created if absent
   (missing tables added to an existing one); an existing slot of that name is dropped
   (the runner opens from the start only while no output holds data) and created again
   with an exported snapshot at its consistent point ``P``; the snapshot's rows are
   emitted at offset ``P - 1`` (all land at the first binding time), then ``Upper(P)``,
   then streaming.
2. ``open(R)``: the slot is checked (:func:`~lamina.ingest.postgres.slot.check_slot`) and
   streaming starts at ``R``: the server sends every transaction whose commit LSN is
   ``>= R``.
3. ``poll``: decoded transactions and stalls, then one ``Upper``. The upper never passes
   the position up to which the catalog checks confirmed that the live tables are still
   published (:mod:`~lamina.ingest.postgres.catalog`); its ``time`` is the commit time of
   the newest transaction below it, or the server's clock at a check whose WAL position
   it reached (``lag_seconds``).
4. ``commit(offset)``: standby feedback with ``flush_lsn = offset``: the slot's
   ``confirmed_flush_lsn`` moves and the server may recycle WAL before it.

Stalls of a table found at open (missing, not ``REPLICA IDENTITY FULL``, not published on
a restart, reserved column names) are immediate; the ones found while streaming carry the
stream position they concern: a change's commit LSN (:mod:`~lamina.ingest.postgres.decode`),
a check's WAL position for a dropped table or a lost ``REPLICA IDENTITY FULL``, the last
confirmed position for a table gone from the publication. ``wal_level`` not ``logical``, a
database encoding other than UTF8, a lost or moved slot, a publication that vanished,
missing privileges stall the whole source (:class:`~lamina.errors.SourceStalledError`); a
lost connection is :class:`~lamina.errors.SourceTransientError`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import time
from collections.abc import Iterator, Sequence
from typing import Any, Final

import psycopg2
import psycopg2.errors
import pyarrow as pa
import structlog

from lamina.errors import (
    SourceError,
    SourceProtocolError,
    SourceStalledError,
    SourceTransientError,
)
from lamina.ingest.postgres import catalog, snapshot
from lamina.ingest.postgres.catalog import FULL_HINT, CheckResult, PgTable
from lamina.ingest.postgres.clock import ServerClock
from lamina.ingest.postgres.connect import RESNAPSHOT_HINT, connect, translate
from lamina.ingest.postgres.decode import StreamDecoder
from lamina.ingest.postgres.feedback import send_status
from lamina.ingest.postgres.frontier import Frontier
from lamina.ingest.postgres.pgoutput import format_lsn, parse_lsn
from lamina.ingest.postgres.slot import check_slot, create_slot, drop_slot, wait_inactive
from lamina.ingest.postgres.spool import Spool
from lamina.ingest.source import (
    Event,
    Offset,
    Stall,
    TableSnapshot,
    TableSpec,
    Transaction,
)
from lamina.schema import DIFF

__all__ = ["PostgresSource"]

log = structlog.get_logger(__name__)

_DRAIN_ROWS: Final = 2000
"""Rows decoded between two looks at the clock (feedback, the poll's deadline)."""

_PSYCOPG2_FEEDBACK_OFF: Final = 10**6
"""psycopg2's own periodic feedback, pushed out of the way (see feedback.py)."""

_resync_slots = itertools.count()


def _qualified(table: str) -> str:
    return table if "." in table else "public." + table


class PostgresSource:
    """A :class:`~lamina.ingest.source.Source` reading PostgreSQL by logical replication
    (and :class:`~lamina.ingest.source.Resyncable`)."""

    replays_from_start = False
    """``open(None)`` takes a new snapshot at a new LSN: it is not a replay."""

    def __init__(self, name: str, dsn: str, tables: Sequence[str], *,
                 publication: str | None = None, slot: str | None = None,
                 slot_wait_seconds: float = 10.0, catalog_check_seconds: float = 0.5,
                 snapshot_batch_rows: int = 65536, max_changes_per_poll: int = 50_000,
                 spool_dir: str | None = None, feedback_seconds: float = 1.0,
                 connect_timeout: int = 10) -> None:
        ident = "lamina_" + name.replace(".", "_").replace("-", "_")
        self.name = name
        self.dsn = dsn
        self.tables = [_qualified(t) for t in tables]
        self.publication = publication or ident
        self.slot = slot or ident
        self.slot_wait_seconds = slot_wait_seconds
        self.catalog_check_seconds = catalog_check_seconds
        self.snapshot_batch_rows = snapshot_batch_rows
        self.max_changes_per_poll = max_changes_per_poll
        self.spool_dir = spool_dir
        self.feedback_seconds = feedback_seconds
        self.connect_timeout = connect_timeout
        self._log = log.bind(source=name, slot=self.slot)
        self._clock = ServerClock()
        self._reset()

    @classmethod
    def from_settings(cls, settings: Any) -> PostgresSource:
        """Build from a :class:`lamina.ingest.settings.PostgresSourceSettings`."""
        return cls(settings.name, settings.dsn, list(settings.outputs()),
                   publication=settings.publication_name, slot=settings.slot_name)

    def _reset(self) -> None:
        self._conn: Any = None
        self._repl: Any = None
        self._cur: Any = None
        self._database = ""
        self._tables: dict[str, PgTable] = {}
        self._decoder = StreamDecoder({}, source=self.name)
        self._events: list[Event] = []
        self._dead: set[str] = set()           # stalled for good in this session
        self._reported: set[str] = set()       # stalled at a position, still decoded
        self._snapshot_rows: Iterator[Transaction] | None = None
        self._spool: Spool | None = None
        self._start_lsn = 0
        self._first_check: CheckResult | None = None  # read at open
        self._frontier: Frontier | None = None   # once streaming
        self._members: set[int] = set()        # oids whose publication membership matters
        self._pending_commit = 0
        self._feedback_at = 0.0
        self._next_check = 0.0

    # --- Source interface -------------------------------------------------------------------

    def set_barriers(self, offsets: list[Offset]) -> None:
        """Transactions are upstream's own: no barrier can fall inside one."""

    def clock(self) -> float:
        return self._clock.now()

    def encode_offset(self, offset: Offset) -> str:
        return format_lsn(int(offset))

    def decode_offset(self, text: str) -> Offset:
        try:
            return parse_lsn(text)
        except ValueError as e:
            raise SourceStalledError(
                f"source {self.name!r}: stored offset {text!r} is not an LSN",
                hint="the remap relation holds offsets of another kind of source; give this "
                     "source a name of its own") from e

    def open(self, resume: Offset | None) -> dict[str, TableSpec]:
        self.close()
        try:
            return self._open(None if resume is None else int(resume))
        except psycopg2.Error as e:
            self.close()
            raise self._translate(e, "opening") from e
        except BaseException:
            self.close()
            raise

    def poll(self, timeout: float) -> list[Event]:
        if self._conn is None:
            raise SourceTransientError(f"source {self.name!r} is not open; open it first")
        snapshotting = self._snapshot_rows is not None
        try:
            return self._poll(timeout)
        except psycopg2.Error as e:
            raise self._translate(e, "copying the snapshot" if snapshotting
                                  else "streaming") from e
        except SourceProtocolError as e:
            raise SourceStalledError(
                f"source {self.name!r}: {e}",
                hint="the slot does not stream pgoutput protocol 1: " + RESNAPSHOT_HINT) from e

    def commit(self, offset: Offset) -> None:
        lsn = int(offset)
        if lsn <= self._pending_commit:
            return
        self._pending_commit = lsn
        if self._frontier is not None and self._repl is not None:
            try:
                self._feedback()
            except psycopg2.Error as e:
                raise self._translate(e, "confirming offsets") from e
            self._log.debug("postgres.feedback_sent", flush_lsn=format_lsn(lsn))

    def lag_offsets(self) -> int | None:
        """WAL bytes between the server's WAL position (at the last catalog check) and
        the upper reported; None before streaming."""
        return None if self._frontier is None else self._frontier.lag_offsets()

    def close(self) -> None:
        if self._spool is not None:
            self._spool.close()
        for c in (self._repl, self._conn):
            if c is not None:
                with contextlib.suppress(Exception):
                    c.close()
        self._reset()

    def snapshot_table(self, upstream: str) -> TableSnapshot:
        """A fresh snapshot of ``upstream`` through a temporary slot (its consistent point
        is the offset); the table is added to the publication first if it left it. Needs
        one free replication slot and walsender; the source's own slot is not touched."""
        conns: list[Any] = []
        spool: Spool | None = None
        try:
            conn = connect(self.dsn, self.name, connect_timeout=self.connect_timeout)
            conns.append(conn)
            found, problems = catalog.discover(conn, [_qualified(upstream)], source=self.name)
            if problems:
                table, error, hint = problems[0]
                raise SourceStalledError(f"source {self.name!r}: {error}", hint=hint,
                                         table=table)
            (table_,) = found.values()
            catalog.ensure_publication(conn, self.publication, [table_.upstream],
                                       create=False, add=True, source=self.name,
                                       on_change=self._publication_changed)
            repl = connect(self.dsn, self.name, replication=True,
                           connect_timeout=self.connect_timeout)
            conns.append(repl)
            temp = f"lamina_resync_{os.getpid()}_{next(_resync_slots)}"
            point, name = create_slot(repl.cursor(), temp, temporary=True)
            spool = snapshot.open_spool(
                connect(self.dsn, self.name, connect_timeout=self.connect_timeout), name,
                [table_], spool_dir=self.spool_dir, log=self._log)

            def bad_value(table: str, e: SourceStalledError) -> None:
                raise SourceStalledError(f"table {table}: {e.error}", hint=e.hint, table=table)

            parts = [t.changes[table_.upstream] for t in snapshot.read(
                spool, [table_], point - 1, batch_rows=self.snapshot_batch_rows,
                stalled=lambda _: False, on_error=bad_value)]
            spool = None
            schema = table_.spec.schema.append(pa.field(DIFF, pa.int64()))
            rows = pa.concat_tables(parts) if parts else schema.empty_table()
            self._log.info("postgres.table_snapshot", table=table_.upstream,
                           rows=rows.num_rows, consistent_point=format_lsn(point))
            return TableSnapshot(table_.spec, rows, point)
        except psycopg2.Error as e:
            raise translate(e, source=self.name, slot=self.slot, publication=self.publication,
                            doing=f"taking a snapshot of {upstream}",
                            connections=tuple(conns)) from e
        finally:
            if spool is not None:
                spool.close()
            for c in conns:
                with contextlib.suppress(Exception):
                    c.close()

    # --- opening ------------------------------------------------------------------------------

    def _open(self, resume: int | None) -> dict[str, TableSpec]:
        self._conn = connect(self.dsn, self.name, connect_timeout=self.connect_timeout)
        with self._conn.cursor() as cur:
            cur.execute("SELECT current_setting('wal_level'), "
                        "pg_encoding_to_char(encoding), current_database(), "
                        "pg_current_wal_lsn()::text, "
                        "extract(epoch FROM clock_timestamp())::float8 "
                        "FROM pg_database WHERE datname = current_database()")
            wal_level, encoding, database, lsn, now = cur.fetchone()
        self._clock.observe(float(now))
        if wal_level != "logical":
            raise SourceStalledError(
                f"source {self.name!r}: the server runs with wal_level={wal_level}",
                hint="set wal_level = logical in postgresql.conf and restart PostgreSQL")
        if encoding != "UTF8":
            raise SourceStalledError(
                f"source {self.name!r}: database {database!r} has encoding {encoding}",
                hint="lamina reads UTF8 databases only; replicate from a UTF8 database")
        self._database = database
        found, problems = catalog.discover(self._conn, self.tables, source=self.name)
        problems += catalog.ensure_publication(
            self._conn, self.publication, [t for t in self.tables if t in found],
            create=resume is None, add=resume is None, source=self.name,
            on_change=self._publication_changed)
        for table, error, hint in problems:
            self._stall(table, error, hint)
        live = {u: t for u, t in found.items() if u not in self._dead}
        self._tables = live
        self._decoder = StreamDecoder(live, source=self.name)
        self._members = {t.oid for t in live.values()}
        self._repl = connect(self.dsn, self.name, replication=True,
                             connect_timeout=self.connect_timeout)
        self._cur = self._repl.cursor()
        if resume is None:
            self._create_slot_and_snapshot(list(live.values()))
        else:
            check_slot(self._conn, self.slot, source=self.name, database=database,
                       resume=resume, wait_seconds=self.slot_wait_seconds)
            self._start_lsn = resume
        self._first_check = CheckResult(parse_lsn(lsn), float(now), frozenset(), frozenset(),
                                        frozenset())
        self._next_check = time.monotonic() + self.catalog_check_seconds
        self._log.info("postgres.opened", resume=None if resume is None else format_lsn(resume),
                       start_lsn=format_lsn(self._start_lsn), tables=sorted(found),
                       stalled=sorted(self._dead))
        return {u: t.spec for u, t in found.items()}

    def _publication_changed(self, what: str, tables: list[str]) -> None:
        self._log.info(f"postgres.publication_{what}", publication=self.publication,
                       tables=tables)

    def _create_slot_and_snapshot(self, tables: list[PgTable]) -> None:
        if wait_inactive(self._conn, self.slot, source=self.name,
                         wait_seconds=self.slot_wait_seconds) is not None:
            # The runner opens from the start only while no output holds data (see
            # lamina.ingest.resume), so nothing read through this slot is durable in
            # lamina: start it afresh so that the snapshot is consistent with it.
            drop_slot(self._conn, self.slot)
            self._log.info("postgres.slot_dropped", reason="first start takes a new snapshot")
        point, name = create_slot(self._cur, self.slot)
        self._log.info("postgres.slot_created", consistent_point=format_lsn(point))
        # the snapshot is imported before the replication connection runs anything else
        self._spool = snapshot.open_spool(
            connect(self.dsn, self.name, connect_timeout=self.connect_timeout), name, tables,
            spool_dir=self.spool_dir, log=self._log)
        self._start_lsn = point
        self._snapshot_rows = snapshot.read(
            self._spool, tables, point - 1, batch_rows=self.snapshot_batch_rows,
            stalled=lambda t: t in self._dead,
            on_error=lambda t, e: self._stall(t, f"table {t}: {e.error}", e.hint))

    # --- streaming ------------------------------------------------------------------------------

    def _start(self) -> None:
        self._cur.start_replication(
            slot_name=self.slot, decode=False, start_lsn=self._start_lsn,
            status_interval=_PSYCOPG2_FEEDBACK_OFF,
            options={"proto_version": "1", "publication_names": self.publication})
        assert self._first_check is not None
        self._frontier = Frontier(self._start_lsn, self._first_check)
        self._feedback()
        self._log.info("postgres.streaming", start_lsn=format_lsn(self._start_lsn))

    def _poll(self, timeout: float) -> list[Event]:
        deadline = time.monotonic() + max(0.0, timeout)
        if self._snapshot_rows is not None:
            try:
                nxt = next(self._snapshot_rows, None)
            except BaseException:
                self.close()  # a snapshot cut short is never resumed: open again
                raise
            if nxt is not None:
                return self._take([nxt])
            self._snapshot_rows = None
            self._spool = None
        if self._frontier is None:
            self._start()
            return self._take([])
        if time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + self.catalog_check_seconds
            self._catalog_check()
        decoder = self._decoder
        frontier = self._frontier
        read = self._cur.read_message
        for _ in range(-(-self.max_changes_per_poll // _DRAIN_ROWS)):
            if time.monotonic() >= self._feedback_at:
                self._feedback()
            if not decoder.drain(read, _DRAIN_ROWS):
                continue                # more to read: check the feedback clock, go on
            if not decoder.in_txn:      # keepalives' wal_end: decoded, nothing published
                frontier.idle(int(self._cur.wal_end or 0))
                if decoder.events:
                    break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            select.select([self._cur], [], [], min(remaining, self.feedback_seconds))
        if decoder.last_commit is not None:
            frontier.committed(*decoder.last_commit)
        return self._take(decoder.take())

    def _take(self, events: list[Event]) -> list[Event]:
        """``events`` after the stalls found meanwhile, then the upper to report."""
        out = self._events + events
        self._events = []
        if self._frontier is not None:
            out.append(self._frontier.upper(clamp=bool(self._members)))
        return out

    def _feedback(self) -> None:
        """A standby status update with the committed offset (0 = nothing yet, which the
        server takes as a sign of life only)."""
        send_status(self._repl, self._pending_commit)
        self._feedback_at = time.monotonic() + self.feedback_seconds

    def _catalog_check(self) -> None:
        """The publication, existence and replica identity of the live tables (see
        :mod:`~lamina.ingest.postgres.catalog`); moves the confirmed position to the
        previous check's WAL position (:mod:`~lamina.ingest.postgres.frontier`)."""
        frontier = self._frontier
        assert frontier is not None
        if frontier.stuck() and not self._decoder.in_txn:
            self._wake()
        live = {t.oid: t for t in self._tables.values() if t.upstream not in self._dead}
        found = catalog.check(self._conn, list(live), self.publication)
        self._clock.observe(found.clock)
        for oid, table in live.items():
            if oid in found.gone:
                self._stall(table.upstream, f"table {table.upstream} was dropped upstream",
                            "re-create it and run `lamina ingest resync`, or remove it from "
                            "the source's tables", offset=found.lsn)
            elif oid in found.unpublished:
                self._stall(table.upstream, f"table {table.upstream} left publication "
                            f"{self.publication!r}: its changes are no longer streamed",
                            f"ALTER PUBLICATION {self.publication} ADD TABLE "
                            f"{table.upstream}, then `lamina ingest resync --config FILE "
                            f"{self.name} {table.upstream}` (the changes made while it was "
                            "out are read from a fresh snapshot)",
                            offset=frontier.confirmed[0])
            elif oid in found.not_full:
                self._stall(table.upstream, f"table {table.upstream} no longer has REPLICA "
                            "IDENTITY FULL",
                            FULL_HINT.format(table=table.upstream, source=self.name),
                            offset=found.lsn, final=False)
        frontier.checked(found)

    def _wake(self) -> None:
        """Commit one tiny transaction (a logical message, which pgoutput does not forward
        without its ``messages`` option): on an idle server the walsender's keepalives
        stop at the last record, possibly short of the WAL position of a check; decoding
        this commit (flushed at once) moves them past it."""
        try:
            with self._conn.cursor() as cur:
                cur.execute("SELECT pg_logical_emit_message(true, 'lamina.wake', '')")
        except psycopg2.errors.InsufficientPrivilege:
            self._log.info("postgres.wake_refused",
                           reason="no EXECUTE on pg_logical_emit_message; the upper moves "
                                  "once other WAL is written")

    def _stall(self, table: str, error: str, hint: str, offset: int | None = None, *,
               final: bool = True) -> None:
        """Report a table's stall (once per session). ``final``: nothing more of the
        table is decoded in this session (it is gone, unpublished, or stalled now)."""
        if table in self._dead or table in self._reported:
            return
        live = self._tables.get(table)
        if final:
            self._dead.add(table)
            if live is not None:
                self._decoder.forget(live.oid)
                self._members.discard(live.oid)
        else:
            self._reported.add(table)
        self._events.append(Stall(table, error, hint, offset=offset))
        self._log.warning("postgres.table_stalled", table=table, error=error, hint=hint,
                          offset=None if offset is None else format_lsn(offset))

    # --- errors ---------------------------------------------------------------------------------

    def _translate(self, e: psycopg2.Error, doing: str) -> SourceError:
        return translate(e, source=self.name, slot=self.slot, publication=self.publication,
                         doing=doing, connections=(self._conn, self._repl))
