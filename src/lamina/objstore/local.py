"""``file://`` object store: objects are files under a root directory, written through
:class:`lamina.fs.FileSystem` (the WAL's storage layer and the fault seam).

How each operation keeps the :mod:`lamina.objstore.base` contract:

- ``put``: ``FileSystem.write_atomic``: a temp file in the same directory, fsynced, renamed
  over the key, the directory fsynced (crash-safety rule 2, docs/architecture.md). A reader
  sees the old file or the new one.
- ``create`` (under ``put_if_absent``): ``FileSystem.publish_exclusive``: a synced temp
  file linked to the key with link(2), which fails if the key exists, exactly as the
  trace state's compare-and-set does today; the temp file is removed either way.
- ``get_range``: ``FileSystem.read_range`` (pread).
- ``list``: a walk of the directory under the prefix, size and mtime from ``stat``; temp
  files (dot-named, which keys cannot be) and directories are not objects. A file deleted
  during the walk is skipped.
- ``delete``: unlink, missing is fine, the directory not fsynced (a delete that a crash
  undoes leaves garbage, which the next collection deletes); directories left empty stay
  (they are not objects) until ``sweep``.
  ``delete_prefix``: ``FileSystem.rmtree`` of the prefix's directory.
- ``open_input``: the file opened (:class:`pyarrow.OSFile`); an open file keeps its bytes
  readable after garbage collection unlinks it, so a long read pins what it opened.
- ``writer``: ``FileSystem.create_synced``: streamed to a temp file, fsynced, renamed into
  place, the directory fsynced (no part held in memory); with ``durable=False`` the same
  without the fsyncs (``create_synced(sync=False)``: a step's scratch runs).
- ``free_bytes``: ``statvfs`` of the nearest existing directory on the way to the key
  (the blocks an unprivileged process may still take); None when that fails.
- ``sync``: fsync of the prefix's directory; ``sweep``: temp files (dot-named) and empty
  directories older than the cut-off.

Missing parent directories are created (and their parents fsynced) by the writes.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pyarrow as pa

from lamina.errors import ConfigError, InvalidArgumentError, ObjectNotFoundError, StorageError
from lamina.fs import TMP_SUFFIX, FileSystem
from lamina.objstore.base import ObjectMeta, ObjectStore, ObjectWriter, check_key, check_prefix

_NOT_AN_OBJECT = (errno.EISDIR, errno.ENOTDIR)


class LocalObjectStore(ObjectStore):
    """Objects as files under ``root``; every operation goes through ``fs``."""

    def __init__(self, root: Path, fs: FileSystem | None = None) -> None:
        if not root.is_absolute():
            raise ConfigError(f"local object store root {str(root)!r} is relative; give an "
                              "absolute directory")
        self.root = root
        self.fs = fs or FileSystem()
        self.url = root.as_uri()

    @classmethod
    def from_url(cls, url: str, *, fs: FileSystem | None = None) -> LocalObjectStore:
        parts = urlsplit(url)
        if parts.scheme != "file" or parts.netloc not in ("", "localhost") or not parts.path:
            raise ConfigError(f"{url!r} is not a local trace URL; use file:///absolute/path")
        return cls(Path(unquote(parts.path)), fs)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _missing(self, key: str) -> ObjectNotFoundError:
        err = ObjectNotFoundError(2, f"{self.url}: no object under {key!r} (it was never "
                                     "written or was deleted)")
        err.filename = str(self.root / key)
        return err

    def get(self, key: str) -> bytes:
        try:
            return self.fs.read_bytes(self._path(key))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise self._missing(key) from exc
        except StorageError as exc:
            if exc.errno in _NOT_AN_OBJECT:  # a prefix, not an object
                raise self._missing(key) from exc
            raise

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if not 0 <= start <= end:
            raise InvalidArgumentError(f"byte range [{start}, {end}) of {key!r} is not "
                                       "0 <= start <= end")
        path = self._path(key)
        try:
            if start == end:
                if not path.is_file():
                    raise FileNotFoundError(path)
                return b""
            return self.fs.read_range(path, start, end)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise self._missing(key) from exc
        except StorageError as exc:
            if exc.errno in _NOT_AN_OBJECT:  # a prefix, not an object
                raise self._missing(key) from exc
            raise

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        self.fs.makedirs(path.parent)
        self.fs.write_atomic(path, bytes(data))

    def create(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        self.fs.makedirs(path.parent)
        return self.fs.publish_exclusive(path, bytes(data))

    def list(self, prefix: str = "") -> list[ObjectMeta]:
        prefix = check_prefix(prefix)
        top = self.root / prefix if prefix else self.root
        out: list[ObjectMeta] = []

        def onerror(exc: OSError) -> None:
            if not isinstance(exc, FileNotFoundError | NotADirectoryError):
                raise StorageError(exc.errno, f"listing {top} failed: {exc.strerror} (check "
                                   "permissions and the disk's health)") from exc

        for dirpath, dirnames, filenames in os.walk(top, onerror=onerror):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                if name.startswith("."):
                    continue  # a temp file of a put in flight
                full = Path(dirpath) / name
                try:
                    st = full.stat()
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise StorageError(exc.errno, f"stat of {full} failed: {exc.strerror}"
                                       " (check permissions and the disk's health)") from exc
                out.append(ObjectMeta(full.relative_to(self.root).as_posix(), st.st_size,
                                      st.st_mtime))
        out.sort(key=lambda m: m.key)
        return out

    def delete(self, key: str) -> None:
        path = self._path(key)
        with contextlib.suppress(NotADirectoryError):
            self.fs.unlink(path, missing_ok=True, sync_dir=False)

    def delete_prefix(self, prefix: str) -> None:
        prefix = check_prefix(prefix)
        top = self.root / prefix if prefix else self.root
        if top.is_dir():
            self.fs.rmtree(top)

    def child(self, prefix: str) -> LocalObjectStore:
        prefix = check_prefix(prefix)
        return LocalObjectStore(self.root / prefix if prefix else self.root, self.fs)

    def children(self, prefix: str = "") -> builtins.list[str]:
        prefix = check_prefix(prefix)
        top = self.root / prefix if prefix else self.root
        try:
            return sorted(d.name for d in top.iterdir()
                          if d.is_dir() and not d.name.startswith("."))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def location(self, key: str) -> str:
        return str(self._path(key)) if key else str(self.root)

    def path(self, key: str) -> Path:
        """The file that holds ``key`` (for readers that hand a path to another program,
        such as Spark's Parquet reader)."""
        return self._path(key)

    def size(self, key: str) -> int:
        path = self._path(key)
        try:
            return path.stat().st_size
        except (FileNotFoundError, NotADirectoryError) as exc:
            raise self._missing(key) from exc

    def open_input(self, key: str, size: int | None = None) -> pa.NativeFile:
        path = self._path(key)
        try:
            return pa.OSFile(str(path), mode="r")
        except FileNotFoundError as exc:
            raise self._missing(key) from exc
        except OSError as exc:
            if exc.errno in _NOT_AN_OBJECT:
                raise self._missing(key) from exc
            raise StorageError(exc.errno or errno.EIO, f"opening {path} failed: {exc} (check "
                               "permissions and the disk's health)") from exc

    @contextlib.contextmanager
    def writer(self, key: str, *, durable: bool = True) -> Iterator[ObjectWriter]:
        path = self._path(key)
        self.fs.makedirs(path.parent)
        with self.fs.create_synced(path, sync=durable) as out:
            yield out

    def free_bytes(self, key: str) -> int | None:
        prefix = check_prefix(key)
        path = self.root / prefix if prefix else self.root
        while not path.is_dir() and path != path.parent:
            path = path.parent
        try:
            vfs = os.statvfs(path)
        except OSError:
            return None
        return vfs.f_bavail * vfs.f_frsize

    def sync(self, prefix: str) -> None:
        prefix = check_prefix(prefix)
        top = self.root / prefix if prefix else self.root
        if top.is_dir():
            self.fs.fsync_dir(top)

    def sweep(self, prefix: str, older_than: float) -> int:
        prefix = check_prefix(prefix)
        top = self.root / prefix if prefix else self.root
        removed = 0
        for dirpath, _dirs, filenames in os.walk(top, topdown=False):
            here = Path(dirpath)
            for name in filenames:
                if name.startswith(".") and name.endswith(TMP_SUFFIX):
                    with contextlib.suppress(FileNotFoundError):
                        if (here / name).stat().st_mtime < older_than:
                            self.fs.unlink(here / name, sync_dir=False)
                            removed += 1
            if here != top:
                with contextlib.suppress(OSError):  # not empty, or just written to
                    if here.stat().st_mtime < older_than and not any(here.iterdir()):
                        here.rmdir()
        return removed
