"""One source's life: recovery, reading, minting bindings, reclocking, offset commit.

A :class:`SourceRunner` runs in a thread of its own (sources block). Each *session*
starts from what is on disk, so a retried session and a restarted process recover alike:

1. **Resumption.** Load the bindings (:class:`~lamina.ingest.remap.Remap`) and the outputs'
   uppers. The resume time ``R`` is the least output upper (an output not created yet has
   upper 0). The binding in force there, ``B`` (the newest with ``B.time < R``), says
   where to re-read: every output holds every transaction below ``F(B)``, so the source
   opens at ``F(B)`` (or from its start, snapshot included, when there is no ``B``).
   A source whose start cannot be read again (PostgreSQL: ``open(None)`` takes a new
   snapshot at a new LSN, above every binding) is opened from its start only while no
   output holds data: otherwise ``R`` is the least upper of the outputs holding data, and
   an output holding none (a table added to the source, a relation dropped) is stalled,
   left out of ``R`` and of the offset commit; the others go on (except an output a kill
   left unsealed at the very first binding, completed by ``_finish_first_seal``). A source
   that replays from its start (files: ``replays_from_start``) fills such an output by
   replay.
2. **Replay.** Bindings at or after ``R`` are durable already; each is written again
   (:class:`~lamina.ingest.reclock.Reclocker`: only to the outputs still at or below it)
   once the source's upper reaches its ``F``. Times and their contents are the ones the
   killed process would have written.
3. **Streaming.** Every ``timestamp_interval_seconds`` a binding ``(T, source upper)`` is
   minted (appended and sealed in the remap relation, ``ingest.binding_sealed``) and the
   buffered transactions below its upper are written at ``T``; outputs are sealed to
   ``T + 1``. A binding is minted also when nothing arrived, so idle outputs' uppers
   follow the clock.
4. **Offset commit.** After each binding, the binding in force at the least output upper
   (stalled outputs included, unfillable ones not) is the offset every output holds durably:
   ``Source.commit`` is told it (``ingest.offset_committed``). Older bindings are
   retracted from the remap relation with the next one.

Errors: :class:`~lamina.errors.SourceTransientError` closes the source and starts a new
session after a backoff (``retry_initial_seconds`` doubling up to ``retry_max_seconds``);
a :class:`~lamina.ingest.source.Stall` for a table stalls its output only; a stall of the
whole source (``Stall(None, ...)``, :class:`~lamina.errors.SourceStalledError`, or a
storage error) stops the source until the process restarts. Stop (SIGTERM): the buffered
transactions below the source's upper get a last binding, outputs are sealed, the source
is closed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pyarrow.compute as pc
import structlog

from lamina import failpoints
from lamina.errors import (
    LaminaError,
    RelationNotFoundError,
    SourceStalledError,
    SourceTransientError,
)
from lamina.ingest.health import Health, State
from lamina.ingest.metrics import IngestMetrics
from lamina.ingest.reclock import Output, Reclocker, open_output
from lamina.ingest.remap import Binding, Remap, next_binding_time
from lamina.ingest.settings import SourceSettings
from lamina.ingest.source import Offset, Source, Stall, TableSpec, Transaction, Upper
from lamina.ingest.tail import unsealed_updates
from lamina.schema import TIME
from lamina.store import Store

log = structlog.get_logger(__name__)

POLL_SLICE_SECONDS = 0.25
"""Longest single ``poll``: how quickly a stop request is noticed."""


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
        self.sealed_at = 0                      # newest binding time all live outputs passed
        metrics.register_source(self.name, self._lag_seconds)

    # --- status (any thread) ---------------------------------------------------------------
    def _lag_seconds(self) -> float:
        if self.sealed_at == 0:
            return 0.0
        return max(0.0, self.clock() - self.sealed_at / 1000)

    def status(self) -> dict[str, Any]:
        with self._mu:
            outs = [{"relation": o.relation, "upstream": o.upstream, "upper": o.upper,
                     "changes": o.changes, **self._output_health(o).as_json()}
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
                "lag_seconds": round(self._lag_seconds(), 3), "outputs": outs}

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

    # --- thread ------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        backoff = self.retry_initial
        try:
            while not stop.is_set():
                try:
                    self._session(stop)
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
            self.log.info("source.ceased", state=self.health.state)

    def _stall_source(self, error: str, hint: str, stop: threading.Event) -> None:
        self._set_health("stalled", error, hint)
        self.log.error("source.stalled", error=error, hint=hint)
        self._close_source()
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
                      decode=self.source.decode_offset)
        bindings = remap.load()
        wanted = self.settings.outputs()
        uppers = {}
        for upstream, relation in wanted.items():
            try:
                uppers[upstream] = self.store.relation(relation).upper
            except RelationNotFoundError:
                uppers[upstream] = 0
        held = {u: up for u, up in uppers.items() if up > 0}
        unfillable: dict[str, SourceStalledError] = {}
        if held and not _replays_from_start(self.source):
            # The source's start (PostgreSQL: the initial snapshot) cannot be read again:
            # resume where the outputs holding data are; an empty one cannot be filled.
            resume_time = min(held.values())
            for u in wanted:
                if u not in held and self._finish_first_seal(bindings, wanted[u],
                                                             resume_time):
                    held[u] = resume_time
            unfillable = {u: self._unfillable(remap.name, u, wanted[u])
                          for u in wanted if u not in held}
        else:
            resume_time = min(uppers.values())
        if not bindings and held:
            full = sorted(wanted[u] for u in held)
            raise SourceStalledError(
                f"outputs {full} hold data, but relation {remap.name!r} has no bindings: "
                "without them lamina cannot tell which upstream offsets they hold",
                hint=f"restore {remap.name!r} from the backup the outputs came from, or drop "
                     f"{full} to ingest them again from the start")
        in_force = _in_force(bindings, resume_time)
        if in_force is None and held and not _replays_from_start(self.source):
            full = sorted(wanted[u] for u in held)
            raise SourceStalledError(   # opening from the start would take a new snapshot
                f"outputs {full} hold data below time {resume_time}, but relation "
                f"{remap.name!r} has no binding below it: lamina cannot tell where upstream "
                "to resume without writing rows twice",
                hint=f"restore {remap.name!r} from the backup the outputs came from, or drop "
                     f"every output of source {self.name!r} and {remap.name!r} to start over")
        resume = in_force.upper if in_force is not None else None
        self.resume_frontier = resume_time
        self.metrics.resume_frontier.labels(source=self.name).set(resume_time)
        self.log.info("source.opening", resume_time=resume_time,
                      resume=in_force.text if in_force else None, bindings=len(bindings))
        replay = [b for b in bindings if b.time >= resume_time]
        barriers = getattr(self.source, "set_barriers", None)
        if callable(barriers):       # an optional extension of the Source protocol
            barriers([b.upper for b in replay])
        specs = self.source.open(resume)
        outputs: dict[str, Output] = {}
        for upstream, relation in wanted.items():
            found = _spec_for(specs, upstream)
            name = found.upstream if found is not None else upstream
            if upstream in unfillable:
                outputs[name] = _unfillable_output(self.store, name, relation,
                                                   unfillable[upstream])
            else:
                outputs[name] = open_output(self.store, name, relation, found)
        with self._mu:
            self.outputs = outputs
            self.binding = in_force
            self.committed = None
        for o in outputs.values():
            self.metrics.register_output(self.name, o.relation, _upper_of(o))
            if o.stalled is not None:
                self.log.error("output.stalled", relation=o.relation, error=o.stalled[0],
                               hint=o.stalled[1])
        reclocker = Reclocker(outputs)
        self._set_health("running")
        self.log.info("source.running", outputs=sorted(o.relation for o in outputs.values()),
                      replay=len(replay))
        self._stream(stop, remap, reclocker, replay, floor=resume)

    def _finish_first_seal(self, bindings: list[Binding], relation: str, least: int) -> bool:
        """A kill between the seals of the outputs at the very first binding ``T0`` leaves
        an output at upper 0 beside outputs sealed to ``T0 + 1``. Every output is appended
        before any is sealed (:mod:`lamina.ingest.reclock`), so when its updates above the
        upper are all at ``T0`` it holds the whole of ``T0``: seal it to ``T0 + 1`` now.
        (One whose table had no rows at ``T0`` cannot be told from a new output and stalls.)
        """
        if not bindings or least != bindings[0].time + 1:
            return False
        try:
            rel = self.store.relation(relation)
        except RelationNotFoundError:
            return False
        if rel.upper != 0:
            return False
        tail = unsealed_updates(rel)
        if tail.num_rows == 0 or set(pc.unique(tail.column(TIME)).to_pylist()) != {
                bindings[0].time}:
            return False
        rel.seal(least)
        self.log.info("output.first_seal_completed", relation=relation, upper=least)
        return True

    def _unfillable(self, remap: str, upstream: str, relation: str) -> SourceStalledError:
        return SourceStalledError(
            f"output {relation!r} of source {self.name!r} holds no data while the source's "
            f"other outputs do, and a {self.settings.kind} source cannot re-read upstream "
            "from its beginning (its initial snapshot is gone): filling this output would "
            "write the other outputs' rows twice",
            hint=f"ingest table {upstream!r} under a new source name (which takes a snapshot "
                 f"of its own), or drop every output of source {self.name!r} and relation "
                 f"{remap!r} to start over; the other outputs go on meanwhile",
            table=upstream)

    def _stream(self, stop: threading.Event, remap: Remap, reclocker: Reclocker,
                replay: list[Binding], *, floor: Offset | None) -> None:
        buffer: list[Transaction] = []
        next_tick = self.clock()
        self.source_upper = None
        halted: Stall | None = None
        while True:
            stopping = stop.is_set() or halted is not None
            if not stopping:
                wait = min(POLL_SLICE_SECONDS, max(0.0, next_tick - self.clock()))
                for ev in self.source.poll(wait):
                    if isinstance(ev, Transaction):
                        if floor is not None and ev.offset < floor:
                            continue            # held by every output already
                        buffer.append(ev)
                        self.transactions += 1
                        self.metrics.transactions.labels(source=self.name).inc()
                    elif isinstance(ev, Upper):
                        if self.source_upper is None or self.source_upper <= ev.offset:
                            self.source_upper = ev.offset
                    elif isinstance(ev, Stall):
                        if ev.table is None:     # write what precedes it, then stall
                            halted = ev
                            break
                        self._on_stall(ev)
                lag = getattr(self.source, "lag_offsets", None)
                self.lag_offsets = lag() if callable(lag) else None
                self.metrics.set_lag_offsets(self.name, self.lag_offsets)
            upper = self.source_upper
            while replay and upper is not None and not upper < replay[0].upper:
                b = replay.pop(0)
                buffer = self._flush(remap, reclocker, b, buffer)
            if halted is not None:
                stopping = True
            if replay:
                if stopping:
                    break       # the rest is re-read after the restart
                continue
            due = self.clock() >= next_tick
            if upper is not None and (due or stopping):
                last = self.binding
                if last is None or not upper < last.upper:
                    b = self._mint(remap, upper)
                    buffer = self._flush(remap, reclocker, b, buffer)
                next_tick = max(next_tick + self.interval_ms / 1000,
                                self.clock() + self.interval_ms / 2000)
            if stopping:
                break
        if halted is not None:
            raise SourceStalledError(halted.error, hint=halted.hint)

    def _on_stall(self, ev: Stall) -> None:
        table = ev.table or ""
        out = self.outputs.get(table) or next(
            (o for u, o in self.outputs.items() if _same_table(u, table)), None)
        if out is None:
            self.log.warning("source.stall_unknown_table", table=ev.table, error=ev.error)
            return
        with self._mu:
            out.stall(ev.error, ev.hint)
        self.log.error("output.stalled", relation=out.relation, error=ev.error, hint=ev.hint)
        self._publish_outputs()

    def _mint(self, remap: Remap, upper: Offset) -> Binding:
        last = remap.last_time
        top = max((o.upper for o in self.outputs.values()), default=0) - 1
        if top >= 0:
            last = max(last if last is not None else top, top)
        now_ms = int(self.clock() * 1000)
        t = next_binding_time(now_ms, self.interval_ms, last)
        retire = _in_force(remap.bindings, self._least_upper())
        b = remap.mint(t, upper, self.source.encode_offset(upper),
                       retire_below=retire.time if retire else None)
        self.metrics.bindings.labels(source=self.name).inc()
        failpoints.hit("ingest.binding_sealed")
        return b

    def _least_upper(self) -> int:
        """The least upper of the outputs that can still be filled (stalled ones
        included: they resume where they stopped once the cause is fixed)."""
        return min((o.upper for o in self.outputs.values() if not o.unfillable), default=0)

    def _flush(self, remap: Remap, reclocker: Reclocker, b: Binding,
               buffer: list[Transaction]) -> list[Transaction]:
        take = [t for t in buffer if t.offset < b.upper]
        rest = [t for t in buffer if not t.offset < b.upper]
        written = reclocker.write(b.time, take)   # fsyncs: not under the status lock
        with self._mu:
            self.binding = b
        for rel, n in written.items():
            if n:
                self.metrics.changes.labels(source=self.name, relation=rel).inc(n)
        live = [o for o in self.outputs.values() if o.stalled is None]
        if live and all(o.upper > b.time for o in live):
            self.sealed_at = b.time
        self.metrics.binding_time.labels(source=self.name).set(b.time)
        least = self._least_upper()
        self.resume_frontier = least
        self.metrics.resume_frontier.labels(source=self.name).set(least)
        self._publish_outputs()
        held = _in_force(remap.bindings, least)
        if held is not None and (self.committed is None or self.committed < held.upper):
            self.source.commit(held.upper)
            with self._mu:
                self.committed = held.upper
            failpoints.hit("ingest.offset_committed")
        return rest


def _in_force(bindings: list[Binding], at: int) -> Binding | None:
    """The newest binding with a time below ``at``: every output with upper ``>= at``
    holds every transaction below its upper."""
    found = None
    for b in bindings:
        if b.time < at:
            found = b
    return found


def _replays_from_start(source: Source) -> bool:
    """Whether ``open(None)`` re-reads the same offsets with the same contents as the first
    time (the optional ``replays_from_start`` attribute; absent means it does not)."""
    return getattr(source, "replays_from_start", False) is True


def _unfillable_output(store: Store, upstream: str, relation: str,
                       why: SourceStalledError) -> Output:
    """A stalled output that nothing is written to, and whose upper does not hold back the
    resumption frontier; the relation is left as it is (not created)."""
    try:
        rel = store.relation(relation)
    except RelationNotFoundError:
        rel = None
    out = Output(upstream, relation, rel, upper=rel.upper if rel is not None else 0,
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
