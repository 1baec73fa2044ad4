"""Reclocking: writing a source's transactions into its outputs at lamina times.

Every transaction with an offset below ``F(T)`` and not below ``F`` of the binding before
goes to time ``T``, whole: :meth:`Reclocker.write` takes all of a binding's changes at
once, gathered by table (:func:`lamina.ingest.changes.gather`), so each output gets one
append per binding. Per binding the writes are, in this order::

    remap: append (T, F(T)), seal T+1            (lamina.ingest.remap, before this module)
    every output at or below T: append its changes at T      -> "ingest.outputs_appended"
    every output at or below T: seal T+1, since T - retention -> "ingest.outputs_sealed"

so every output of a source is sealed to the same ``T + 1`` and no output is sealed past a
binding that is not durable. ``since`` follows the seal by the output's retention
(:mod:`lamina.ingest.retention`).

Exactly once after a kill: an output whose upper is above ``T`` already holds ``T``'s
changes and is skipped (a re-read change goes only to the outputs whose upper is at or
below its time). An output at or below ``T`` may hold part of ``T`` already (appended, not
sealed: see :mod:`lamina.ingest.tail`); those updates are subtracted from what is written,
so the output ends with exactly the changes of ``T``, whatever was appended before.

TRUNCATE (a gathered table marked ``truncated``): with ``on_truncate = "retract"`` the
output also gets, at ``T``, the retraction of every row it holds sealed (its snapshot at
``upper - 1``), then the changes after the truncate; that is a function of what is
sealed, so a replay after a kill writes the same. With ``"stall"`` the output stalls
before ``T``.

A stalled output (a definite error for its table, a schema that does not fit, a value
that cannot be stored) receives nothing and is not sealed: its upper stays where its data
stops, so nothing is skipped and the resumption frontier holds the upstream offsets it
still needs.

Each append and seal waits for an fsync of the output's own WAL, so a source of many
tables would spend a binding waiting on one disk flush after the other: the outputs are
appended (then sealed) by up to :data:`IO_THREADS` threads at once (:func:`each`), which
the disk serves together. The order across outputs within a phase does not matter; the
phases stay in order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TypeVar

import pyarrow as pa
import pyarrow.compute as pc

from lamina import failpoints
from lamina.errors import RelationNotFoundError, SchemaError, SourceStalledError
from lamina.ingest.changes import Gathered
from lamina.ingest.retention import Retention
from lamina.ingest.settings import OnTruncate, OutputSettings
from lamina.ingest.source import TableSpec
from lamina.ingest.tail import unsealed_updates
from lamina.schema import DIFF, TIME
from lamina.store import Relation, Store

_T = TypeVar("_T")
_R = TypeVar("_R")

APPEND_SLICE_BYTES = 256 << 20
"""Appends above this many bytes are split (a WAL record holds at most 1 GiB)."""

IO_THREADS = 16
"""Outputs appended, sealed or opened at once (:func:`each`)."""


@functools.cache
def _io_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(IO_THREADS, thread_name_prefix="lamina-ingest-io")


def each(items: Iterable[_T], fn: Callable[[_T], _R]) -> list[_R]:
    """``fn`` of every item, by up to :data:`IO_THREADS` threads (in this thread for a
    few); results in order; the first exception is raised once all are done."""
    todo = list(items)
    if len(todo) <= 2:
        return [fn(x) for x in todo]
    pool = _io_pool()
    futures = [pool.submit(fn, x) for x in todo]
    wait(futures)
    return [f.result() for f in futures]


RESYNC_HINT = ("run `lamina ingest resync --config FILE {source} {table}`: it reads the "
               "table afresh and writes the difference, leaving the other tables and the "
               "slot alone")


@dataclass
class Output:
    """One output relation of a source and what the reclocker knows of it."""

    upstream: str
    relation: str
    rel: Relation | None
    upper: int = 0
    since: int = 0
    retention: Retention = field(default_factory=lambda: Retention(float("inf")))
    on_truncate: OnTruncate = "retract"
    unsealed: dict[int, pa.Table] = field(default_factory=dict)
    stalled: tuple[str, str] | None = None
    changes: int = 0
    unfillable: bool = False
    """Holds no data while the source cannot re-read its start: never written to, and
    left out of the resumption frontier (see :mod:`lamina.ingest.runner`)."""

    def stall(self, error: str, hint: str) -> None:
        if self.stalled is None:
            self.stalled = (error, hint)


def open_output(store: Store, source: str, upstream: str, how: OutputSettings,
                spec: TableSpec | None) -> Output:
    """The output for upstream table ``upstream``: created from ``spec`` when missing; an
    existing relation whose columns differ is a stalled output."""
    relation = how.relation
    try:
        rel = store.relation(relation)
    except RelationNotFoundError:
        if spec is None:
            out = Output(upstream, relation, None)
            out.stall(f"upstream table {upstream!r} was not found",
                      "check the source's table list and that the table exists upstream")
            return out
        try:
            rel = store.create_relation(relation, spec.schema, list(spec.key), time_unit="ms")
        except SchemaError as exc:
            out = Output(upstream, relation, None)
            out.stall(f"upstream table {upstream!r} cannot be stored: {exc}",
                      "map the column to a supported type upstream, or leave the table out")
            return out
    out = Output(upstream, relation, rel, upper=rel.upper, since=rel.since,
                 retention=how.retention, on_truncate=how.on_truncate)
    if spec is not None and not fits(rel, spec):
        out.stall(f"relation {relation!r} has columns {_columns(rel.schema)} and key "
                  f"{list(rel.key)}, but upstream table {upstream!r} now has "
                  f"{_columns(spec.schema)} and key {list(spec.key)}",
                  "a PostgreSQL table: " + RESYNC_HINT.format(source=source, table=upstream)
                  + " (the relation is created again with the new columns); a files "
                  "source: map it to a new relation name, or drop the relation and restart "
                  "(it is filled again from the files)")
        return out
    tail = unsealed_updates(rel)
    if tail.num_rows:
        for t in pc.unique(tail.column(TIME)).to_pylist():
            part = tail.filter(pc.equal(tail.column(TIME), pa.scalar(t, pa.uint64())))
            out.unsealed[int(t)] = part
    return out


def fits(rel: Relation, spec: TableSpec) -> bool:
    """Whether ``rel`` stores ``spec``'s columns and key as they are."""
    return (_columns(rel.schema) == _columns(spec.schema)
            and tuple(rel.key) == tuple(spec.key))


def _columns(schema: pa.Schema) -> list[tuple[str, pa.DataType]]:
    return [(f.name, f.type) for f in schema]


def contents(rel: Relation) -> pa.Table:
    """What ``rel`` holds once sealed past its unsealed updates: its snapshot at
    ``upper - 1`` plus the updates above the upper (row columns and ``_diff``)."""
    schema = rel.schema.append(pa.field(DIFF, pa.int64()))
    parts = [unsealed_updates(rel).select(schema.names).cast(schema)]
    if rel.upper > 0:
        parts.insert(0, rel.snapshot(rel.upper - 1).select(schema.names).cast(schema))
    return pa.concat_tables(parts)


def negated(table: pa.Table) -> pa.Table:
    i = table.schema.get_field_index(DIFF)
    return table.set_column(i, DIFF, pc.negate_checked(table.column(DIFF)))


class Reclocker:
    """Writes the changes of one binding into every output of a source."""

    def __init__(self, outputs: dict[str, Output], source: str) -> None:
        self.outputs = outputs
        self.source = source

    def write(self, time: int, changes: Mapping[str, Gathered]) -> dict[str, int]:
        """Write ``changes`` at ``time`` to every live output at or below ``time``, then
        seal them to ``time + 1`` and move their ``since``. Returns the rows written per
        output relation."""
        due = [o for o in self.outputs.values()
               if o.stalled is None and o.rel is not None and o.upper <= time]

        def append(out: Output) -> int:
            try:
                rows = self._append(out, time, changes.get(out.upstream))
            except SchemaError as exc:
                out.stall(f"changes for {out.relation!r} do not fit the relation: {exc}",
                          "the upstream table changed shape: "
                          + RESYNC_HINT.format(source=self.source, table=out.upstream))
                return 0
            except SourceStalledError as exc:
                out.stall(f"table {out.upstream}: {exc.error}", exc.hint)
                return 0
            out.changes += rows
            return rows

        rows = each(due, append)
        failpoints.hit("ingest.outputs_appended")
        each([o for o in due if o.stalled is None], lambda out: self._seal(out, time))
        failpoints.hit("ingest.outputs_sealed")
        return {o.relation: n for o, n in zip(due, rows, strict=True) if o.stalled is None}

    @staticmethod
    def _seal(out: Output, time: int) -> None:
        assert out.rel is not None
        out.rel.seal(time + 1)
        out.upper = time + 1
        for t in [t for t in out.unsealed if t <= time]:
            del out.unsealed[t]
        since = out.retention.since_at(time, out.since)
        if since is not None:
            out.rel.allow_compaction(since)
            out.since = since

    def _append(self, out: Output, time: int, gathered: Gathered | None) -> int:
        assert out.rel is not None
        names = [*out.rel.schema.names, DIFF]
        tables: list[pa.Table] = []
        if gathered is not None and gathered.truncated:
            if out.on_truncate == "stall":
                raise SourceStalledError(
                    f"table {out.upstream} was truncated upstream (TRUNCATE) and its "
                    'on_truncate is "stall"',
                    hint=RESYNC_HINT.format(source=self.source, table=out.upstream)
                    + '; or set on_truncate = "retract" and restart')
            if out.upper > 0:
                tables.append(negated(out.rel.snapshot(out.upper - 1).select(names)))
        new = gathered.table() if gathered is not None else None
        if new is not None:
            missing = [n for n in names if n not in new.column_names]
            if missing:
                raise SchemaError(f"the source sent changes without columns {missing}")
            tables.append(new.select(names))
        rows = int(sum(t.num_rows for t in tables))
        old = out.unsealed.get(time)
        if old is not None and old.num_rows:
            tables.append(negated(old.select(names)))
        if not tables:
            return 0
        try:
            table = pa.concat_tables(tables, promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise SchemaError(f"changes of differing shapes: {exc}") from exc
        append_at(out.rel, table, time)
        return rows


def append_at(rel: Relation, table: pa.Table, time: int) -> None:
    """Append ``table`` (row columns and ``_diff``) at ``time``, in slices small enough
    for one WAL record each."""
    n = table.num_rows
    if n == 0:
        return
    table = table.append_column(TIME, pa.repeat(pa.scalar(time, pa.uint64()), n))
    step = max(1, n * APPEND_SLICE_BYTES // max(1, table.nbytes)) if \
        table.nbytes > APPEND_SLICE_BYTES else n
    for start in range(0, n, step):
        rel.append(table.slice(start, step))
