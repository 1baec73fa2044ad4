"""Where things live: every file name of a data directory and of a trace is spelled here.

A data directory (:class:`Layout`)::

    <data>/compacter.lock                 flock of the one compacter (docs/architecture.md)
    <data>/wal/<relation>/relation.json   RelationMeta, written once
    <data>/wal/<relation>/LOCK            flock of the one writer
    <data>/wal/<relation>/QUARANTINED     present when corruption was found (JSON reason)
    <data>/wal/<relation>/*.wal[.open]    segments (names: lamina.wal.segment)
    <data>/wal/.dropped/<relation>.<id>/  a dropped relation's WAL, until it is removed
    <data>/trace/<relation>/              the relation's trace (:class:`TraceLayout`)
    <data>/trace.json                     TraceLocation: where the traces live, when not
                                          under <data>/trace (an ``s3://`` URL)

The traces of a data directory live under one URL (:meth:`Layout.trace_url`): by default
``file://<data>/trace``; ``Store.open(path, trace_url=...)`` records another in
``trace.json`` once, and everything that opens the data directory (the daemon, readers,
``lamina verify``) then finds its traces there: one relation's trace is the object store
``<trace url>/<relation>`` (:meth:`Layout.trace_store`).

Inside one relation's trace (:class:`TraceLayout`; names relative to the trace directory,
so the same names serve a directory and an object-store prefix)::

    state/<version>.json                  versioned trace state (lamina.trace.state)
    batches/<batch id>/part-00000.parquet parts of one batch, written by parallel tasks
    batches/<batch id>.scratch/...        a conversion's intermediate runs, until it is done
    pending/<part id>.parquet             future updates (lamina.trace.pending)
    staging/<segment seq>.wal             a finished WAL segment staged for decode tasks
                                          on other machines (lamina.trace.staging)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lamina.errors import ConfigError, CorruptionError, QuarantinedError, RelationNotFoundError
from lamina.fs import FileSystem
from lamina.schema import RelationMeta, validate_name

if TYPE_CHECKING:
    from lamina.objstore.base import ObjectStore
    from lamina.objstore.s3 import S3Settings

META_NAME = "relation.json"
LOCK_NAME = "LOCK"
QUARANTINE_NAME = "QUARANTINED"
TRACE_LOCATION_NAME = "trace.json"
TRACE_LOCATION_FORMAT = 1


@dataclass(frozen=True)
class TraceLocation:
    """``<data>/trace.json``: ``{"format_version": 1, "url": "s3://bucket/prefix"}``."""

    url: str
    format_version: int = TRACE_LOCATION_FORMAT

    def to_json(self) -> bytes:
        return json.dumps({"format_version": self.format_version, "url": self.url},
                          indent=1).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, path: Path) -> TraceLocation:
        try:
            doc = json.loads(data)
            version, url = int(doc["format_version"]), doc["url"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptionError(f"{TRACE_LOCATION_NAME} is unreadable: {exc!r}",
                                  path=path) from exc
        if version != TRACE_LOCATION_FORMAT or not isinstance(url, str) or not url:
            raise CorruptionError(f"{TRACE_LOCATION_NAME} has format version {version} and "
                                  f"url {url!r}; this lamina reads version "
                                  f"{TRACE_LOCATION_FORMAT} with a URL", path=path)
        return cls(url=url, format_version=version)


class TraceLayout:
    """Names inside one relation's trace, relative to its directory."""

    STATE = "state"
    BATCHES = "batches"
    PENDING = "pending"
    STAGING = "staging"
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
    def staged_segment(seq: int) -> str:
        return f"{TraceLayout.STAGING}/{seq:020d}.wal"

    @staticmethod
    def pending_part(part_id: str) -> str:
        return f"{TraceLayout.PENDING}/{part_id}.parquet"


@dataclass(frozen=True)
class Layout:
    root: Path
    s3: S3Settings | None = None
    """Explicit S3 settings for an ``s3://`` trace (unset fields: the AWS environment)."""

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
        """The local directory of a ``file://`` trace under ``<data>/trace`` (tests and
        tools that inspect files; everything else uses :meth:`trace_store`)."""
        return self.trace / validate_name(name)

    @property
    def trace_location_path(self) -> Path:
        return self.root / TRACE_LOCATION_NAME

    def default_trace_url(self) -> str:
        return self.trace.absolute().as_uri()

    def trace_url(self) -> str:
        """Where this data directory's traces live (the module docstring)."""
        path = self.trace_location_path
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return self.default_trace_url()
        return TraceLocation.from_json(data, path).url

    def record_trace_url(self, url: str, fs: FileSystem) -> None:
        """Record ``url`` as the traces' location, once: a data directory whose traces
        already live elsewhere (a recorded URL, or traces under ``trace/``) refuses a
        different URL with :class:`ConfigError` and stays as it was. Relations without a
        trace yet (nothing converted) follow the new location."""
        from lamina.objstore.base import open_store

        url = url.rstrip("/")
        current = self.trace_url()
        if url == current:
            return
        if self.trace_location_path.exists():
            raise ConfigError(f"the traces of {self.root} live at {current}, not {url}; a "
                              "data directory keeps the trace location it was created with")
        if self.trace.is_dir() and any(self.trace.iterdir()):
            raise ConfigError(f"{self.root} already has traces at {current}; moving them to "
                              f"{url} is not supported (start a new data directory)")
        open_store(url, self.s3)  # a malformed URL fails here, before it is recorded
        fs.write_atomic(self.trace_location_path, TraceLocation(url).to_json())

    def trace_store(self, name: str, fs: FileSystem | None = None) -> ObjectStore:
        """The object store of relation ``name``'s trace (``fs``: the local fault seam)."""
        from lamina.objstore.base import open_store

        return open_store(self.trace_url(), self.s3, fs=fs).child(validate_name(name))

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
