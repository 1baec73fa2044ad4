"""Bindings between a source's offsets and lamina time: the ``<source>.remap`` relation.

A binding ``(T, F(T))`` says "at lamina time ``T`` the source's upper offset was
``F(T)``": every upstream transaction with an offset below ``F(T)`` is written at a time
``<= T``. ``F`` is monotone (``T1 < T2`` implies ``F(T1) <= F(T2)``).

Lamina times of a source are milliseconds since the Unix epoch rounded up to the source's
``timestamp_interval_seconds`` and strictly increasing: a new binding time is
``max(ceil(now), last + interval)``, with ``last`` the newest binding ever made durable,
so a clock stepped backwards, or a restart, never reuses or reorders a time.

Layout of the relation (key ``binding_time``)::

    binding_time  int64   not null   T, milliseconds since the Unix epoch
    upper         string  not null   F(T), the source's encode_offset() text

Each binding is one ``+1`` row at time ``T``, appended and sealed (``seal(T + 1)``) in one
step before any output of the source is sealed past ``T``. Bindings that no output can
need again (older than the binding in force at the resumption frontier) are retracted in
the same append as a later binding, so the relation holds a handful of rows, and its
compaction frontier follows the source's retained history like its outputs'
(:mod:`lamina.ingest.retention`), so the compacter consolidates the rest away.

Recovery (:meth:`Remap.load`): the sealed bindings come from a snapshot; a binding that
was appended but not sealed (a kill between the two) is *adopted*: it was a true upper of
the source when it was minted, and no output holds data at its time yet, so sealing it now
is as good as having sealed it then.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from lamina.errors import RelationNotFoundError, SourceStalledError
from lamina.ingest.retention import Retention
from lamina.ingest.source import Offset
from lamina.ingest.tail import unsealed_updates
from lamina.schema import DIFF, TIME
from lamina.store import Relation, Store

REMAP_SCHEMA = pa.schema([pa.field("binding_time", pa.int64(), False),
                          pa.field("upper", pa.string(), False)])
REMAP_KEY = ("binding_time",)


@dataclass(frozen=True)
class Binding:
    """At lamina time ``time`` the source's upper offset was ``upper``."""

    time: int
    upper: Offset
    text: str


def next_binding_time(now_ms: int, interval_ms: int, last: int | None) -> int:
    """``now_ms`` rounded up to ``interval_ms``, and above ``last`` by at least one
    interval (strictly increasing across clock steps and restarts)."""
    t = -(-now_ms // interval_ms) * interval_ms
    if last is not None:
        t = max(t, last + interval_ms)
    return t


class Remap:
    """The durable bindings of one source."""

    def __init__(self, store: Store, name: str, *, decode: Callable[[str], Offset],
                 retention: Retention) -> None:
        self.name = name
        self.decode = decode
        self.retention = retention
        try:
            self.rel: Relation = store.relation(name)
        except RelationNotFoundError:
            self.rel = store.create_relation(name, REMAP_SCHEMA, list(REMAP_KEY), time_unit="ms")
        if not self.rel.schema.equals(REMAP_SCHEMA, check_metadata=False) \
                or self.rel.key != REMAP_KEY:
            raise SourceStalledError(
                f"relation {name!r} exists but is not a remap relation (schema "
                f"{self.rel.schema})",
                hint=f"drop relation {name!r} or rename the source; lamina keeps a source's "
                     "bindings there")
        self.bindings: list[Binding] = []

    def hold(self) -> None:
        """Take the relation's writer now (LockedError when another process writes the
        source's relations), before any slow work that would end in writing it."""
        self.rel.seal(self.rel.upper)

    def load(self) -> list[Binding]:
        """Read the bindings (adopting an unsealed one); sorted by time."""
        tail = unsealed_updates(self.rel)
        if tail.num_rows:
            top = int(pc.max(tail.column(TIME)).as_py())
            self.rel.seal(top + 1)
        upper = self.rel.upper
        rows: list[Binding] = []
        if upper > 0:
            snap = self.rel.snapshot(upper - 1)
            for t, text, d in zip(snap.column("binding_time").to_pylist(),
                                  snap.column("upper").to_pylist(),
                                  snap.column(DIFF).to_pylist(), strict=True):
                if d != 1:
                    raise SourceStalledError(
                        f"relation {self.name!r} holds binding {t} with multiplicity {d}",
                        hint="the remap relation was written by something other than "
                             "`lamina ingest`; restore it from a backup or drop the source's "
                             "relations and ingest again")
                rows.append(Binding(int(t), self.decode(str(text)), str(text)))
        rows.sort(key=lambda b: b.time)
        for a, b in itertools.pairwise(rows):
            if b.upper < a.upper:
                raise SourceStalledError(
                    f"relation {self.name!r}: binding {b.time} has upper {b.text} below "
                    f"{a.text} of binding {a.time}; bindings must be monotone",
                    hint="the remap relation is damaged; restore it or ingest again")
        self.bindings = rows
        return rows

    @property
    def last_time(self) -> int | None:
        """The newest binding time, sealed ever (also after retractions)."""
        upper = self.rel.upper
        last = self.bindings[-1].time if self.bindings else None
        if upper > 0:
            last = max(last or 0, upper - 1)
        return last

    def next_time(self, now_ms: int, interval_ms: int, uppers: Iterable[int]) -> int:
        """The time of the next binding: ``now_ms`` rounded up to the interval, above every
        binding ever made durable and below no output's upper (``uppers``)."""
        last = self.last_time
        top = max(uppers, default=0) - 1
        if top >= 0:
            last = top if last is None else max(last, top)
        return next_binding_time(now_ms, interval_ms, last)

    def mint(self, time: int, upper: Offset, text: str, *, retire_below: int | None) -> Binding:
        """Append binding ``(time, upper)`` and seal past it, retracting the bindings older
        than ``retire_below`` (in the same record). Durable on return."""
        b = Binding(time, upper, text)
        retired = [x for x in self.bindings if retire_below is not None and x.time < retire_below]
        times = [time] + [x.time for x in retired]
        texts = [text] + [x.text for x in retired]
        diffs = [1] + [-1] * len(retired)
        table = pa.table({"binding_time": pa.array(times, pa.int64()),
                          "upper": pa.array(texts, pa.string()),
                          TIME: pa.array([time] * len(times), pa.uint64()),
                          DIFF: pa.array(diffs, pa.int64())})
        self.rel.append(table)
        self.rel.seal(time + 1)
        self.bindings = [x for x in self.bindings if x not in retired] + [b]
        since = self.retention.since_at(time, self.rel.since)
        if since is not None:
            self.rel.allow_compaction(since)
        return b
