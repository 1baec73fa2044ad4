"""Connections of a PostgreSQL source, and what its errors mean.

Every session sets the text formats :mod:`~lamina.ingest.postgres.types` parses
(``SESSION_SETTINGS``, added to the DSN's own ``options``) and ``synchronous_commit=on``
(a wake-up record is flushed at once); it is named ``lamina-ingest-<source>`` in
``pg_stat_activity``.

:func:`translate` turns a psycopg2 error into the framework's two kinds:

- **retried** (:class:`~lamina.errors.SourceTransientError`): anything about getting or
  keeping a connection: refused or lost, a server restart, ``pg_terminate_backend``,
  SQLSTATE classes 08, 53 (but 53400), 57, and every failed connection attempt, refused
  credentials included (``password authentication failed``, ``no pg_hba.conf entry``,
  a missing role or database: classes 28 and 3D). libpq gives no SQLSTATE for a refused
  connection and its messages are translated by the server's ``lc_messages``, so lamina
  does not try to tell a wrong password from a server that is still starting: it retries
  with backoff, showing the error (state ``starting``, log ``source.retrying``), and heals
  by itself once the DSN's server side is fixed.
- **stalled** (:class:`~lamina.errors.SourceStalledError`, with the remedy): a slot held by
  another backend (55006), a missing slot or publication (42704), a slot that cannot be
  used any more (55000), missing privileges (42501), no free replication slot (53400),
  and any other error of a statement.
"""

from __future__ import annotations

from typing import Any, Final

import psycopg2
import psycopg2.errorcodes
import psycopg2.extensions
import psycopg2.extras

from lamina.errors import SourceError, SourceStalledError, SourceTransientError
from lamina.ingest.postgres.types import SESSION_SETTINGS

__all__ = ["RESNAPSHOT_HINT", "connect", "translate"]

RESNAPSHOT_HINT: Final = (
    "the source cannot go on from where it was: drop every output relation of the source "
    "and its remap relation and restart `lamina ingest` (the slot is created again with a "
    "new snapshot)")


def connect(dsn: str, source: str, *, replication: bool = False,
            connect_timeout: int = 10) -> Any:
    """A connection with the source's session settings (autocommit unless
    ``replication``, which gives a ``LogicalReplicationConnection``)."""
    params = psycopg2.extensions.parse_dsn(dsn)
    options = " ".join(f"-c {k}={v}" for k, v in SESSION_SETTINGS.items()
                       if k != "client_encoding")
    options += " -c synchronous_commit=on"
    if params.get("options"):
        options = params["options"] + " " + options
    kwargs: dict[str, Any] = {"options": options, "client_encoding": "UTF8",
                              "application_name": f"lamina-ingest-{source}"}
    if "connect_timeout" not in params:
        kwargs["connect_timeout"] = connect_timeout
    if replication:
        kwargs["connection_factory"] = psycopg2.extras.LogicalReplicationConnection
    conn = psycopg2.connect(dsn, **kwargs)
    if not replication:
        conn.autocommit = True
    return conn


def translate(e: psycopg2.Error, *, source: str, slot: str, publication: str, doing: str,
              connections: tuple[Any, ...] = ()) -> SourceError:
    """``e`` as a retried or a definite error (see the module docstring)."""
    code = getattr(e, "pgcode", None)
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    what = f"source {source!r}: PostgreSQL error while {doing}: {text}"
    codes = psycopg2.errorcodes
    if code == codes.OBJECT_IN_USE:
        return SourceStalledError(what, hint=(
            f"replication slot {slot!r} is held by another backend: if it is a stale lamina "
            "process, end it with pg_terminate_backend(active_pid) from "
            "pg_replication_slots"))
    if code == codes.UNDEFINED_OBJECT and "slot" in text:
        return SourceStalledError(what, hint=f"replication slot {slot!r} is lost: "
                                  + RESNAPSHOT_HINT)
    if code == codes.UNDEFINED_OBJECT and "publication" in text:
        return SourceStalledError(what, hint=f"publication {publication!r} is gone: "
                                  + RESNAPSHOT_HINT)
    if code == codes.OBJECT_NOT_IN_PREREQUISITE_STATE:
        return SourceStalledError(what, hint=f"replication slot {slot!r} cannot be used any "
                                  "more (lost WAL or invalidated): " + RESNAPSHOT_HINT)
    if code == codes.INSUFFICIENT_PRIVILEGE:
        return SourceStalledError(what, hint=(
            "give the role REPLICATION and SELECT on the tables (and CREATE on the "
            "database, or create the publication yourself): see docs/ingestion.md"))
    if code == codes.CONFIGURATION_LIMIT_EXCEEDED:
        return SourceStalledError(what, hint=(
            "raise max_replication_slots / max_wal_senders in postgresql.conf, or drop "
            "unused slots (pg_replication_slots)"))
    lost = any(c is not None and c.closed for c in connections)
    if lost or (code is not None and code.startswith(("08", "28", "3D", "53", "57"))) \
            or isinstance(e, psycopg2.OperationalError | psycopg2.InterfaceError):
        return SourceTransientError(
            what + "; retrying (if it persists, check the source's dsn, the role and its "
            "password, pg_hba.conf, max_wal_senders and the server)")
    return SourceStalledError(what, hint="see the PostgreSQL error above")
