"""Reclocking: writing a source's transactions into its outputs at lamina times.

Every transaction with an offset below ``F(T)`` and not below ``F`` of the binding before
goes to time ``T``, whole (:meth:`Reclocker.write` takes all of a binding's transactions at
once). Per binding the writes are, in this order::

    remap: append (T, F(T)), seal T+1            (lamina.ingest.remap, before this module)
    every output at or below T: append its changes at T      -> "ingest.outputs_appended"
    every output at or below T: seal T+1                     -> "ingest.outputs_sealed"

so every output of a source is sealed to the same ``T + 1`` and no output is sealed past a
binding that is not durable.

Exactly once after a kill: an output whose upper is above ``T`` already holds ``T``'s
changes and is skipped (a re-read change goes only to the outputs whose upper is at or
below its time). An output at or below ``T`` may hold part of ``T`` already (appended, not
sealed: see :mod:`lamina.ingest.tail`); those updates are subtracted from what is written,
so the output ends with exactly the transactions of ``T``, whatever was appended before.

A stalled output (a definite error for its table, or a schema that does not fit) receives
nothing and is not sealed: its upper stays where its data stops, so nothing is skipped and
the resumption frontier holds the upstream offsets it still needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from lamina import failpoints
from lamina.errors import RelationNotFoundError, SchemaError
from lamina.ingest.source import TableSpec, Transaction
from lamina.ingest.tail import unsealed_updates
from lamina.schema import DIFF, TIME
from lamina.store import Relation, Store

APPEND_SLICE_BYTES = 256 << 20
"""Appends above this many bytes are split (a WAL record holds at most 1 GiB)."""


@dataclass
class Output:
    """One output relation of a source and what the reclocker knows of it."""

    upstream: str
    relation: str
    rel: Relation | None
    upper: int = 0
    unsealed: dict[int, pa.Table] = field(default_factory=dict)
    stalled: tuple[str, str] | None = None
    changes: int = 0
    unfillable: bool = False
    """Holds no data while the source cannot re-read its start: never written to, and
    left out of the resumption frontier (see :mod:`lamina.ingest.runner`)."""

    def stall(self, error: str, hint: str) -> None:
        if self.stalled is None:
            self.stalled = (error, hint)


def open_output(store: Store, upstream: str, relation: str, spec: TableSpec | None) -> Output:
    """The output ``relation`` for upstream table ``upstream``: created from ``spec`` when
    missing; an existing relation whose columns differ is a stalled output."""
    try:
        rel = store.relation(relation)
    except RelationNotFoundError:
        if spec is None:
            out = Output(upstream, relation, None)
            out.stall(f"upstream table {upstream!r} was not found",
                      "check the source's table list and that the table exists upstream")
            return out
        try:
            rel = store.create_relation(relation, spec.schema, list(spec.key))
        except SchemaError as exc:
            out = Output(upstream, relation, None)
            out.stall(f"upstream table {upstream!r} cannot be stored: {exc}",
                      "map the column to a supported type upstream, or leave the table out")
            return out
    out = Output(upstream, relation, rel, upper=rel.upper)
    if spec is not None:
        have = [(f.name, f.type) for f in rel.schema]
        want = [(f.name, f.type) for f in spec.schema]
        if have != want or tuple(rel.key) != tuple(spec.key):
            out.stall(f"relation {relation!r} has columns {have} and key {list(rel.key)}, but "
                      f"upstream table {upstream!r} now has {want} and key {list(spec.key)}",
                      f"map the table to a new relation name, or drop relation {relation!r} "
                      "and restart: a files source fills it again from its files, a "
                      "PostgreSQL source cannot (ingest the table under a new source name, "
                      "or drop every output of the source and its remap relation to start "
                      "over); lamina never rewrites a relation's schema")
            return out
    tail = unsealed_updates(rel)
    if tail.num_rows:
        times = pc.unique(tail.column(TIME)).to_pylist()
        for t in times:
            part = tail.filter(pc.equal(tail.column(TIME), pa.scalar(t, pa.uint64())))
            out.unsealed[int(t)] = part
    return out


class Reclocker:
    """Writes the transactions of one binding into every output of a source."""

    def __init__(self, outputs: dict[str, Output]) -> None:
        self.outputs = outputs

    def write(self, time: int, txns: Sequence[Transaction]) -> dict[str, int]:
        """Write ``txns`` at ``time`` to every live output at or below ``time``, then seal
        them to ``time + 1``. Returns the rows written per output relation."""
        written: dict[str, int] = {}
        due = [o for o in self.outputs.values()
               if o.stalled is None and o.rel is not None and o.upper <= time]
        for out in due:
            parts = [t.changes[out.upstream] for t in txns if out.upstream in t.changes]
            try:
                rows = self._append(out, time, parts)
            except SchemaError as exc:
                out.stall(f"changes for {out.relation!r} do not fit the relation: {exc}",
                          "the upstream table changed shape; drop and re-ingest the relation "
                          "or map the table to a new relation")
                continue
            written[out.relation] = rows
            out.changes += rows
        failpoints.hit("ingest.outputs_appended")
        for out in due:
            if out.stalled is None and out.rel is not None:
                out.rel.seal(time + 1)
                out.upper = time + 1
                for t in [t for t in out.unsealed if t <= time]:
                    del out.unsealed[t]
        failpoints.hit("ingest.outputs_sealed")
        return written

    def _append(self, out: Output, time: int, parts: list[pa.Table]) -> int:
        assert out.rel is not None
        names = [*out.rel.schema.names, DIFF]
        tables: list[pa.Table] = []
        for p in parts:
            missing = [n for n in names if n not in p.column_names]
            if missing:
                raise SchemaError(f"the source sent changes without columns {missing}")
            tables.append(p.select(names))
        rows = int(sum(t.num_rows for t in tables))
        old = out.unsealed.get(time)
        if old is not None and old.num_rows:
            negated = old.select(names)
            negated = negated.set_column(len(names) - 1, DIFF,
                                         pc.negate_checked(negated.column(DIFF)))
            tables.append(negated)
        if not tables:
            return 0
        try:
            table = pa.concat_tables(tables, promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise SchemaError(f"changes of differing shapes: {exc}") from exc
        if table.num_rows == 0:
            return 0
        table = table.append_column(TIME, pa.repeat(pa.scalar(time, pa.uint64()), table.num_rows))
        n = table.num_rows
        step = max(1, n * APPEND_SLICE_BYTES // max(1, table.nbytes)) if \
            table.nbytes > APPEND_SLICE_BYTES else n
        for start in range(0, n, step):
            out.rel.append(table.slice(start, step))
        return rows
