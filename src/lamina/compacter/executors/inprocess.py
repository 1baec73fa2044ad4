"""The in-process executor: conversion and merge plans carried out by the pyarrow reference
(:mod:`lamina.compacter.executors.reference`) in threads of the daemon's own process.

Selected with ``executor = "inprocess"`` (``LAMINA_EXECUTOR=inprocess``). No JVM starts,
so the daemon is ready in well under a second, which suits small relations, a laptop and
the tests of the pipeline and the daemon. A step holds its whole input in memory (that is
what the reference does), so a large backlog wants the Spark executor; ``max_bytes_per_job``
bounds the WAL bytes of one conversion either way, but a merge reads both parents whole.

Each job runs in a daemon thread of its own. Errors are those of the Spark executor,
through the same record (:func:`lamina.compacter.step.failures.task_error`): CorruptionError as
itself, every other failure as JobError (retried by the
pipeline). A cancel (:meth:`InProcessExecutor.cancel_relation`, :meth:`cancel_all`, or the
awaiting task being cancelled) returns at once with JobCancelledError: Python threads
cannot be interrupted, so the thread runs to its end and its output is dropped, never
committed (the files it wrote are unnamed garbage, removed by garbage collection or with
the dropped relation's trace). Its slot stays taken until the thread ends, so
``max_concurrent`` bounds the threads actually running, cancelled or not. Being a daemon
thread, it does not hold up the process's exit. Steps start in the order they arrive
(``waiting_since`` is not used: there is no pack to form).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import threading
from collections.abc import Callable
from typing import TypeVar

from lamina.compacter.executors import ConversionResult, reference
from lamina.compacter.step.failures import task_error
from lamina.errors import JobCancelledError, JobError, LaminaError
from lamina.trace.batch import PartFile
from lamina.trace.plan import ConversionPlan, MergePlan
from lamina.trace.trace import Trace

T = TypeVar("T")


def convert_in_process(trace: Trace, plan: ConversionPlan) -> ConversionResult:
    """Carry out a conversion plan with the reference (blocking); nothing is committed."""
    updates = reference.conversion_input(trace, plan)
    parts, pending = reference.run_conversion(trace, plan, updates)
    return ConversionResult(parts=parts, pending=pending, input_rows=updates.num_rows)


class InProcessExecutor:
    """Executor over lamina.compacter.executors.reference, in threads of this process."""

    def __init__(self, max_concurrent: int) -> None:
        self._sem = asyncio.Semaphore(max_concurrent)
        self._ids = itertools.count(1)
        self._jobs: dict[int, tuple[str, asyncio.Future[object]]] = {}

    def running(self) -> dict[str, int]:
        """Jobs running, by relation."""
        out: dict[str, int] = {}
        for relation, _ in self._jobs.values():
            out[relation] = out.get(relation, 0) + 1
        return out

    async def convert(self, relation: str, trace: Trace, plan: ConversionPlan, *,
                      waiting_since: float | None = None) -> ConversionResult:
        return await self._run(relation, f"conversion of {relation!r} to {plan.upper}",
                               lambda: convert_in_process(trace, plan))

    async def merge(self, relation: str, trace: Trace, plan: MergePlan, *,
                    waiting_since: float | None = None) -> list[PartFile]:
        return await self._run(relation,
                               f"merge of {relation!r} [{plan.lower}, {plan.upper})",
                               lambda: reference.run_merge(trace, plan))

    def cancel_relation(self, relation: str) -> int:
        cancelled = 0
        for rel, fut in list(self._jobs.values()):
            if rel == relation and not fut.done():
                fut.set_exception(JobCancelledError(
                    f"a job of {relation!r} was cancelled; its output is not committed"))
                cancelled += 1
        return cancelled

    def cancel_all(self) -> int:
        relations = {rel for rel, _ in self._jobs.values()}
        return sum(self.cancel_relation(r) for r in sorted(relations))

    async def _run(self, relation: str, context: str, fn: Callable[[], T]) -> T:
        # The slot is held until the thread ends, not until the caller stops waiting: a
        # cancelled job's thread still runs, and must count against max_concurrent_jobs.
        await self._sem.acquire()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[object] = loop.create_future()
        job = next(self._ids)
        self._jobs[job] = (relation, done)
        try:
            _start_thread(fn, done, loop, f"lamina-{relation}-{job}", self._sem.release)
        except BaseException:
            self._sem.release()
            self._jobs.pop(job, None)
            raise
        try:
            result = await done
        except JobCancelledError:
            raise
        except LaminaError as exc:
            raise task_error(exc, context) from exc
        except Exception as exc:  # a disk error, a bug in the step: retryable
            raise JobError(f"{context} failed: {type(exc).__name__}: {exc} (nothing was "
                           "committed; the step is retried from its inputs)") from exc
        finally:
            self._jobs.pop(job, None)
        return result  # type: ignore[return-value]  # the future holds fn's result


def _start_thread(fn: Callable[[], object], done: asyncio.Future[object],
                  loop: asyncio.AbstractEventLoop, name: str,
                  finished: Callable[[], None]) -> None:
    """Run ``fn`` in a daemon thread (with the caller's context variables, so log lines
    keep their bound keys) and settle ``done`` on the loop, unless a cancel settled it;
    call ``finished`` on the loop when the thread has ended, whatever happened."""
    ctx = contextvars.copy_context()

    def settle(value: object, error: BaseException | None) -> None:
        finished()
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(value)

    def target() -> None:
        value: object = None
        error: BaseException | None = None
        try:
            value = ctx.run(fn)
        except BaseException as exc:  # handed to the awaiting task
            error = exc
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=target, name=name, daemon=True).start()
