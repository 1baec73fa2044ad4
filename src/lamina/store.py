"""The public API: :class:`Store` and :class:`Relation` (README, Using it).

A Store is a data directory. Relations are created with a schema and key columns; a
:class:`Relation` handle writes through a :class:`~lamina.wal.log.WalWriter`, taken on the
first write (so that processes that only read, such as ``lamina snapshot``, never contend
for the writer lock), and reads through :mod:`lamina.read` (its docstring is the read
contract), which combines the trace, its pending area and the WAL segments not yet
converted into one consistent view, over the relation's files
(:class:`lamina.datadir.RelationFiles`).

Every call validates its arguments before touching the disk: a rejected call changes
nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Iterator, Mapping
from datetime import datetime
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from lamina.datadir import DEFAULT_LEASE_SECONDS, DataDir, RelationFiles
from lamina.errors import (
    ConfigError,
    CorruptionError,
    InvalidArgumentError,
    RelationExistsError,
    RelationNotFoundError,
    StorageError,
)
from lamina.frontier import frontier_arg
from lamina.fs import FileSystem
from lamina.layout import LOCK_NAME, META_NAME
from lamina.read.snapshot import snapshot
from lamina.schema import RelationMeta, check_diffs, checked_updates, validate_name
from lamina.wal.log import FSYNC_POLICIES, FsyncPolicy, WalWriter
from lamina.wal.record import COMPRESSIONS, DEFAULT_COMPRESSION, Compression
from lamina.wal.segment import encode_header, opening_records, segment_name, version_for
from lamina.wal.throttle import DEFAULT_TIMEOUT as DEFAULT_BACKLOG_TIMEOUT
from lamina.wal.throttle import BacklogGate

if TYPE_CHECKING:
    from lamina.objstore.s3 import S3Settings
    from lamina.read.lookup import KeyIndex
    from lamina.read.subscribe import Progress



class Store:
    """A lamina data directory: ``wal/`` for the logs, the traces under ``trace/`` or at
    the URL the directory records (:meth:`lamina.datadir.DataDir.trace_url`)."""

    def __init__(self, root: Path, *, segment_bytes: int, segment_max_age_seconds: float,
                 fsync: FsyncPolicy, fsync_interval: float, fs: FileSystem,
                 s3: S3Settings | None = None, read_only: bool = False,
                 wal_compression: Compression = DEFAULT_COMPRESSION,
                 lease_seconds: float = DEFAULT_LEASE_SECONDS,
                 wal_backlog_bytes: int | None = None,
                 wal_backlog_timeout: float = DEFAULT_BACKLOG_TIMEOUT) -> None:
        self.layout = DataDir(root, s3=s3, lease_seconds=lease_seconds)
        self.read_only = read_only
        self.wal_compression: Compression = wal_compression
        self.wal_backlog_bytes = wal_backlog_bytes
        self.wal_backlog_timeout = wal_backlog_timeout
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
             s3: S3Settings | None = None, read_only: bool = False,
             wal_compression: Compression = DEFAULT_COMPRESSION,
             lease_seconds: float = DEFAULT_LEASE_SECONDS,
             wal_backlog_bytes: int | None = None,
             wal_backlog_timeout: float = DEFAULT_BACKLOG_TIMEOUT) -> Store:
        """Open (creating if needed) the data directory at ``path``.

        ``read_only=True`` opens an existing data directory for reading: it creates nothing,
        refuses a path that is not a data directory (InvalidArgumentError, one line), and
        every write through it (create, drop, append, seal, allow_compaction) is refused
        with InvalidArgumentError.

        A WAL segment finishes (and becomes work for the compacter) at a seal once it has
        passed ``segment_bytes``, or once it is older than ``segment_max_age_seconds`` and
        holds an update or an advanced upper; closing the store finishes every open
        segment that holds either. Smaller targets mean more, smaller segments (the
        compacter converts many in one job) and a trace that keeps closer to the upper.

        ``trace_url`` (``file:///abs/dir`` or ``s3://bucket/prefix``) records where the
        compacter keeps this directory's traces, once: a directory created without one keeps
        them under ``trace/``, and a different URL later is a :class:`ConfigError` that
        changes nothing. An ``s3://`` URL is probed before it is recorded (a conditional
        create must be refused the second time: lamina.objstore.probe): a store that cannot
        be reached or does not honour conditional puts is refused with ConfigError and
        nothing is created or recorded. ``s3``: explicit settings for an ``s3://`` trace
        (unset fields come from the standard AWS environment).

        ``wal_compression`` ("none", "lz4" or "zstd"): how appends write their updates'
        buffers into the WAL (lamina.wal.record; docs/performance.md has what each costs
        an append and saves on disk). Every reader reads every setting, so it may change
        from one open to the next. ``lease_seconds``: how long a read's lease on its trace
        files outlives this process if it dies (renewed while it lives; docs/reading.md,
        "Leases").

        ``wal_backlog_bytes``: a bound on each relation's WAL backlog, the finished segments
        the compacter has not converted yet (None, the default: no bound). An ``append``
        waits while its relation's backlog is above it, so a coordinator that outruns the
        compacter fills its disk up to about the bound plus ``segment_bytes``, not with the
        whole stream; when the backlog has not shrunk for ``wal_backlog_timeout`` seconds
        the append raises BacklogTimeoutError and writes nothing (lamina.wal.throttle;
        docs/operations.md, "Disk")."""
        if fsync not in FSYNC_POLICIES:
            raise InvalidArgumentError(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        if not isinstance(segment_bytes, int) or segment_bytes < 4096:
            raise InvalidArgumentError(f"segment_bytes must be an int >= 4096, got "
                                       f"{segment_bytes!r}")
        if not (_is_number(segment_max_age_seconds) and segment_max_age_seconds > 0):
            raise InvalidArgumentError(f"segment_max_age_seconds must be a number > 0, got "
                                       f"{segment_max_age_seconds!r}")
        if not fsync_interval > 0:
            raise InvalidArgumentError(f"fsync_interval must be > 0, got {fsync_interval!r}")
        if wal_compression not in COMPRESSIONS:
            raise InvalidArgumentError(f"wal_compression must be one of {COMPRESSIONS}, got "
                                       f"{wal_compression!r}")
        if not (_is_number(lease_seconds) and 1 <= lease_seconds <= 86400):
            raise InvalidArgumentError(f"lease_seconds must be a number of seconds in "
                                       f"[1, 86400], got {lease_seconds!r}")
        if wal_backlog_bytes is not None and not (
                _is_number(wal_backlog_bytes) and isinstance(wal_backlog_bytes, int)
                and wal_backlog_bytes >= 1):
            raise InvalidArgumentError(f"wal_backlog_bytes must be None or an int >= 1, got "
                                       f"{wal_backlog_bytes!r}")
        if not (_is_number(wal_backlog_timeout) and wal_backlog_timeout > 0):
            raise InvalidArgumentError(f"wal_backlog_timeout must be a number of seconds > 0, "
                                       f"got {wal_backlog_timeout!r}")
        root = Path(path)
        fs = fs or FileSystem()
        if root.exists() and not root.is_dir():
            raise InvalidArgumentError(f"{root} exists and is not a directory")
        store = cls(root, segment_bytes=segment_bytes,
                    segment_max_age_seconds=float(segment_max_age_seconds), fsync=fsync,
                    fsync_interval=fsync_interval, fs=fs, s3=s3, read_only=read_only,
                    wal_compression=wal_compression, lease_seconds=float(lease_seconds),
                    wal_backlog_bytes=wal_backlog_bytes,
                    wal_backlog_timeout=float(wal_backlog_timeout))
        if read_only:
            if trace_url is not None:
                raise InvalidArgumentError("a read-only store cannot record a trace_url; "
                                           "open it writable once to record one")
            if not store.layout.wal.is_dir():
                raise InvalidArgumentError(f"{root} is not a lamina data directory (no wal/ "
                                           "inside); nothing was created")
            return store
        if trace_url is not None:  # refused before anything is created
            _probe_trace_url(store.layout, trace_url.rstrip("/"))
        fs.makedirs(store.layout.wal)
        if trace_url is not None:
            store.layout.record_trace_url(trace_url, fs)
        if store.layout.trace_url() == store.layout.default_trace_url():
            fs.makedirs(store.layout.trace)
        return store

    # --- relations ------------------------------------------------------------------------
    def create_relation(self, name: str, schema: pa.Schema,
                        key: list[str] | tuple[str, ...] | None = None, *,
                        time_unit: str | None = None) -> Relation:
        """Create a relation; its directory appears whole or not at all. ``time_unit``:
        ``"ms"`` if its times are milliseconds since the Unix epoch (every time argument
        then also takes a timezone-aware datetime), None for plain integers."""
        self._check_writable("create_relation")
        meta = RelationMeta.new(name, schema, key, time_unit)
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
                handle.write(encode_header(name, 1, version_for(self.wal_compression))
                             + opening_records(0, 0))
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
            files = self.layout.relation(name)
            files.check_not_quarantined()
            rel = Relation(self, files)
            self._relations[name] = rel
            return rel

    def relations(self) -> list[str]:
        return self.layout.relation_names()

    def drop_relation(self, name: str) -> None:
        """Remove a relation: its WAL leaves the namespace atomically; the compacter removes
        its trace. The name can be created again at once."""
        rel = self.relation(name)
        writer = rel._writer_or_open("drop_relation")
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

    def _check_writable(self, what: str) -> None:
        self._check_open()
        if self.read_only:
            raise InvalidArgumentError(f"{what} refused: the store {self.layout.root} was "
                                       "opened read-only (Store.open(path) opens it for "
                                       "writing); nothing was written")

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _probe_trace_url(layout: DataDir, url: str) -> None:
    """Refuse ``url`` (ConfigError) unless it is already this directory's trace location or
    its store answers the conditional-put probe: a bucket nobody checked is never recorded."""
    from lamina.objstore.base import open_store
    from lamina.objstore.probe import check_conditional_put

    root = open_store(url, layout.s3)  # a malformed URL is refused here
    if url.startswith("file:") or url == layout.trace_url():
        return
    try:
        check_conditional_put(root)
    except StorageError as exc:
        raise ConfigError(f"trace_url {url} was not recorded: the store could not be "
                          f"checked ({exc}); nothing was created") from None
    except ConfigError as exc:
        raise ConfigError(f"trace_url {url} was not recorded: {exc}") from None


def _is_number(value: object) -> bool:
    """An int or a float, and not a bool (which Python counts as an int)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


class Relation:
    """A named collection of updates. Obtain through :class:`Store`."""

    def __init__(self, store: Store, files: RelationFiles) -> None:
        self.store = store
        self.files = files
        self.meta = files.meta
        self.dropped = False
        self._writer: WalWriter | None = None
        self._gate: BacklogGate | None = None  # with a wal_backlog_bytes bound
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
        return self.files.wal_dir

    def _check_usable(self) -> None:
        self.store._check_open()
        if self.dropped:
            raise RelationNotFoundError(f"relation {self.name!r} was dropped")

    def _writer_or_open(self, what: str) -> WalWriter:
        self._check_usable()
        self.store._check_writable(what)
        with self._mu:
            if self._writer is None:
                self.store.layout.check_not_quarantined(self.name)
                with self._quarantine_on_corruption():
                    self._writer = WalWriter(self.wal_dir, self.name, fs=self.store.fs,
                                             fsync=self.store.fsync,
                                             segment_bytes=self.store.segment_bytes,
                                             segment_max_age=self.store.segment_max_age_seconds,
                                             fsync_interval=self.store.fsync_interval,
                                             compression=self.store.wal_compression,
                                             update_schema=self.meta.update_schema)
                if self.store.wal_backlog_bytes is not None:
                    self._gate = BacklogGate(self.name, self.wal_dir,
                                             self.store.wal_backlog_bytes,
                                             self.store.wal_backlog_timeout,
                                             self._converted_through)
            return self._writer

    @property
    def wal_backlog_wait_seconds(self) -> float:
        """Seconds this handle's appends have waited for the WAL backlog to shrink below
        ``wal_backlog_bytes`` (0.0 without a bound): what the bound has cost so far."""
        return 0.0 if self._gate is None else self._gate.waited_seconds

    def _converted_through(self) -> int:
        state = self.files.state()
        return 0 if state is None else state.converted_through

    @contextlib.contextmanager
    def _quarantine_on_corruption(self) -> Iterator[None]:
        """Corruption found by this relation's writer in its own log quarantines the
        relation (docs/architecture.md, torn tail vs corruption): the marker stops the
        compacter and other writers until an operator repairs it. Reads never do this:
        they raise CorruptionError and write nothing."""
        try:
            yield
        except CorruptionError as exc:
            self.store.layout.quarantine(self.name, str(exc), self.store.fs)
            raise

    def append(self, updates: Any) -> None:
        """Append updates (row columns + ``_time`` + ``_diff``); durable on return.

        ``updates``: a ``pa.Table`` or ``pa.RecordBatch``, anything exporting the Arrow C
        stream (``__arrow_c_stream__``: a polars DataFrame, a DuckDB relation, a
        ``pa.RecordBatchReader``) or a pandas DataFrame (lamina.schema.to_table). A
        rejected input raises SchemaError naming what was wrong and writes nothing.

        With ``Store.open(wal_backlog_bytes=...)`` it first waits while the relation's WAL
        backlog is above that bound (lamina.wal.throttle); BacklogTimeoutError, writing
        nothing, when the backlog has not shrunk for ``wal_backlog_timeout`` seconds."""
        # as it is where it only lacks the non-null flags, which the writer's records
        # declare (lamina.schema.checked_updates); the diffs are checked while the record
        # is on its way to the disk (lamina.wal.log)
        table = checked_updates(self.meta, updates)
        writer = self._writer_or_open("append")
        if self._gate is not None:
            self._gate.wait(writer.seq)
        writer.append(table, partial(check_diffs, self.meta))

    def seal(self, upper: int | datetime) -> None:
        """Promise that no update at a time below ``upper`` will arrive (a datetime where
        the relation counts milliseconds: lamina.frontier)."""
        upper = frontier_arg(upper, self.meta.time_unit, "upper")
        self._writer_or_open("seal").seal(upper)

    def allow_compaction(self, since: int | datetime) -> None:
        """Allow history before ``since`` to be read as ``since``."""
        since = frontier_arg(since, self.meta.time_unit, "since")
        self._writer_or_open("allow_compaction").allow_compaction(since)

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
        return self.files.frontiers()

    # --- reads (lamina.read: the read contract) ---------------------------------------------
    # ``as_of`` omitted is the latest readable time, upper - 1; a datetime where the relation
    # counts milliseconds. Reads never write to the data directory but their lease.

    def snapshot(self, as_of: int | datetime | None = None) -> pa.Table:
        """The consolidated rows at ``as_of`` (default: the latest readable time) with
        their ``_diff``, ordered by key."""
        upper, since = self._frontiers()
        return snapshot(self.files, as_of, upper=upper, since=since)

    def snapshot_reader(self, as_of: int | datetime | None = None) -> pa.RecordBatchReader:
        """The rows of :meth:`snapshot` as a stream of record batches in key order, read in
        bounded memory (lamina.read.stream), holding a lease on their files until the reader
        is exhausted, closed or garbage-collected; ``duckdb.from_arrow(reader)`` and
        ``polars.from_arrow(reader)`` take it as it is (docs/reading.md)."""
        from lamina.read.stream import snapshot_batches

        upper, since = self._frontiers()
        return snapshot_batches(self.files, as_of, upper=upper, since=since)

    def lookup(self, keys: pa.Table | Mapping[str, Any],
               as_of: int | datetime | None = None) -> pa.Table:
        """The consolidated rows at ``as_of`` whose key columns equal one of ``keys`` (a
        table of the key columns, or a mapping ``pa.table()`` accepts), ordered like a
        snapshot; reads only the row groups whose key range can hold them
        (lamina.read.lookup)."""
        from lamina.read.lookup import KeyIndex, lookup

        upper, since = self._frontiers()
        if self._key_index is None:
            self._key_index = KeyIndex()
        return lookup(self.files, keys, as_of, upper=upper, since=since,
                      index=self._key_index)

    def subscribe(self, as_of: int | datetime | None = None, *, snapshot: bool = True,
                  stop: threading.Event | None = None,
                  max_wait: float = 0.05) -> Iterator[pa.Table | Progress]:
        """The snapshot at ``as_of`` (default: the latest readable time; unless
        ``snapshot=False``: the caller already holds it), then each newly sealed
        interval's consolidated updates, each followed by a :class:`lamina.Progress`;
        ends after ``Progress(CLOSED)`` or once ``stop`` is set. Resume after
        ``Progress(u)`` with ``subscribe(u - 1, snapshot=False)`` (lamina.read.subscribe)."""
        from lamina.read.subscribe import subscribe

        self._check_usable()
        return subscribe(self.files, as_of, snapshot=snapshot, stop=stop, max_wait=max_wait)

    def updates(self, lower: int | datetime = 0,
                upper: int | datetime | None = None) -> pa.Table:
        """The updates with times in ``[lower, upper)`` (default: everything up to the
        sealed upper), consolidated and ordered by key and time, wherever they are stored;
        ``upper`` may lie beyond the sealed upper, and then also returns updates appended
        but not sealed yet. ``lower`` must be 0 or at least ``since``
        (lamina.read.unsealed)."""
        from lamina.read.unsealed import updates

        sealed, since = self._frontiers()
        return updates(self.files, lower, sealed if upper is None else upper, since=since)

    def close(self) -> None:
        """Release the writer, finishing an open segment that holds something to convert.
        The handle stays usable: a later write takes the writer again."""
        self._close()

    def _close(self) -> None:
        with self._mu:
            if self._writer is not None:
                self._writer.close(finish=True)
                self._writer = None

