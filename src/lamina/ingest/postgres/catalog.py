"""What a PostgreSQL source knows of its tables upstream: discovery, the publication, and
the periodic check of both while streaming.

**Discovery** (at open, and for a resync): per table its oid, replica identity, columns
(name, type oid and typmod as ``pg_attribute`` has them, a domain resolved to its base
type, generated columns left out: PostgreSQL does not replicate them) and primary key.

**The publication**: created ``FOR TABLE ...`` when absent on a first start (missing
tables added to an existing one then, and for a resync); otherwise a table not in it is
stalled.

**The check** (:func:`check`, every ``catalog_check_seconds`` while streaming), one
statement: the server's WAL position ``L`` and clock, and for the live tables which still
exist, which lost ``REPLICA IDENTITY FULL`` and which are still published. Publication
membership is what may not be missed: pgoutput simply stops sending the changes of a table
dropped from the publication (from the commit ``d`` of the ``ALTER PUBLICATION``), so the
source must never report an upper past ``d`` as complete for it. A check whose catalog
snapshot shows a table published proves ``d`` lies after every WAL position read *before*
that snapshot; the source therefore treats a check as confirming membership up to the
``L`` of the check *before* it (read at least ``catalog_check_seconds`` earlier, so any
commit written below it is long visible), and never reports an upper beyond the confirmed
position (:class:`~lamina.ingest.postgres.source.PostgresSource`). A table found gone from
the publication is stalled at the last confirmed position: its output takes every binding
up to it, none after.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import pyarrow as pa
from psycopg2 import sql

from lamina.errors import SourceStalledError
from lamina.ingest.changes import ChangeBuffer
from lamina.ingest.postgres.connect import RESNAPSHOT_HINT
from lamina.ingest.postgres.pgoutput import parse_lsn
from lamina.ingest.postgres.rows import to_columns
from lamina.ingest.postgres.types import PgType, to_arrow
from lamina.ingest.source import TableSpec
from lamina.schema import RESERVED

__all__ = ["FULL_HINT", "CheckResult", "PgTable", "check", "discover", "ensure_publication",
           "quote_table"]

FULL_HINT: Final = ("run ALTER TABLE {table} REPLICA IDENTITY FULL upstream (UPDATE and "
                    "DELETE need the whole old row), then `lamina ingest resync --config "
                    "FILE {source} {table}`")

_IDENTITY: Final = {"d": "DEFAULT", "n": "NOTHING", "i": "USING INDEX", "f": "FULL"}

Problem = tuple[str, str, str]
"""``(table, error, hint)`` found by discovery."""


@dataclass
class PgTable:
    """One upstream table as found by discovery."""

    upstream: str
    oid: int
    columns: list[tuple[str, int, int]]
    """(name, type oid as in pg_attribute, typmod): what a Relation message must match."""
    types: list[PgType]
    spec: TableSpec

    def buffer(self) -> ChangeBuffer:
        """A buffer of this table's streamed change messages, cut into Arrow by
        :func:`lamina.ingest.postgres.rows.to_columns` and the type mapping."""
        types, width, upstream = self.types, len(self.columns), self.upstream

        def convert(messages: Sequence[bytes]) -> list[pa.Array]:
            columns, diffs = to_columns(messages, width, table=upstream)
            return [*(to_arrow(c, t) for c, t in zip(columns, types, strict=True)), diffs]

        return ChangeBuffer(self.spec.schema, convert)


def quote_table(upstream: str) -> sql.Composed:
    schema, _, name = upstream.partition(".")
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(name))


def discover(conn: Any, tables: Iterable[str], *, source: str,
             ) -> tuple[dict[str, PgTable], list[Problem]]:
    """The tables that can be read, and a problem (stall) for each that cannot or lacks
    ``REPLICA IDENTITY FULL`` (such a table is also among the first, for a resync to
    report; the source does not stream it)."""
    found: dict[str, PgTable] = {}
    problems: list[Problem] = []
    with conn.cursor() as cur:
        for upstream in tables:
            schema, _, name = upstream.partition(".")
            cur.execute("SELECT c.oid, c.relreplident, c.relkind FROM pg_class c "
                        "JOIN pg_namespace n ON n.oid = c.relnamespace "
                        "WHERE n.nspname = %s AND c.relname = %s", (schema, name))
            row = cur.fetchone()
            if row is None or row[2] not in ("r", "p"):
                problems.append((upstream, f"table {upstream} does not exist upstream"
                                 if row is None else f"{upstream} is not a table",
                                 "create it (or fix the name in the source's tables), then "
                                 "restart the source"))
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
                problems.append((upstream, f"table {upstream} has columns named {reserved}, "
                                 "which lamina reserves", "rename those columns upstream"))
                continue
            schema_pa = pa.schema([pa.field(c[0], t.arrow)
                                   for c, t in zip(cols, types, strict=True)])
            spec = TableSpec(upstream=upstream, schema=schema_pa, key=key)
            found[upstream] = PgTable(upstream, oid, [(c[0], c[1], c[2]) for c in cols],
                                      types, spec)
            if replident != "f":
                problems.append((upstream, f"table {upstream} has REPLICA IDENTITY "
                                 f"{_IDENTITY.get(replident, replident)}, not FULL",
                                 FULL_HINT.format(table=upstream, source=source)))
    return found, problems


def ensure_publication(conn: Any, publication: str, tables: Sequence[str], *, create: bool,
                       add: bool, source: str, on_change: Callable[[str, list[str]], None],
                       ) -> list[Problem]:
    """Make sure ``tables`` are published: with ``create`` the publication is created if
    absent, with ``add`` the missing tables are added (``on_change(what, tables)`` is
    told); otherwise a problem for each table not in it. A missing publication without
    ``create`` is a SourceStalledError."""
    with conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (publication,))
        exists = cur.fetchone() is not None
        if not exists:
            if not create:
                raise SourceStalledError(
                    f"source {source!r}: publication {publication!r} no longer exists "
                    "upstream", hint="the slot cannot decode without it: " + RESNAPSHOT_HINT)
            if not tables:
                raise SourceStalledError(f"source {source!r}: none of its tables can be "
                                         "read", hint="see the tables' stall messages")
            cur.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
                sql.Identifier(publication),
                sql.SQL(", ").join(quote_table(t) for t in tables)))
            on_change("created", list(tables))
            return []
        cur.execute("SELECT schemaname || '.' || tablename FROM pg_publication_tables "
                    "WHERE pubname = %s", (publication,))
        present = {r[0] for r in cur.fetchall()}
        missing = [t for t in tables if t not in present]
        if missing and add:
            cur.execute(sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(
                sql.Identifier(publication),
                sql.SQL(", ").join(quote_table(t) for t in missing)))
            on_change("altered", missing)
            return []
        return [(t, f"table {t} is not in publication {publication!r}, so its changes are "
                 "not streamed", f"ALTER PUBLICATION {publication} ADD TABLE {t}, then "
                 f"`lamina ingest resync --config FILE {source} {t}`") for t in missing]


@dataclass(frozen=True)
class CheckResult:
    """One catalog check: the server's WAL position and clock, and what became of the
    live tables (by oid)."""

    lsn: int
    clock: float
    """The server's clock, Unix seconds."""
    gone: frozenset[int]
    not_full: frozenset[int]
    unpublished: frozenset[int]


def check(conn: Any, oids: Sequence[int], publication: str) -> CheckResult:
    """One statement: ``pg_current_wal_lsn()``, ``clock_timestamp()`` and the state of
    ``oids`` (see the module docstring)."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT pg_current_wal_lsn()::text, "
            "extract(epoch FROM clock_timestamp())::float8, "
            "array(SELECT o FROM unnest(%(oids)s::int8[]) o "
            "      WHERE NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.oid = o)), "
            "array(SELECT oid::int8 FROM pg_class WHERE oid = ANY(%(oids)s::oid[]) "
            "      AND relreplident <> 'f'), "
            "array(SELECT o FROM unnest(%(oids)s::int8[]) o EXCEPT "
            "      SELECT to_regclass(format('%%I.%%I', schemaname, tablename))::oid::int8 "
            "      FROM pg_publication_tables WHERE pubname = %(pub)s)",
            {"oids": list(oids), "pub": publication})
        lsn, clock, gone, not_full, unpublished = cur.fetchone()
    return CheckResult(parse_lsn(lsn), float(clock), frozenset(gone), frozenset(not_full),
                       frozenset(unpublished) - frozenset(gone))
