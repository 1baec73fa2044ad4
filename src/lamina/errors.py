"""Every error lamina raises, under one root: :class:`LaminaError`.

The tree is small on purpose; callers catch a branch, not a leaf:

- :class:`InvalidArgumentError` (also a ``ValueError``): the call was wrong and nothing
  was written. Leaves say which argument: names, schemas, times, frontiers, ``as_of``.
  :class:`DiffOutOfRangeError`: an appended ``_diff`` outside the per-update bound.
- :class:`DiffOverflowError` (also an ``ArithmeticError``): diffs summed past int64 where
  the sum must be an int64 (a snapshot row); carries the offending rows and the rest.
- :class:`RelationNotFoundError`, :class:`RelationExistsError`.
- :class:`LockedError`: another writer or compacter holds the lock.
- :class:`CorruptionError`: stored bytes fail a checksum or an invariant; names the file
  and, where it applies, the byte offset. :class:`QuarantinedError` is raised for a
  relation that was quarantined because of one.
- :class:`StorageError`: the operating system failed a write, fsync, rename or read.
  :class:`WriterFailedError` follows one: the writer stopped and must be reopened.
  :class:`ObjectNotFoundError` (also a ``FileNotFoundError``): no object under a key.
  :class:`PathNotFoundError` (also a ``FileNotFoundError``): a file operation's path is
  gone, its directory removed or renamed away meanwhile.
- :class:`StateConflictError`: another writer published the trace state version first.
  :class:`ObjectExistsError`: a conditional create found another writer's object.
  :class:`StalePlanError`: a step was planned against a state this writer has since
  replaced (re-plan from the state on disk; nothing is corrupt).
- :class:`ConfigError`: settings could not be validated.
- :class:`BacklogTimeoutError` (also a ``TimeoutError``): an append waited for the
  compacter to shrink the WAL backlog below ``wal_backlog_bytes`` and it did not
  (lamina.wal.throttle); nothing was written.
- :class:`JobError`: a Spark job failed (after retries, where the caller retries).
  :class:`JobCancelledError`: a job was cancelled (shutdown, a dropped relation).
- :class:`ForkServerError`: a fork server (the drills' starter of short-lived processes)
  could not start, refused to fork, or died.
- :class:`SourceError`: an ingestion source failed: :class:`SourceTransientError` is
  retried with backoff, :class:`SourceStalledError` (with a ``hint``) stalls outputs.
  :class:`SourceProtocolError`: upstream bytes break the wire protocol (message, byte).

Every message says what was wrong and what to do about it, in bounded length: a damaged
file is described (:func:`decode_failure`), never quoted.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa


class LaminaError(Exception):
    """Root of every error lamina raises."""


class InvalidArgumentError(LaminaError, ValueError):
    """A call was given a bad argument; nothing was written."""


class InvalidNameError(InvalidArgumentError):
    """A relation name breaks the naming rule."""


class SchemaError(InvalidArgumentError):
    """A schema or an update table does not fit the relation's schema."""


class UpdateBeforeUpperError(InvalidArgumentError):
    """An update's time is below the sealed upper: that time is closed."""


class FrontierRegressionError(InvalidArgumentError):
    """A seal or compaction frontier would go backwards (or beyond what is allowed)."""


class AsOfOutOfRangeError(InvalidArgumentError):
    """A read asked for ``as_of`` outside ``[since, upper)``."""


class SubscriptionBehindError(AsOfOutOfRangeError):
    """A subscription's frontier fell behind the relation's ``since``: the history it still
    needed was compacted away (its times forwarded), so it cannot continue exactly. Start a
    new subscription from a snapshot at a time in ``[since, upper)``."""


class DiffOutOfRangeError(InvalidArgumentError):
    """An appended ``_diff`` lies outside the per-update bound
    (:data:`lamina.schema.MAX_DIFF`); the append wrote nothing."""


class DiffOverflowError(LaminaError, ArithmeticError):
    """The diffs of a row summed past int64 where the result must be an int64 (a snapshot's
    ``_diff``). Stored batches never raise it: they keep such a sum exactly, as a carry
    (:func:`lamina.consolidate.consolidate`).

    ``overflows``: the offending rows with their exact sums (``_diff`` as
    decimal128(38, 0)); ``rest``: every other row of the result, exact and in order, for a
    caller that can do without the offending rows. Both are None where the error was
    rebuilt from a message only (a Spark task's record)."""

    def __init__(self, message: str, *, overflows: pa.Table | None = None,
                 rest: pa.Table | None = None) -> None:
        super().__init__(message)
        self.overflows = overflows
        self.rest = rest


class RelationNotFoundError(LaminaError, LookupError):
    """No relation has that name."""


class RelationReplacedError(RelationNotFoundError, FileNotFoundError):
    """The relation a long-lived process works for no longer holds its name: dropped, and
    perhaps created again under it (another ``relation_id``). Also a FileNotFoundError, so
    code that treats a vanished WAL directory as a drop treats this the same."""


class RelationExistsError(LaminaError):
    """A relation with that name already exists."""


class LockedError(LaminaError):
    """Another writer or compacter holds the lock on this relation or data directory."""


class CorruptionError(LaminaError):
    """Stored bytes fail a checksum, a framing rule or an invariant."""

    def __init__(self, message: str, *, path: Path | str | None = None,
                 offset: int | None = None) -> None:
        where = ""
        if path is not None:
            where = f" [{path}" + (f" at byte {offset}" if offset is not None else "") + "]"
        super().__init__(message + where)
        self.reason = message
        """The message without the location (what travels from a Spark task)."""
        self.path: Path | str | None = (
            path if path is None or isinstance(path, Path) or "://" in path else Path(path))
        """Where: a local :class:`~pathlib.Path`, or an object's URL (``s3://bucket/key``)."""
        self.offset = offset


class QuarantinedError(LaminaError):
    """The relation was quarantined after corruption was found; it is refused until repaired."""


class StorageError(LaminaError, OSError):
    """The operating system failed a file operation."""


class WriterFailedError(StorageError):
    """A writer stopped after a write or fsync error; reopen the store to recover from disk."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """An object store has no object under the key asked for (also a ``FileNotFoundError``,
    so code that treats a file vanishing under a reader as normal treats it the same)."""


class PathNotFoundError(StorageError, FileNotFoundError):
    """A write, sync, rename or open found no file or directory at its path (ENOENT): its
    directory was removed or renamed away meanwhile, as a dropped relation's WAL directory
    is under the compacter. Also a ``FileNotFoundError``, so code that treats a vanished
    path as a drop treats it the same."""


class StateConflictError(LaminaError):
    """Another writer published the trace state version this writer meant to publish."""


class ObjectExistsError(StateConflictError):
    """A conditional create (``ObjectStore.put_if_absent``) found another writer's object
    under the key: the race for it was lost and nothing was written."""


class StalePlanError(StateConflictError):
    """A step's plan no longer matches the trace state it would be committed against (the
    state moved on since the plan was made): nothing was committed and nothing is corrupt;
    the caller re-plans from the state on disk."""


class ConfigError(LaminaError, ValueError):
    """Settings could not be validated."""


class BacklogTimeoutError(LaminaError, TimeoutError):
    """An append waited ``wal_backlog_timeout`` seconds for the relation's WAL backlog to
    shrink below ``wal_backlog_bytes`` and it did not (lamina.wal.throttle); the append
    wrote nothing."""


class JobError(LaminaError):
    """A Spark job failed."""


class JobCancelledError(JobError):
    """A compaction job was cancelled (shutdown, a dropped relation, an operator) before
    its output was committed: nothing was committed; it runs again from its inputs."""


class ForkServerError(LaminaError):
    """A fork server (lamina.forkserver) could not start, refused to fork, or died: the
    children it started may still run, but their exit status is lost."""


class SourceError(LaminaError):
    """An ingestion source failed to read its upstream."""


class SourceTransientError(SourceError):
    """An upstream error worth retrying (connection lost); the service retries with backoff."""


class SourceProtocolError(SourceError):
    """An upstream sent bytes that break its wire protocol; names the message and byte."""

    def __init__(self, message: str, *, message_type: str = "?", offset: int = 0) -> None:
        super().__init__(message)
        self.message_type = message_type
        self.offset = offset


class SourceStalledError(SourceError):
    """A definite upstream error: retrying cannot heal it; ``hint`` says what to do."""

    def __init__(self, message: str, *, hint: str = "", table: str | None = None) -> None:
        super().__init__(message + (f" ({hint})" if hint else ""))
        self.error = message
        self.hint = hint
        self.table = table


_QUOTED = 200
"""Characters of a third-party message quoted by :func:`decode_failure`."""


def decode_failure(exc: BaseException) -> str:
    """What a parser's exception says about damaged bytes, in one short clause: the
    ``repr`` of a ``UnicodeDecodeError`` carries the whole input (a damaged state file's
    every byte), so messages about stored data describe it with this instead."""
    import json

    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
    if isinstance(exc, json.JSONDecodeError):
        return f"not valid JSON ({exc.msg} at offset {exc.pos})"
    if isinstance(exc, KeyError):
        return f"field {str(exc.args[0])[:_QUOTED]!r} is missing"
    text = " ".join(str(exc).split())
    if len(text) > _QUOTED:
        text = text[:_QUOTED - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
