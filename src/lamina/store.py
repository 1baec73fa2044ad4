"""The public API: :class:`Store` and :class:`Relation` (README, Using it).

A Store is a data directory. Relations are created with a schema and key columns; a
:class:`Relation` handle writes through a :class:`~lamina.wal.log.WalWriter`, taken on the
first write (so that processes that only read, such as ``lamina snapshot``, never contend
for the writer lock), and reads through :mod:`lamina.read`, which combines the trace, its
pending area and the WAL segments not yet converted into one consistent view.

Every call validates its arguments before touching the disk: a rejected call changes
nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from lamina.errors import (
    CorruptionError,
    InvalidArgumentError,
    RelationExistsError,
    RelationNotFoundError,
)
from lamina.fs import FileSystem
from lamina.layout import LOCK_NAME, META_NAME, Layout
from lamina.read import snapshot
from lamina.schema import RelationMeta, check_diffs, conform_updates, validate_name
from lamina.wal.log import FSYNC_POLICIES, FsyncPolicy, WalWriter
from lamina.wal.reader import frontiers
from lamina.wal.segment import encode_header, opening_records, segment_name

if TYPE_CHECKING:
    from lamina.lookup import KeyIndex
    from lamina.objstore.s3 import S3Settings
    from lamina.subscribe import Progress



class Store:
    """A lamina data directory: ``wal/`` for the logs, the traces under ``trace/`` or at
    the URL the directory records (:meth:`lamina.layout.Layout.trace_url`)."""

    def __init__(self, root: Path, *, segment_bytes: int, segment_max_age_seconds: float,
                 fsync: FsyncPolicy, fsync_interval: float, fs: FileSystem,
                 s3: S3Settings | None = None) -> None:
        self.layout = Layout(root, s3=s3)
        self.segment_bytes = segment_bytes
        self.segment_max_age_seconds = segment_max_age_seconds
        self.fsync: FsyncPolicy = fsync
        self.fsync_interval = fsync_interval
        self.fs = fs
        self._relations: dict[str, Relation] = {}
        self._mu = threading.Lock()
        self._closed = False

    @classmethod
    def open(cls, path: str | os.PathLike[str] = "lamina-data", *,
             segment_bytes: int = 64 << 20, segment_max_age_seconds: float = 60.0,
             fsync: FsyncPolicy = "always", fsync_interval: float = 0.1,
             fs: FileSystem | None = None, trace_url: str | None = None,
             s3: S3Settings | None = None) -> Store:
        """Open (creating if needed) the data directory at ``path``.

        A WAL segment finishes (and becomes work for the compacter) at a seal once it has
        passed ``segment_bytes``, or once it is older than ``segment_max_age_seconds`` and
        holds an update or an advanced upper; closing the store finishes every open
        segment that holds either. Smaller targets mean more, smaller segments (the
        compacter converts many in one job) and a trace that keeps closer to the upper.

        ``trace_url`` (``file:///abs/dir`` or ``s3://bucket/prefix``) records where the
        compacter keeps this directory's traces, once: a directory created without one keeps
        them under ``trace/``, and a different URL later is a :class:`ConfigError` that
        changes nothing. ``s3``: explicit settings for reading an ``s3://`` trace (unset
        fields come from the standard AWS environment)."""
        if fsync not in FSYNC_POLICIES:
            raise InvalidArgumentError(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        if not isinstance(segment_bytes, int) or segment_bytes < 4096:
            raise InvalidArgumentError(f"segment_bytes must be an int >= 4096, got "
                                       f"{segment_bytes!r}")
        if isinstance(segment_max_age_seconds, bool) or not (
                isinstance(segment_max_age_seconds, int | float) and segment_max_age_seconds > 0):
            raise InvalidArgumentError(f"segment_max_age_seconds must be a number > 0, got "
                                       f"{segment_max_age_seconds!r}")
        if not fsync_interval > 0:
            raise InvalidArgumentError(f"fsync_interval must be > 0, got {fsync_interval!r}")
        root = Path(path)
        fs = fs or FileSystem()
        if root.exists() and not root.is_dir():
            raise InvalidArgumentError(f"{root} exists and is not a directory")
        if trace_url is not None:  # a malformed URL is refused before anything is created
            from lamina.objstore.base import open_store

            open_store(trace_url.rstrip("/"), s3)
        store = cls(root, segment_bytes=segment_bytes,
                    segment_max_age_seconds=float(segment_max_age_seconds), fsync=fsync,
                    fsync_interval=fsync_interval, fs=fs, s3=s3)
        fs.makedirs(store.layout.wal)
        if trace_url is not None:
            store.layout.record_trace_url(trace_url, fs)
        if store.layout.trace_url() == store.layout.default_trace_url():
            fs.makedirs(store.layout.trace)
        return store

    # --- relations ------------------------------------------------------------------------
    def create_relation(self, name: str, schema: pa.Schema,
                        key: list[str] | tuple[str, ...] | None = None) -> Relation:
        """Create a relation; its directory appears whole or not at all."""
        self._check_open()
        meta = RelationMeta.new(name, schema, key)
        final = self.layout.wal_dir(name)
        if final.exists():
            raise RelationExistsError(f"relation {name!r} already exists; open it with "
                                      "store.relation(name) or drop it first")
        staging = self.layout.wal / f".create-{name}-{uuid.uuid4().hex[:8]}"
        self.fs.makedirs(staging)
        try:
            self.fs.write_atomic(staging / META_NAME, meta.to_json())
            self.fs.write_atomic(staging / LOCK_NAME, b"")  # so taking the lock adds no file
            first = staging / segment_name(1, finished=False)
            handle = self.fs.open_append(first, create=True)
            try:
                handle.write(encode_header(name, 1) + opening_records(0, 0))
                handle.sync()
            finally:
                handle.close()
            self.fs.fsync_dir(staging)
            try:
                self.fs.rename(staging, final)
            except OSError as exc:  # a racing creator won
                raise RelationExistsError(f"relation {name!r} already exists") from exc
        except BaseException:
            self.fs.rmtree(staging)
            raise
        return self.relation(name)

    def relation(self, name: str) -> Relation:
        """A handle on an existing relation."""
        self._check_open()
        validate_name(name)
        with self._mu:
            rel = self._relations.get(name)
            if rel is not None and not rel.dropped:
                return rel
            meta = self.layout.read_meta(name)
            self.layout.check_not_quarantined(name)
            rel = Relation(self, meta)
            self._relations[name] = rel
            return rel

    def relations(self) -> list[str]:
        return self.layout.relation_names()

    def drop_relation(self, name: str) -> None:
        """Remove a relation: its WAL leaves the namespace atomically; the compacter removes
        its trace. The name can be created again at once."""
        rel = self.relation(name)
        writer = rel._writer_or_open()
        dropped = self.layout.dropped / f"{name}.{rel.meta.relation_id}"
        self.fs.makedirs(self.layout.dropped)
        try:
            writer.close()
            self.fs.rename(self.layout.wal_dir(name), dropped)
        finally:
            rel.dropped = True
            with self._mu:
                self._relations.pop(name, None)
        self.fs.rmtree(dropped)

    # --- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        with self._mu:
            rels = list(self._relations.values())
            self._relations.clear()
            self._closed = True
        for rel in rels:
            rel._close()

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError("the store is closed")

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class Relation:
    """A named collection of updates. Obtain through :class:`Store`."""

    def __init__(self, store: Store, meta: RelationMeta) -> None:
        self.store = store
        self.meta = meta
        self.dropped = False
        self._writer: WalWriter | None = None
        self._mu = threading.Lock()
        self._key_index: KeyIndex | None = None  # part footers kept between lookups

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def schema(self) -> pa.Schema:
        return self.meta.schema

    @property
    def key(self) -> tuple[str, ...]:
        return self.meta.key

    @property
    def wal_dir(self) -> Path:
        return self.store.layout.wal_dir(self.name)

    def _check_usable(self) -> None:
        self.store._check_open()
        if self.dropped:
            raise RelationNotFoundError(f"relation {self.name!r} was dropped")

    def _writer_or_open(self) -> WalWriter:
        self._check_usable()
        with self._mu:
            if self._writer is None:
                self.store.layout.check_not_quarantined(self.name)
                with self._quarantine_on_corruption():
                    self._writer = WalWriter(self.wal_dir, self.name, fs=self.store.fs,
                                             fsync=self.store.fsync,
                                             segment_bytes=self.store.segment_bytes,
                                             segment_max_age=self.store.segment_max_age_seconds,
                                             fsync_interval=self.store.fsync_interval)
            return self._writer

    @contextlib.contextmanager
    def _quarantine_on_corruption(self) -> Iterator[None]:
        """Corruption found by this process quarantines the relation (docs/architecture.md, torn
        tail vs corruption): the
        marker stops the compacter and other writers until an operator repairs it."""
        try:
            yield
        except CorruptionError as exc:
            self.store.layout.quarantine(self.name, str(exc), self.store.fs)
            raise

    def append(self, updates: pa.Table | pa.RecordBatch) -> None:
        """Append updates (row columns + ``_time`` + ``_diff``); durable on return."""
        table = check_diffs(self.meta, conform_updates(self.meta, updates))
        self._writer_or_open().append(table)

    def seal(self, upper: int) -> None:
        """Promise that no update at a time below ``upper`` will arrive."""
        self._writer_or_open().seal(upper)

    def allow_compaction(self, since: int) -> None:
        """Allow history before ``since`` to be read as ``since``."""
        self._writer_or_open().allow_compaction(since)

    @property
    def upper(self) -> int:
        return self._frontiers()[0]

    @property
    def since(self) -> int:
        return self._frontiers()[1]

    def _frontiers(self) -> tuple[int, int]:
        self._check_usable()
        if self._writer is not None:
            return self._writer.upper, self._writer.since
        with self._quarantine_on_corruption():
            return frontiers(self.wal_dir, self.name)

    def snapshot(self, as_of: int) -> pa.Table:
        """The consolidated rows at ``as_of`` with their ``_diff``, ordered by key."""
        upper, since = self._frontiers()
        with self._quarantine_on_corruption():
            return snapshot(self.store.layout, self.meta, as_of, upper=upper, since=since)

    def snapshot_reader(self, as_of: int) -> pa.RecordBatchReader:
        """The rows of :meth:`snapshot` as a stream of record batches in key order, read in
        bounded memory (lamina.stream); ``duckdb.from_arrow(reader)`` and
        ``polars.from_arrow(reader)`` take it as it is (docs/reading.md)."""
        from lamina.stream import snapshot_batches

        upper, since = self._frontiers()
        with self._quarantine_on_corruption():
            return snapshot_batches(self.store.layout, self.meta, as_of, upper=upper,
                                    since=since)

    def lookup(self, keys: pa.Table | Mapping[str, Any], as_of: int) -> pa.Table:
        """The consolidated rows at ``as_of`` whose key columns equal one of ``keys`` (a
        table of the key columns, or a mapping ``pa.table()`` accepts), ordered like a
        snapshot; reads only the row groups whose key range can hold them
        (lamina.lookup)."""
        from lamina.lookup import KeyIndex, lookup

        upper, since = self._frontiers()
        if self._key_index is None:
            self._key_index = KeyIndex()
        with self._quarantine_on_corruption():
            return lookup(self.store.layout, self.meta, keys, as_of, upper=upper,
                          since=since, index=self._key_index)

    def subscribe(self, as_of: int, *, snapshot: bool = True,
                  stop: threading.Event | None = None,
                  max_wait: float = 0.05) -> Iterator[pa.Table | Progress]:
        """The snapshot at ``as_of`` (unless ``snapshot=False``: the caller already holds
        it), then each newly sealed interval's consolidated updates, each followed by a
        :class:`lamina.Progress`; ends after ``Progress(CLOSED)`` or once ``stop`` is set.
        Resume after ``Progress(u)`` with ``subscribe(u - 1, snapshot=False)``
        (lamina.subscribe)."""
        from lamina.subscribe import subscribe

        self._check_usable()
        return subscribe(self.store.layout, self.meta, as_of, snapshot=snapshot, stop=stop,
                         max_wait=max_wait)

    def close(self) -> None:
        """Release the writer, finishing an open segment that holds something to convert.
        The handle stays usable: a later write takes the writer again."""
        self._close()

    def _close(self) -> None:
        with self._mu:
            if self._writer is not None:
                self._writer.close(finish=True)
                self._writer = None

