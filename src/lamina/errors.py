"""Every error lamina raises, under one root: :class:`LaminaError`.

The tree is small on purpose; callers catch a branch, not a leaf:

- :class:`InvalidArgumentError` (also a ``ValueError``): the call was wrong and nothing
  was written. Leaves say which argument: names, schemas, times, frontiers, ``as_of``.
- :class:`DiffOverflowError` (also an ``ArithmeticError``): diffs summed past int64.
- :class:`RelationNotFoundError`, :class:`RelationExistsError`.
- :class:`LockedError`: another writer or compacter holds the lock.
- :class:`CorruptionError`: stored bytes fail a checksum or an invariant; names the file
  and, where it applies, the byte offset. :class:`QuarantinedError` is raised for a
  relation that was quarantined because of one.
- :class:`StorageError`: the operating system failed a write, fsync, rename or read.
  :class:`WriterFailedError` follows one: the writer stopped and must be reopened.
- :class:`StateConflictError`: another writer published the trace state version first.
- :class:`ConfigError`: settings could not be validated.
- :class:`JobError`: a Spark job failed (after retries, where the caller retries).

Every message says what was wrong and what to do about it.
"""

from __future__ import annotations

from pathlib import Path


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


class DiffOverflowError(LaminaError, ArithmeticError):
    """Summing diffs of one row at one time left the int64 range."""


class RelationNotFoundError(LaminaError, LookupError):
    """No relation has that name."""


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
        self.path = Path(path) if path is not None else None
        self.offset = offset


class QuarantinedError(LaminaError):
    """The relation was quarantined after corruption was found; it is refused until repaired."""


class StorageError(LaminaError, OSError):
    """The operating system failed a file operation."""


class WriterFailedError(StorageError):
    """A writer stopped after a write or fsync error; reopen the store to recover from disk."""


class StateConflictError(LaminaError):
    """Another writer published the trace state version this writer meant to publish."""


class ConfigError(LaminaError, ValueError):
    """Settings could not be validated."""


class JobError(LaminaError):
    """A Spark job failed."""
