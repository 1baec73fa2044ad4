"""Fail points: named places where a test or drill can make lamina crash or fail.

Switched on by configuration only, through the ``LAMINA_FAILPOINTS`` environment
variable read at import::

    LAMINA_FAILPOINTS="trace.after_batch_written=kill@2,fs.before_rename=error"

Actions: ``kill`` (SIGKILL this process), ``error`` (raise StorageError(EIO) there),
``sleep:<seconds>``; ``@N`` fires on the N-th time the point is reached (default: the
first). When the variable is unset, :func:`hit` is one truthiness test of an empty dict.

Passes are counted per process, unless ``LAMINA_FAILPOINTS_SHARED`` names a directory:
then every process with that setting counts in one file per point there (one byte
appended per pass), so ``@N`` fires once across a daemon and all its Spark Python workers.
Without it a point inside a Spark task fires in every worker: PySpark ends a worker whose
task raised, and the retried task runs in a fresh process that counts from zero again.

The points (each at a step boundary of DESIGN §7):

| name | where |
|---|---|
| ``wal.mid_record`` | the WAL writer has written half of a record |
| ``wal.after_write`` | a record is written, before its fsync |
| ``fs.before_rename`` / ``fs.after_rename`` | around every rename of the storage layer |
| ``trace.after_batch_written`` | a conversion's files are durable, the state not yet |
| ``trace.mid_merge`` | a merge's files are durable, the state not yet |
| ``trace.after_state_published`` | the new state is durable, inputs not yet deleted |
| ``trace.mid_segment_delete`` | between deletions of converted segments |
| ``gc.before_delete`` / ``gc.after_delete`` | around garbage collection's deletions |
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass

from lamina.errors import StorageError

ENV = "LAMINA_FAILPOINTS"
SHARED_ENV = "LAMINA_FAILPOINTS_SHARED"
NAMES = ("wal.mid_record", "wal.after_write", "fs.before_rename", "fs.after_rename",
         "trace.after_batch_written", "trace.mid_merge", "trace.after_state_published",
         "trace.mid_segment_delete", "gc.before_delete", "gc.after_delete")


@dataclass
class _Point:
    action: str
    nth: int
    hits: int = 0


def parse(spec: str) -> dict[str, _Point]:
    """Parse a ``LAMINA_FAILPOINTS`` value; unknown names or actions raise ValueError."""
    points: dict[str, _Point] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, rest = item.partition("=")
        if not sep or name not in NAMES:
            raise ValueError(f"{ENV}: unknown fail point {name!r}; known: {', '.join(NAMES)}")
        action, _, nth = rest.partition("@")
        if action not in ("kill", "error") and not action.startswith("sleep:"):
            raise ValueError(f"{ENV}: unknown action {action!r} for {name}")
        points[name] = _Point(action, int(nth or 1))
    return points


ACTIVE: dict[str, _Point] = parse(os.environ.get(ENV, ""))
SHARED: str | None = os.environ.get(SHARED_ENV) or None


def hit(name: str) -> None:
    """Reach fail point ``name``: nothing happens unless it is configured."""
    if ACTIVE and fires(name):
        act(name)


def fires(name: str) -> bool:
    """Count a pass through ``name``; True if this pass is the one that fires. For points
    where the caller must do something first (``wal.mid_record`` tears the record), then
    calls :func:`act`."""
    p = ACTIVE.get(name)
    if p is None:
        return False
    p.hits = _shared_pass(SHARED, name) if SHARED else p.hits + 1
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
