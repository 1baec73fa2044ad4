"""Runs conversion and merge jobs off the event loop, bounded and cancellable.

The executor owns the one long-lived SparkSession. Blocking Spark calls run in worker
threads (``asyncio.to_thread``); each job runs under a Spark job group named after its
relation, so shutdown (or a dropped relation) cancels exactly that relation's jobs; a
semaphore bounds how many jobs run at once across relations.
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
    from lamina.compacter.jobs import ConversionResult

T = TypeVar("T")


class Executor(Protocol):
    async def convert(self, relation: str, trace: Trace,
                      plan: ConversionPlan) -> ConversionResult: ...

    async def merge(self, relation: str, trace: Trace, plan: MergePlan) -> list[PartFile]: ...

    def cancel_all(self) -> None: ...


class SparkExecutor:
    """Spark-backed executor: lamina.compacter.jobs under per-relation job groups."""

    def __init__(self, spark: Any, max_concurrent: int) -> None:
        self.spark = spark
        self._sem = asyncio.Semaphore(max_concurrent)
        self._groups: set[str] = set()
        self._mu = threading.Lock()
        self._ids = itertools.count(1)

    async def _run(self, relation: str, what: str, fn: Callable[[], T]) -> T:
        from lamina.compacter.spark import run_in_group

        group = f"lamina-{relation}-{next(self._ids)}"
        async with self._sem:
            with self._mu:
                self._groups.add(group)
            try:
                return await asyncio.to_thread(run_in_group, self.spark, group,
                                               f"{what} of {relation}", fn)
            finally:
                with self._mu:
                    self._groups.discard(group)

    async def convert(self, relation: str, trace: Trace,
                      plan: ConversionPlan) -> ConversionResult:
        from lamina.compacter.jobs import spark_convert

        return await self._run(relation, "conversion",
                               lambda: spark_convert(self.spark, trace, plan))

    async def merge(self, relation: str, trace: Trace, plan: MergePlan) -> list[PartFile]:
        from lamina.compacter.jobs import spark_merge

        return await self._run(relation, "merge", lambda: spark_merge(self.spark, trace, plan))

    def cancel_all(self) -> None:
        """Cancel every running job group (used on shutdown)."""
        from lamina.compacter.spark import cancel_group

        with self._mu:
            groups = list(self._groups)
        for g in groups:
            cancel_group(self.spark, g)
