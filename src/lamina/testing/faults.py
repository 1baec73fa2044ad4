"""Fault injection for tests: storage layers that crash or fail on a chosen file operation.

Every durable file operation lamina performs goes through a :class:`lamina.fs.FileSystem`,
and everything there is built on seven primitives (``os_write``, ``os_pwrite``,
``os_fdatasync``, ``os_fsync_dir``, ``os_rename``, ``os_link``, ``os_unlink``; a pwrite
counts as a write). The classes here override only
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
- :class:`DelayingFileSystem`: a slow disk under some paths: operations of chosen kinds on
  paths containing a string wait before they are performed. It pickles, so a Spark task
  that receives a trace store built on it (a step's context) is slowed the same way in its
  Python worker: a long step of one chosen relation, without a large input.
- :class:`KillOnceFileSystem`: SIGKILLs the process at the first operation on a chosen
  path, once across every process that holds a copy (a marker file says it happened):
  in a Spark task, the Python worker dies and the job fails once, then succeeds.

- :class:`PowerLossFileSystem`: simulates a power cut. SIGKILL loses nothing the kernel
  already has (data written but not yet fsynced survives in the page cache), so a missing
  fsync is invisible to kill -9 tests. This shim records which bytes and which directory
  entries were not yet made durable, and :meth:`~PowerLossFileSystem.crash` drops, tears
  or undoes them on the real files, the way a power cut would (see its docstring for the
  model).
"""

from __future__ import annotations

import errno as errno_codes
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal, TypeVar

from lamina.fs import AppendFile, FileSystem

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

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        del state["_mu"]  # a lock does not pickle; the unpickled copy counts on its own
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._mu = threading.Lock()

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

    def os_pwrite(self, fd: int, data: bytes, offset: int, path: Path) -> int:
        return self._run("write", path, partial(super().os_pwrite, fd, data, offset, path),
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


_RENAME: tuple[OpKind, ...] = ("rename",)


class DelayingFileSystem(InjectingFileSystem):
    """Waits ``seconds`` before every operation of one of ``kinds`` on a path (or rename
    or link target) containing ``path_contains``, then performs it."""

    def __init__(self, seconds: float, *, path_contains: str,
                 kinds: Collection[OpKind] = _RENAME, record: bool = False) -> None:
        unknown = set(kinds) - set(OP_KINDS)
        if unknown:
            raise ValueError(f"unknown operation kinds {sorted(unknown)}; use {OP_KINDS}")
        super().__init__(record=record)
        self.seconds = seconds
        self.path_contains = path_contains
        self.kinds = frozenset(kinds)

    def before(self, op: Op) -> None:
        if op.kind in self.kinds and (self.path_contains in str(op.path) or (
                op.target is not None and self.path_contains in str(op.target))):
            time.sleep(self.seconds)


class KillOnceFileSystem(InjectingFileSystem):
    """SIGKILLs its process before the first operation of one of ``kinds`` on a path
    containing ``path_contains``, unless ``marker`` exists; it creates ``marker`` first
    (exclusively), so of all the processes holding a copy exactly one dies, once."""

    def __init__(self, marker: Path, *, path_contains: str,
                 kinds: Collection[OpKind] = _RENAME) -> None:
        super().__init__()
        self.marker = Path(marker)
        self.path_contains = path_contains
        self.kinds = frozenset(kinds)

    def before(self, op: Op) -> None:
        if op.kind not in self.kinds or self.path_contains not in str(op.path):
            return
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return
        os.close(fd)
        kill_self()


# --- power loss -----------------------------------------------------------------------------

class PowerCut(BaseException):
    """The power is off: raised by :class:`PowerLossFileSystem` at its cut point and by every
    file operation after it. A ``BaseException``, so code under test that handles
    ``Exception`` or ``OSError`` cannot carry on writing as if one operation had failed."""


EntryKind = Literal["create", "rename", "link", "unlink"]
FileKey = tuple[int, int]
"""``(st_dev, st_ino)``: a file or directory, whatever its names."""


def _key(st: os.stat_result) -> FileKey:
    return (st.st_dev, st.st_ino)


def _abs(path: Path | str) -> Path:
    return Path(os.path.abspath(path))


@dataclass
class _FileRecord:
    """What the disk is known to hold of one file (inode). Writes only ever append (every
    lamina file is opened O_APPEND), so the first ``size`` bytes are durable and the rest
    of the file is not, unless the file was truncated since its last fdatasync: then
    ``saved`` holds the durable bytes, read just before the truncation."""

    size: int
    dirty: bool = False
    saved: bytes | None = None


@dataclass(frozen=True)
class EntryOp:
    """One directory-entry operation, recorded until the directories it changed are
    fsynced. Paths are relative to the shim's root."""

    seq: int
    kind: EntryKind
    path: Path
    """The name created or removed, or the source of a rename or link."""
    target: Path | None
    """The new name of a rename or link."""
    dirs: tuple[FileKey, ...]
    """The directories whose fsync after ``seq`` makes the operation durable."""
    file: FileKey | None
    """The file the entry names (for unlink: the file removed)."""
    saved: bytes | None = None
    """unlink: the removed file's bytes; rename: the bytes of a file the target replaced."""
    saved_file: FileKey | None = None
    """rename: the file the target named before, if any."""

    def names(self) -> tuple[Path, ...]:
        return (self.path,) if self.target is None else (self.path, self.target)

    def __str__(self) -> str:
        where = f"{self.path} -> {self.target}" if self.target is not None else str(self.path)
        return f"{self.kind} {where}"


def _conflict(a: EntryOp, b: EntryOp) -> bool:
    """Whether two operations touch the same name, or one touches a directory above a
    name the other touches: then their order matters and is kept."""
    return any(x == y or x in y.parents or y in x.parents
               for x in a.names() for y in b.names())


@dataclass
class CrashReport:
    """What :meth:`PowerLossFileSystem.crash` did to the files."""

    undone: list[str] = field(default_factory=list)
    """Directory operations that did not survive the power cut."""
    kept: list[str] = field(default_factory=list)
    """Directory operations that were not durable yet but survived by chance."""
    files: list[str] = field(default_factory=list)
    """Files whose unsynced bytes were dropped, torn or garbled, and how."""

    @property
    def changed(self) -> bool:
        return bool(self.undone or self.files)

    def __str__(self) -> str:
        lines = [f"undone: {u}" for u in self.undone] + [f"kept: {k}" for k in self.kept]
        return "\n".join(lines + [f"file: {f}" for f in self.files]) or "nothing to lose"


class _TrackedAppendFile(AppendFile):
    """An AppendFile whose truncation the power-loss shim sees (``truncate`` is no
    primitive of the storage layer: it is only ever followed by an fdatasync or by the
    writer giving up, or cuts off a record never synced, a rejected append's)."""

    def __init__(self, fs: PowerLossFileSystem, handle: AppendFile) -> None:
        super().__init__(fs, handle.path, handle._fd, handle.size)
        self._plfs = fs

    def truncate(self, size: int) -> None:
        self._plfs._before_truncate(self._fd)
        super().truncate(size)


class PowerLossFileSystem(InjectingFileSystem):
    """Performs every operation and records what a power cut could still take away;
    :meth:`crash` then takes it away from the real files under ``root``.

    The model (strict POSIX durability on Linux, as SQLite's crash-test VFS, RocksDB's
    ``FaultInjectionTestFS`` and the ALICE study assume, rather than the stronger
    ordering that ext4's default ``data=ordered`` mode happens to give):

    - **File data.** Bytes written to a file are durable once an ``fdatasync`` of that
      file returned. At a crash the bytes appended since then are dropped, kept, or torn:
      a random prefix of them survives, and the end of that prefix may be garbage (random
      bytes or zeros: the file's size reached the disk, its data did not). Durable bytes
      are never touched. A file truncated since its last fdatasync comes back either as
      it is or as it was at that fdatasync.
    - **Directory entries.** Creating a file (``open_append(create=True)``), a rename, a
      link and an unlink are durable once every directory they changed was fsynced after
      them (a rename between two directories needs both). At a crash each operation that
      is not durable is independently kept or undone: a create is removed, a rename is
      moved back (restoring the file it replaced), a link's new name is removed, an
      unlinked file is restored from a copy taken when it was unlinked.
    - **Order.** Operations touching the same name (or a directory above it) keep their
      order: one is undone whenever an earlier one on the same name is undone, and an
      operation that is durable makes the earlier ones on its names durable too (a
      journal commits in order). Operations on unrelated names are independent, which is
      weaker than any real journaling file system and so finds more bugs.

    Simplifications: the whole tree under ``root`` is assumed durable when the shim is
    created (files it never saw written keep their content); ``mkdir`` and ``rmdir`` are
    not primitives of the storage layer and count as durable at once (lamina fsyncs the
    parent right after creating a directory, and removing one only removes garbage);
    writes are appends (lamina opens every file O_APPEND), or overwrite bytes appended since
    the last fdatasync (the WAL's record headers: ``os_pwrite``); metadata other than names and
    sizes (mtimes, permissions) is not modelled; temp files that exception handlers
    remove behind the storage layer's back after an in-place cut stay removed.

    Two ways to crash:

    - **In place**: ``cut_at=n`` turns the power off right before primitive operation
      ``n`` (it and every later file operation raise :class:`PowerCut`), or the caller
      stops the code under test in any other way; then ``crash(rng)`` rewrites the files
      under ``root`` and the shim starts afresh (power back on, everything on disk
      durable).
    - **Into a copy**: ``crash(rng, into=dest)`` copies ``root`` to ``dest`` and simulates
      the crash there, leaving the real files and the records alone, so the code under
      test carries on. Called from ``on_op`` (run before every primitive operation), one
      run yields a crash image at as many points as wanted.

    Real fdatasync and directory fsync calls are skipped unless ``real_sync`` is set: the
    simulation, not the disk, decides what a crash keeps.
    """

    def __init__(self, root: Path | str, *, cut_at: int | None = None,
                 on_op: Callable[[Op], None] | None = None, real_sync: bool = False,
                 record: bool = False) -> None:
        super().__init__(record=record)
        self.root = _abs(root)
        self.real_sync = real_sync
        """Whether fdatasync and directory fsync also reach the real disk. The shim decides
        what survives a simulated crash by itself, so by default they do not (they would
        only cost time)."""
        self.cut_at = cut_at
        self.on_op = on_op
        self.cut = False
        """True once the power is off."""
        self._jmu = threading.RLock()
        self._seq = 0
        self._files: dict[FileKey, _FileRecord] = {}
        self._ops: list[EntryOp] = []
        self._dir_synced: dict[FileKey, int] = {}

    # --- what is not durable yet --------------------------------------------------------
    def unsynced(self) -> tuple[list[str], list[Path]]:
        """The directory operations not durable yet, and the files (by a current name, if
        any) holding bytes that are not: what a crash now could take away."""
        with self._jmu:
            ops = [str(op) for op in self._ops if not self._durable(op)]
            dirty = {k for k, r in self._files.items() if r.dirty}
        names: list[Path] = []
        for rel, key in self._walk().items():
            if key in dirty:
                names.append(rel)
        return ops, sorted(names)

    # --- hooks and primitives --------------------------------------------------------------
    def before(self, op: Op) -> None:
        if self.cut or (self.cut_at is not None and op.number >= self.cut_at):
            self.cut = True
            raise PowerCut(f"power cut before {op}")
        if self.on_op is not None:
            self.on_op(op)

    def _check_power(self) -> None:
        if self.cut:
            raise PowerCut("the power is off")

    def os_write(self, fd: int, data: memoryview, path: Path) -> int:
        key = _key(os.fstat(fd))
        with self._jmu:
            if key not in self._files:  # first seen: what it holds now is durable
                self._files[key] = _FileRecord(size=os.fstat(fd).st_size)
        n = super().os_write(fd, data, path)
        with self._jmu:
            self._files[key].dirty = True
        return n

    def os_pwrite(self, fd: int, data: bytes, offset: int, path: Path) -> int:
        """A write inside the file: the WAL's record header, over the zeros of a record
        written just before, which nothing acknowledged follows. From ``offset`` on the
        file counts as not durable: a crash may drop, keep or tear those bytes as it does
        appended ones. (A group commit's fdatasync running meanwhile may have counted the
        unsealed record durable; its bytes are the writer's alone, never acknowledged.)"""
        key = _key(os.fstat(fd))
        with self._jmu:
            rec = self._files.get(key)
            if rec is None:
                raise AssertionError(f"pwrite at {offset} of {path}, a file never written "
                                     "through this shim")
            rec.size = min(rec.size, offset)
            rec.dirty = True
        return super().os_pwrite(fd, data, offset, path)

    def os_fdatasync(self, fd: int, path: Path) -> None:
        key = _key(os.fstat(fd))
        if self.real_sync:
            super().os_fdatasync(fd, path)
        else:
            self._run("fdatasync", path, _nothing)
        with self._jmu:
            self._files[key] = _FileRecord(size=os.fstat(fd).st_size)

    def os_fsync_dir(self, path: Path) -> None:
        key = _key(os.stat(path))
        if self.real_sync:
            super().os_fsync_dir(path)
        else:
            self._run("fsync_dir", path, _nothing)
        with self._jmu:
            self._seq += 1
            self._dir_synced[key] = self._seq
            # Durable operations at the head of the journal can no longer be undone, nor
            # constrain later ones: forget them (and the bytes they saved).
            while self._ops and self._durable(self._ops[0]):
                self._ops.pop(0)

    def os_rename(self, src: Path, dst: Path) -> None:
        rel_src, rel_dst = self._rel(src), self._rel(dst)
        if rel_src is None or rel_dst is None:
            super().os_rename(src, dst)
            return
        dirs = (self._dir_key(src), self._dir_key(dst))
        moved = _key(os.lstat(src))
        saved, saved_file = self._capture(dst)
        super().os_rename(src, dst)
        self._entry("rename", rel_src, rel_dst, dirs=dirs, file=moved, saved=saved,
                    saved_file=saved_file)

    def os_link(self, src: Path, dst: Path) -> None:
        rel_src, rel_dst = self._rel(src), self._rel(dst)
        super().os_link(src, dst)
        if rel_src is not None and rel_dst is not None:
            self._entry("link", rel_src, rel_dst, dirs=(self._dir_key(dst),),
                        file=_key(os.lstat(dst)))

    def os_unlink(self, path: Path) -> None:
        rel = self._rel(path)
        if rel is None or not os.path.lexists(path):
            super().os_unlink(path)
            return
        dirs = (self._dir_key(path),)
        saved, file = self._capture(path)
        super().os_unlink(path)
        self._entry("unlink", rel, None, dirs=dirs, file=file, saved=saved)

    def open_append(self, path: Path, *, create: bool = False) -> AppendFile:
        self._check_power()
        handle = super().open_append(path, create=create)
        tracked = _TrackedAppendFile(self, handle)
        rel = self._rel(path)
        if create and rel is not None:
            key = _key(os.fstat(tracked._fd))
            with self._jmu:
                self._files[key] = _FileRecord(size=0)
            self._entry("create", rel, None, dirs=(self._dir_key(path),), file=key)
        return tracked

    def _before_truncate(self, fd: int) -> None:
        self._check_power()
        key = _key(os.fstat(fd))
        with self._jmu:
            rec = self._files.setdefault(key, _FileRecord(size=os.fstat(fd).st_size))
            if rec.saved is None:
                rec.saved = _read_fd(fd)[:rec.size]
            rec.dirty = True

    # --- bookkeeping ---------------------------------------------------------------------
    def _rel(self, path: Path | str) -> Path | None:
        p = _abs(path)
        if p == self.root or self.root in p.parents:
            return p.relative_to(self.root)
        return None

    @staticmethod
    def _dir_key(path: Path) -> FileKey:
        return _key(os.stat(_abs(path).parent))

    @staticmethod
    def _capture(path: Path) -> tuple[bytes | None, FileKey | None]:
        """The bytes and identity of the regular file at ``path``, if there is one."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None, None
        if not os.path.isfile(path) or os.path.islink(path):
            return None, _key(st)
        return Path(path).read_bytes(), _key(st)

    def _entry(self, kind: EntryKind, path: Path, target: Path | None, *,
               dirs: tuple[FileKey, ...], file: FileKey | None, saved: bytes | None = None,
               saved_file: FileKey | None = None) -> None:
        with self._jmu:
            self._seq += 1
            self._ops.append(EntryOp(self._seq, kind, path, target, tuple(dict.fromkeys(dirs)),
                                     file, saved, saved_file))

    def _durable(self, op: EntryOp) -> bool:
        return all(self._dir_synced.get(d, 0) > op.seq for d in op.dirs)

    def _walk(self) -> dict[Path, FileKey]:
        """Every file under the root (relative path) and its identity, now."""
        out: dict[Path, FileKey] = {}
        for top, _dirs, files in os.walk(self.root):
            for name in files:
                p = Path(top) / name
                try:
                    out[p.relative_to(self.root)] = _key(os.lstat(p))
                except FileNotFoundError:
                    continue
        return out

    # --- the crash -----------------------------------------------------------------------
    def crash(self, rng: random.Random, *, into: Path | None = None,
              keep_probability: float = 0.5, garble_probability: float = 0.3) -> CrashReport:
        """Simulate a power cut now (see the class docstring): on the files under ``root``,
        or on a copy of them at ``into`` (which must not exist). Every choice is drawn from
        ``rng``, so a seed replays a crash exactly."""
        with self._jmu:
            names = self._walk()
            target = self.root
            if into is not None:
                target = _abs(into)
                shutil.copytree(self.root, target, symlinks=True)
            report = CrashReport()
            ops = list(self._ops)
            forced = [self._durable(op) for op in ops]
            for i in reversed(range(len(ops))):  # a durable operation makes its past durable
                if forced[i]:
                    for j in range(i):
                        if not forced[j] and _conflict(ops[j], ops[i]):
                            forced[j] = True
            keep: list[bool] = []
            for i, op in enumerate(ops):
                kept = forced[i] or (all(keep[j] for j in range(i) if _conflict(ops[j], op))
                                     and rng.random() < keep_probability)
                keep.append(kept)
                if kept and not forced[i]:
                    report.kept.append(str(op))
            for op, kept in reversed(list(zip(ops, keep, strict=True))):
                if not kept:
                    _undo(op, target, names)
                    report.undone.append(str(op))
            by_file: dict[FileKey, list[Path]] = {}
            for rel, key in sorted(names.items()):
                by_file.setdefault(key, []).append(rel)
            for key, rec in self._files.items():
                if not rec.dirty:
                    continue
                paths = [target / rel for rel in by_file.get(key, ())]
                paths = [p for p in paths if p.is_file()]
                if not paths:
                    continue
                content = paths[0].read_bytes()
                new, what = _lose_data(rec, content, rng, garble_probability)
                if new != content:
                    for p in paths:
                        _overwrite(p, new)
                if what:
                    report.files.append(f"{paths[0].relative_to(target)}: {what}")
            if into is None:
                self._files.clear()
                self._ops.clear()
                self._dir_synced.clear()
                self.cut = False
                self.cut_at = None
            return report


def _nothing() -> None:
    pass


def _read_fd(fd: int) -> bytes:
    """The content of the file open (perhaps write-only) as ``fd``."""
    with open(f"/proc/self/fd/{fd}", "rb") as f:
        return f.read()


def _overwrite(path: Path, data: bytes) -> None:
    """Replace the content of ``path`` in place (same inode, so hard links follow)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.pwrite(fd, view, len(data) - len(view)):]
    finally:
        os.close(fd)


def _move_names(names: dict[Path, FileKey], src: Path, dst: Path) -> None:
    """Rename ``src`` (a file or a directory) to ``dst`` in the name map."""
    for rel in [r for r in names if r == src or src in r.parents]:
        names[dst / rel.relative_to(src)] = names.pop(rel)


def _undo(op: EntryOp, target: Path, names: dict[Path, FileKey]) -> None:
    """Take back one directory operation in the tree at ``target``."""
    if op.kind in ("create", "link"):
        name = op.path if op.kind == "create" else op.target
        assert name is not None
        p = target / name
        if p.is_file() or p.is_symlink():
            p.unlink()
        names.pop(name, None)
    elif op.kind == "rename":
        assert op.target is not None
        src, dst = target / op.path, target / op.target
        if os.path.lexists(dst):
            src.parent.mkdir(parents=True, exist_ok=True)
            os.rename(dst, src)
            _move_names(names, op.target, op.path)
        if op.saved is not None and op.saved_file is not None:
            dst.write_bytes(op.saved)
            names[op.target] = op.saved_file
    elif op.saved is not None and op.file is not None:  # unlink of a regular file
        p = target / op.path
        if not os.path.lexists(p):
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(op.saved)
            names[op.path] = op.file


def _lose_data(rec: _FileRecord, content: bytes, rng: random.Random,
               garble_probability: float) -> tuple[bytes, str]:
    """The content a file has after the power cut, and what happened to it."""
    if rec.saved is not None:  # truncated since its last fdatasync
        if rng.random() < 0.5:
            return rec.saved, f"reverted to its {len(rec.saved)} synced bytes"
        return content, "kept as truncated"
    if len(content) <= rec.size:
        return content, ""
    durable, extra = content[:rec.size], content[rec.size:]
    roll = rng.random()
    keep = 0 if roll < 1 / 3 else len(extra) if roll < 2 / 3 else rng.randint(0, len(extra))
    kept = bytearray(extra[:keep])
    what = f"kept {keep} of {len(extra)} unsynced bytes"
    if keep and rng.random() < garble_probability:
        n = rng.randint(1, keep)
        kept[-n:] = bytes(n) if rng.random() < 0.5 else rng.randbytes(n)
        what += f", the last {n} garbled"
    return durable + bytes(kept), what
