"""Fault injection for tests: storage layers that crash or fail on a chosen file operation.

Every durable file operation lamina performs goes through a :class:`lamina.fs.FileSystem`,
and everything there is built on six primitives (``os_write``, ``os_fdatasync``,
``os_fsync_dir``, ``os_rename``, ``os_link``, ``os_unlink``). The classes here override only
those primitives, so a test hands one to ``Store.open(..., fs=...)`` or
``Trace.open(..., fs=...)`` and the code under test runs unchanged: no monkeypatching. This
is the seam Materialize's ``UnreliableBlob`` and RocksDB's ``FaultInjectionTestFS`` provide.

- :class:`InjectingFileSystem`: the base. It numbers every primitive call (1, 2, ...,
  across all kinds, and per kind), optionally records each as an :class:`Op`, and calls
  :meth:`~InjectingFileSystem.before` and :meth:`~InjectingFileSystem.after` around the
  real operation. Subclasses decide what happens there.
- :class:`CountingFileSystem`: records every operation; a dry run with it tells a test
  how many crash points a step has (``fs.count``) and what they are (``fs.ops``).
- :class:`CrashingFileSystem`: at call number ``crash_at`` kills its own process with
  SIGKILL, before the operation (default) or right after it. Run the step in a child
  process once per ``crash_at`` in ``1..count`` and every gap between two file
  operations has been crashed in; ``count + 1`` never crashes.
- :class:`FailingFileSystem`: raises ``OSError`` (EIO, ENOSPC, ...) instead of performing
  chosen operations: the N-th call of a kind, any call a predicate picks, and optionally
  every call after the first failure (a disk gone bad).

SIGKILL loses nothing the kernel already has: data written but not yet fsynced survives
in the page cache. A power-loss simulator (dropping unsynced writes and directory entries)
belongs here too; it would subclass :class:`InjectingFileSystem` and track, in
:meth:`~InjectingFileSystem.after`, which writes and entries each fdatasync and directory
fsync made durable.
"""

from __future__ import annotations

import errno as errno_codes
import os
import signal
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal, TypeVar

from lamina.fs import FileSystem

OpKind = Literal["write", "fdatasync", "fsync_dir", "rename", "link", "unlink"]
OP_KINDS: tuple[OpKind, ...] = ("write", "fdatasync", "fsync_dir", "rename", "link", "unlink")

_T = TypeVar("_T")


@dataclass(frozen=True)
class Op:
    """One primitive file operation as the storage layer issued it.

    ``number`` counts every primitive call of the file system from 1; ``kind_number``
    counts calls of this kind only. ``path`` is the file or directory operated on (the
    source for rename and link); ``target`` is the destination of a rename or link."""

    number: int
    kind: OpKind
    kind_number: int
    path: Path
    target: Path | None = None
    size: int | None = None  # bytes offered to a write

    def __str__(self) -> str:
        where = f"{self.path} -> {self.target}" if self.target is not None else str(self.path)
        return f"#{self.number} {self.kind} {where}"


class InjectingFileSystem(FileSystem):
    """A FileSystem whose primitives are numbered and pass through :meth:`before` and
    :meth:`after`: the base of every fault-injecting file system. Thread-safe (the WAL
    writer syncs from several threads)."""

    def __init__(self, *, record: bool = False) -> None:
        self._mu = threading.Lock()
        self._record = record
        self.count = 0
        """Primitive calls issued so far (including one that crashed or failed)."""
        self.counts: dict[OpKind, int] = dict.fromkeys(OP_KINDS, 0)
        """Calls issued so far, per kind."""
        self.ops: list[Op] = []
        """Every call issued, when constructed with ``record=True``."""

    # --- hooks for subclasses -----------------------------------------------------------
    def before(self, op: Op) -> None:
        """Called before the operation is performed; raise to fail it."""

    def after(self, op: Op) -> None:
        """Called after the operation succeeded."""

    # --- the machinery --------------------------------------------------------------------
    def _next_op(self, kind: OpKind, path: Path, target: Path | None,
                 size: int | None) -> Op:
        with self._mu:
            self.count += 1
            self.counts[kind] += 1
            op = Op(self.count, kind, self.counts[kind], Path(path),
                    None if target is None else Path(target), size)
            if self._record:
                self.ops.append(op)
            return op

    def _run(self, kind: OpKind, path: Path, fn: Callable[[], _T], *,
             target: Path | None = None, size: int | None = None) -> _T:
        op = self._next_op(kind, path, target, size)
        self.before(op)
        result = fn()
        self.after(op)
        return result

    # --- the primitives -------------------------------------------------------------------
    def os_write(self, fd: int, data: memoryview, path: Path) -> int:
        return self._run("write", path, partial(super().os_write, fd, data, path),
                         size=len(data))

    def os_fdatasync(self, fd: int, path: Path) -> None:
        self._run("fdatasync", path, partial(super().os_fdatasync, fd, path))

    def os_fsync_dir(self, path: Path) -> None:
        self._run("fsync_dir", path, partial(super().os_fsync_dir, path))

    def os_rename(self, src: Path, dst: Path) -> None:
        self._run("rename", src, partial(super().os_rename, src, dst), target=dst)

    def os_link(self, src: Path, dst: Path) -> None:
        self._run("link", src, partial(super().os_link, src, dst), target=dst)

    def os_unlink(self, path: Path) -> None:
        self._run("unlink", path, partial(super().os_unlink, path))


class CountingFileSystem(InjectingFileSystem):
    """Performs every operation and records it: the dry run that measures a step."""

    def __init__(self) -> None:
        super().__init__(record=True)


def kill_self() -> None:
    """SIGKILL the current process: no cleanup handler, no flush, no ``finally`` runs."""
    os.kill(os.getpid(), signal.SIGKILL)


class CrashingFileSystem(InjectingFileSystem):
    """Kills its own process with SIGKILL at primitive call number ``crash_at``.

    ``when="before"`` (default) dies before that operation is performed, ``"after"``
    right after it returned. With ``crash_at`` beyond the step's operation count nothing
    happens, so ``CrashingFileSystem(n + 1)`` is a normal run."""

    def __init__(self, crash_at: int, *, when: Literal["before", "after"] = "before",
                 record: bool = False) -> None:
        if crash_at < 1:
            raise ValueError(f"crash_at counts operations from 1, got {crash_at}")
        if when not in ("before", "after"):
            raise ValueError(f"when must be 'before' or 'after', got {when!r}")
        super().__init__(record=record)
        self.crash_at = crash_at
        self.when = when

    def before(self, op: Op) -> None:
        if self.when == "before" and op.number == self.crash_at:
            kill_self()

    def after(self, op: Op) -> None:
        if self.when == "after" and op.number == self.crash_at:
            kill_self()


FailRule = Mapping[OpKind, int | Collection[int]] | Callable[[Op], bool]


class FailingFileSystem(InjectingFileSystem):
    """Raises ``OSError(error)`` instead of performing chosen operations.

    ``fail_at`` is either a mapping from an operation kind to the call number(s) of that
    kind to fail (``{"fdatasync": 2}`` fails the second fdatasync), or a predicate on the
    :class:`Op`. With ``sticky=True`` every operation after the first failure fails too,
    as on a disk that went bad. Failed operations are listed in ``failures``."""

    def __init__(self, fail_at: FailRule, error: int = errno_codes.EIO, *,
                 sticky: bool = False, record: bool = False) -> None:
        super().__init__(record=record)
        if callable(fail_at):
            self._rule: Callable[[Op], bool] = fail_at
        else:
            unknown = set(fail_at) - set(OP_KINDS)
            if unknown:
                raise ValueError(f"unknown operation kinds {sorted(unknown)}; use {OP_KINDS}")
            table: dict[OpKind, frozenset[int]] = {
                kind: frozenset([nums] if isinstance(nums, int) else nums)
                for kind, nums in fail_at.items()}
            self._rule = lambda op: op.kind_number in table.get(op.kind, frozenset())
        self.error = error
        self.sticky = sticky
        self.failures: list[Op] = []

    def before(self, op: Op) -> None:
        if (self.sticky and self.failures) or self._rule(op):
            with self._mu:
                self.failures.append(op)
            raise OSError(self.error, f"injected fault: {os.strerror(self.error)}",
                          str(op.path))
