"""Fail points: named places where a test or drill can make lamina crash or fail.

Switched on by configuration only: the ``LAMINA_FAILPOINTS`` environment variable, or at
run time :func:`configure` / :func:`clear` / the context manager :func:`active`::

    LAMINA_FAILPOINTS="trace.after_batch_written=kill@2,fs.before_rename=error"

    with failpoints.active("wal.mid_record=error@5"):
        ...  # the fifth record written in this process is torn, then StorageError(EIO)

Actions: ``kill`` (SIGKILL this process), ``error`` (raise StorageError(EIO) there),
``sleep:<seconds>``; ``@N`` fires on the N-th time the point is reached (default: the
first). When nothing is configured, :func:`hit` is one truthiness test of an empty dict.

The environment variable is read at import but parsed at start-up, never at import (a
malformed value must not make ``import lamina`` fail): the CLI and the daemon call
:func:`load_env` first and exit with a configuration error (code 2); a library process
that skips that gets the :class:`~lamina.errors.ConfigError` at the first fail point it
reaches (a set variable leaves a placeholder in ``ACTIVE`` until parsed, so the one-test
fast path still leads there).

Passes are counted per process, unless ``LAMINA_FAILPOINTS_SHARED`` names a directory:
then every process with that setting counts in one file per point there (one byte
appended per pass), so ``@N`` fires once across a daemon and all its Spark Python workers.
Without it a point inside a Spark task fires in every worker: PySpark ends a worker whose
task raised, and the retried task runs in a fresh process that counts from zero again.

The points (each at a step boundary of the crash-safety rules, docs/architecture.md):

| name | where |
|---|---|
| ``wal.mid_record`` | the WAL writer has written half of a record |
| ``wal.before_seal`` | an update record is written with a zero header, not yet sealed |
| ``wal.after_write`` | a record is written, before its fsync |
| ``fs.before_rename`` / ``fs.after_rename`` | around every rename of the storage layer |
| ``compacter.pack_task`` | a task of a pack starts (outside its step: fails the whole job) |
| ``compacter.pack_collected`` | a pack's Spark job returned; none of its steps committed yet |
| ``trace.after_batch_written`` | a conversion's files are durable, the state not yet |
| ``trace.mid_merge`` | a merge's files are durable, the state not yet |
| ``trace.after_state_published`` | the new state is durable, inputs not yet deleted |
| ``trace.mid_segment_delete`` | between deletions of converted segments |
| ``gc.before_delete`` / ``gc.after_delete`` | around garbage collection's deletions |
| ``ingest.binding_sealed`` | a source's binding is durable, its outputs not yet written |
| ``ingest.outputs_appended`` | a binding's data is in every output, not yet sealed |
| ``ingest.outputs_sealed`` | every output is sealed past the binding, offset not committed |
| ``ingest.offset_committed`` | the source was told the offset it may release |
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from lamina.errors import ConfigError, StorageError

ENV = "LAMINA_FAILPOINTS"
SHARED_ENV = "LAMINA_FAILPOINTS_SHARED"
NAMES = ("wal.mid_record", "wal.before_seal", "wal.after_write",
         "fs.before_rename", "fs.after_rename",
         "compacter.pack_task", "compacter.pack_collected",
         "trace.after_batch_written", "trace.mid_merge",
         "trace.after_state_published", "trace.mid_segment_delete", "gc.before_delete",
         "gc.after_delete",
         "ingest.binding_sealed", "ingest.outputs_appended", "ingest.outputs_sealed",
         "ingest.offset_committed")
_UNPARSED = "<LAMINA_FAILPOINTS not parsed yet>"  # ACTIVE's placeholder key, never a name


@dataclass
class _Point:
    action: str
    nth: int
    hits: int = 0


def parse(spec: str, *, source: str = ENV) -> dict[str, _Point]:
    """Parse a fail-point spec (``name=action[@N],...``); an unknown name or action, or a
    bad ``@N`` or sleep time, raises ConfigError naming ``source`` and the item."""
    points: dict[str, _Point] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, rest = item.partition("=")
        name = name.strip()
        if not sep or name not in NAMES:
            raise ConfigError(f"{source}: unknown fail point {name!r} in {item!r}; use "
                              f"name=action[@N] with a name among {', '.join(NAMES)}")
        action, at, nth_s = rest.strip().partition("@")
        if action.startswith("sleep:"):
            try:
                seconds = float(action.split(":", 1)[1])
            except ValueError:
                seconds = -1.0
            if not 0 <= seconds < float("inf"):
                raise ConfigError(f"{source}: bad sleep time in {item!r}; use sleep:<seconds "
                                  ">= 0>, e.g. sleep:0.5")
        elif action not in ("kill", "error"):
            raise ConfigError(f"{source}: unknown action {action!r} for {name}; use kill, "
                              "error or sleep:<seconds>")
        try:
            nth = int(nth_s) if at else 1
        except ValueError:
            nth = 0
        if nth < 1:
            raise ConfigError(f"{source}: bad count in {item!r}; @N must be a whole number "
                              ">= 1 (the pass that fires)")
        points[name] = _Point(action, nth)
    return points


@dataclass
class _Config:
    shared: str | None = None
    """Directory counting passes across processes (``LAMINA_FAILPOINTS_SHARED``)."""
    env_spec: str | None = None
    """The environment's spec while not yet parsed."""


ACTIVE: dict[str, _Point] = {}
"""The configured points by name; empty when none (the fast path of :func:`hit`)."""
CONFIG = _Config()


def read_env() -> None:
    """Note the environment's settings without parsing them (safe at import; a process
    forked after the import, as the tests' fork server's children, calls it again)."""
    CONFIG.env_spec = os.environ.get(ENV) or None
    CONFIG.shared = os.environ.get(SHARED_ENV) or None
    ACTIVE.clear()
    if CONFIG.env_spec is not None:
        ACTIVE[_UNPARSED] = _Point("unparsed", 0)


def load_env() -> None:
    """Parse ``LAMINA_FAILPOINTS`` now: what the CLI and the daemon do at start-up, so a bad
    value is a ConfigError there. Idempotent; a no-op once parsed or when unset."""
    if _UNPARSED not in ACTIVE:
        return
    points = parse(CONFIG.env_spec or "")  # on error still unparsed: every use raises
    ACTIVE.clear()
    ACTIVE.update(points)
    CONFIG.env_spec = None


def configure(spec: str, *, shared: str | os.PathLike[str] | None = None) -> None:
    """Replace the configured points with ``spec`` (same syntax as the environment
    variable), counting passes from zero; ``shared`` names a directory whose per-point
    files count passes across processes (see ``LAMINA_FAILPOINTS_SHARED``). A bad spec
    raises ConfigError and changes nothing."""
    points = parse(spec, source="fail point spec")
    ACTIVE.clear()
    ACTIVE.update(points)
    CONFIG.shared = os.fspath(shared) if shared is not None else None
    CONFIG.env_spec = None


def clear() -> None:
    """Switch every fail point off (the environment variable is not read again)."""
    ACTIVE.clear()
    CONFIG.shared = None
    CONFIG.env_spec = None


@contextmanager
def active(spec: str, *, shared: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Configure ``spec`` for the ``with`` block, then restore what was configured before
    (points, their pass counts and the shared directory)."""
    saved, shared_before, env_before = dict(ACTIVE), CONFIG.shared, CONFIG.env_spec
    configure(spec, shared=shared)
    try:
        yield
    finally:
        ACTIVE.clear()
        ACTIVE.update(saved)
        CONFIG.shared, CONFIG.env_spec = shared_before, env_before


read_env()


def hit(name: str) -> None:
    """Reach fail point ``name``: nothing happens unless it is configured."""
    if ACTIVE and fires(name):
        act(name)


def fires(name: str) -> bool:
    """Count a pass through ``name``; True if this pass is the one that fires. For points
    where the caller must do something first (``wal.mid_record`` tears the record), then
    calls :func:`act`. Parses the environment variable first if nothing did yet."""
    if _UNPARSED in ACTIVE:
        load_env()
    p = ACTIVE.get(name)
    if p is None:
        return False
    p.hits = _shared_pass(CONFIG.shared, name) if CONFIG.shared else p.hits + 1
    return p.hits == p.nth


def _shared_pass(directory: str, name: str) -> int:
    """Count one pass in ``directory``'s file for ``name``; the count so far, across every
    process (an O_APPEND write is atomic, and the offset after it is this pass's number)."""
    fd = os.open(os.path.join(directory, f"{name}.hits"),
                 os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, b".")
        return os.lseek(fd, 0, os.SEEK_CUR)
    finally:
        os.close(fd)


def act(name: str) -> None:
    """Carry out the action configured for ``name``."""
    action = ACTIVE[name].action
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)  # SIGKILL is delivered asynchronously; never run past the point
    elif action == "error":
        raise StorageError(errno.EIO, f"fail point {name}: injected I/O error")
    else:
        time.sleep(float(action.split(":", 1)[1]))
