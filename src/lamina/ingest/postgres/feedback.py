"""Standby status updates with exactly the flush LSN lamina has made durable.

Why not psycopg2's ``ReplicationCursor.send_feedback``: psycopg2 (2.8.5 and later) moves the
flush position it reports *on its own* to the ``wal_end`` of a server keepalive whenever
the client has confirmed everything it received (``explicitly_flushed_lsn >=
last_msg_data_start``), and sends that with every later feedback message. That position is
safe in itself (no change of a published table lies in between), but it is ahead of what
lamina's outputs hold: after a crash in that window the slot's ``confirmed_flush_lsn`` is
beyond the resume point, which must stay a definite error (it is what a slot consumed or
advanced by another client looks like). So lamina never calls ``send_feedback``; psycopg2's
own periodic feedback is pushed out to ``status_interval`` = 10**6 s, and this module
writes the status update itself, on the same libpq connection, through the ``libpq``
that psycopg2 has loaded (``PQputCopyData`` + ``PQflush``, via ctypes; the
``PGconn *`` is ``connection.pgconn_ptr``).

Message (a ``CopyData`` payload, big-endian)::

    Byte1 'r'  Int64 write LSN  Int64 flush LSN  Int64 apply LSN
    Int64 client clock (microseconds since 2000-01-01 UTC)  Byte1 reply requested (0)

psycopg2 still answers a keepalive that *requests* a reply with its own (possibly
advanced) positions; the server requests one only when it has heard nothing for
``wal_sender_timeout / 2`` (these updates go every second) or while it shuts down.
"""

from __future__ import annotations

import ctypes
import struct
import time
from functools import cache
from typing import Any, Final

from lamina.errors import SourceStalledError, SourceTransientError

__all__ = ["send_status"]

_STATUS: Final = struct.Struct(">cQQQqB")
_PG_EPOCH_UNIX_US: Final = 946_684_800_000_000


@cache
def _libpq() -> Any:
    """The libpq shared object mapped into this process (psycopg2's own copy)."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and "/libpq" in parts[-1] and ".so" in parts[-1]:
                    paths.append(parts[-1])
    except OSError:
        pass
    if not paths:
        raise SourceStalledError(
            "cannot find the libpq that psycopg2 loaded (no libpq in /proc/self/maps)",
            hint="install psycopg2-binary or a psycopg2 linked against a shared libpq")
    lib = ctypes.CDLL(paths[0])
    lib.PQputCopyData.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.PQputCopyData.restype = ctypes.c_int
    lib.PQflush.argtypes = [ctypes.c_void_p]
    lib.PQflush.restype = ctypes.c_int
    lib.PQerrorMessage.argtypes = [ctypes.c_void_p]
    lib.PQerrorMessage.restype = ctypes.c_char_p
    return lib


def send_status(conn: Any, flush_lsn: int) -> None:
    """Send one standby status update (write = flush = apply = ``flush_lsn``) on ``conn``,
    a psycopg2 replication connection in COPY BOTH mode. Raises
    :class:`SourceTransientError` when the connection is broken."""
    lib = _libpq()
    now = time.time_ns() // 1000 - _PG_EPOCH_UNIX_US
    msg = _STATUS.pack(b"r", flush_lsn, flush_lsn, flush_lsn, now, 0)
    ptr = ctypes.c_void_p(conn.pgconn_ptr)
    rc = lib.PQputCopyData(ptr, msg, len(msg))
    if rc == 0:
        return  # the send buffer is full (non-blocking): the next update goes in a second
    if rc != 1 or lib.PQflush(ptr) < 0:
        err = (lib.PQerrorMessage(ptr) or b"").decode(errors="replace").strip()
        raise SourceTransientError(f"sending the standby status update failed: {err}; "
                                   "retrying")
