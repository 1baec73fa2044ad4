"""One relation's compaction pipeline: a serial loop of steps.

Each pass (:meth:`RelationPipeline.step`):

1. **Convert**: the finished WAL segments after the trace's ``converted_through`` have
   their frontiers read (frame headers only; the Spark tasks verify every checksum), grouped
   into one job up to ``max_segments_per_job`` / ``max_bytes_per_job`` (Spark's fixed cost
   per job is paid once for many small segments), converted by the executor, and
   committed with one compare-and-append; then the segments are deleted.
2. **Merge**: while two adjacent batches share a level, merge the oldest such pair.
3. **Collect garbage** every ``gc_interval_seconds``.

Failures: a failing job is retried with exponential backoff (counted in
``lamina_job_retries_total`` under the kind that failed: conversion, merge or gc); corrupt
input quarantines the relation (reported, the other relations go on; a diff sum that
leaves int64 does not: it is stored exactly as a carry, lamina.consolidate); a plan that
no longer matches the trace state (:class:`~lamina.errors.StalePlanError`) is dropped and
the step planned again from the state on disk; a lost compare-and-set stops the pipeline
(another writer owns the trace); a cancelled job is not retried once the daemon stops or
the relation is dropped. Every step is crash-safe by construction
(lamina.trace.trace), so a kill anywhere is only a delay.

Log events (logger ``lamina.compacter.pipeline``; keys as in :mod:`lamina.compacter.logs`):
``relation.recovered``, ``conversion.started`` / ``.committed`` / ``.retrying`` /
``.cancelled`` / ``.replanned`` (and the same for ``merge``; a merge's input level is
``batch_level``, its output's ``batch_level_out``), ``gc.collected``, ``pipeline.retrying``
(a pass failed outside a job), ``pipeline.state_conflict``, ``relation.dropped``,
``relation.quarantined``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import structlog

from lamina.compacter.executor import Executor
from lamina.compacter.metrics import Metrics
from lamina.compacter.settings import Settings
from lamina.errors import (
    CorruptionError,
    JobCancelledError,
    JobError,
    LaminaError,
    StalePlanError,
    StateConflictError,
)
from lamina.frontier import as_time
from lamina.fs import FileSystem
from lamina.layout import Layout
from lamina.schema import RelationMeta
from lamina.trace.plan import plan_conversion, plan_merge
from lamina.trace.trace import Trace
from lamina.wal.reader import SegmentSpan, backlog, frontiers, segment_spans

T = TypeVar("T")
log = structlog.get_logger(__name__)
JobKind = Literal["conversion", "merge", "gc"]


class PipelineStopped(Exception):
    """The pipeline ended for good (quarantine, dropped relation, lost CAS)."""


@dataclass
class RelationPipeline:
    name: str
    meta: RelationMeta
    layout: Layout
    settings: Settings
    executor: Executor
    metrics: Metrics
    fs: FileSystem
    trace: Trace | None = None
    quarantined: str | None = None
    stopped: str | None = None
    backlog_bytes: int = 0
    _spans: dict[int, SegmentSpan] = field(default_factory=dict)
    _last_gc: float = 0.0
    _kind: JobKind = "conversion"
    """The kind of step the current pass is in (what a failed pass is counted as)."""

    @property
    def wal_dir(self) -> Path:
        return self.layout.wal_dir(self.name)

    # --- lifecycle ------------------------------------------------------------------------
    async def recover(self) -> None:
        """Open the trace (checking invariants) and delete segments it already converted."""
        started = time.monotonic()
        try:
            self.trace = await asyncio.to_thread(
                Trace.open, self.layout.trace_store(self.name, self.fs), self.meta, self.fs)
            deleted = await asyncio.to_thread(self.trace.delete_converted_segments,
                                              self.wal_dir)
        except CorruptionError as exc:
            await self._quarantine(exc)
            return
        log.info("relation.recovered", relation=self.name, version=self.trace.state.version,
                 trace_upper=self.trace.state.upper, segments_deleted=deleted,
                 duration_seconds=round(time.monotonic() - started, 3))
        await asyncio.to_thread(self.refresh_metrics)

    async def run(self, stop: asyncio.Event) -> None:
        """Step until ``stop`` is set or the pipeline ends. An unexpected error (a disk
        error deleting inputs, a bug) is logged and the pass retried after a backoff: the
        steps are crash-safe, so a failed pass leaves nothing half done."""
        if self.trace is None and self.quarantined is None:
            await self.recover()
        delay = self.settings.retry_initial_seconds
        while not stop.is_set() and self.quarantined is None and self.stopped is None:
            try:
                worked = await self.step(stop)
                delay = self.settings.retry_initial_seconds
            except PipelineStopped:
                return
            except Exception as exc:  # one relation must not stop the daemon
                log.exception("pipeline.retrying", relation=self.name, kind=self._kind,
                              error=str(exc), retry_in_seconds=delay)
                self.metrics.job_retries.labels(kind=self._kind).inc()
                await self._reload_trace()
                worked = False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                delay = min(delay * 2, self.settings.retry_max_seconds)
                continue
            if not worked:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.settings.poll_interval)

    async def _reload_trace(self) -> None:
        """After a failed pass, start again from the state on disk, not the one in memory."""
        try:
            self.trace = await asyncio.to_thread(
                Trace.open, self.layout.trace_store(self.name, self.fs), self.meta, self.fs)
        except CorruptionError as exc:
            await self._quarantine(exc)
        except Exception:  # retried on the next pass
            log.exception("trace.reload_failed", relation=self.name)

    # --- steps ----------------------------------------------------------------------------
    async def step(self, stop: asyncio.Event) -> bool:
        """One pass: convert what is ready, merge, maybe collect garbage. True if it worked."""
        assert self.trace is not None
        try:
            self._kind = "conversion"
            worked = await self._convert(stop)
            while not stop.is_set() and (plan := plan_merge(self.trace.state)) is not None:
                self._kind = "merge"
                await self._merge(plan, stop)
                worked = True
            if time.monotonic() - self._last_gc >= self.settings.gc_interval_seconds:
                self._kind = "gc"
                await self._collect_garbage()
        except CorruptionError as exc:
            await self._quarantine(exc)
            raise PipelineStopped from exc
        except StalePlanError as exc:  # before StateConflictError: its subclass
            self.metrics.job_retries.labels(kind=self._kind).inc()
            log.warning(f"{self._kind}.replanned", relation=self.name, error=str(exc))
            await self._reload_trace()
            if self.quarantined is not None:
                raise PipelineStopped from exc
            return True
        except StateConflictError as exc:
            self.stopped = str(exc)
            log.error("pipeline.state_conflict", relation=self.name, error=str(exc))
            raise PipelineStopped from exc
        except FileNotFoundError as exc:
            if self._dropped():
                raise PipelineStopped from exc
            raise
        await asyncio.to_thread(self.refresh_metrics)
        return worked

    def _dropped(self) -> bool:
        """Whether the relation was dropped (its WAL directory is gone); if so the pipeline
        stops for good."""
        if self.layout.meta_path(self.name).exists():
            return False
        self.stopped = "relation dropped"
        log.info("relation.dropped", relation=self.name)
        return True

    def _ready_spans(self) -> list[SegmentSpan]:
        """Consecutive finished segments after the trace's, within the per-job limits."""
        assert self.trace is not None
        spans: list[SegmentSpan] = []
        size = 0
        for span in segment_spans(self.wal_dir, self.name,
                                  after=self.trace.state.converted_through, known=self._spans):
            if spans and (len(spans) >= self.settings.max_segments_per_job
                          or size + span.bytes > self.settings.max_bytes_per_job):
                break
            spans.append(span)
            size += span.bytes
        self._spans = {s.seq: s for s in spans}
        return spans

    async def _convert(self, stop: asyncio.Event) -> bool:
        assert self.trace is not None
        spans = await asyncio.to_thread(self._ready_spans)
        if not spans:
            return False
        trace = self.trace
        first, last = spans[0], spans[-1]
        bound = log.bind(relation=self.name, segments=f"{first.seq}..{last.seq}",
                         lower=first.lower, upper=last.upper)
        started = time.monotonic()
        bound.info("conversion.started", wal_bytes=sum(s.bytes for s in spans))

        async def attempt() -> Any:
            plan = plan_conversion(trace.state, spans)
            result = await self.executor.convert(self.name, trace, plan)
            state = await asyncio.to_thread(trace.commit_conversion, plan, result.parts,
                                            result.pending)
            return plan, result, state

        plan, result, state = await self._retrying("conversion", attempt, stop, bound)
        deleted = await asyncio.to_thread(trace.delete_converted_segments, self.wal_dir)
        parts, pending = result.parts, result.pending
        rows_out = sum(p.rows for p in parts) + sum(p.part.rows for p in pending)
        bytes_out = sum(p.bytes for p in parts) + sum(p.part.bytes for p in pending)
        in_bytes = sum(s.bytes for s in spans) + sum(p.part.bytes for p in plan.consume)
        self._observe("conversion", started, rows_in=result.input_rows, rows_out=rows_out,
                      bytes_in=in_bytes, bytes_out=bytes_out)
        bound.info("conversion.committed", batch=plan.batch_id, version=state.version,
                   rows_in=result.input_rows, rows_out=rows_out, bytes_out=bytes_out,
                   segments_deleted=deleted, pending_parts=len(pending),
                   duration_seconds=round(time.monotonic() - started, 3))
        return True

    async def _merge(self, plan: Any, stop: asyncio.Event) -> None:
        assert self.trace is not None
        trace = self.trace
        bound = log.bind(relation=self.name, left=plan.left.id, right=plan.right.id,
                         batch_level=plan.left.level)
        started = time.monotonic()
        bound.info("merge.started", rows_in=plan.left.rows + plan.right.rows)

        async def attempt() -> Any:
            fresh = plan_merge(trace.state)
            assert fresh is not None
            parts = await self.executor.merge(self.name, trace, fresh)
            state = await asyncio.to_thread(trace.commit_merge, fresh, parts)
            return fresh, parts, state

        done, parts, state = await self._retrying("merge", attempt, stop, bound)
        rows_in = done.left.rows + done.right.rows
        self._observe("merge", started, rows_in=rows_in, rows_out=sum(p.rows for p in parts),
                      bytes_in=done.left.bytes + done.right.bytes,
                      bytes_out=sum(p.bytes for p in parts))
        bound.info("merge.committed", batch=done.batch_id, version=state.version,
                   batch_level_out=state.batches[done.index].level, rows_in=rows_in,
                   rows_out=sum(p.rows for p in parts),
                   duration_seconds=round(time.monotonic() - started, 3))

    async def _collect_garbage(self) -> None:
        assert self.trace is not None
        started = time.monotonic()
        try:
            report = await asyncio.to_thread(self.trace.collect_garbage,
                                             keep_versions=self.settings.keep_versions,
                                             grace_seconds=self.settings.gc_grace_seconds,
                                             keep_versions_seconds=(
                                                 self.settings.keep_versions_seconds))
        except Exception:
            self.metrics.jobs.labels(kind="gc", outcome="failure").inc()
            raise
        self._last_gc = time.monotonic()
        self.metrics.jobs.labels(kind="gc", outcome="success").inc()
        self.metrics.job_seconds.labels(kind="gc").observe(time.monotonic() - started)
        self.metrics.gc_files.inc(report.files_deleted)
        self.metrics.gc_bytes.inc(report.bytes_deleted)
        if report.files_deleted or report.versions_deleted:
            log.info("gc.collected", relation=self.name, files=report.files_deleted,
                     bytes=report.bytes_deleted, versions=report.versions_deleted,
                     duration_seconds=round(time.monotonic() - started, 3))

    async def _retrying(self, kind: JobKind, attempt: Callable[[], Awaitable[T]],
                        stop: asyncio.Event, bound: Any) -> T:
        delay = self.settings.retry_initial_seconds
        tries = 0
        while True:
            tries += 1
            try:
                return await attempt()
            except JobError as exc:
                cancelled = isinstance(exc, JobCancelledError)
                outcome = "cancelled" if cancelled else "failure"
                self.metrics.jobs.labels(kind=kind, outcome=outcome).inc()
                if cancelled:
                    bound.warning(f"{kind}.cancelled", attempt=tries, error=str(exc))
                if stop.is_set() or await asyncio.to_thread(self._dropped):
                    raise PipelineStopped from exc
                self.metrics.job_retries.labels(kind=kind).inc()
                bound.warning(f"{kind}.retrying", attempt=tries, retry_in_seconds=delay,
                              error=str(exc))
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                    raise PipelineStopped from exc
                except TimeoutError:
                    pass
                delay = min(delay * 2, self.settings.retry_max_seconds)
            except asyncio.CancelledError:
                self.metrics.jobs.labels(kind=kind, outcome="cancelled").inc()
                raise

    def _observe(self, kind: str, started: float, *, rows_in: int, rows_out: int,
                 bytes_in: int, bytes_out: int) -> None:
        m = self.metrics
        m.jobs.labels(kind=kind, outcome="success").inc()
        m.job_seconds.labels(kind=kind).observe(time.monotonic() - started)
        m.rows_in.labels(kind=kind).inc(rows_in)
        m.rows_out.labels(kind=kind).inc(rows_out)
        m.bytes_in.labels(kind=kind).inc(bytes_in)
        m.bytes_out.labels(kind=kind).inc(bytes_out)

    async def _quarantine(self, exc: LaminaError) -> None:
        self.quarantined = str(exc)
        await asyncio.to_thread(self.layout.quarantine, self.name, str(exc), self.fs)
        self.metrics.quarantined.labels(relation=self.name).set(1)
        log.error("relation.quarantined", relation=self.name, error=str(exc))

    # --- metrics --------------------------------------------------------------------------
    def refresh_metrics(self) -> None:
        """Recompute the relation's gauges from disk and the trace state."""
        m = self.metrics
        m.quarantined.labels(relation=self.name).set(1 if self.quarantined else 0)
        if self.trace is None:
            return
        st = self.trace.state
        pending_segments, pending_bytes = backlog(self.wal_dir, st.converted_through)
        self.backlog_bytes = pending_bytes
        m.wal_pending_bytes.labels(relation=self.name).set(pending_bytes)
        m.wal_pending_segments.labels(relation=self.name).set(pending_segments)
        m.trace_bytes.labels(relation=self.name).set(st.bytes)
        m.trace_rows.labels(relation=self.name).set(st.rows)
        m.set_levels(self.name, st.batches_by_level())
        try:
            upper, _ = frontiers(self.wal_dir, self.name)
        except (FileNotFoundError, CorruptionError):
            return
        m.frontier_lag.labels(relation=self.name).set(max(0, as_time(upper) - st.upper))
