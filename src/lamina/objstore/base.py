"""The trace's storage interface: an :class:`ObjectStore`, chosen by URL scheme.

A trace is a set of immutable objects named by '/'-separated keys relative to the store's
root (a directory for ``file://``, a bucket prefix for ``s3://``); the names are
:class:`lamina.layout.TraceLayout`'s. :func:`open_store` picks the implementation from the
URL, the way pyiceberg's ``FileIO`` does:

- ``file:///abs/path`` -> :class:`lamina.objstore.local.LocalObjectStore` (over
  :class:`lamina.fs.FileSystem`, the fault seam);
- ``s3://bucket/prefix`` -> :class:`lamina.objstore.s3.S3ObjectStore` (over ``obstore``).

What every method guarantees, on every implementation:

- ``get(key)``: the whole object, as some completed ``put`` wrote it (never a torn mix of
  two puts); :class:`~lamina.errors.ObjectNotFoundError` when there is none.
- ``get_range(key, start, end)``: bytes ``[start, end)`` of the object, cut short at its
  end (``b""`` past it), like ``data[start:end]`` with ``0 <= start <= end``.
- ``put(key, data)``: atomic whole-object create-or-replace: a reader sees the old object
  or the new one, never a part. Durable when it returns.
- ``put_if_absent(key, data)``: a conditional create. Of writers racing to create the same
  key, exactly one returns normally; every other raises
  :class:`~lamina.errors.ObjectExistsError` and wrote nothing. It is *idempotent for the
  winner*: a create whose response was lost (a timeout, a connection reset) may be retried,
  and when the retry finds an object equal byte for byte to ``data`` the call returns
  normally, because that object is this writer's own. Callers doing compare-and-set must
  therefore make their payload unique to the writer (the trace state carries a writer
  nonce), so two writers never put equal bytes.
- ``list(prefix)``: every object under ``prefix`` (segment-wise: ``"a/b"`` lists
  ``a/b/x`` and ``a/b/c/y``, not ``a/bc``), recursively, sorted by key, with size and
  modification time. It reflects every put that returned before ``list`` was called; a put
  still in flight may or may not be listed.
- ``delete(key)``: idempotent (deleting a missing key is not an error).
  ``delete_prefix(prefix)``: deletes what ``list(prefix)`` returns.

Built on those, for the trace's data files (one implementation here; the local store
overrides them to keep a file's own strengths):

- ``child(prefix)``: the store rooted at ``prefix`` (one relation's trace);
  ``children(prefix)``: the names one level below ``prefix`` that hold objects (the
  relations of a trace root), without listing every object where the store can.
- ``size(key)``: the object's size (a HEAD; local: stat).
- ``open_input(key, size=None)``: a seekable :class:`pyarrow.NativeFile` for Parquet and
  Arrow readers, reading by ranged gets through a buffer (local: the open file, which
  keeps its bytes readable after garbage collection unlinks it).
- ``writer(key, durable=True)``: a file-like writer with a running CRC32C whose object
  appears, whole, when the block exits cleanly and not at all otherwise (here: buffered,
  then one ``put``; local: a temp file renamed into place, streaming, synced unless
  ``durable`` is False: scratch that lives for one step only).
- ``free_bytes(key)``: the room left for new objects under ``key`` where the store has a
  bound it can tell (local: the free space of the filesystem holding it); None where it
  has none or cannot tell (here, and on S3).
- ``sync(prefix)``: make objects listed under ``prefix`` durable (a no-op where a returned
  put is durable; local: fsync of the directory, for a writer that died before it did).
- ``sweep(prefix, older_than)``: remove what failed writes left under ``prefix`` before
  ``older_than`` (local: temp files and empty directories; S3 leaves incomplete multipart
  uploads to the bucket's lifecycle rule, docs/object-store.md).

Nothing relies on rename, on directories, or on listing being consistent with a put that
has not returned. Errors are lamina's: third-party and OS exceptions are translated at the
implementation's boundary into :class:`~lamina.errors.StorageError` (I/O),
:class:`~lamina.errors.ObjectNotFoundError`, :class:`~lamina.errors.ObjectExistsError` or
:class:`~lamina.errors.ConfigError` (a bad URL, missing credentials, a store that ignores
conditional puts: :func:`lamina.objstore.probe.check_conditional_put`).

Keys: non-empty '/'-separated segments, none empty, ``.`` or ``..``, none starting with
``.`` (the local store's temp files are dot-named), no backslash or NUL.
"""

from __future__ import annotations

import builtins
import contextlib
import io
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import pyarrow as pa

from lamina.errors import (
    ConfigError,
    InvalidArgumentError,
    ObjectExistsError,
    ObjectNotFoundError,
)
from lamina.fs import crc32c

if TYPE_CHECKING:
    from lamina.fs import FileSystem
    from lamina.objstore.s3 import S3Settings


@dataclass(frozen=True)
class ObjectMeta:
    """One listed object: its key (relative to the store's root), size in bytes and
    modification time (seconds since the epoch)."""

    key: str
    size: int
    mtime: float


def check_key(key: str) -> str:
    """``key`` if it is a valid object key, else :class:`InvalidArgumentError`."""
    if not isinstance(key, str) or not key:
        raise InvalidArgumentError(f"object key {key!r} is empty; give a relative name "
                                   "such as 'state/00000000000000000001.json'")
    if "\\" in key or "\0" in key:
        raise InvalidArgumentError(f"object key {key!r} contains a backslash or NUL; use "
                                   "'/'-separated names")
    for seg in key.split("/"):
        if not seg or seg.startswith("."):
            raise InvalidArgumentError(
                f"object key {key!r} has an empty segment or one starting with '.'; keys are "
                "relative '/'-separated names (no leading or doubled '/', no '.' or '..')")
    return key


def check_prefix(prefix: str) -> str:
    """``prefix`` with any trailing '/' removed; ``""`` means the whole store."""
    stripped = prefix.rstrip("/")
    if stripped:
        check_key(stripped)
    return stripped


class ObjectWriter(Protocol):
    """What :meth:`ObjectStore.writer` yields: a write-only file for pyarrow's writers, with
    the CRC32C and size of what was written so far."""

    crc32c: int

    def write(self, data: bytes | memoryview) -> int: ...

    def tell(self) -> int: ...

    def flush(self) -> None: ...


class _BufferedWriter(io.RawIOBase):
    """An :class:`ObjectWriter` that keeps the bytes in memory for one ``put``."""

    def __init__(self) -> None:
        self._buf = io.BytesIO()
        self.crc32c = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc32c = crc32c(view, self.crc32c)
        return self._buf.write(view)

    def tell(self) -> int:
        return self._buf.tell()

    def writable(self) -> bool:
        return True

    def getvalue(self) -> bytes:
        return self._buf.getvalue()


_READ_BUFFER = 1 << 20
"""Bytes fetched per ranged get by :meth:`ObjectStore.open_input` (Parquet footers and
column chunks are read in few, larger requests)."""


class _RangedReader(io.RawIOBase):
    """A seekable raw file over an object's ranged gets; ``size`` is known up front."""

    def __init__(self, store: ObjectStore, key: str, size: int) -> None:
        self._store, self._key, self._size, self._pos = store, key, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        end = min(self._pos + len(view), self._size)
        if end <= self._pos:
            return 0
        data = self._store.get_range(self._key, self._pos, end)
        view[:len(data)] = data
        self._pos += len(data)
        return len(data)


class ObjectStore(ABC):
    """A flat namespace of immutable objects (see the module docstring for the contract).

    Implementations provide the primitives; :meth:`put_if_absent` (the read-back that
    resolves a lost response) and :meth:`delete_prefix` are built here on them, once."""

    url: str
    """The URL this store was opened from (no credentials in it)."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object under ``key``."""

    @abstractmethod
    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object, cut short at its end."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Create or replace the object under ``key`` atomically."""

    @abstractmethod
    def create(self, key: str, data: bytes) -> bool:
        """The raw conditional create: True if this call created the object, False (writing
        nothing) if one was already there. Callers use :meth:`put_if_absent`."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[ObjectMeta]:
        """Every object under ``prefix``, sorted by key."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete the object under ``key``, if there is one."""

    @abstractmethod
    def child(self, prefix: str) -> ObjectStore:
        """The store rooted at ``prefix`` under this one (same settings and fault seam)."""

    def children(self, prefix: str = "") -> builtins.list[str]:
        """Sorted names one level below ``prefix`` under which objects live."""
        prefix = check_prefix(prefix)
        skip = len(prefix) + 1 if prefix else 0
        return sorted({m.key[skip:].split("/", 1)[0] for m in self.list(prefix)
                       if "/" in m.key[skip:]})

    def location(self, key: str) -> str:
        """Where ``key`` lives, for messages: the store's URL and the key."""
        return f"{self.url}/{key}"

    def size(self, key: str) -> int:
        """The object's size in bytes; :class:`ObjectNotFoundError` when there is none."""
        return len(self.get(key))

    def open_input(self, key: str, size: int | None = None) -> pa.NativeFile:
        """A seekable reader of the object (``size``: its size when the caller knows it,
        saving a request); a missing object raises :class:`ObjectNotFoundError`."""
        raw = _RangedReader(self, check_key(key), self.size(key) if size is None else size)
        return pa.PythonFile(io.BufferedReader(raw, _READ_BUFFER), mode="r")

    @contextlib.contextmanager
    def writer(self, key: str, *, durable: bool = True) -> Iterator[ObjectWriter]:
        """Yield a writer; the object appears whole when the block exits cleanly (and is
        durable then, unless ``durable`` is False where that costs extra)."""
        check_key(key)
        out = _BufferedWriter()
        yield out
        self.put(key, out.getvalue())

    def free_bytes(self, key: str) -> int | None:
        """Bytes that new objects under ``key`` may still take, where the store has such a
        bound and can tell it; None otherwise (see the module docstring)."""
        check_prefix(key)
        return None

    def sync(self, prefix: str) -> None:
        """Make every object listed under ``prefix`` durable (see the module docstring)."""
        check_prefix(prefix)

    def sweep(self, prefix: str, older_than: float) -> int:
        """Remove leftovers of failed writes under ``prefix``; return how many."""
        check_prefix(prefix)
        return 0

    def put_if_absent(self, key: str, data: bytes) -> None:
        """Create ``key`` with ``data`` unless an object is there; an object already there
        equal to ``data`` is this writer's own (a retried create whose first response was
        lost) and counts as success. Raises :class:`ObjectExistsError` otherwise."""
        check_key(key)
        if self.create(key, data):
            return
        try:
            existing = self.get(key)
        except ObjectNotFoundError:
            existing = None  # created by another writer and already deleted: still lost
        if existing == data:
            return
        raise ObjectExistsError(
            f"{self.url}: an object under {key!r} was created by another writer; this "
            "conditional create lost the race and wrote nothing (re-read and decide again)")

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object under ``prefix``."""
        check_prefix(prefix)
        for meta in self.list(prefix):
            self.delete(meta.key)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def open_store(url: str, settings: S3Settings | None = None, *,
               fs: FileSystem | None = None) -> ObjectStore:
    """The store for ``url``, by scheme: ``file:///abs/dir`` (``fs``: the FileSystem to
    use, the fault seam) or ``s3://bucket/prefix`` (``settings``: explicit endpoint and
    credentials; unset fields come from the standard AWS environment)."""
    scheme = urlsplit(url).scheme
    if scheme == "file":
        from lamina.objstore.local import LocalObjectStore

        return LocalObjectStore.from_url(url, fs=fs)
    if scheme == "s3":
        from lamina.objstore.s3 import S3ObjectStore

        return S3ObjectStore.from_url(url, settings)
    raise ConfigError(f"trace URL {url!r} has an unsupported scheme {scheme!r}; use "
                      "file:///absolute/path or s3://bucket/prefix")
