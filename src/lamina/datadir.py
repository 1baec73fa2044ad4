"""A data directory's files, opened: :class:`DataDir` (where the traces live, the
relations' metadata, quarantine markers) and :class:`RelationFiles`, the one handle on a
relation's files that readers, ``lamina status`` and the public API share.

:mod:`lamina.layout` spells every name; this module reads and writes what those names
hold:

- ``<data>/trace.json`` (:class:`TraceLocation`), read until the location is fixed and
  then never again: a recorded URL never changes, and once traces exist under
  ``<data>/trace`` no other URL can be recorded (:meth:`DataDir.record_trace_url`). Before
  that, each call checks for it once (a relation with no trace yet may follow a URL the
  daemon records later).
- the traces' object store, opened once per :class:`DataDir` and URL (an ``s3://`` store
  keeps its HTTP client), and one child store per relation;
- ``relation.json`` (:class:`lamina.schema.RelationMeta`) and the quarantine marker. The
  marker is written only by the daemon (:meth:`DataDir.quarantine`); readers look at it
  and never write one, whatever they find (DESIGN.md section 2).

A :class:`RelationFiles` knows one relation's metadata, WAL directory and trace store, and
reads its frontiers (from the WAL), its newest trace state and its quarantine marker. It
replaces the ``(layout, meta)`` pairs that used to travel through the read path.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lamina.errors import ConfigError, CorruptionError, QuarantinedError, RelationNotFoundError
from lamina.layout import META_NAME, TRACE_LOCATION_NAME, Layout
from lamina.objstore.base import ObjectStore, open_store
from lamina.schema import RelationMeta, validate_name
from lamina.trace.state import StateStore, TraceState
from lamina.wal.reader import frontiers
from lamina.wal.segment import SegmentFile, list_segments

if TYPE_CHECKING:
    from lamina.fs import FileSystem
    from lamina.objstore.s3 import S3Settings

TRACE_LOCATION_FORMAT = 1

DEFAULT_LEASE_SECONDS = 60.0
"""How long a reader's lease lasts unless renewed (lamina.trace.lease); renewed every
third of it while the read runs."""


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


@dataclass(frozen=True, eq=False)
class DataDir(Layout):
    """A data directory opened by this process: its names (:class:`Layout`) and the I/O
    on them. ``s3``: explicit settings for an ``s3://`` trace (unset fields: the AWS
    environment); ``lease_seconds``: how long the leases of reads through it last."""

    s3: S3Settings | None = None
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    _cache: dict[str, object] = field(default_factory=dict, repr=False)
    """The fixed trace URL (``"url"``) and the opened root stores (by URL)."""

    # --- where the traces live ----------------------------------------------------------
    def trace_url(self) -> str:
        """Where this data directory's traces live (the module docstring)."""
        url = self._cache.get("url")
        if isinstance(url, str):
            return url
        path = self.trace_location_path
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            url = self.default_trace_url()
            if _holds_anything(self.trace):  # traces here: no other URL can be recorded
                self._cache["url"] = url
            return url
        url = TraceLocation.from_json(data, path).url
        self._cache["url"] = url
        return url

    def record_trace_url(self, url: str, fs: FileSystem) -> None:
        """Record ``url`` as the traces' location, once: a data directory whose traces
        already live elsewhere (a recorded URL, or traces under ``trace/``) refuses a
        different URL with :class:`ConfigError` and stays as it was. Relations without a
        trace yet (nothing converted) follow the new location."""
        url = url.rstrip("/")
        current = self.trace_url()
        if url == current:
            return
        if self.trace_location_path.exists():
            raise ConfigError(f"the traces of {self.root} live at {current}, not {url}; a "
                              "data directory keeps the trace location it was created with")
        if _holds_anything(self.trace):
            raise ConfigError(f"{self.root} already has traces at {current}; moving them to "
                              f"{url} is not supported (start a new data directory)")
        open_store(url, self.s3)  # a malformed URL fails here, before it is recorded
        fs.write_atomic(self.trace_location_path, TraceLocation(url).to_json())
        self._cache["url"] = url

    def trace_root(self, fs: FileSystem | None = None) -> ObjectStore:
        """The object store under which every relation's trace lives (``fs``: the local
        fault seam, a fresh store; without it, one store per URL, kept)."""
        url = self.trace_url()
        if fs is not None:
            return open_store(url, self.s3, fs=fs)
        store = self._cache.get(f"store:{url}")
        if not isinstance(store, ObjectStore):
            store = self._cache[f"store:{url}"] = open_store(url, self.s3)
        return store

    def trace_store(self, name: str, fs: FileSystem | None = None) -> ObjectStore:
        """The object store of relation ``name``'s trace (``fs``: the local fault seam)."""
        return self.trace_root(fs).child(validate_name(name))

    # --- relations ----------------------------------------------------------------------
    def relation_names(self) -> list[str]:
        """Relations with a ``relation.json``, sorted."""
        try:
            entries = list(self.wal.iterdir())
        except FileNotFoundError:
            return []
        return sorted(p.name for p in entries
                      if not p.name.startswith(".") and (p / META_NAME).exists())

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

    def relation(self, name: str) -> RelationFiles:
        """The files of relation ``name`` (reads its ``relation.json``)."""
        return RelationFiles(self, self.read_meta(name))

    # --- quarantine -----------------------------------------------------------------------
    def quarantine_reason(self, name: str) -> str | None:
        try:
            doc = json.loads(self.quarantine_path(name).read_bytes())
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
                f"restore the named file, then remove {self.quarantine_path(name)}")

    def quarantine(self, name: str, reason: str, fs: FileSystem) -> None:
        """Mark a relation quarantined (idempotent; the first reason is kept). The daemon
        and a writer that finds its own log damaged call this; readers never do."""
        marker = self.quarantine_path(name)
        if marker.exists() or not marker.parent.exists():
            return
        doc = {"reason": reason, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        try:
            fs.write_atomic(marker, json.dumps(doc).encode())
        except FileNotFoundError:
            if marker.parent.exists():
                raise
            # dropped meanwhile (its WAL directory renamed into wal/.dropped/): nothing is
            # left to mark


def _holds_anything(directory: Path) -> bool:
    try:
        return any(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return False


class RelationFiles:
    """One relation's files: its metadata, WAL directory and trace store (kept once the
    trace location is fixed), its frontiers, newest trace state and quarantine marker."""

    def __init__(self, datadir: DataDir, meta: RelationMeta) -> None:
        self.datadir = datadir
        self.meta = meta
        self._trace: tuple[str, ObjectStore] | None = None

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def wal_dir(self) -> Path:
        return self.datadir.wal_dir(self.name)

    @property
    def lease_seconds(self) -> float:
        return self.datadir.lease_seconds

    @property
    def trace(self) -> ObjectStore:
        """The relation's trace store."""
        url = self.datadir.trace_url()
        if self._trace is None or self._trace[0] != url:
            self._trace = (url, self.datadir.trace_store(self.name))
        return self._trace[1]

    def segments(self) -> list[SegmentFile]:
        """The WAL segments, in order."""
        return list_segments(self.wal_dir)

    def frontiers(self) -> tuple[int, int]:
        """``(upper, since)`` as the WAL says (lamina.wal.reader.frontiers)."""
        return frontiers(self.wal_dir, self.name)

    def state(self) -> TraceState | None:
        """The newest trace state of this incarnation of the relation, if any (no lease:
        for status and tools; readers pin one through :func:`lamina.read.view.pin`)."""
        state = StateStore(self.trace).load_latest()
        return self.own(state)

    def own(self, state: TraceState | None) -> TraceState | None:
        """``state`` if it belongs to this incarnation (a trace left by a dropped relation
        of the same name is not this one's)."""
        if state is None or state.relation_id != self.meta.relation_id:
            return None
        return state

    def quarantine_reason(self) -> str | None:
        return self.datadir.quarantine_reason(self.name)

    def check_not_quarantined(self) -> None:
        self.datadir.check_not_quarantined(self.name)
