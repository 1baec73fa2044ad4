"""Where things live in a data directory::

    <data>/compacter.lock                 flock of the one compacter (DESIGN §7 rule 7)
    <data>/wal/<relation>/relation.json   RelationMeta, written once
    <data>/wal/<relation>/LOCK            flock of the one writer
    <data>/wal/<relation>/QUARANTINED     present when corruption was found (JSON reason)
    <data>/wal/<relation>/*.wal[.open]    segments (lamina.wal.segment)
    <data>/wal/.dropped/<relation>.<id>/  a dropped relation's WAL, until it is removed
    <data>/trace/<relation>/              trace state, batches and pending area (lamina.trace)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from lamina.errors import QuarantinedError
from lamina.fs import FileSystem
from lamina.schema import validate_name

QUARANTINE_NAME = "QUARANTINED"


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

    def relation_names(self) -> list[str]:
        """Relations with a ``relation.json``, sorted."""
        try:
            entries = list(self.wal.iterdir())
        except FileNotFoundError:
            return []
        return sorted(p.name for p in entries
                      if not p.name.startswith(".") and (p / "relation.json").exists())

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
