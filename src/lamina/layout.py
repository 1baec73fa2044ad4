"""Where things live: every file name of a data directory and of a trace is spelled here.

A data directory (:class:`Layout`)::

    <data>/compacter.lock                 flock of the one compacter (docs/architecture.md)
    <data>/wal/<relation>/relation.json   RelationMeta, written once
    <data>/wal/<relation>/LOCK            flock of the one writer
    <data>/wal/<relation>/QUARANTINED     present when corruption was found (JSON reason)
    <data>/wal/<relation>/*.wal[.open]    segments (names: lamina.wal.segment)
    <data>/wal/.dropped/<relation>.<id>/  a dropped relation's WAL, until it is removed
    <data>/trace/<relation>/              the relation's trace (:class:`TraceLayout`)

Inside one relation's trace (:class:`TraceLayout`; names relative to the trace directory,
so the same names serve a directory and an object-store prefix)::

    state/<version>.json                  versioned trace state (lamina.trace.state)
    batches/<batch id>/part-00000.parquet parts of one batch, written by parallel tasks
    batches/<batch id>.scratch/...        a conversion's intermediate runs, until it is done
    pending/<part id>.parquet             future updates (lamina.trace.pending)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from lamina.errors import CorruptionError, QuarantinedError, RelationNotFoundError
from lamina.fs import FileSystem
from lamina.schema import RelationMeta, validate_name

META_NAME = "relation.json"
LOCK_NAME = "LOCK"
QUARANTINE_NAME = "QUARANTINED"


class TraceLayout:
    """Names inside one relation's trace, relative to its directory."""

    STATE = "state"
    BATCHES = "batches"
    PENDING = "pending"
    DATA_DIRS = (BATCHES, PENDING)
    """Directories of data files: what garbage collection and verify walk."""

    @staticmethod
    def batch_dir(batch_id: str) -> str:
        return f"{TraceLayout.BATCHES}/{batch_id}"

    @staticmethod
    def batch_part(batch_id: str, index: int) -> str:
        return f"{TraceLayout.BATCHES}/{batch_id}/part-{index:05d}.parquet"

    @staticmethod
    def scratch(batch_id: str) -> str:
        """A step's scratch directory (its runs), removed before its state is published."""
        return f"{TraceLayout.BATCHES}/{batch_id}.scratch"

    @staticmethod
    def pending_part(part_id: str) -> str:
        return f"{TraceLayout.PENDING}/{part_id}.parquet"


@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def wal(self) -> Path:
        return self.root / "wal"

    @property
    def trace(self) -> Path:
        return self.root / "trace"

    @property
    def dropped(self) -> Path:
        return self.wal / ".dropped"

    @property
    def compacter_lock(self) -> Path:
        return self.root / "compacter.lock"

    def wal_dir(self, name: str) -> Path:
        return self.wal / validate_name(name)

    def trace_dir(self, name: str) -> Path:
        return self.trace / validate_name(name)

    def meta_path(self, name: str) -> Path:
        return self.wal_dir(name) / META_NAME

    def lock_path(self, name: str) -> Path:
        return self.wal_dir(name) / LOCK_NAME

    def read_meta(self, name: str) -> RelationMeta:
        """The relation's ``relation.json``: RelationNotFoundError if there is none,
        CorruptionError if it does not parse or names another relation."""
        try:
            data = self.meta_path(name).read_bytes()
        except FileNotFoundError:
            raise RelationNotFoundError(
                f"relation {name!r} does not exist in {self.root}; existing: "
                f"{self.relation_names()}") from None
        return self.parse_meta(name, data)

    def parse_meta(self, name: str, data: bytes) -> RelationMeta:
        """``relation.json``'s bytes as read by a caller with its own I/O (the daemon
        reads them without blocking its loop); CorruptionError as in :meth:`read_meta`."""
        path = self.meta_path(name)
        meta = RelationMeta.from_json(data, path)
        if meta.name != name:
            raise CorruptionError(f"{META_NAME} names {meta.name!r}, not {name!r}", path=path)
        return meta

    def relation_names(self) -> list[str]:
        """Relations with a ``relation.json``, sorted."""
        try:
            entries = list(self.wal.iterdir())
        except FileNotFoundError:
            return []
        return sorted(p.name for p in entries
                      if not p.name.startswith(".") and (p / META_NAME).exists())

    def quarantine_reason(self, name: str) -> str | None:
        try:
            doc = json.loads((self.wal_dir(name) / QUARANTINE_NAME).read_bytes())
        except FileNotFoundError:
            return None
        except ValueError:
            return "unreadable quarantine marker"
        return str(doc.get("reason", "unknown"))

    def check_not_quarantined(self, name: str) -> None:
        reason = self.quarantine_reason(name)
        if reason is not None:
            raise QuarantinedError(
                f"relation {name!r} is quarantined: {reason}. Run 'lamina verify', repair or "
                f"restore the named file, then remove {self.wal_dir(name) / QUARANTINE_NAME}")

    def quarantine(self, name: str, reason: str, fs: FileSystem) -> None:
        """Mark a relation quarantined (idempotent; the first reason is kept)."""
        marker = self.wal_dir(name) / QUARANTINE_NAME
        if marker.exists() or not marker.parent.exists():
            return
        doc = {"reason": reason, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        fs.write_atomic(marker, json.dumps(doc).encode())
