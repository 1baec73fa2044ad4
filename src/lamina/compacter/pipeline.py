"""One relation's compaction pipeline: a serial loop of steps, woken when there is work.

Each pass (:meth:`RelationPipeline.step`):

1. **Convert**: the finished WAL segments after the trace's ``converted_through`` have
   their frontiers read (frame headers only; the Spark tasks verify every checksum), grouped
   into one step up to ``max_segments_per_job`` / ``max_bytes_per_job``, handed to the
   executor (which may run it in a pack with other relations' steps,
   :mod:`lamina.compacter.executors`), and committed with this relation's own
   compare-and-append; then the segments are deleted.
2. **Merge**: while two adjacent batches share a level, merge the oldest such pair.
3. **Collect garbage** when it is due (below).

Between passes the pipeline sleeps until its :attr:`~RelationPipeline.wake` event is set
(the daemon's poll sets it when the relation's finished segments changed,
:mod:`lamina.compacter.watch`), until garbage collection is due, or until the daemon
stops; a pipeline run without a daemon polls its own watch every ``poll_interval``. An idle
relation therefore costs no pass, no listing and no thread.

Garbage collection is due after the trace changed (a step committed, or an attempt failed
and may have left files), at most every ``gc_interval_seconds``; once more
``max(gc_grace_seconds, keep_versions_seconds)`` after a collection that followed a change
or deleted something, when what that collection had to keep for its age can go; and every
``gc_interval_seconds`` while read leases hold versions (what they name can go once they
end). After that, nothing is due until the trace changes again.

Each step is submitted with the time the relation's work has waited (``waiting_since``:
when the oldest segment it converts was finished; the merges a conversion makes due keep
that time), which is the executor's order (:mod:`lamina.compacter.executors.schedule`).

Failures: a failing job is retried with exponential backoff (counted in
``lamina_job_retries_total`` under the kind that failed: conversion, merge or gc); corrupt
input quarantines the relation (reported, the other relations go on; a diff sum that
leaves int64 does not: it is stored exactly as a carry, lamina.consolidate); a plan that
no longer matches the trace state (:class:`~lamina.errors.StalePlanError`) is dropped and
the step planned again from the state on disk; a lost compare-and-set stops the pipeline
(another writer owns the trace); a cancelled job is not retried once the daemon stops or
the relation is dropped. Every step is crash-safe by construction
(lamina.trace.trace), so a kill anywhere is only a delay.

Log events: the registry :mod:`lamina.events` lists each one this module logs (logger
``lamina.compacter.pipeline``) with its level and meaning; a merge's input level is
``batch_level``, its output's ``batch_level_out``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import structlog

from lamina.compacter.executors import Executor
from lamina.compacter.metrics import Metrics, RelationGauges
from lamina.compacter.settings import Settings
from lamina.compacter.watch import WalWatch
from lamina.datadir import DataDir
from lamina.errors import (
    CorruptionError,
    JobCancelledError,
    JobError,
    LaminaError,
    RelationReplacedError,
    StalePlanError,
    StateConflictError,
)
from lamina.frontier import as_time
from lamina.fs import FileSystem
from lamina.schema import RelationMeta
from lamina.trace.plan import plan_conversion, plan_merge
from lamina.trace.trace import Trace
from lamina.wal.reader import SegmentSpan, segment_spans
from lamina.wal.retire import check_identity

T = TypeVar("T")
log = structlog.get_logger(__name__)
JobKind = Literal["conversion", "merge", "gc"]


class PipelineStopped(Exception):
    """The pipeline ended for good (quarantine, dropped relation, lost CAS)."""


@dataclass
class RelationPipeline:
    name: str
    meta: RelationMeta
    layout: DataDir
    settings: Settings
    executor: Executor
    metrics: Metrics
    fs: FileSystem
    trace: Trace | None = None
    quarantined: str | None = None
    stopped: str | None = None
    polled: bool = False
    """True when the daemon polls :attr:`watch` and sets :attr:`wake`; False: the pipeline
    polls its own watch every ``poll_interval`` while idle."""
    watch: WalWatch = field(init=False)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    _spans: dict[int, SegmentSpan] = field(default_factory=dict)
    _last_gc: float = -math.inf
    _gc_due: float = -math.inf
    """Monotonic time at which garbage collection is next due (inf: not until a change)."""
    _changed_since_gc: bool = True
    _work_since: float | None = None
    """When the work the pipeline is doing began waiting (a conversion's oldest segment);
    the merges that conversion makes due keep it."""
    _kind: JobKind = "conversion"
    """The kind of step the current pass is in (what a failed pass is counted as)."""

    def __post_init__(self) -> None:
        self.watch = WalWatch(self.wal_dir, self.name)
        self._last_gc = time.monotonic()  # the first collection one interval after start
        self._gc_due = self._last_gc + self.settings.gc_interval_seconds

    @property
    def wal_dir(self) -> Path:
        return self.layout.wal_dir(self.name)

    # --- what the daemon reads (metrics, readiness, status) -----------------------------
    @property
    def backlog_bytes(self) -> int:
        converted = self.trace.state.converted_through if self.trace is not None else 0
        return self.watch.backlog(converted).bytes

    def gauges(self, now: float) -> RelationGauges:
        """The relation's gauges as the pipeline knows them (no I/O)."""
        if self.trace is None:
            return RelationGauges(self.name, quarantined=self.quarantined is not None)
        st = self.trace.state
        waiting = self.watch.backlog(st.converted_through)
        return RelationGauges(
            self.name, wal_pending_bytes=waiting.bytes, wal_pending_segments=waiting.segments,
            conversion_lag_seconds=waiting.lag(now), trace_bytes=st.bytes, trace_rows=st.rows,
            frontier_lag=max(0, as_time(self.watch.upper) - st.upper),
            quarantined=self.quarantined is not None, batches_by_level=st.batches_by_level())

    def status(self) -> dict[str, Any]:
        """The relation's ``lamina status`` object (lamina.status.KEYS), from memory."""
        converted = self.trace.state.converted_through if self.trace is not None else 0
        waiting = self.watch.backlog(converted)
        out: dict[str, Any] = {
            "name": self.name, "sealed_upper": self.watch.upper, "since": self.watch.since,
            "trace_upper": 0, "wal_segments_pending": waiting.segments,
            "wal_bytes_pending": waiting.bytes, "batches_by_level": {}, "trace_bytes": 0,
            "quarantined": self.quarantined is not None}
        if self.trace is not None:
            st = self.trace.state
            out.update(trace_upper=st.upper, trace_bytes=st.bytes,
                       batches_by_level={str(k): v for k, v in st.batches_by_level().items()})
        return out

    # --- lifecycle ------------------------------------------------------------------------
    async def recover(self) -> None:
        """Open the trace (checking invariants) and delete segments it already converted.
        A relation dropped meanwhile (its WAL directory gone) ends the pipeline as dropped;
        :attr:`trace` is set only once recovery finished, so a failed one is done again."""
        started = time.monotonic()
        try:
            trace = await asyncio.to_thread(
                Trace.open, self.layout.trace_store(self.name, self.fs), self.meta, self.fs)
            deleted = await asyncio.to_thread(trace.delete_converted_segments, self.wal_dir)
            await asyncio.to_thread(self.watch.poll)
        except CorruptionError as exc:
            await self.quarantine(exc)
            return
        except FileNotFoundError:
            if self._dropped():
                return
            raise
        self.trace = trace
        log.info("relation.recovered", relation=self.name, version=trace.state.version,
                 trace_upper=trace.state.upper, segments_deleted=deleted,
                 duration_seconds=round(time.monotonic() - started, 3))

    async def run(self, stop: asyncio.Event) -> None:
        """Recover, then step until ``stop`` is set or the pipeline ends. An unexpected
        error (a disk error deleting inputs, a bug) is logged and the recovery or pass
        retried after a backoff: both are crash-safe, so a failed one leaves nothing half
        done."""
        delay = self.settings.retry_initial_seconds
        while not stop.is_set() and self.quarantined is None and self.stopped is None:
            self.wake.clear()  # a change noticed from here on wakes the next idle wait
            try:
                if self.trace is None:
                    await self.recover()
                    delay = self.settings.retry_initial_seconds
                    continue  # recovered, quarantined or dropped: the loop's test says
                worked = await self.step(stop)
                delay = self.settings.retry_initial_seconds
            except PipelineStopped:
                return
            except Exception as exc:  # one relation must not stop the daemon
                recovering = self.trace is None
                log.exception("pipeline.retrying", relation=self.name,
                              kind="recovery" if recovering else self._kind,
                              error=str(exc), retry_in_seconds=delay)
                if not recovering:  # a recovery is no job: done again, not counted
                    self.metrics.job_retries.labels(kind=self._kind).inc()
                    self._trace_changed()
                    await self._reload_trace()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                delay = min(delay * 2, self.settings.retry_max_seconds)
                continue
            if not worked:
                await self._idle(stop)

    async def _idle(self, stop: asyncio.Event) -> None:
        """Wait for work: a wake-up, garbage collection coming due, or the stop."""
        while not stop.is_set() and not self.wake.is_set():
            left = self._gc_due - time.monotonic()
            if left <= 0:
                return
            if not self.polled:
                left = min(left, self.settings.poll_interval)
            waiters = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.wake.wait())}
            try:
                await asyncio.wait(waiters, timeout=None if math.isinf(left) else left,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
            if not self.polled and not stop.is_set():
                try:
                    if await asyncio.to_thread(self.watch.poll):
                        return
                except FileNotFoundError:
                    return  # dropped: the next pass finds out

    async def _reload_trace(self) -> None:
        """After a failed pass, start again from the state on disk, not the one in memory."""
        try:
            self.trace = await asyncio.to_thread(
                Trace.open, self.layout.trace_store(self.name, self.fs), self.meta, self.fs)
        except CorruptionError as exc:
            await self.quarantine(exc)
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
            if not worked:
                self._work_since = None
            if time.monotonic() >= self._gc_due:
                self._kind = "gc"
                await self._collect_garbage()
        except CorruptionError as exc:
            await self.quarantine(exc)
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
        return worked

    def _dropped(self) -> bool:
        """Whether the relation was dropped (its WAL directory is gone, or holds another
        relation created again under the name); if so the pipeline stops for good and the
        daemon takes up whatever now holds the name."""
        try:
            check_identity(self.wal_dir, self.name, self.meta.relation_id)
        except RelationReplacedError as exc:
            self.stopped = "relation dropped"
            log.info("relation.dropped", relation=self.name, reason=str(exc))
            return True
        except CorruptionError:  # a damaged relation.json is not a drop: the step says
            return False
        return False

    def _ready_spans(self) -> list[SegmentSpan]:
        """Consecutive finished segments after the trace's, within the per-job limits
        (``max_bytes_per_job`` counts what the segments hold decoded: a compressed segment
        by its sampled expansion, lamina.wal.reader.SegmentSpan)."""
        assert self.trace is not None
        spans: list[SegmentSpan] = []
        size = 0
        seen: dict[int, SegmentSpan] = {}
        for span in segment_spans(self.wal_dir, self.name,
                                  after=self.trace.state.converted_through, known=self._spans):
            seen[span.seq] = span  # the one that stops the loop too: sampled once
            if spans and (len(spans) >= self.settings.max_segments_per_job
                          or size + span.decoded_bytes > self.settings.max_bytes_per_job):
                break
            spans.append(span)
            size += span.decoded_bytes
        self._spans = seen
        return spans

    def _finished_at(self, seq: int) -> float:
        """When segment ``seq`` was finished, as the watch last saw it (now if unknown)."""
        return next((f.finished_at for f in self.watch.finished if f.seq == seq), time.time())

    def _trace_changed(self) -> None:
        """The trace changed (or an attempt may have left files): collect garbage at the
        next pass, at most every ``gc_interval_seconds``."""
        self._changed_since_gc = True
        self._gc_due = min(self._gc_due, self._last_gc + self.settings.gc_interval_seconds)

    async def _convert(self, stop: asyncio.Event) -> bool:
        assert self.trace is not None
        spans = await asyncio.to_thread(self._ready_spans)
        if not spans:
            return False
        if await asyncio.to_thread(self._dropped):  # its segments may be another relation's
            raise PipelineStopped
        trace = self.trace
        first, last = spans[0], spans[-1]
        bound = log.bind(relation=self.name, segments=f"{first.seq}..{last.seq}",
                         lower=first.lower, upper=last.upper)
        started = time.monotonic()
        since = self._finished_at(first.seq)
        self._work_since = since
        bound.info("conversion.started", wal_bytes=sum(s.bytes for s in spans))

        async def attempt() -> Any:
            plan = plan_conversion(trace.state, spans)
            result = await self.executor.convert(self.name, trace, plan, waiting_since=since)
            state = await asyncio.to_thread(trace.commit_conversion, plan, result.parts,
                                            result.pending)
            return plan, result, state

        plan, result, state = await self._retrying("conversion", attempt, stop, bound)
        self._trace_changed()
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
        since = self._work_since if self._work_since is not None else time.time()
        self._work_since = since
        bound.info("merge.started", rows_in=plan.left.rows + plan.right.rows)

        async def attempt() -> Any:
            fresh = plan_merge(trace.state)
            assert fresh is not None
            parts = await self.executor.merge(self.name, trace, fresh, waiting_since=since)
            state = await asyncio.to_thread(trace.commit_merge, fresh, parts)
            return fresh, parts, state

        done, parts, state = await self._retrying("merge", attempt, stop, bound)
        self._trace_changed()
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
        s = self.settings
        try:
            report = await asyncio.to_thread(self.trace.collect_garbage,
                                             keep_versions=s.keep_versions,
                                             grace_seconds=s.gc_grace_seconds,
                                             keep_versions_seconds=s.keep_versions_seconds)
        except Exception:
            self.metrics.jobs.labels(kind="gc", outcome="failure").inc()
            raise
        now = time.monotonic()
        self._last_gc = now
        if report.versions_leased:  # what the leases hold can go once they end
            self._gc_due = now + s.gc_interval_seconds
        elif self._changed_since_gc or report.files_deleted or report.versions_deleted:
            # what this pass kept for its age can go by then
            self._gc_due = now + max(s.gc_grace_seconds, s.keep_versions_seconds,
                                     s.gc_interval_seconds)
        else:
            self._gc_due = math.inf
        self._changed_since_gc = False
        self.metrics.jobs.labels(kind="gc", outcome="success").inc()
        self.metrics.job_seconds.labels(kind="gc").observe(now - started)
        self.metrics.gc_files.inc(report.files_deleted)
        self.metrics.gc_bytes.inc(report.bytes_deleted)
        if report.files_deleted or report.versions_deleted:
            log.info("gc.collected", relation=self.name, files=report.files_deleted,
                     bytes=report.bytes_deleted, versions=report.versions_deleted,
                     duration_seconds=round(now - started, 3))

    async def _retrying(self, kind: JobKind, attempt: Callable[[], Awaitable[T]],
                        stop: asyncio.Event, bound: Any) -> T:
        delay = self.settings.retry_initial_seconds
        tries = 0
        while True:
            tries += 1
            try:
                return await attempt()
            except JobError as exc:
                self._trace_changed()  # a failed attempt may have left files
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
            except asyncio.CancelledError:  # shutdown's grace period ended: nothing committed
                self.metrics.jobs.labels(kind=kind, outcome="cancelled").inc()
                bound.warning(f"{kind}.cancelled", attempt=tries,
                              error="the daemon is stopping and its grace period ended")
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

    async def quarantine(self, exc: LaminaError) -> None:
        """Mark the relation quarantined: the marker first, so that the daemon's poll never
        sees a quarantined pipeline without one (which reads as the operator lifting it)."""
        try:
            await asyncio.to_thread(self.layout.quarantine, self.name, str(exc), self.fs)
        finally:
            self.quarantined = str(exc)
            log.error("relation.quarantined", relation=self.name, error=str(exc))
