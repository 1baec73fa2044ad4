"""The storage layer: every durable file operation lamina performs goes through a
:class:`FileSystem`.

Why a layer of its own: the crash-safety rules of docs/architecture.md live here, once, and the
fault-injection shim of the tests (``lamina.testing.faults``) subclasses it to fail, tear or drop
operations the way a failing disk or a power cut would, without patching anything.

Rules kept here:

- Publishing a file: write a temp file in the same directory, fsync it, rename (or link,
  for an exclusive publish), fsync the directory (crash-safety rule 2, docs/architecture.md).
- Every write is checked for short writes; ENOSPC and EIO come out as
  :class:`~lamina.errors.StorageError` naming the operation and the path.
- A gathered write (``AppendFile.writev``: the WAL's records, header and Arrow buffers
  written without first copying them into one buffer) goes through the ``os_writev``
  primitive, short writes resumed mid-buffer. A subclass that overrides ``os_write`` but
  not ``os_writev`` (a fault-injecting one written for plain writes) gets the buffers
  joined and passed to its ``os_write`` instead, one call per ``writev``, so it sees every
  byte lamina writes and the same operations as before gathered writes existed.
- Files are opened ``O_APPEND``; the one write inside a file, ``AppendFile.patch`` (the
  WAL's record header, written over zeros after its record: lamina.wal.log), goes through
  the ``os_pwrite`` primitive, and may only touch bytes written since the last sync.
  ``AppendFile.start_writeback`` (``sync_file_range``) is a hint that makes nothing
  durable.
- Creating or removing a directory entry fsyncs the parent directory.

``FileNotFoundError`` passes through untranslated where a caller treats a missing file as
a normal outcome (readers racing a deleter); every other ``OSError`` becomes a
``StorageError``. An ENOENT (a write or a directory sync whose directory was renamed away
meanwhile: a relation dropped under the compacter) becomes a
:class:`~lamina.errors.PathNotFoundError`, a ``StorageError`` that is also a
``FileNotFoundError``, so callers that treat a vanished path as a drop catch one class.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import importlib.machinery
import importlib.util
import os
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from lamina import failpoints
from lamina.errors import PathNotFoundError, StorageError

TMP_SUFFIX = ".tmp"
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
"""The most buffers one ``writev`` takes."""


def _crc32c_extension() -> ModuleType:
    """The ``crc32c`` package's C extension (``crc32c._crc32c``: ``crc32c()`` and
    ``hardware_based``), loaded without running the package's ``__init__``.

    That ``__init__`` asks ``importlib.metadata`` for the package's version and imports
    its command line (``argparse``), with ``email``, ``zipfile`` and ``csv`` behind them:
    35 to 42 ms in fresh interpreters on a busy machine, against 4 to 5 ms for the
    extension alone (2026-11-28). With the subscription's modules left out as well
    (``lamina/__init__.py``), ``from lamina import Store`` went from 204 to 182 ms, which a
    cold read (``bench.cold_read``) pays first. Where the package is laid out otherwise, it
    is imported as it is."""
    spec = importlib.util.find_spec("crc32c")
    for location in (spec.submodule_search_locations or []) if spec else []:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(location, f"_crc32c{suffix}")
            if not os.path.exists(path):
                continue
            found = importlib.util.spec_from_file_location("crc32c._crc32c", path)
            if found is not None and found.loader is not None:
                module = importlib.util.module_from_spec(found)
                found.loader.exec_module(module)
                return module
    import crc32c  # pragma: no cover - another layout of the package

    return crc32c  # pragma: no cover


_crc32c = _crc32c_extension()
crc32c_raw = _crc32c.crc32c
"""The extension's ``crc32c(data, value=0) -> int``, for callers that checksum many small
pieces and cannot afford :func:`crc32c`'s extra call."""

if not _crc32c.hardware_based:  # pragma: no cover - depends on the CPU
    import warnings

    warnings.warn("crc32c runs without SSE4.2/ARMv8 CRC instructions; checksums will be "
                  "slow", RuntimeWarning, stacklevel=1)


_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` (Linux; Python's ``os`` has no binding), loaded on first
    use, or None where there is none. PostgreSQL starts its WAL and data write-back the
    same way (``pg_flush_data``)."""
    if not sys.platform.startswith("linux"):  # pragma: no cover - lamina runs on Linux
        return None
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # pragma: no cover - a libc without it
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


def crc32c(data: bytes | memoryview, value: int = 0) -> int:
    """CRC32C (hardware-accelerated) of ``data``, continuing from ``value``."""
    return int(_crc32c.crc32c(data, value))


def _fail(op: str, path: Path | str, exc: OSError) -> StorageError:
    if exc.errno == errno.ENOENT:
        err: StorageError = PathNotFoundError(
            exc.errno, f"{op} failed on {path}: {os.strerror(exc.errno)} (it was removed "
            "or renamed meanwhile)")
    else:
        err = StorageError(exc.errno, f"{op} failed on {path}: {os.strerror(exc.errno or 0)}"
                           " (check free space, permissions and the disk's health)")
    err.filename = str(path)
    return err


class AppendFile:
    """An append-only file handle whose writes are checked and whose syncs are explicit."""

    def __init__(self, fs: FileSystem, path: Path, fd: int, size: int) -> None:
        self._fs = fs
        self.path = path
        self._fd = fd
        self.size = size

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Write all of ``data`` at the end of the file, or raise ``StorageError``."""
        view = memoryview(data)
        while view:
            try:
                n = self._fs.os_write(self._fd, view, self.path)
            except OSError as exc:
                raise _fail("write", self.path, exc) from exc
            if n <= 0:
                raise StorageError(f"write made no progress on {self.path}")
            view = view[n:]
            self.size += n

    def writev(self, buffers: Sequence[Any]) -> None:
        """Write the concatenation of ``buffers`` (bytes-like objects: bytes, memoryviews,
        ``pyarrow.Buffer``) at the end of the file, or raise ``StorageError``. One
        ``writev`` when the kernel takes it all; a short write is resumed where it stopped
        (possibly inside a buffer), never repeated."""
        if not self._fs.native_writev:
            self.write(b"".join(buffers))
            return
        pending = list(buffers)
        while pending:
            batch = pending[:IOV_MAX]
            try:
                n = self._fs.os_writev(self._fd, batch, self.path)
            except OSError as exc:
                raise _fail("write", self.path, exc) from exc
            if n <= 0 and any(len(b) for b in batch):
                raise StorageError(f"write made no progress on {self.path}")
            self.size += n
            done = 0  # buffers of the batch written whole
            for b in batch:
                if n < len(b):
                    break
                n -= len(b)
                done += 1
            if done < len(batch) and n:
                pending[done] = memoryview(pending[done])[n:]
            del pending[:done]

    def patch(self, offset: int, data: bytes) -> None:
        """Overwrite ``len(data)`` bytes at ``offset``, inside what was written since the
        last sync (the WAL writer's record header, written after its record: lamina.wal.log,
        "Sealing a record last"), or raise ``StorageError``."""
        if offset < 0 or offset + len(data) > self.size:
            raise ValueError(f"patch of {len(data)} bytes at {offset} lies outside the "
                             f"{self.size} bytes of {self.path}")
        try:
            n = self._fs.os_pwrite(self._fd, data, offset, self.path)
        except OSError as exc:
            raise _fail("write", self.path, exc) from exc
        if n != len(data):  # a few bytes inside the file: a short write is a failing disk
            raise StorageError(f"write of {len(data)} bytes at {offset} wrote {n} on "
                               f"{self.path}")

    def start_writeback(self, start: int, end: int) -> None:
        """Ask the kernel to start writing bytes ``[start, end)`` to the disk now, without
        waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so that a later
        fdatasync finds them under way. Only a hint: it does not make anything durable, and
        where the call is missing or fails nothing happens (the fdatasync reports errors)."""
        if end > start:
            self._fs.os_start_writeback(self._fd, start, end - start, self.path)

    def sync(self) -> None:
        """fdatasync the file. An error here is fatal for the writer (crash-safety rule 5,
        docs/architecture.md)."""
        try:
            self._fs.os_fdatasync(self._fd, self.path)
        except OSError as exc:
            raise _fail("fdatasync", self.path, exc) from exc

    def truncate(self, size: int) -> None:
        try:
            os.ftruncate(self._fd, size)
        except OSError as exc:
            raise _fail("truncate", self.path, exc) from exc
        self.size = size

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


class SyncedWriter:
    """A binary file-like object for library writers (pyarrow's Parquet writer); ``close``
    flushes, fsyncs (unless ``sync`` is False) and closes before the caller renames the file
    into place. Writes are gathered into ``BUFFER`` bytes before they reach the OS (Parquet
    writers emit many small pieces), and a running CRC32C of everything written makes the
    file's checksum free."""

    BUFFER = 1 << 20

    def __init__(self, handle: AppendFile, *, sync: bool = True) -> None:
        self._h = handle
        self._sync = sync
        self._buf = bytearray()
        self._size = 0
        self.closed = False
        self.crc32c = 0

    def write(self, data: bytes | memoryview) -> int:
        self.crc32c = crc32c(data, self.crc32c)
        n = len(data)
        self._size += n
        if len(self._buf) + n < self.BUFFER:
            self._buf += data
        else:
            self._drain()
            self._h.write(data)
        return n

    def _drain(self) -> None:
        if self._buf:
            self._h.write(self._buf)
            self._buf = bytearray()

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        self._drain()

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        if not self.closed:
            self._drain()
            if self._sync:
                self._h.sync()
            self._h.close()
            self.closed = True


class FileSystem:
    """Real file operations with lamina's durability rules. Subclasses may override the
    ``os_*`` primitives to inject faults; everything else is built on them."""

    native_writev = True
    """Whether ``AppendFile.writev`` calls :meth:`os_writev` (else it joins the buffers and
    calls :meth:`os_write`): false for a subclass overriding ``os_write`` alone."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.native_writev = (cls.os_writev is not FileSystem.os_writev
                             or cls.os_write is FileSystem.os_write)

    # --- primitives (the fault-injection seams) -------------------------------------
    def os_write(self, fd: int, data: memoryview, path: Path) -> int:
        return os.write(fd, data)

    def os_writev(self, fd: int, buffers: Sequence[Any], path: Path) -> int:
        """Write ``buffers`` (at most ``IOV_MAX``) in one gathered write; bytes written."""
        return os.writev(fd, buffers)

    def os_pwrite(self, fd: int, data: bytes, offset: int, path: Path) -> int:
        """Write ``data`` at ``offset`` of a file opened for appending (every file of
        lamina's is: Linux's ``pwrite`` would append there, so ``O_APPEND`` is lifted for
        the call); bytes written."""
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_APPEND)
        try:
            return os.pwrite(fd, data, offset)
        finally:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)

    def os_start_writeback(self, fd: int, offset: int, length: int, path: Path) -> None:
        """Start the write-back of ``length`` bytes at ``offset`` (:meth:`AppendFile.
        start_writeback`); errors are ignored, a hint that fails changes nothing."""
        call = _sync_file_range()
        if call is not None:
            call(fd, offset, length, _SYNC_FILE_RANGE_WRITE)

    def os_fdatasync(self, fd: int, path: Path) -> None:
        os.fdatasync(fd)

    def os_fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def os_rename(self, src: Path, dst: Path) -> None:
        os.rename(src, dst)

    def os_link(self, src: Path, dst: Path) -> None:
        os.link(src, dst)

    def os_unlink(self, path: Path) -> None:
        os.unlink(path)

    # --- operations -------------------------------------------------------------------
    def fsync_dir(self, path: Path) -> None:
        try:
            self.os_fsync_dir(path)
        except OSError as exc:
            raise _fail("fsync of directory", path, exc) from exc

    def makedirs(self, path: Path) -> None:
        """Create ``path`` and missing parents, fsyncing each parent that gained an entry."""
        missing: list[Path] = []
        p = path
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            try:
                d.mkdir(exist_ok=True)
            except OSError as exc:
                raise _fail("mkdir", d, exc) from exc
            self.fsync_dir(d.parent)

    def open_append(self, path: Path, *, create: bool = False) -> AppendFile:
        """Open ``path`` for appending; ``create`` requires that it does not exist yet."""
        flags = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC
        if create:
            flags |= os.O_CREAT | os.O_EXCL
        try:
            fd = os.open(path, flags, 0o644)
            size = os.fstat(fd).st_size
        except OSError as exc:
            raise _fail("open", path, exc) from exc
        return AppendFile(self, path, fd, size)

    def rename(self, src: Path, dst: Path, *, sync_dir: bool = True) -> None:
        failpoints.hit("fs.before_rename")
        try:
            self.os_rename(src, dst)
        except OSError as exc:
            raise _fail("rename", f"{src} -> {dst}", exc) from exc
        failpoints.hit("fs.after_rename")
        if sync_dir:
            self.fsync_dir(dst.parent)
            if src.parent != dst.parent:
                self.fsync_dir(src.parent)

    def unlink(self, path: Path, *, missing_ok: bool = True, sync_dir: bool = True) -> None:
        try:
            self.os_unlink(path)
        except FileNotFoundError:
            if not missing_ok:
                raise
            return
        except OSError as exc:
            raise _fail("unlink", path, exc) from exc
        if sync_dir:
            self.fsync_dir(path.parent)

    def rmtree(self, path: Path) -> None:
        """Remove a directory tree (used for dropped relations and abandoned batches)."""
        if not path.exists():
            return
        for child in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            try:
                if child.is_dir() and not child.is_symlink():
                    child.rmdir()
                else:
                    self.os_unlink(child)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise _fail("remove", child, exc) from exc
        try:
            path.rmdir()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise _fail("rmdir", path, exc) from exc
        self.fsync_dir(path.parent)

    def temp_path(self, final: Path) -> Path:
        return final.with_name(f".{final.name}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}")

    def _write_temp(self, final: Path, data: bytes) -> Path:
        tmp = self.temp_path(final)
        handle = self.open_append(tmp, create=True)
        try:
            handle.write(data)
            handle.sync()
        except BaseException:
            handle.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        handle.close()
        return tmp

    def write_atomic(self, path: Path, data: bytes) -> None:
        """Publish ``data`` at ``path``, replacing any old file: temp, fsync, rename, fsync dir."""
        tmp = self._write_temp(path, data)
        try:
            self.rename(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def publish_exclusive(self, path: Path, data: bytes) -> bool:
        """Publish ``data`` at ``path`` only if nothing is there: the compare-and-set of the
        trace state. Returns False, writing nothing visible, when ``path`` already exists."""
        tmp = self._write_temp(path, data)
        try:
            try:
                self.os_link(tmp, path)
            except FileExistsError:
                return False
            except OSError as exc:
                raise _fail("link", path, exc) from exc
        finally:
            with contextlib.suppress(OSError):
                self.os_unlink(tmp)
        self.fsync_dir(path.parent)
        return True

    @contextlib.contextmanager
    def create_synced(self, path: Path, *, sync: bool = True) -> Iterator[SyncedWriter]:
        """Yield a writer for a new file published at ``path`` when the block exits cleanly:
        the bytes go to a temp file, are fsynced, renamed into place and the directory is
        fsynced. On an exception the temp file is removed and ``path`` is untouched. With
        ``sync=False`` the same without the fsyncs (scratch that lives for one step: the
        rename still makes it appear whole)."""
        tmp = self.temp_path(path)
        writer = SyncedWriter(self.open_append(tmp, create=True), sync=sync)
        try:
            yield writer
            writer.close()
            self.rename(tmp, path, sync_dir=sync)
        except BaseException:
            writer._h.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def read_bytes(self, path: Path) -> bytes:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise _fail("read", path, exc) from exc

    def read_range(self, path: Path, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``path``, cut short at the end of the file (a ranged
        read of the object store's ``file://`` layer). ``FileNotFoundError`` passes through."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise _fail("open", path, exc) from exc
        try:
            parts: list[bytes] = []
            pos = start
            while pos < end:
                chunk = os.pread(fd, end - pos, pos)
                if not chunk:
                    break
                parts.append(chunk)
                pos += len(chunk)
            return b"".join(parts)
        except OSError as exc:
            raise _fail("read", path, exc) from exc
        finally:
            os.close(fd)
