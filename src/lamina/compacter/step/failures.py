"""Failures: how a task's error reaches the driver, and what the driver raises.

A lamina error raised in a task travels to the driver as a typed record
(:class:`TaskError`: format version, class name, message, path and byte offset), JSON in
base64 between markers in the task's exception text (:func:`encode_failure`), the only
thing Spark carries back. Every task function is wrapped by :func:`guarded`, which does
that. The driver finds the record in Spark's error text (:func:`translate`) and rebuilds
the error from its fields (:meth:`TaskError.rebuild`): CorruptionError as itself (it
quarantines the relation), a cancel as JobCancelledError, anything else as JobError naming
relation, step and the task's error class (retried). Everything else Spark or Py4J reports
becomes JobError with its root cause (:func:`root_cause`); a cancelled job raises
:class:`lamina.errors.JobCancelledError`. The in-process executor
(:mod:`lamina.compacter.executors.inprocess`) maps its errors through the same record
(:func:`task_error`), so both executors fail alike.

The record's format is versioned (:attr:`TaskError.FORMAT`): a driver refuses a record of
another format (run one lamina version on the driver and the executors).
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow as pa

from lamina.errors import CorruptionError, JobCancelledError, JobError, LaminaError

_TASK_MARK = "LAMINA-TASK-ERROR<"
_TASK_MARK_RE = re.compile(r"LAMINA-TASK-ERROR<([A-Za-z0-9+/=]+)>")


class TaskFailure(RuntimeError):
    """A lamina error raised in a task, carried to the driver in its message."""


@dataclass(frozen=True)
class TaskError:
    """A lamina error as data: what a task sends the driver instead of the exception."""

    FORMAT = 1

    type: str
    """The error's class name (``CorruptionError``, ``StorageError``, ...)."""
    message: str
    """The message without the location (``CorruptionError.reason``)."""
    path: str | None = None
    offset: int | None = None

    @classmethod
    def of(cls, exc: LaminaError) -> TaskError:
        if isinstance(exc, CorruptionError):
            return cls(type=type(exc).__name__, message=exc.reason,
                       path=str(exc.path) if exc.path is not None else None,
                       offset=exc.offset)
        return cls(type=type(exc).__name__, message=str(exc))

    def encode(self) -> str:
        doc = {"format": self.FORMAT, "type": self.type, "message": self.message,
               "path": self.path, "offset": self.offset}
        return base64.b64encode(json.dumps(doc).encode()).decode()

    @classmethod
    def decode(cls, blob: str) -> TaskError:
        doc = json.loads(base64.b64decode(blob))
        if doc.get("format") != cls.FORMAT:
            raise JobError(f"a Spark task reported an error in format {doc.get('format')!r}, "
                           f"this driver reads format {cls.FORMAT}: run one lamina version "
                           "on the driver and the executors")
        offset = doc.get("offset")
        return cls(type=str(doc["type"]), message=str(doc["message"]), path=doc.get("path"),
                   offset=int(offset) if offset is not None else None)

    def rebuild(self, context: str) -> LaminaError:
        """The error the driver raises: corruption as itself (it quarantines the
        relation), anything else as a retryable JobError. (A diff sum outside int64 raises
        nothing here: steps store it as a carry, lamina.consolidate.)"""
        if self.type == CorruptionError.__name__:
            return CorruptionError(self.message, path=self.path, offset=self.offset)
        if self.type == JobCancelledError.__name__:
            return JobCancelledError(f"{context} was cancelled: {self.message}")
        return JobError(f"{context} failed: {self.type}: {self.message} (nothing was "
                        "committed; the step is retried from its inputs)")


def task_error(exc: LaminaError, context: str) -> LaminaError:
    """What the driver raises for ``exc`` raised by a step's work (in a Spark task or in
    process): the same as if it had travelled as a :class:`TaskError`."""
    return TaskError.of(exc).rebuild(context)


def encode_failure(exc: LaminaError) -> TaskFailure:
    """The exception a task raises for ``exc``: its :class:`TaskError` between markers."""
    return TaskFailure(f"{_TASK_MARK}{TaskError.of(exc).encode()}> "
                       f"{type(exc).__name__}: {exc}")


def guarded(fn: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]
            ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """``fn`` with its lamina errors raised as :func:`encode_failure` of them."""
    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        try:
            yield from fn(batches)
        except LaminaError as exc:
            raise encode_failure(exc) from exc
    return run


def _error_text(exc: BaseException) -> str:
    parts = [str(exc)]
    java = getattr(exc, "java_exception", None)
    if java is not None:
        with contextlib.suppress(Exception):  # the gateway may be gone
            parts.append(str(java.toString()))
    return "\n".join(parts)


_CAUSE_RE = re.compile(r"^[\w.$]*(Error|Exception|Failure|Interrupted)\b[^\n]*", re.MULTILINE)


def root_cause(exc: BaseException) -> str:
    """One line naming what failed: a task's Python error, else Spark's or Py4J's message."""
    text = _error_text(exc)
    if "Traceback (most recent call last)" in text:
        lines = [m.group(0) for m in _CAUSE_RE.finditer(text)]
        if lines:
            return lines[-1][:500]
    for raw in text.splitlines():
        line = raw.strip().lstrip(": ").strip()
        if line and not line.startswith("An error occurred while calling"):
            return line[:500]
    return type(exc).__name__


def translate(exc: BaseException, context: str) -> LaminaError:
    """The lamina error for a failure reported by Spark or Py4J during ``context``."""
    text = _error_text(exc)
    match = _TASK_MARK_RE.search(text)
    if match:
        return TaskError.decode(match.group(1)).rebuild(f"{context} in a Spark task")
    if "SPARK_JOB_CANCELLED" in text or "cancelled part of cancelled job tags" in text:
        return JobCancelledError(f"{context} was cancelled: {root_cause(exc)}")
    return JobError(f"{context} failed in Spark: {root_cause(exc)} (nothing was committed; "
                    "the step can be retried from its inputs)")
