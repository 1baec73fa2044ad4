"""The PostgreSQL source: logical replication (``pgoutput`` protocol 1) through a slot.

Offsets are LSNs (``int``; text ``16/B374D848``). A transaction's offset is its commit
record's LSN; after it the upper is the transaction's end LSN, and while the source is idle
the server's keepalives (the WAL the walsender has decoded, psycopg2's ``wal_end``) advance
the upper too, so that committing it lets the slot release WAL written by other tables and
databases.

Life of a source:

1. ``open(None)`` (first start): the publication ``FOR TABLE ...`` is created if absent
   (missing tables are added to an existing one); an existing slot of that name is dropped
   (the runner opens from the start only while no output holds data, so nothing of it is
   durable in lamina) and created again with
   ``CREATE_REPLICATION_SLOT <slot> LOGICAL pgoutput EXPORT_SNAPSHOT``. Another session
   imports the exported snapshot (``SET TRANSACTION SNAPSHOT``, before ``open`` returns and
   before the replication connection runs anything else) and ``COPY``\\ s every table (CSV)
   into spool files, so the snapshot is exactly the database at the slot's consistent point
   ``P``. The ``COPY`` runs in a thread of its own while ``poll`` parses what is spooled
   already (:mod:`~lamina.ingest.postgres.spool`) and emits it as transactions at offset
   ``P - 1`` (all land at the first binding time); once every table is read and the
   ``COPY`` session is done, ``Upper(P)``, and then streaming. A ``COPY`` that fails (lost
   connection, cancel) raises from ``poll``, never reads as a short table; ``close`` cancels
   a running one.
2. ``open(R)``: the slot must exist, belong to this database and use ``pgoutput``, must not
   be lost (``wal_status``) nor have a ``confirmed_flush_lsn`` beyond ``R`` (the changes
   between would be gone), and must not be held by another backend. Streaming starts at
   ``R``: the server sends every transaction whose commit LSN is ``>= R``.
3. ``poll``: changes of one upstream transaction are gathered from ``Begin`` to ``Commit``
   into one :class:`~lamina.ingest.source.Transaction`: an insert is ``+new``, a delete
   ``-old``, an update ``-old, +new`` (an unchanged TOASTed value of the new row is taken
   from the old row, which ``REPLICA IDENTITY FULL`` logs whole).
4. ``commit(offset)``: standby feedback with ``flush_lsn = offset``: the slot's
   ``confirmed_flush_lsn`` moves and the server may recycle WAL before it.

Stalls (definite; never a skipped change): a table missing, without ``REPLICA IDENTITY
FULL`` (checked at open and again while streaming), truncated, dropped, or whose columns
changed incompatibly (a ``Relation`` message differing from the schema found at open)
stalls that table's output only: the stall is emitted in stream order, before any later
change, and the table's changes of the transaction that stalled it are left out. A
dropped table or a changed replica identity is noticed by a catalog check every
``catalog_check_seconds`` and reported once the stream has passed the WAL position of
that check, so every change committed before it is emitted first. ``wal_level`` not
``logical``, a database encoding other than UTF8, a lost or moved slot, a publication
that vanished, missing privileges: the whole source stalls
(:class:`~lamina.errors.SourceStalledError`). A lost connection or a server restart:
:class:`~lamina.errors.SourceTransientError` (the framework re-opens at its resume point).

Standby status updates (the slot's confirmed flush position) are written by
:mod:`~lamina.ingest.postgres.feedback` every ``feedback_seconds`` while
:meth:`PostgresSource.poll` is called, always with the last committed offset, never more
(see that module for why psycopg2's ``send_feedback`` is not used).
"""

from __future__ import annotations

import contextlib
import re
import select
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import psycopg2
import psycopg2.errorcodes
import psycopg2.errors
import psycopg2.extensions
import psycopg2.extras
import pyarrow as pa
import pyarrow.csv as pacsv
import structlog
from psycopg2 import sql

from lamina.errors import (
    SourceError,
    SourceProtocolError,
    SourceStalledError,
    SourceTransientError,
)
from lamina.ingest.postgres import pgoutput
from lamina.ingest.postgres.feedback import send_status
from lamina.ingest.postgres.pgoutput import format_lsn, parse_lsn
from lamina.ingest.postgres.spool import Spool
from lamina.ingest.postgres.types import SESSION_SETTINGS, PgType, to_arrow
from lamina.ingest.source import Event, Offset, Stall, TableSpec, Transaction, Upper
from lamina.schema import RESERVED

__all__ = ["PostgresSource"]

log = structlog.get_logger(__name__)

DIFF: Final = "_diff"
FULL_HINT: Final = ("run ALTER TABLE {table} REPLICA IDENTITY FULL upstream (UPDATE and "
                    "DELETE need the whole old row), then take a new snapshot of it: ingest "
                    "the table under a new source name, or drop every output relation of "
                    "this source and its remap relation and restart lamina ingest")
RESNAPSHOT_HINT: Final = ("the output cannot follow this change: take a new snapshot, by "
                          "ingesting the table under a new source name, or by dropping every "
                          "output relation of this source and its remap relation and "
                          "restarting lamina ingest (the slot is then re-created)")


@dataclass
class _Table:
    """One upstream table as found at open."""

    upstream: str
    oid: int
    columns: list[tuple[str, int, int]]
    """(name, type oid as in pg_attribute, typmod): what a Relation message must match."""
    types: list[PgType]
    spec: TableSpec


@dataclass
class _Pending:
    """Changes of one table in the transaction being gathered, column-wise as text."""

    columns: list[list[str | None]]
    diffs: list[int] = field(default_factory=list)


def _quote_table(upstream: str) -> sql.Composed:
    schema, _, name = upstream.partition(".")
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(name))


def _qualified(table: str) -> str:
    return table if "." in table else "public." + table


class PostgresSource:
    """A :class:`~lamina.ingest.source.Source` reading PostgreSQL by logical replication."""

    def __init__(self, name: str, dsn: str, tables: Sequence[str], *,
                 publication: str | None = None, slot: str | None = None,
                 slot_wait_seconds: float = 10.0, catalog_check_seconds: float = 5.0,
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
        self._by_oid: dict[int, _Table] = {}
        self._by_name: dict[str, _Table] = {}
        self._stalled: set[str] = set()
        self._events: list[Event] = []
        self._spool: Iterator[Transaction] | None = None
        self._snapshot: Spool | None = None
        self._start_lsn = 0
        self._started = False
        self._upper = 0
        self._txn: dict[str, _Pending] | None = None
        self._txn_changes = 0
        self._pending_commit = 0
        self._feedback_at = 0.0
        self._next_catalog_check = 0.0
        self._catalog_stalls: list[tuple[int, str, str, str]] = []
        self._wal_lsn: int | None = None

    # --- Source interface -------------------------------------------------------------------

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
        snapshot = self._spool is not None
        try:
            return self._poll(timeout)
        except psycopg2.Error as e:
            raise self._translate(e, "copying the snapshot" if snapshot
                                  else "streaming") from e
        except SourceProtocolError as e:
            raise SourceStalledError(
                f"source {self.name!r}: {e}",
                hint="the slot does not stream pgoutput protocol 1: drop the slot and "
                     "restart from a new snapshot") from e

    def commit(self, offset: Offset) -> None:
        lsn = int(offset)
        if lsn <= self._pending_commit:
            return
        self._pending_commit = lsn
        if self._started and self._repl is not None:
            try:
                self._feedback()
            except psycopg2.Error as e:
                raise self._translate(e, "confirming offsets") from e
            self._log.debug("postgres.feedback_sent", flush_lsn=format_lsn(lsn))

    def lag_offsets(self) -> int | None:
        """WAL bytes between the server's WAL position (at the last catalog check, every
        ``catalog_check_seconds``) and the source's upper; None before streaming."""
        if self._wal_lsn is None or not self._started:
            return None
        return max(0, self._wal_lsn - self._upper)

    def close(self) -> None:
        if self._snapshot is not None:
            self._snapshot.close()
        for c in (self._repl, self._conn):
            if c is not None:
                with contextlib.suppress(Exception):
                    c.close()
        self._reset()

    # --- opening ------------------------------------------------------------------------------

    def _connect(self, replication: bool = False) -> Any:
        params = psycopg2.extensions.parse_dsn(self.dsn)
        options = " ".join(f"-c {k}={v}" for k, v in SESSION_SETTINGS.items()
                           if k != "client_encoding")
        options += " -c synchronous_commit=on"  # a wake-up record is flushed at once
        if params.get("options"):
            options = params["options"] + " " + options
        kwargs: dict[str, Any] = {"options": options, "client_encoding": "UTF8",
                                  "application_name": f"lamina-ingest-{self.name}"}
        if "connect_timeout" not in params:
            kwargs["connect_timeout"] = self.connect_timeout
        if replication:
            kwargs["connection_factory"] = psycopg2.extras.LogicalReplicationConnection
        conn = psycopg2.connect(self.dsn, **kwargs)
        if not replication:
            conn.autocommit = True
        return conn

    def _open(self, resume: int | None) -> dict[str, TableSpec]:
        self._conn = self._connect()
        with self._conn.cursor() as cur:
            cur.execute("SELECT current_setting('wal_level'), "
                        "pg_encoding_to_char(encoding), current_database() "
                        "FROM pg_database WHERE datname = current_database()")
            wal_level, encoding, database = cur.fetchone()
        if wal_level != "logical":
            raise SourceStalledError(
                f"source {self.name!r}: the server runs with wal_level={wal_level}",
                hint="set wal_level = logical in postgresql.conf and restart PostgreSQL")
        if encoding != "UTF8":
            raise SourceStalledError(
                f"source {self.name!r}: database {database!r} has encoding {encoding}",
                hint="lamina reads UTF8 databases only; replicate from a UTF8 database")
        self._database = database
        specs = self._discover()
        self._ensure_publication(create=resume is None)
        self._repl = self._connect(replication=True)
        self._cur = self._repl.cursor()
        if resume is None:
            self._create_slot_and_snapshot()
        else:
            self._check_slot(resume)
            self._start_lsn = resume
        self._next_catalog_check = time.monotonic() + self.catalog_check_seconds
        self._log.info("postgres.opened", resume=None if resume is None else format_lsn(resume),
                       start_lsn=format_lsn(self._start_lsn), tables=sorted(specs),
                       stalled=sorted(self._stalled))
        return specs

    def _discover(self) -> dict[str, TableSpec]:
        specs: dict[str, TableSpec] = {}
        with self._conn.cursor() as cur:
            for upstream in self.tables:
                schema, _, name = upstream.partition(".")
                cur.execute("SELECT c.oid, c.relreplident, c.relkind FROM pg_class c "
                            "JOIN pg_namespace n ON n.oid = c.relnamespace "
                            "WHERE n.nspname = %s AND c.relname = %s", (schema, name))
                row = cur.fetchone()
                if row is None or row[2] not in ("r", "p"):
                    self._stall(upstream, f"table {upstream} does not exist upstream"
                                if row is None else f"{upstream} is not a table",
                                "create it (or fix the name in the source's tables), then "
                                "restart the source")
                    continue
                oid, replident, _ = row
                cur.execute(
                    "SELECT a.attname, a.atttypid, a.atttypmod, "
                    "format_type(a.atttypid, a.atttypmod), "
                    "CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE a.atttypid END, "
                    "CASE WHEN t.typtype = 'd' THEN t.typtypmod ELSE a.atttypmod END "
                    "FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
                    "WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped "
                    "AND a.attgenerated = '' ORDER BY a.attnum", (oid,))
                cols = cur.fetchall()
                cur.execute(
                    "SELECT a.attname FROM pg_index i JOIN pg_attribute a "
                    "ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
                    "WHERE i.indrelid = %s AND i.indisprimary "
                    "ORDER BY array_position(i.indkey::int2[], a.attnum)", (oid,))
                key = tuple(r[0] for r in cur.fetchall())
                types = [PgType(base, mod, tname) for _, _, _, tname, base, mod in cols]
                reserved = [c[0] for c in cols if c[0] in RESERVED]
                if reserved:
                    self._stall(upstream, f"table {upstream} has columns named {reserved}, "
                                "which lamina reserves", "rename those columns upstream")
                    continue
                schema_pa = pa.schema([pa.field(c[0], t.arrow) for c, t in zip(cols, types,
                                                                                strict=True)])
                spec = TableSpec(upstream=upstream, schema=schema_pa, key=key)
                table = _Table(upstream, oid, [(c[0], c[1], c[2]) for c in cols], types, spec)
                self._by_oid[oid] = table
                self._by_name[upstream] = table
                specs[upstream] = spec
                if replident != "f":
                    self._stall(upstream, f"table {upstream} has REPLICA IDENTITY "
                                f"{_IDENTITY.get(replident, replident)}, not FULL",
                                FULL_HINT.format(table=upstream))
        return specs

    def _ensure_publication(self, *, create: bool) -> None:
        with self._conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (self.publication,))
            exists = cur.fetchone() is not None
            wanted = [t for t in self.tables if t in self._by_name]
            if not exists:
                if not create:
                    raise SourceStalledError(
                        f"source {self.name!r}: publication {self.publication!r} no longer "
                        "exists upstream",
                        hint="the slot cannot decode without it: " + RESNAPSHOT_HINT)
                if not wanted:
                    raise SourceStalledError(
                        f"source {self.name!r}: none of the tables {self.tables} can be read",
                        hint="see the tables' stall messages")
                cur.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
                    sql.Identifier(self.publication),
                    sql.SQL(", ").join(_quote_table(t) for t in wanted)))
                self._log.info("postgres.publication_created", publication=self.publication)
                return
            cur.execute("SELECT schemaname || '.' || tablename FROM pg_publication_tables "
                        "WHERE pubname = %s", (self.publication,))
            present = {r[0] for r in cur.fetchall()}
            missing = [t for t in wanted if t not in present]
            if missing and create:
                cur.execute(sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(
                    sql.Identifier(self.publication),
                    sql.SQL(", ").join(_quote_table(t) for t in missing)))
                self._log.info("postgres.publication_altered", publication=self.publication,
                               added=missing)
            elif missing:
                for t in missing:
                    self._stall(t, f"table {t} is not in publication {self.publication!r}, "
                                "so its changes are not streamed", RESNAPSHOT_HINT)

    def _slot_row(self) -> tuple[Any, ...] | None:
        with self._conn.cursor() as cur:
            cur.execute("SELECT plugin, database, active_pid, confirmed_flush_lsn::text, "
                        "wal_status, slot_type FROM pg_replication_slots "
                        "WHERE slot_name = %s", (self.slot,))
            row: tuple[Any, ...] | None = cur.fetchone()
            return row

    def _wait_inactive(self) -> tuple[Any, ...] | None:
        deadline = time.monotonic() + self.slot_wait_seconds
        row = self._slot_row()
        while row is not None and row[2] is not None:
            if time.monotonic() >= deadline:
                raise SourceStalledError(
                    f"source {self.name!r}: replication slot {self.slot!r} is held by backend "
                    f"pid {row[2]} (for more than {self.slot_wait_seconds:g} s)",
                    hint=f"if that is a stale lamina process, end it with "
                         f"SELECT pg_terminate_backend({row[2]}); if another program uses the "
                         "slot, give this source a slot of its own")
            time.sleep(0.1)
            row = self._slot_row()
        return row

    def _create_slot_and_snapshot(self) -> None:
        row = self._wait_inactive()
        if row is not None:
            # The runner opens from the start only while no output holds data (see
            # lamina.ingest.runner), so nothing read through this slot is durable in
            # lamina: start it afresh so that the snapshot is consistent with it.
            with self._conn.cursor() as cur:
                cur.execute("SELECT pg_drop_replication_slot(%s)", (self.slot,))
            self._log.info("postgres.slot_dropped", reason="first start takes a new snapshot")
        self._cur.execute(sql.SQL("CREATE_REPLICATION_SLOT {} LOGICAL pgoutput "
                                  "EXPORT_SNAPSHOT").format(sql.Identifier(self.slot)))
        _, consistent, snapshot, _ = self._cur.fetchone()
        point = parse_lsn(consistent)
        self._log.info("postgres.slot_created", consistent_point=consistent)
        snap = self._connect()
        try:
            snap.autocommit = False
            with snap.cursor() as cur:
                cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                cur.execute("SET TRANSACTION SNAPSHOT %s", (snapshot,))
                copies = [(upstream, sql.SQL("COPY (SELECT {} FROM {}) TO STDOUT "
                                             "WITH (FORMAT csv)").format(
                    sql.SQL(", ").join(sql.Identifier(c[0]) for c in table.columns),
                    _quote_table(upstream)).as_string(cur))
                    for upstream, table in self._by_name.items()
                    if upstream not in self._stalled]
            spool = Spool(snap, copies, self.spool_dir, self._log)
        except BaseException:
            snap.close()
            raise
        # the snapshot is imported: the replication connection may run commands again
        self._snapshot = spool
        spool.start()
        self._start_lsn = point
        self._spool = self._read_spool([self._by_name[k] for k, _ in copies], point - 1)

    def _read_spool(self, tables: list[_Table], offset: int) -> Iterator[Transaction]:
        """The snapshot's rows, table by table, as the spool grows (see
        :mod:`~lamina.ingest.postgres.spool`); ends once every ``COPY`` returned."""
        spool = self._snapshot
        assert spool is not None
        for table in tables:
            if not spool.wait_started(table.upstream):
                continue
            names = [c[0] for c in table.columns]
            source = spool.reader(table.upstream)
            try:
                reader = pacsv.open_csv(
                    source, read_options=pacsv.ReadOptions(column_names=names,
                                                           block_size=SPOOL_BLOCK_BYTES),
                    parse_options=pacsv.ParseOptions(newlines_in_values=True),
                    convert_options=pacsv.ConvertOptions(
                        column_types={n: pa.string() for n in names}, null_values=[""],
                        strings_can_be_null=True, quoted_strings_can_be_null=False))
                for batch in reader:
                    if table.upstream in self._stalled:
                        break
                    for start in range(0, batch.num_rows, self.snapshot_batch_rows):
                        part = batch.slice(start, self.snapshot_batch_rows)
                        try:
                            cols = [to_arrow(part.column(i), t)
                                    for i, t in enumerate(table.types)]
                        except SourceStalledError as e:
                            self._stall(table.upstream, f"table {table.upstream}: {e.error}",
                                        e.hint)
                            break
                        cols.append(_ones(part.num_rows))
                        data = pa.Table.from_arrays(cols, schema=_with_diff(table.spec.schema))
                        yield Transaction(offset=offset, changes={table.upstream: data})
            except Exception:
                with spool.cond:
                    if spool.error is not None:  # the COPY failed: that, not the parse
                        raise spool.error from None
                raise
            source.release()
        spool.finish()
        self._snapshot = None

    def _check_slot(self, resume: int) -> None:
        row = self._wait_inactive()
        if row is None:
            raise SourceStalledError(
                f"source {self.name!r}: replication slot {self.slot!r} does not exist "
                f"(lost: dropped, or removed by max_slot_wal_keep_size); the changes after "
                f"{format_lsn(resume)} cannot be read", hint=RESNAPSHOT_HINT)
        plugin, database, _, confirmed, wal_status, slot_type = row
        if slot_type != "logical" or plugin != "pgoutput" or database != self._database:
            raise SourceStalledError(
                f"source {self.name!r}: replication slot {self.slot!r} is a {slot_type} slot "
                f"of plugin {plugin!r} in database {database!r}, not a pgoutput slot of "
                f"{self._database!r}", hint="give this source a slot name of its own")
        if wal_status == "lost":
            raise SourceStalledError(
                f"source {self.name!r}: replication slot {self.slot!r} is lost: the server "
                "removed WAL it still needed (max_slot_wal_keep_size)", hint=RESNAPSHOT_HINT)
        if confirmed is not None and parse_lsn(confirmed) > resume:
            raise SourceStalledError(
                f"source {self.name!r}: replication slot {self.slot!r} confirmed "
                f"{confirmed}, beyond the resume point {format_lsn(resume)}: changes between "
                "them are gone (another client consumed or advanced the slot)",
                hint="let only lamina use this slot; " + RESNAPSHOT_HINT)

    # --- streaming ------------------------------------------------------------------------------

    def _start(self) -> None:
        self._cur.start_replication(
            slot_name=self.slot, decode=False, start_lsn=self._start_lsn,
            status_interval=_PSYCOPG2_FEEDBACK_OFF,
            options={"proto_version": "1", "publication_names": self.publication})
        self._started = True
        self._upper = self._start_lsn
        self._events.append(Upper(self._start_lsn))
        self._feedback()
        self._log.info("postgres.streaming", start_lsn=format_lsn(self._start_lsn))

    def _poll(self, timeout: float) -> list[Event]:
        deadline = time.monotonic() + max(0.0, timeout)
        if self._started and time.monotonic() >= self._next_catalog_check:
            self._next_catalog_check = time.monotonic() + self.catalog_check_seconds
            self._check_catalog()
        if self._spool is not None:
            try:
                nxt = next(self._spool, None)
            except BaseException:
                self.close()  # a snapshot cut short is never resumed: open again
                raise
            if nxt is not None:
                return self._take([nxt])
            self._spool = None
        if not self._started:
            self._start()
        changes = 0
        while changes < self.max_changes_per_poll:
            if time.monotonic() >= self._feedback_at:
                self._feedback()
            msg = self._cur.read_message()
            if msg is None:
                if self._txn is None:
                    self._idle()
                    if self._events:
                        break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                select.select([self._cur], [], [], min(remaining, self.feedback_seconds))
                continue
            changes += self._handle(pgoutput.decode(msg.payload, lsn=msg.data_start))
        return self._take([])

    def _feedback(self) -> None:
        """A standby status update with the committed offset (0 = nothing yet, which the
        server takes as a sign of life only)."""
        send_status(self._repl, self._pending_commit)
        self._feedback_at = time.monotonic() + self.feedback_seconds

    def _take(self, extra: list[Event]) -> list[Event]:
        out = self._events + extra
        self._events = []
        return out

    def _idle(self) -> None:
        wal_end = int(self._cur.wal_end or 0)
        if wal_end > self._upper:
            self._advance(wal_end)

    def _advance(self, upper: int) -> None:
        if upper > self._upper:
            self._upper = upper
            self._release_catalog_stalls()
            self._events.append(Upper(upper))

    def _release_catalog_stalls(self) -> None:
        """Report the catalog checks' findings the stream has caught up with."""
        ready = [c for c in self._catalog_stalls if c[0] <= self._upper]
        self._catalog_stalls = [c for c in self._catalog_stalls if c[0] > self._upper]
        for _, table, error, hint in ready:
            self._stall(table, error, hint)

    def _check_catalog(self) -> None:
        if self._catalog_stalls and self._catalog_stalls[0][0] > self._upper:
            self._wake()
        live = {t.oid: t for t in self._by_name.values() if t.upstream not in self._stalled}
        if not live:
            with self._conn.cursor() as cur:
                cur.execute("SELECT pg_current_wal_lsn()::text")
                self._wal_lsn = parse_lsn(cur.fetchone()[0])
            return
        waiting = {c[1] for c in self._catalog_stalls}
        with self._conn.cursor() as cur:
            cur.execute("SELECT pg_current_wal_lsn()::text, "
                        "array(SELECT oid::int8 FROM pg_class WHERE oid = ANY(%s)), "
                        "array(SELECT oid::int8 FROM pg_class WHERE oid = ANY(%s) "
                        "AND relreplident <> 'f')", (list(live), list(live)))
            lsn_text, present, not_full = cur.fetchone()
        lsn = self._wal_lsn = parse_lsn(lsn_text)
        for oid, table in live.items():
            if table.upstream in waiting:
                continue
            if oid not in present:
                self._catalog_stalls.append(
                    (lsn, table.upstream, f"table {table.upstream} was dropped upstream",
                     RESNAPSHOT_HINT))
            elif oid in not_full:
                self._catalog_stalls.append(
                    (lsn, table.upstream, f"table {table.upstream} no longer has REPLICA "
                     "IDENTITY FULL", FULL_HINT.format(table=table.upstream)))
        if self._txn is None:
            self._release_catalog_stalls()

    def _wake(self) -> None:
        """Commit one tiny transaction (a logical message, which pgoutput does not forward
        without its ``messages`` option): on an idle server the walsender's keepalives
        stop at the last record, possibly short of the WAL position a catalog check is
        waiting for; decoding this commit (flushed at once) moves them past it."""
        try:
            with self._conn.cursor() as cur:
                cur.execute("SELECT pg_logical_emit_message(true, 'lamina.wake', '')")
        except psycopg2.errors.InsufficientPrivilege:
            self._log.info("postgres.wake_refused",
                           reason="no EXECUTE on pg_logical_emit_message; the stall is "
                                  "reported once other WAL is written")

    def _stall(self, table: str, error: str, hint: str) -> None:
        if table in self._stalled:
            return
        self._stalled.add(table)
        if self._txn is not None:
            self._txn.pop(table, None)
        self._events.append(Stall(table=table, error=error, hint=hint))
        self._log.warning("postgres.table_stalled", table=table, error=error, hint=hint)

    def _handle(self, msg: pgoutput.PgMessage) -> int:
        if isinstance(msg, pgoutput.Begin):
            self._txn = {}
            return 0
        if isinstance(msg, pgoutput.Commit):
            self._finish(msg)
            return 0
        if isinstance(msg, pgoutput.Relation):
            self._relation(msg)
            return 0
        if isinstance(msg, pgoutput.Insert):
            return self._row(msg.relation_oid, None, msg.new)
        if isinstance(msg, pgoutput.Update):
            table = self._live(msg.relation_oid)
            if table is None:
                return 0
            if msg.old is None or msg.old_kind != "O":
                self._stall(table.upstream, f"an UPDATE of {table.upstream} came without the "
                            "old row: the table does not have REPLICA IDENTITY FULL",
                            FULL_HINT.format(table=table.upstream))
                return 0
            return self._row(msg.relation_oid, msg.old, msg.new)
        if isinstance(msg, pgoutput.Delete):
            table = self._live(msg.relation_oid)
            if table is None:
                return 0
            if msg.old_kind != "O":
                self._stall(table.upstream, f"a DELETE of {table.upstream} came with only the "
                            "old key: the table does not have REPLICA IDENTITY FULL",
                            FULL_HINT.format(table=table.upstream))
                return 0
            return self._row(msg.relation_oid, msg.old, None)
        if isinstance(msg, pgoutput.Truncate):
            for oid in msg.relation_oids:
                table = self._live(oid)
                if table is not None:
                    self._stall(table.upstream, f"table {table.upstream} was truncated "
                                "upstream (TRUNCATE)", RESNAPSHOT_HINT)
            return 0
        return 0  # Origin, Type, Message: nothing to store

    def _live(self, oid: int) -> _Table | None:
        table = self._by_oid.get(oid)
        if table is None or table.upstream in self._stalled:
            return None
        return table

    def _relation(self, msg: pgoutput.Relation) -> None:
        table = self._live(msg.oid)
        if table is None:
            return
        got = [(c.name, c.type_oid, c.type_modifier) for c in msg.columns]
        if got == table.columns:
            return
        same_names = [g[0] for g in got] == [c[0] for c in table.columns]
        compatible = same_names and all(
            g[1] == c[1] and PgType(g[1], g[2]).arrow == PgType(c[1], c[2]).arrow
            for g, c in zip(got, table.columns, strict=True))
        if compatible:
            return
        self._stall(table.upstream,
                    f"the columns of {table.upstream} changed upstream: "
                    f"{_describe(table.columns)} became {_describe(got)}", RESNAPSHOT_HINT)

    def _row(self, oid: int, old: pgoutput.TupleData | None,
             new: pgoutput.TupleData | None) -> int:
        table = self._live(oid)
        if table is None or self._txn is None:
            return 0
        ncols = len(table.columns)
        rows: list[tuple[tuple[pgoutput.Value, ...], int]] = []
        if old is not None:
            rows.append((old.values, -1))
        if new is not None:
            values = new.values
            if old is not None and any(v is pgoutput.Unchanged for v in values):
                values = tuple(o if v is pgoutput.Unchanged else v
                               for v, o in zip(values, old.values, strict=False))
            rows.append((values, 1))
        for values, _ in rows:
            bad = len(values) != ncols or not {type(v) for v in values} <= _TEXT_TYPES
            if bad:
                self._stall(table.upstream, f"a change of {table.upstream} has "
                            f"{len(values)} columns, or an unchanged TOAST value lamina "
                            f"cannot fill in, where {ncols} text columns were expected",
                            RESNAPSHOT_HINT)
                return 0
        pending = self._txn.get(table.upstream)
        if pending is None:
            pending = self._txn[table.upstream] = _Pending([[] for _ in range(ncols)])
        for values, diff in rows:
            for col, v in zip(pending.columns, values, strict=True):
                col.append(v)  # type: ignore[arg-type]  # checked above: str | None
            pending.diffs.append(diff)
        return len(rows)

    def _finish(self, msg: pgoutput.Commit) -> None:
        txn = self._txn or {}
        self._txn = None
        changes: dict[str, pa.Table] = {}
        for upstream, pending in txn.items():
            table = self._by_name[upstream]
            try:
                cols = [to_arrow(c, t) for c, t in zip(pending.columns, table.types,
                                                          strict=True)]
            except SourceStalledError as e:
                self._stall(upstream, f"table {upstream}: {e.error}", e.hint)
                continue
            cols.append(pa.array(pending.diffs, pa.int64()))
            changes[upstream] = pa.Table.from_arrays(cols, schema=_with_diff(table.spec.schema))
        if changes:
            self._events.append(Transaction(offset=msg.commit_lsn, changes=changes))
        self._advance(msg.end_lsn)

    # --- errors ---------------------------------------------------------------------------------

    def _translate(self, e: psycopg2.Error, doing: str) -> SourceError:
        code = getattr(e, "pgcode", None)
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        what = f"source {self.name!r}: PostgreSQL error while {doing}: {text}"
        if code == psycopg2.errorcodes.OBJECT_IN_USE:
            return SourceStalledError(what, hint=(
                f"replication slot {self.slot!r} is held by another backend: if it is a "
                "stale lamina process, end it with pg_terminate_backend(active_pid) from "
                "pg_replication_slots"))
        if code == psycopg2.errorcodes.UNDEFINED_OBJECT and "slot" in text:
            return SourceStalledError(what, hint=f"replication slot {self.slot!r} is lost: "
                                      + RESNAPSHOT_HINT)
        if code == psycopg2.errorcodes.UNDEFINED_OBJECT and "publication" in text:
            return SourceStalledError(what, hint=f"publication {self.publication!r} is gone: "
                                      + RESNAPSHOT_HINT)
        if code == psycopg2.errorcodes.OBJECT_NOT_IN_PREREQUISITE_STATE:
            return SourceStalledError(what, hint=f"replication slot {self.slot!r} cannot be "
                                      "used any more (lost WAL or invalidated): "
                                      + RESNAPSHOT_HINT)
        if code == psycopg2.errorcodes.INSUFFICIENT_PRIVILEGE:
            return SourceStalledError(what, hint=(
                "give the role REPLICATION and SELECT on the tables (and CREATE on the "
                "database, or create the publication yourself): see docs/ingestion.md"))
        refused = _REFUSED.search(text)
        if (code is not None and code.startswith(("28", "3D"))) or refused:
            return SourceStalledError(what, hint=(
                "the server refused the connection's credentials, role or database: fix the "
                "source's dsn (user, password, dbname) or the server's pg_hba.conf and "
                "restart; retrying the same settings cannot succeed"))
        if code == psycopg2.errorcodes.CONFIGURATION_LIMIT_EXCEEDED:
            return SourceStalledError(what, hint=(
                "raise max_replication_slots / max_wal_senders in postgresql.conf, or drop "
                "unused slots (pg_replication_slots)"))
        lost = any(c is not None and c.closed for c in (self._conn, self._repl))
        if lost or (code is not None and code.startswith(("08", "57", "53"))) or isinstance(
                e, psycopg2.OperationalError | psycopg2.InterfaceError):
            return SourceTransientError(what + "; retrying")
        return SourceStalledError(what, hint="see the PostgreSQL error above")


_REFUSED: Final = re.compile(
    r"password authentication failed|authentication failed for user|no pg_hba\.conf entry"
    r"|role \".*\" does not exist|database \".*\" does not exist")
"""Connection refusals that retrying cannot cure. libpq gives no SQLSTATE for a refused
connection (classes 28 and 3D once connected), so they are known by their message."""

_TEXT_TYPES: Final = frozenset({str, type(None)})
"""What a decoded column may be once unchanged TOAST values are filled in."""

SPOOL_BLOCK_BYTES: Final = 1 << 20
"""How much of a table's spool pyarrow parses at a time (the reader waits for that much,
or for the table's end)."""

_PSYCOPG2_FEEDBACK_OFF: Final = 10**6
"""psycopg2's own periodic feedback, pushed out of the way (see feedback.py)."""

_IDENTITY: Final = {"d": "DEFAULT", "n": "NOTHING", "i": "USING INDEX", "f": "FULL"}


def _ones(n: int) -> pa.Array:
    """``n`` int64 ones (the ``_diff`` of snapshot rows), without a Python list."""
    return pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(_ONE_LE * n)])


_ONE_LE: Final = (1).to_bytes(8, sys.byteorder)  # Arrow buffers are native-endian


def _with_diff(schema: pa.Schema) -> pa.Schema:
    return schema.append(pa.field(DIFF, pa.int64(), nullable=False))


def _describe(columns: Sequence[tuple[str, int, int]]) -> str:
    return "(" + ", ".join(f"{n} oid {t}" + (f"({m})" if m >= 0 else "")
                           for n, t, m in columns) + ")"
