"""Packs: the small steps of many relations as the tasks of one Spark job.

A *pack* is one job of ``n`` tasks (:mod:`lamina.compacter.step.wire`): task ``i``
carries out the steps of group ``i`` (:func:`task_groups`), each whole, as the single task
of a small step does (:func:`lamina.compacter.step.write.single_written`: decode, sort,
consolidate, write), for whatever relation each step belongs to. Spark places and runs the
tasks (on a cluster, spread over the executors); the relations' outputs are committed by
the daemon one by one, each with its own compare-and-set, exactly as for a step run alone.

Why groups, not a task per step: a Spark task has a fixed cost of its own (scheduling,
the Python worker's hand-off, Arrow framing; measured in docs/performance.md), while a
small step is mostly waiting for its two fsyncs. So a pack has a few tasks per core, each
running its steps on :data:`TASK_THREADS` threads, whose fsyncs overlap (they release the
GIL, as Arrow's compute does). Steps are spread over the groups by input bytes, largest
first onto the least loaded, so the groups end together.

Each step's context is pickled once on the driver (:func:`packed` takes the pickles), so a
task unpickles its own steps' contexts only, not every step of the pack.

**Failures stay with their step.** A task catches whatever its step raises and returns
it as an error row (:data:`PACK_FIELDS` with ``error`` set to a
:class:`~lamina.compacter.step.failures.TaskError` record), so the job succeeds and the
driver fails that step alone: corruption quarantines that relation, anything else retries
it, the others commit. Only what kills the task itself (its Python worker killed, the
executor lost, the fail point ``compacter.pack_task``) fails the whole job, and then every
step of the pack is retried (the executor runs each of them alone next time:
:mod:`lamina.compacter.executors.schedule`).

Rows a task returns (:data:`PACK_FIELDS`): the step's index, then either one error row or its
:class:`~lamina.compacter.step.wire.Written` rows (the tally first, then each part written).
"""

from __future__ import annotations

import heapq
import pickle
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa

from lamina import failpoints
from lamina.compacter.step.context import StepContext
from lamina.compacter.step.failures import TaskError
from lamina.compacter.step.wire import META_FIELDS, batch_of, task_ids
from lamina.compacter.step.write import single_written
from lamina.errors import LaminaError

PACK_FIELDS = [("step", pa.int32()), ("error", pa.string()), *META_FIELDS]
TASKS_PER_CORE = 2
"""A pack has at most this many tasks per core of the cluster (``defaultParallelism``)."""
TASK_THREADS = 4
"""Threads a pack task runs its steps on."""


def task_groups(sizes: Sequence[int], tasks: int) -> tuple[tuple[int, ...], ...]:
    """Step indexes grouped into at most ``tasks`` groups of about equal input bytes
    (largest step first onto the least loaded group); each group in step order."""
    n = max(1, min(tasks, len(sizes)))
    loads = [(0, g) for g in range(n)]
    groups: list[list[int]] = [[] for _ in range(n)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        load, g = heapq.heappop(loads)
        groups[g].append(i)
        heapq.heappush(loads, (load + sizes[i], g))
    return tuple(tuple(sorted(g)) for g in groups if g)


def _error_record(exc: Exception) -> TaskError:
    if isinstance(exc, LaminaError):
        return TaskError.of(exc)
    return TaskError(type=type(exc).__name__, message=str(exc) or repr(exc))


def step_rows(index: int, ctx: StepContext) -> list[dict[str, Any]]:
    """The rows of step ``index`` of a pack: its parts written, or its error."""
    try:
        written = single_written(ctx)
    except Exception as exc:  # this step's failure, never its neighbours'
        return [{"step": index, "error": _error_record(exc).encode(),
                 **dict.fromkeys(n for n, _ in META_FIELDS)}]
    return [{"step": index, "error": None, **w.row()} for w in written]


def packed(contexts: tuple[bytes, ...], groups: tuple[tuple[int, ...], ...]
           ) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The pack job's task function: task ``t`` runs the steps ``groups[t]``, step ``i``
    being the one pickled in ``contexts[i]``."""
    def one(i: int) -> list[dict[str, Any]]:
        ctx: StepContext = pickle.loads(contexts[i])  # noqa: S301 (the driver's own)
        return step_rows(i, ctx)

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for t in task_ids(batches):
            failpoints.hit("compacter.pack_task")  # outside the steps: fails the whole job
            steps = groups[t]
            with ThreadPoolExecutor(min(TASK_THREADS, len(steps))) as pool:
                rows = [r for out in pool.map(one, steps) for r in out]
            yield batch_of(rows, PACK_FIELDS)
    return run


def pickled(ctx: StepContext) -> bytes:
    """A step's context as its pack task unpickles it."""
    return pickle.dumps(ctx, protocol=pickle.HIGHEST_PROTOCOL)
