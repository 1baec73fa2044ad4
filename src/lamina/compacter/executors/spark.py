"""The Spark executor: every relation's steps in one queue, small ones packed into shared
Spark jobs, all off the event loop, bounded and cancellable.

Each ``convert`` / ``merge`` call becomes a step in one queue. Whenever a step arrives or a
job ends, :func:`lamina.compacter.executors.schedule.next_jobs` decides what starts: a
*pack* (the oldest small steps of many relations as the tasks of one Spark job,
:func:`lamina.compacter.step.driver.run_pack`) or one large step alone
(:func:`~lamina.compacter.step.driver.run_step`: its decode and write jobs), at most
``max_concurrent`` jobs at a time. A step's awaiter gets that step's own result or error:
a step that fails in its task fails alone, and the pack's other relations commit.

Jobs run in threads of the executor's own pool (one per slot, so a scrape or a commit on
the loop's default pool never queues behind Spark) under a Spark job tag: a pack is tagged
``lamina-pack-<n>``, a large step ``lamina-rel-<relation>-<n>``
(:func:`lamina.compacter.spark.relation_tag`).

Cancelling. :meth:`SparkExecutor.cancel_relation` (a dropped relation) takes the
relation's step out of the queue, or, when it is running, fails its awaiter at once with
JobCancelledError and drops its output when the job returns (its files are unnamed
garbage); the Spark job itself is cancelled (``cancelJobsWithTag``) once no step of it is
still wanted, so a pack goes on for the relations that remain. Cancelling the task that
awaits a step does the same for that step. :meth:`SparkExecutor.cancel_all` (shutdown)
cancels every job. A slot is free again when its job's thread returns, which a cancel
makes happen within about a second (the task's Python worker is interrupted); until then
it counts against ``max_concurrent``.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import structlog

from lamina import failpoints
from lamina.compacter.executors import ConversionResult
from lamina.compacter.executors.schedule import (
    DEFAULT_PACK_BYTES,
    DEFAULT_PACK_STEPS,
    Waiting,
    large_slots_of,
    next_jobs,
)
from lamina.compacter.metrics import Metrics
from lamina.compacter.step.driver import (
    StepOutput,
    StepSpec,
    conversion_result,
    conversion_spec,
    is_small,
    merge_spec,
    run_pack,
    run_step,
)
from lamina.compacter.step.work import DEFAULT_TUNING, JobTuning
from lamina.errors import JobCancelledError, JobError, LaminaError
from lamina.trace.batch import PartFile
from lamina.trace.plan import ConversionPlan, MergePlan
from lamina.trace.trace import Trace

T = TypeVar("T")
log = structlog.get_logger(__name__)

@dataclass(eq=False)
class _Step:
    """A submitted step: where it is (queued, or in job ``tag``) and who waits for it."""

    id: int
    relation: str
    kind: Literal["conversion", "merge"]
    trace: Trace
    plan: ConversionPlan | MergePlan
    spec: StepSpec
    waiting_since: float
    large: bool
    future: asyncio.Future[Any]
    tag: str | None = None

    def waiting(self, isolated: bool) -> Waiting:
        return Waiting(key=self.id, relation=self.relation, waiting_since=self.waiting_since,
                       arrival=self.id, bytes=self.spec.input_bytes, large=self.large,
                       isolated=isolated)


@dataclass(eq=False)
class _Job:
    tag: str
    steps: list[_Step]
    large: bool
    started: float = field(default_factory=time.monotonic)


class SparkExecutor:
    """Spark-backed executor (module docstring). ``stage_segments``: conversions copy their
    WAL segments into the trace store first, for executors that cannot read the daemon's
    disk (lamina.trace.staging)."""

    def __init__(self, spark: Any, max_concurrent: int, *, stage_segments: bool = False,
                 tuning: JobTuning = DEFAULT_TUNING, pack_max_steps: int = DEFAULT_PACK_STEPS,
                 pack_max_bytes: int = DEFAULT_PACK_BYTES, metrics: Metrics | None = None
                 ) -> None:
        self.spark = spark
        self.stage_segments = stage_segments
        self.tuning = tuning
        self.slots = max_concurrent
        self.pack_max_steps = pack_max_steps
        self.pack_max_bytes = pack_max_bytes
        self.metrics = metrics or Metrics()
        self._ids = itertools.count(1)
        self._queue: dict[int, _Step] = {}
        self._jobs: dict[str, _Job] = {}
        self._isolated: set[str] = set()
        self._threads = ThreadPoolExecutor(max_concurrent, thread_name_prefix="lamina-spark")
        self._tasks: set[asyncio.Task[None]] = set()
        self._dispatching = False

    # --- what runs -----------------------------------------------------------------------
    def running(self) -> dict[str, list[str]]:
        """The job tags running, by relation (a pack's tag under each of its relations)."""
        out: dict[str, list[str]] = {}
        for job in self._jobs.values():
            for s in job.steps:
                if not s.future.done():
                    out.setdefault(s.relation, []).append(job.tag)
        return {r: sorted(t) for r, t in out.items()}

    def waiting(self) -> int:
        """Steps queued for a slot."""
        return len(self._queue)

    # --- the calls -----------------------------------------------------------------------
    async def convert(self, relation: str, trace: Trace, plan: ConversionPlan, *,
                      waiting_since: float | None = None) -> ConversionResult:
        out: ConversionResult = await self._submit(
            relation, "conversion", trace, plan, spec=conversion_spec(trace, plan),
            waiting_since=waiting_since)
        return out

    async def merge(self, relation: str, trace: Trace, plan: MergePlan, *,
                    waiting_since: float | None = None) -> list[PartFile]:
        spec = merge_spec(trace, plan)
        if not spec.parts:  # two empty batches: nothing to read or write
            return []
        out: list[PartFile] = await self._submit(relation, "merge", trace, plan, spec=spec,
                                                 waiting_since=waiting_since)
        return out

    def cancel_relation(self, relation: str) -> int:
        """Cancel the relation's step, queued or running (module docstring)."""
        steps = [s for s in self._queue.values() if s.relation == relation]
        steps += [s for j in self._jobs.values() for s in j.steps if s.relation == relation]
        return sum(self._cancel(s, f"relation {relation!r} was dropped") for s in steps)

    def cancel_all(self) -> int:
        """Cancel every queued and running step, and their Spark jobs."""
        steps = list(self._queue.values()) + [s for j in self._jobs.values() for s in j.steps]
        return sum(self._cancel(s, "the compacter is stopping") for s in steps)

    # --- queue ---------------------------------------------------------------------------
    async def _submit(self, relation: str, kind: Literal["conversion", "merge"], trace: Trace,
                      plan: ConversionPlan | MergePlan, *, spec: StepSpec,
                      waiting_since: float | None) -> Any:
        step = _Step(id=next(self._ids), relation=relation, kind=kind, trace=trace, plan=plan,
                     spec=spec, waiting_since=time.time() if waiting_since is None
                     else waiting_since, large=not is_small(spec, self.tuning),
                     future=asyncio.get_running_loop().create_future())
        self._queue[step.id] = step
        self._dispatch_soon()
        try:
            return await asyncio.shield(step.future)
        except asyncio.CancelledError:
            self._cancel(step, "the task awaiting it was cancelled")
            raise

    def _cancel(self, step: _Step, why: str) -> bool:
        """Fail ``step``'s awaiter with JobCancelledError; cancel its Spark job once none of
        the job's steps is wanted. False if it had already ended."""
        self._queue.pop(step.id, None)
        if step.future.done():
            return False
        step.future.set_exception(JobCancelledError(
            f"{step.spec.context} was cancelled ({why}); its output is not committed"))
        step.future.exception()  # retrieved: its awaiter may be gone
        job = self._jobs.get(step.tag) if step.tag else None
        if job is not None and all(s.future.done() for s in job.steps):
            from lamina.compacter.spark import cancel_group

            cancel_group(self.spark, job.tag)
        self.metrics.steps_waiting.set(len(self._queue))
        return True

    def _dispatch_soon(self) -> None:
        """Dispatch once the loop has run what is ready now: steps submitted in one turn of
        the loop (pipelines woken by one poll) are seen together."""
        if not self._dispatching:
            self._dispatching = True
            asyncio.get_running_loop().call_soon(self._dispatch)

    def _dispatch(self) -> None:
        """Start what the policy says may start now."""
        self._dispatching = False
        free = self.slots - len(self._jobs)
        if free <= 0 or not self._queue:
            return
        large = sum(j.large for j in self._jobs.values())
        jobs = next_jobs([s.waiting(s.relation in self._isolated)
                          for s in self._queue.values()],
                         free_slots=free, large_running=large,
                         large_slots=large_slots_of(self.slots),
                         max_steps=self.pack_max_steps, max_bytes=self.pack_max_bytes)
        for planned in jobs:
            steps = [self._queue.pop(k) for k in planned.keys]
            self._start(steps, planned.large)
        self.metrics.steps_waiting.set(len(self._queue))

    def _start(self, steps: list[_Step], large: bool) -> None:
        from lamina.compacter.spark import relation_tag

        n = next(self._ids)
        tag = f"{relation_tag(steps[0].relation)}-{n}" if large else f"lamina-pack-{n}"
        job = _Job(tag=tag, steps=steps, large=large)
        for s in steps:
            s.tag = tag
        self._jobs[tag] = job
        task = asyncio.create_task(self._run(job), name=tag)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- jobs ----------------------------------------------------------------------------
    async def _run(self, job: _Job) -> None:
        """Run one job in a thread of the pool and settle its steps; never raises."""
        try:
            if job.large:
                [step] = job.steps
                out = await self._off_loop(job, f"{step.kind} of {step.relation}", run_step,
                                           self.spark, step.trace, step.spec,
                                           tuning=self.tuning,
                                           stage_segments=self._stages(step))
                self.metrics.spark_jobs.labels(shape="step").inc(out.spark_jobs)
                self._settle(step, out)
            else:
                log.info("pack.started", pack=job.tag, steps=len(job.steps),
                         bytes_in=sum(s.spec.input_bytes for s in job.steps))
                self.metrics.spark_jobs.labels(shape="pack").inc()
                self.metrics.pack_steps.observe(len(job.steps))
                outs = await self._off_loop(
                    job, f"pack of {len(job.steps)} steps", run_pack, self.spark,
                    [(s.trace, s.spec) for s in job.steps], tuning=self.tuning,
                    stage_segments=self.stage_segments)
                failpoints.hit("compacter.pack_collected")
                for s, o in zip(job.steps, outs, strict=True):
                    self._settle(s, o)
                log.info("pack.finished", pack=job.tag, steps=len(job.steps),
                         failed=sum(isinstance(o, LaminaError) for o in outs),
                         duration_seconds=round(time.monotonic() - job.started, 3))
        except Exception as exc:  # the whole job failed: every step of it fails
            error = exc if isinstance(exc, LaminaError) else JobError(
                f"a Spark job failed in the driver: {type(exc).__name__}: {exc} (nothing "
                "was committed; its steps are retried)")
            wanted = [s for s in job.steps if not s.future.done()]
            if not job.large and wanted and not isinstance(error, JobCancelledError):
                self._isolated.update(s.relation for s in wanted)  # alone next time
                log.warning("pack.failed", pack=job.tag, steps=len(job.steps),
                            relations=len(wanted), error=str(error))
            for s in wanted:
                s.future.set_exception(error)
        finally:
            del self._jobs[job.tag]
            self._dispatch_soon()

    def _stages(self, step: _Step) -> bool:
        return self.stage_segments and step.kind == "conversion"

    async def _off_loop(self, job: _Job, what: str, fn: Callable[..., T], *args: Any,
                        **kwargs: Any) -> T:
        from lamina.compacter.spark import run_in_group

        ctx = contextvars.copy_context()

        def call() -> T:
            return ctx.run(run_in_group, self.spark, job.tag, what, lambda: fn(*args, **kwargs))

        return await asyncio.get_running_loop().run_in_executor(self._threads, call)

    def _settle(self, step: _Step, out: StepOutput | LaminaError) -> None:
        """Hand a step its own output or error, unless it was cancelled meanwhile."""
        if step.future.done():
            return
        if isinstance(out, LaminaError):
            step.future.set_exception(out)
            return
        self._isolated.discard(step.relation)
        if step.kind == "conversion":
            assert isinstance(step.plan, ConversionPlan)
            step.future.set_result(conversion_result(step.plan, out))
        else:
            step.future.set_result(out.parts)
