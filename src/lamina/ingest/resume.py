"""Where a source resumes: the resumption frontier, the binding in force there, the
bindings to replay and the outputs that cannot be filled.

The resume time ``R`` is the least upper of the outputs (an output not created yet has
upper 0). The binding in force there, ``B`` (the newest with ``B.time < R``), says where
to re-read: every output holds every transaction below ``F(B)``, so the source opens at
``F(B)`` (or from its start, snapshot included, when there is no ``B``). Bindings at or
after ``R`` are durable already: they are replayed, each written again only to the outputs
still at or below it.

A source whose start cannot be read again (PostgreSQL: ``open(None)`` takes a new snapshot
at a new LSN, above every binding) is opened from its start only while no output holds
data: otherwise ``R`` is the least upper of the outputs holding data, and an output holding
none (a table added to the source, a relation dropped) is *unfillable*: stalled, left out
of ``R`` and of the offset commit, until ``lamina ingest resync`` fills it; the others go
on. The exception is an output a kill left unsealed at the very first binding, completed
by :func:`_finish_first_seal`. A source that replays from its start (files) fills such an
output by replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow.compute as pc
import structlog

from lamina.errors import RelationNotFoundError, SourceStalledError
from lamina.ingest.reclock import RESYNC_HINT
from lamina.ingest.remap import Binding
from lamina.ingest.settings import SourceSettings
from lamina.ingest.tail import unsealed_updates
from lamina.schema import TIME
from lamina.store import Store

log = structlog.get_logger(__name__)


@dataclass
class Resumption:
    """Where one session of a source starts."""

    time: int
    """``R``: the least upper of the outputs that can be filled."""
    in_force: Binding | None
    """The binding in force at ``R``: the source reopens at its upper (None: its start)."""
    replay: list[Binding]
    """The durable bindings at or after ``R``, written again once the source reaches them."""
    unfillable: dict[str, SourceStalledError] = field(default_factory=dict)
    """Upstream table -> why its output cannot be filled (see the module docstring)."""


def in_force(bindings: list[Binding], at: int) -> Binding | None:
    """The newest binding with a time below ``at``: every output with upper ``>= at``
    holds every transaction below its upper."""
    found = None
    for b in bindings:
        if b.time < at:
            found = b
    return found


def plan(store: Store, settings: SourceSettings, bindings: list[Binding], *,
         replays_from_start: bool, remap: str) -> Resumption:
    """Where the source's next session starts, from what is on disk. Raises
    :class:`SourceStalledError` when the outputs hold data the bindings cannot place."""
    wanted = settings.outputs()
    uppers = {}
    for upstream, relation in wanted.items():
        try:
            uppers[upstream] = store.relation(relation).upper
        except RelationNotFoundError:
            uppers[upstream] = 0
    held = {u: up for u, up in uppers.items() if up > 0}
    unfillable: dict[str, SourceStalledError] = {}
    if held and not replays_from_start:
        resume_time = min(held.values())
        for u in wanted:
            if u not in held and _finish_first_seal(store, settings.name, bindings, wanted[u],
                                                     resume_time):
                held[u] = resume_time
        unfillable = {u: _unfillable(settings, remap, u, wanted[u])
                      for u in wanted if u not in held}
    else:
        resume_time = min(uppers.values())
    if not bindings and held:
        full = sorted(wanted[u] for u in held)
        raise SourceStalledError(
            f"outputs {full} hold data, but relation {remap!r} has no bindings: without "
            "them lamina cannot tell which upstream offsets they hold",
            hint=f"restore {remap!r} from the backup the outputs came from, or drop {full} "
                 "to ingest them again from the start")
    found = in_force(bindings, resume_time)
    if found is None and held and not replays_from_start:
        full = sorted(wanted[u] for u in held)
        raise SourceStalledError(   # opening from the start would take a new snapshot
            f"outputs {full} hold data below time {resume_time}, but relation {remap!r} "
            "has no binding below it: lamina cannot tell where upstream to resume without "
            "writing rows twice",
            hint=f"restore {remap!r} from the backup the outputs came from, or drop every "
                 f"output of source {settings.name!r} and {remap!r} to start over")
    return Resumption(resume_time, found, [b for b in bindings if b.time >= resume_time],
                      unfillable)


def _finish_first_seal(store: Store, source: str, bindings: list[Binding], relation: str,
                       least: int) -> bool:
    """A kill between the seals of the outputs at the very first binding ``T0`` leaves
    an output at upper 0 beside outputs sealed to ``T0 + 1``. Every output is appended
    before any is sealed (:mod:`lamina.ingest.reclock`), so when its updates above the
    upper are all at ``T0`` it holds the whole of ``T0``: seal it to ``T0 + 1`` now.
    (One whose table had no rows at ``T0`` cannot be told from a new output and stalls.)
    """
    if not bindings or least != bindings[0].time + 1:
        return False
    try:
        rel = store.relation(relation)
    except RelationNotFoundError:
        return False
    if rel.upper != 0:
        return False
    tail = unsealed_updates(rel)
    if tail.num_rows == 0 or set(pc.unique(tail.column(TIME)).to_pylist()) != {
            bindings[0].time}:
        return False
    rel.seal(least)
    log.info("output.first_seal_completed", source=source, relation=relation, upper=least)
    return True


def _unfillable(settings: SourceSettings, remap: str, upstream: str,
                relation: str) -> SourceStalledError:
    return SourceStalledError(
        f"output {relation!r} of source {settings.name!r} holds no data while the source's "
        f"other outputs do, and a {settings.kind} source cannot re-read upstream from its "
        "beginning (its initial snapshot is gone): filling it from the stream would leave "
        "out what the table held before",
        hint=RESYNC_HINT.format(source=settings.name, table=upstream)
        + f" (or drop every output of source {settings.name!r} and relation {remap!r} to "
        "start over); the other outputs go on meanwhile",
        table=upstream)
