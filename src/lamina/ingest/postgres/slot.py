"""The source's logical replication slot: checked before streaming from it, created (with
an exported snapshot) on a first start, and the temporary slots of a resync.

- **Checked** (:func:`check_slot`) before ``START_REPLICATION`` at a resume point ``R``: it
  must exist, belong to this database and use ``pgoutput``, must not be lost
  (``wal_status``) nor have a ``confirmed_flush_lsn`` beyond ``R`` (the changes between
  would be gone: another client consumed or advanced it), and must not be held by another
  backend for longer than ``slot_wait_seconds`` (a walsender of a killed lamina lets go
  a moment after).
- **Created** (:func:`create_slot`) with ``CREATE_REPLICATION_SLOT <slot> [TEMPORARY]
  LOGICAL pgoutput EXPORT_SNAPSHOT`` on a replication connection: the result is the slot's
  consistent point ``P`` and the name of a snapshot of the database exactly at ``P``
  (every transaction committed below ``P`` visible, none at or above it), usable by another
  session (``SET TRANSACTION SNAPSHOT``) until the replication connection runs another
  command. On a first start a leftover slot of the name is dropped first (nothing read
  through it is durable in lamina). A resync takes a *temporary* slot (dropped by the
  server when its connection closes) only for its snapshot and ``P``: the source's own
  slot is not touched.
"""

from __future__ import annotations

import time
from typing import Any

from psycopg2 import sql

from lamina.errors import SourceStalledError
from lamina.ingest.postgres.connect import RESNAPSHOT_HINT
from lamina.ingest.postgres.pgoutput import format_lsn, parse_lsn

__all__ = ["check_slot", "create_slot", "drop_slot", "wait_inactive"]


def _slot_row(conn: Any, slot: str) -> tuple[Any, ...] | None:
    with conn.cursor() as cur:
        cur.execute("SELECT plugin, database, active_pid, confirmed_flush_lsn::text, "
                    "wal_status, slot_type FROM pg_replication_slots "
                    "WHERE slot_name = %s", (slot,))
        row: tuple[Any, ...] | None = cur.fetchone()
        return row


def wait_inactive(conn: Any, slot: str, *, source: str, wait_seconds: float,
                  ) -> tuple[Any, ...] | None:
    """The slot's row once no backend holds it (None: no such slot); SourceStalledError
    when one still does after ``wait_seconds``."""
    deadline = time.monotonic() + wait_seconds
    row = _slot_row(conn, slot)
    while row is not None and row[2] is not None:
        if time.monotonic() >= deadline:
            raise SourceStalledError(
                f"source {source!r}: replication slot {slot!r} is held by backend pid "
                f"{row[2]} (for more than {wait_seconds:g} s)",
                hint=f"if that is a stale lamina process, end it with SELECT "
                     f"pg_terminate_backend({row[2]}); if another program uses the slot, "
                     "give this source a slot of its own")
        time.sleep(0.1)
        row = _slot_row(conn, slot)
    return row


def drop_slot(conn: Any, slot: str) -> None:
    with conn.cursor() as cur:
        cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))


def check_slot(conn: Any, slot: str, *, source: str, database: str, resume: int,
               wait_seconds: float) -> None:
    """SourceStalledError unless streaming from ``slot`` at ``resume`` loses nothing."""
    row = wait_inactive(conn, slot, source=source, wait_seconds=wait_seconds)
    if row is None:
        raise SourceStalledError(
            f"source {source!r}: replication slot {slot!r} does not exist (lost: dropped, "
            f"or removed by max_slot_wal_keep_size); the changes after {format_lsn(resume)} "
            "cannot be read", hint=RESNAPSHOT_HINT)
    plugin, db, _, confirmed, wal_status, slot_type = row
    if slot_type != "logical" or plugin != "pgoutput" or db != database:
        raise SourceStalledError(
            f"source {source!r}: replication slot {slot!r} is a {slot_type} slot of plugin "
            f"{plugin!r} in database {db!r}, not a pgoutput slot of {database!r}",
            hint="give this source a slot name of its own")
    if wal_status == "lost":
        raise SourceStalledError(
            f"source {source!r}: replication slot {slot!r} is lost: the server removed WAL "
            "it still needed (max_slot_wal_keep_size)", hint=RESNAPSHOT_HINT)
    if confirmed is not None and parse_lsn(confirmed) > resume:
        raise SourceStalledError(
            f"source {source!r}: replication slot {slot!r} confirmed {confirmed}, beyond "
            f"the resume point {format_lsn(resume)}: changes between them are gone "
            "(another client consumed or advanced the slot)",
            hint="let only lamina use this slot; " + RESNAPSHOT_HINT)


def create_slot(repl_cursor: Any, slot: str, *, temporary: bool = False) -> tuple[int, str]:
    """Create a pgoutput slot exporting its snapshot; ``(consistent point, snapshot
    name)``. The snapshot stays importable until the cursor's connection runs another
    command."""
    repl_cursor.execute(sql.SQL("CREATE_REPLICATION_SLOT {} {} LOGICAL pgoutput "
                                "EXPORT_SNAPSHOT").format(
        sql.Identifier(slot), sql.SQL("TEMPORARY" if temporary else "")))
    _, consistent, snapshot, _ = repl_cursor.fetchone()
    return parse_lsn(consistent), str(snapshot)
