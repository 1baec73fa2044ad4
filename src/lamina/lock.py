"""Exclusive advisory locks on files (``fcntl.flock``).

Used for the one writer per relation (``wal/<relation>/LOCK``) and the one compacter per
data directory (``compacter.lock``), crash-safety rule 7, docs/architecture.md. The lock dies with
the process, so
a crash never leaves a stale lock; the holder's pid is written into the file for the
error message of the next comer.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from lamina.errors import LockedError, StorageError


class DirLock:
    """An exclusive, non-blocking ``flock`` on a file, released on close or process death."""

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StorageError(exc.errno, f"cannot open lock file {path}: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise LockedError(f"{what} is held by another process (pid {holder}) through "
                                  f"{path}; stop that process or use it instead") from exc
            raise StorageError(exc.errno, f"cannot lock {path}: {exc.strerror}") from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
