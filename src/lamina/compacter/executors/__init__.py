"""Executors: what carries out a relation's plans, between the pipeline and the engine.

A relation's pipeline (:mod:`lamina.compacter.pipeline`) decides what to do (a plan,
:mod:`lamina.trace.plan`) and commits what was done; an :class:`Executor` does it and
commits nothing. The executors, and what each one runs:

- :mod:`~lamina.compacter.executors.spark` (``executor = "spark"``, the default): the
  Spark jobs of :mod:`lamina.compacter.step` on the daemon's one SparkSession. Steps of
  many relations wait in one queue; small ones run packed, many relations per Spark job,
  large ones alone; the order and the slots are the policy of
  :mod:`~lamina.compacter.executors.schedule`.
- :mod:`~lamina.compacter.executors.inprocess` (``executor = "inprocess"``): the pyarrow
  reference in threads of the daemon's process; no JVM, for small relations and tests.
- :mod:`~lamina.compacter.executors.reference`: the reference itself, what the Spark jobs
  are tested against row for row (and what the trace tests drive a trace with).

Both executors take the same calls (:class:`Executor`), bound how many jobs run at once,
and raise the same errors: corruption as :class:`~lamina.errors.CorruptionError` (the
pipeline quarantines the relation), a cancel as :class:`~lamina.errors.JobCancelledError`,
anything else as :class:`~lamina.errors.JobError` (retried by the pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from lamina.trace.batch import PartFile
from lamina.trace.plan import ConversionPlan, MergePlan
from lamina.trace.state import PendingPart
from lamina.trace.trace import Trace


@dataclass(frozen=True)
class ConversionResult:
    """What a conversion wrote and read (nothing of it committed yet)."""

    parts: list[PartFile]
    """The batch's parts, in order."""
    pending: list[PendingPart]
    """The new pending parts, one per bucket, in time order."""
    input_rows: int
    """Updates decoded: those of the plan's WAL segments plus the rows of the pending
    parts it consumes (future updates are thus counted once when they are first converted
    and again when the conversion that reaches their time brings them in)."""


class Executor(Protocol):
    """Carries out plans; the caller commits their output. Every method is called from
    the event loop.

    ``waiting_since`` (seconds since the epoch) is how long the relation's work has been
    waiting: an executor that queues steps serves the oldest first (None: now)."""

    async def convert(self, relation: str, trace: Trace, plan: ConversionPlan, *,
                      waiting_since: float | None = None) -> ConversionResult: ...

    async def merge(self, relation: str, trace: Trace, plan: MergePlan, *,
                    waiting_since: float | None = None) -> list[PartFile]: ...

    def cancel_relation(self, relation: str) -> int:
        """Cancel the relation's waiting and running steps (their awaiters raise
        JobCancelledError at once; the other relations' steps go on); returns how many."""
        ...

    def cancel_all(self) -> int:
        """Cancel every waiting and running step; returns how many."""
        ...
