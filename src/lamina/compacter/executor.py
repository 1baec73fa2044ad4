"""Runs conversion and merge jobs off the event loop, bounded and cancellable.

:class:`Executor` is the seam between a relation's pipeline (what to do, and committing
it) and the engine that does it. Two implementations:

- :class:`SparkExecutor` (``executor = "spark"``, the default): the one long-lived
  SparkSession. Blocking Spark calls run in worker threads (``asyncio.to_thread``); each
  job runs under a Spark job tag ``lamina-rel-<relation>-<n>``
  (:func:`lamina.compacter.spark.relation_tag`), so a dropped relation
  (:meth:`Executor.cancel_relation`) or shutdown (:meth:`Executor.cancel_all`) cancels
  exactly those Spark jobs, and cancelling the asyncio task that awaits a job cancels its
  Spark jobs too.
- :class:`lamina.compacter.inprocess.InProcessExecutor` (``executor = "inprocess"``): the
  pyarrow reference (:mod:`lamina.trace.reference`) in threads of the daemon's process; no
  JVM, for small relations and fast tests.

Both bound the jobs running at once across relations with a semaphore, raise the same
errors (corruption and overflow as themselves, anything else as JobError, a cancel as
JobCancelledError) and commit nothing themselves: the pipeline commits a job's output.
A cancelled job's semaphore slot is released at once, even while its thread winds down.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from lamina.trace.batch import PartFile
from lamina.trace.plan import ConversionPlan, MergePlan
from lamina.trace.trace import Trace

if TYPE_CHECKING:
    from lamina.compacter.step.driver import ConversionResult

T = TypeVar("T")


class Executor(Protocol):
    """Carries out plans; the caller commits their output. Every method is called from
    the event loop."""

    async def convert(self, relation: str, trace: Trace,
                      plan: ConversionPlan) -> ConversionResult: ...

    async def merge(self, relation: str, trace: Trace, plan: MergePlan) -> list[PartFile]: ...

    def cancel_relation(self, relation: str) -> int:
        """Cancel the relation's running jobs (their awaiters raise JobCancelledError);
        returns how many were running."""
        ...

    def cancel_all(self) -> int:
        """Cancel every running job; returns how many were running."""
        ...


class SparkExecutor:
    """Spark-backed executor: lamina.compacter.step under per-relation job tags.
    ``stage_segments``: conversions copy their WAL segments into the trace store first, for
    executors that cannot read the daemon's disk (lamina.trace.staging)."""

    def __init__(self, spark: Any, max_concurrent: int, *, stage_segments: bool = False
                 ) -> None:
        self.spark = spark
        self.stage_segments = stage_segments
        self._sem = asyncio.Semaphore(max_concurrent)
        self._tags: dict[str, set[str]] = {}
        self._mu = threading.Lock()
        self._ids = itertools.count(1)

    def running(self) -> dict[str, list[str]]:
        """The job tags running, by relation."""
        with self._mu:
            return {r: sorted(t) for r, t in self._tags.items() if t}

    async def _run(self, relation: str, what: str, fn: Callable[[], T]) -> T:
        from lamina.compacter.spark import cancel_group, relation_tag, run_in_group

        tag = f"{relation_tag(relation)}-{next(self._ids)}"
        async with self._sem:
            with self._mu:
                self._tags.setdefault(relation, set()).add(tag)
            work = asyncio.ensure_future(asyncio.to_thread(
                run_in_group, self.spark, tag, f"{what} of {relation}", fn))
            try:
                return await asyncio.shield(work)
            except asyncio.CancelledError:
                cancel_group(self.spark, tag)  # the awaiting task is gone: so are its jobs
                raise
            finally:
                with self._mu:
                    tags = self._tags.get(relation, set())
                    tags.discard(tag)
                    if not tags:
                        self._tags.pop(relation, None)

    async def convert(self, relation: str, trace: Trace,
                      plan: ConversionPlan) -> ConversionResult:
        from lamina.compacter.step.driver import spark_convert

        return await self._run(relation, "conversion",
                               lambda: spark_convert(self.spark, trace, plan,
                                                     stage_segments=self.stage_segments))

    async def merge(self, relation: str, trace: Trace, plan: MergePlan) -> list[PartFile]:
        from lamina.compacter.step.driver import spark_merge

        return await self._run(relation, "merge", lambda: spark_merge(self.spark, trace, plan))

    def cancel_relation(self, relation: str) -> int:
        """Cancel the relation's Spark jobs (``cancelJobsWithTag``); used when it is dropped."""
        from lamina.compacter.spark import cancel_group

        with self._mu:
            tags = sorted(self._tags.get(relation, ()))
        return sum(cancel_group(self.spark, t) for t in tags)

    def cancel_all(self) -> int:
        """Cancel every running job (used on shutdown)."""
        with self._mu:
            relations = list(self._tags)
        return sum(self.cancel_relation(r) for r in relations)
