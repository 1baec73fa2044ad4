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

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from lamina.errors import (
    ConfigError,
    InvalidArgumentError,
    ObjectExistsError,
    ObjectNotFoundError,
)

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
