"""One source's life: recovery, reading, minting bindings, reclocking, offset commit.

A :class:`SourceRunner` runs in a thread of its own (sources block). Each *session*
starts from what is on disk, so a retried session and a restarted process recover alike:

1. **Resumption** (:mod:`lamina.ingest.resume`): the resume time ``R`` (least output
   upper), the binding in force there (where the source reopens), the bindings to replay
   and the outputs that cannot be filled.
2. **Replay.** Bindings at or after ``R`` are durable already; each is written again
   (:class:`~lamina.ingest.reclock.Reclocker`: only to the outputs still at or below it)
   once the source's upper reaches its ``F``. Times and their contents are the ones the
   killed process would have written.
3. **Streaming.** Every ``timestamp_interval_seconds`` a binding ``(T, source upper)`` is
   minted (appended and sealed in the remap relation, ``ingest.binding_sealed``) and the
   buffered transactions below its upper are gathered by table
   (:func:`lamina.ingest.changes.gather`: one Arrow table per table per binding) and
   written at ``T``; outputs are sealed to ``T + 1`` and their ``since`` follows by their
   retention. The writing runs in the session's writer thread while this one goes on
   reading upstream; it is finished (published, offset committed) before the next binding
   is minted, so bindings are written one after the other, in order. A binding is minted
   also when nothing arrived, so idle outputs' uppers follow the clock.
4. **Offset commit.** After each binding, the binding in force at the least output upper
   (stalled outputs included, unfillable ones not) is the offset every output holds durably:
   ``Source.commit`` is told it (``ingest.offset_committed``). Older bindings are
   retracted from the remap relation with the next one.

Stalls: a :class:`~lamina.ingest.source.Stall` without an offset stops its output at once;
one with an offset waits for the first binding whose upper passes the offset, and stops
the output before that binding is written to it (an output already past the binding
ignores it: a replayed stall it has left behind, e.g. after a resync).

Errors: :class:`~lamina.errors.SourceTransientError` closes the source and starts a new
session after a backoff (``retry_initial_seconds`` doubling up to ``retry_max_seconds``);
a stall of the whole source (``Stall(None, ...)``, :class:`~lamina.errors.SourceStalledError`,
or a storage error) stops the source until the process restarts. Stop (SIGTERM): the
buffered transactions below the source's upper get a last binding, outputs are sealed, the
source is closed.

Resync (:meth:`SourceRunner.request_resync`, from ``POST /v1/sources/<name>/resync``): the
session ends as on a stop (a last binding), :func:`lamina.ingest.resync.resync` runs while
the source is closed, and a new session starts (which finds the resynced output past the
replayed bindings).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import structlog

from lamina import failpoints
from lamina.errors import (
    LaminaError,
    RelationNotFoundError,
    SourceStalledError,
    SourceTransientError,
)
from lamina.ingest import resume
from lamina.ingest.changes import gather, release
from lamina.ingest.health import Health, State
from lamina.ingest.lag import Lag
from lamina.ingest.metrics import IngestMetrics
from lamina.ingest.reclock import Output, Reclocker, each, open_output
from lamina.ingest.remap import Binding, Remap
from lamina.ingest.settings import OutputSettings, SourceSettings
from lamina.ingest.source import Offset, Source, Stall, TableSpec, Transaction, Upper
from lamina.store import Store

log = structlog.get_logger(__name__)

POLL_SLICE_SECONDS = 0.25
"""Longest single ``poll``: how quickly a stop request is noticed."""

WRITING_POLL_SECONDS = 0.01
"""Longest ``poll`` while a binding is being written: how soon it is published (and its
offset committed) once written."""


class SourceRunner:
    """Drives one source; ``run(stop)`` is the thread's target."""

    def __init__(self, settings: SourceSettings, source: Source, store: Store,
                 metrics: IngestMetrics, *, retry_initial_seconds: float = 0.5,
                 retry_max_seconds: float = 30.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.name = settings.name
        self.source = source
        self.store = store
        self.metrics = metrics
        self.retry_initial = retry_initial_seconds
        self.retry_max = retry_max_seconds
        self.clock = clock
        self.interval_ms = settings.interval_ms
        self.log = log.bind(source=self.name)
        self._mu = threading.Lock()
        self.health = Health("starting")
        self.outputs: dict[str, Output] = {}
        self.resume_frontier = 0
        self.binding: Binding | None = None     # newest binding written to the outputs
        self.source_upper: Offset | None = None
        self.committed: Offset | None = None
        self.transactions = 0
        self.lag_offsets: int | None = None
        self.lag = Lag(source.clock)
        self._resyncs: list[tuple[str, Future[dict[str, Any]]]] = []
        self._resync_wanted = threading.Event()
        metrics.register_source(self.name, self.lag.seconds)

    # --- status (any thread) ---------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        with self._mu:
            outs = [{"relation": o.relation, "upstream": o.upstream, "upper": o.upper,
                     "since": o.since, "changes": o.changes, **self._output_health(o).as_json()}
                    for o in self.outputs.values()]
            binding = self.binding
            upper = self.source_upper
            committed = self.committed
            health = self.health
        enc = self._encode
        return {"name": self.name, "kind": self.settings.kind, **health.as_json(),
                "resume_frontier": self.resume_frontier,
                "binding_time": binding.time if binding else None,
                "binding_upper": binding.text if binding else None,
                "source_upper": enc(upper) if upper is not None else None,
                "committed": enc(committed) if committed is not None else None,
                "transactions": self.transactions, "lag_offsets": self.lag_offsets,
                "lag_seconds": round(self.lag.seconds(), 3), "outputs": outs}

    def stalled_outputs(self) -> list[tuple[str, str]]:
        """``(relation, error)`` of every stalled output (all of them when the source is
        stalled)."""
        with self._mu:
            return [(o.relation, h.error or "")
                    for o in self.outputs.values()
                    if (h := self._output_health(o)).state == "stalled"]

    def _encode(self, offset: Offset) -> str | None:
        try:
            return self.source.encode_offset(offset)
        except Exception:  # a status call must not fail on a source's quirk
            return None

    def _output_health(self, o: Output) -> Health:
        if o.stalled is not None:
            return Health("stalled", o.stalled[0], o.stalled[1])
        return Health(self.health.state)

    def _set_health(self, state: State, error: str | None = None,
                    hint: str | None = None) -> None:
        with self._mu:
            self.health = Health(state, error, hint)
        self.metrics.set_state(self.name, state)
        self._publish_outputs()

    def _publish_outputs(self) -> None:
        for o in list(self.outputs.values()):
            self.metrics.set_output_state(self.name, o.relation, self._output_health(o).state)

    # --- resync requests (any thread) --------------------------------------------------------
    def request_resync(self, upstream: str) -> Future[dict[str, Any]]:
        """Ask the runner to resync ``upstream`` between two sessions; the future gets
        :func:`lamina.ingest.resync.resync`'s result or its error."""
        fut: Future[dict[str, Any]] = Future()
        with self._mu:
            if self.health.state in ("stalled", "ceased"):
                fut.set_exception(SourceStalledError(
                    f"source {self.name!r} is {self.health.state}"
                    + (f": {self.health.error}" if self.health.error else ""),
                    hint="stop `lamina ingest`, then run `lamina ingest resync` (it runs "
                         "on its own when no ingest serves the source)"))
                return fut
            self._resyncs.append((upstream, fut))
        self._resync_wanted.set()
        return fut

    def _run_resyncs(self) -> None:
        from lamina.ingest.resync import resync

        with self._mu:
            todo, self._resyncs = self._resyncs, []
            self._resync_wanted.clear()
        for upstream, fut in todo:
            self._set_health("starting", None, f"resyncing {upstream}")
            try:
                fut.set_result(resync(self.store, self.settings, self.source, upstream,
                                      clock=self.clock))
            except BaseException as exc:  # the caller reports it; the source goes on
                self.log.warning("source.resync_failed", table=upstream, error=str(exc))
                fut.set_exception(exc)

    # --- thread ------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        backoff = self.retry_initial
        try:
            while not stop.is_set():
                try:
                    if self._resyncs:   # between sessions, the source closed
                        self._close_source()
                        self._run_resyncs()
                    self._session(stop)
                    if not self._resyncs or stop.is_set():
                        return
                except SourceTransientError as exc:
                    self.metrics.retries.labels(source=self.name).inc()
                    self.log.warning("source.retrying", error=str(exc),
                                     backoff_seconds=round(backoff, 3))
                    self._set_health("starting", str(exc), f"retrying in {backoff:.1f} s")
                    self._close_source()
                    if stop.wait(backoff):
                        return
                    backoff = min(self.retry_max, backoff * 2)
                except SourceStalledError as exc:
                    self._stall_source(exc.error, exc.hint, stop)
                    return
                except LaminaError as exc:
                    self._stall_source(f"{type(exc).__name__}: {exc}",
                                       "fix the storage problem named, then restart "
                                       "`lamina ingest`; nothing was skipped", stop)
                    return
                except Exception as exc:
                    self.log.exception("source.failed")
                    self._stall_source(f"{type(exc).__name__}: {exc}",
                                       "this is a bug in lamina or the source; report it "
                                       "with the log, then restart `lamina ingest`", stop)
                    return
        finally:
            self._close_source()
            if self.health.state != "stalled":
                self._set_health("ceased")
            self._fail_resyncs()
            self.log.info("source.ceased", state=self.health.state)

    def _fail_resyncs(self) -> None:
        with self._mu:
            todo, self._resyncs = self._resyncs, []
        for upstream, fut in todo:
            fut.set_exception(SourceStalledError(
                f"source {self.name!r} stopped before resyncing {upstream}",
                hint="run `lamina ingest resync` again"))

    def _stall_source(self, error: str, hint: str, stop: threading.Event) -> None:
        self._set_health("stalled", error, hint)
        self.log.error("source.stalled", error=error, hint=hint)
        self._close_source()
        self._fail_resyncs()
        stop.wait()

    def _close_source(self) -> None:
        try:
            self.source.close()
        except Exception as exc:
            self.log.warning("source.close_failed", error=str(exc))

    # --- one session -------------------------------------------------------------------------
    def _session(self, stop: threading.Event) -> None:
        self._set_health("starting")
        remap = Remap(self.store, self.settings.remap_relation,
                      decode=self.source.decode_offset, retention=self.settings.retention)
        bindings = remap.load()
        plan = resume.plan(self.store, self.settings, bindings,
                           replays_from_start=self.source.replays_from_start,
                           remap=remap.name)
        in_force = plan.in_force
        floor = in_force.upper if in_force is not None else None
        self.resume_frontier = plan.time
        self.metrics.resume_frontier.labels(source=self.name).set(plan.time)
        self.log.info("source.opening", resume_time=plan.time,
                      resume=in_force.text if in_force else None, bindings=len(bindings))
        self.source.set_barriers([b.upper for b in plan.replay])
        specs = self.source.open(floor)

        def opened(item: tuple[str, OutputSettings]) -> Output:
            upstream, how = item
            found = _spec_for(specs, upstream)
            name = found.upstream if found is not None else upstream
            if upstream in plan.unfillable:
                return _unfillable_output(self.store, name, how, plan.unfillable[upstream])
            return open_output(self.store, self.name, name, how, found)

        outputs = {o.upstream: o for o in each(self.settings.output_settings().items(),
                                               opened)}
        with self._mu:
            self.outputs = outputs
            self.binding = in_force
            self.committed = None
        for o in outputs.values():
            self.metrics.register_output(self.name, o.relation, _upper_of(o))
            if o.stalled is not None:
                self.log.error("output.stalled", relation=o.relation, error=o.stalled[0],
                               hint=o.stalled[1])
        self._set_health("running")
        self.log.info("source.running", outputs=sorted(o.relation for o in outputs.values()),
                      replay=len(plan.replay))
        _Session(self, remap, Reclocker(outputs, self.name), plan.replay, floor).stream(stop)


class _Session:
    """The streaming loop of one session: events in, bindings out."""

    def __init__(self, runner: SourceRunner, remap: Remap, reclocker: Reclocker,
                 replay: list[Binding], floor: Offset | None) -> None:
        self.r = runner
        self.remap = remap
        self.reclocker = reclocker
        self.replay = replay
        self.floor = floor
        self.buffer: list[Transaction] = []
        self.stalls: list[Stall] = []    # waiting for the binding that passes their offset
        self.halted: Stall | None = None
        self.writer = ThreadPoolExecutor(1, thread_name_prefix=f"lamina-ingest-{runner.name}")
        self.writing: Future[dict[str, int]] | None = None
        self.written: tuple[Binding, list[Transaction], list[Output]] | None = None

    def stream(self, stop: threading.Event) -> None:
        try:
            self._stream(stop)
        finally:
            self.writer.shutdown(wait=True)

    def _stream(self, stop: threading.Event) -> None:
        r = self.r
        next_tick = r.clock()
        r.source_upper = None
        while True:
            stopping = (stop.is_set() or self.halted is not None
                        or r._resync_wanted.is_set())
            if not stopping:
                wait = min(POLL_SLICE_SECONDS, max(0.0, next_tick - r.clock()))
                if self.writing is not None:     # look again soon: publish it once written
                    wait = min(wait, WRITING_POLL_SECONDS)
                self._take(r.source.poll(wait))
                r.lag_offsets = r.source.lag_offsets()
                r.metrics.set_lag_offsets(r.name, r.lag_offsets)
            if self.writing is not None and self.writing.done():
                self._finish()
            upper = r.source_upper
            while self.replay and upper is not None and not upper < self.replay[0].upper:
                self._flush(self.replay.pop(0))
            if self.halted is not None:
                stopping = True
            if self.replay:
                if stopping:
                    break       # the rest is re-read after the restart
                continue
            due = r.clock() >= next_tick
            if upper is not None and (due or stopping):
                self._finish()
                last = r.binding
                if last is None or not upper < last.upper:
                    self._flush(self._mint(upper))
                next_tick = max(next_tick + r.interval_ms / 1000,
                                r.clock() + r.interval_ms / 2000)
            if stopping:
                break
        self._finish()
        release(self.buffer)
        if self.halted is not None:
            raise SourceStalledError(self.halted.error, hint=self.halted.hint)

    def _take(self, events: list[Any]) -> None:
        r = self.r
        read = 0
        for ev in events:
            if isinstance(ev, Transaction):
                if self.floor is not None and ev.offset < self.floor:
                    release([ev])          # held by every output already
                    continue
                self.buffer.append(ev)
                r.lag.read(ev)
                read += 1
            elif isinstance(ev, Upper):
                if r.source_upper is None or r.source_upper <= ev.offset:
                    r.source_upper = ev.offset
                r.lag.read_upto(ev.time)
            elif isinstance(ev, Stall):
                if ev.table is None:     # write what precedes it, then stall
                    self.halted = ev
                    break
                if ev.offset is None:
                    self._stall(ev)
                else:
                    self.stalls.append(ev)
        if read:
            r.transactions += read
            r.metrics.transactions.labels(source=r.name).inc(read)

    def _stall(self, ev: Stall) -> None:
        out = self._output(ev.table or "")
        if out is None:
            self.r.log.warning("source.stall_unknown_table", table=ev.table, error=ev.error)
            return
        with self.r._mu:
            out.stall(ev.error, ev.hint)
        self.r.log.error("output.stalled", relation=out.relation, error=ev.error,
                         hint=ev.hint)
        self.r._publish_outputs()

    def _output(self, table: str) -> Output | None:
        outs = self.reclocker.outputs
        return outs.get(table) or next(
            (o for u, o in outs.items() if _same_table(u, table)), None)

    def _mint(self, upper: Offset) -> Binding:
        r = self.r
        t = self.remap.next_time(int(r.clock() * 1000), r.interval_ms,
                                 (o.upper for o in self.reclocker.outputs.values()))
        retire = resume.in_force(self.remap.bindings, self._least_upper())
        b = self.remap.mint(t, upper, r.source.encode_offset(upper),
                            retire_below=retire.time if retire else None)
        r.metrics.bindings.labels(source=r.name).inc()
        failpoints.hit("ingest.binding_sealed")
        return b

    def _least_upper(self) -> int:
        """The least upper of the outputs that can still be filled (stalled ones
        included: they resume where they stopped once the cause is fixed)."""
        return min((o.upper for o in self.reclocker.outputs.values() if not o.unfillable),
                   default=0)

    def _flush(self, b: Binding) -> None:
        """Write binding ``b``: its transactions are taken from the buffer here, written
        by the session's writer thread while this one goes on reading upstream (so the
        walsender is not held up by lamina's appends and fsyncs), and the rest is done by
        :meth:`_finish`, before the next binding is minted or written."""
        self._finish()
        take = [t for t in self.buffer if t.offset < b.upper]
        self.buffer = [t for t in self.buffer if not t.offset < b.upper]
        self._apply_stalls(b)
        live = [o for o in self.reclocker.outputs.values() if o.stalled is None]
        self.writing = self.writer.submit(self.reclocker.write, b.time, gather(take))
        self.written = (b, take, live)

    def _finish(self) -> None:
        """Wait for the binding being written (raising what its writing raised), then
        publish it and commit the offset every output holds."""
        if self.writing is None or self.written is None:
            return
        r = self.r
        try:
            written = self.writing.result()
        finally:
            self.writing = None
        b, take, live = self.written
        self.written = None
        for o in live:
            if o.stalled is not None:           # a value or shape its binding could not take
                r.log.error("output.stalled", relation=o.relation, error=o.stalled[0],
                            hint=o.stalled[1])
        release(take)
        r.lag.pending(self.buffer)
        with r._mu:
            r.binding = b
        for rel, n in written.items():
            if n:
                r.metrics.changes.labels(source=r.name, relation=rel).inc(n)
        r.metrics.binding_time.labels(source=r.name).set(b.time)
        least = self._least_upper()
        r.resume_frontier = least
        r.metrics.resume_frontier.labels(source=r.name).set(least)
        r._publish_outputs()
        held = resume.in_force(self.remap.bindings, least)
        if held is not None and (r.committed is None or r.committed < held.upper):
            r.source.commit(held.upper)
            with r._mu:
                r.committed = held.upper
            failpoints.hit("ingest.offset_committed")

    def _apply_stalls(self, b: Binding) -> None:
        """Stall the outputs whose stall offset ``b`` passes, before ``b`` is written to
        them. An output that holds the stall's position already (every offset below the
        upper of the binding in force at its upper) ignores it: a replayed stall it has
        left behind, e.g. after a resync."""
        now = [s for s in self.stalls if s.offset < b.upper]
        self.stalls = [s for s in self.stalls if not s.offset < b.upper]
        for s in now:
            out = self._output(s.table or "")
            held = resume.in_force(self.remap.bindings, out.upper) if out else None
            if out is not None and held is not None and s.offset < held.upper:
                self.r.log.info("output.stall_passed", relation=out.relation,
                                error=s.error)
                continue
            self._stall(s)


def _unfillable_output(store: Store, upstream: str, how: OutputSettings,
                       why: SourceStalledError) -> Output:
    """A stalled output that nothing is written to, and whose upper does not hold back the
    resumption frontier; the relation is left as it is (not created)."""
    try:
        rel = store.relation(how.relation)
    except RelationNotFoundError:
        rel = None
    out = Output(upstream, how.relation, rel, upper=rel.upper if rel is not None else 0,
                 unfillable=True)
    out.stall(why.error, why.hint)
    return out


def _same_table(a: str, b: str) -> bool:
    return a.removeprefix("public.") == b.removeprefix("public.")


def _spec_for(specs: dict[str, TableSpec], upstream: str) -> TableSpec | None:
    if upstream in specs:
        return specs[upstream]
    return next((s for u, s in specs.items() if _same_table(u, upstream)), None)


def _upper_of(o: Output) -> Callable[[], int]:
    return lambda: o.upper
