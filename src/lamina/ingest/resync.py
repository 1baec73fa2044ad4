"""``lamina ingest resync``: one table of a source read afresh, its output brought to it.

The remedy for everything that leaves an output behind its table for good: a TRUNCATE
under ``on_truncate = "stall"``, a column added, dropped or retyped, a lost ``REPLICA
IDENTITY FULL``, a table that left the publication and came back, a table added to
``tables`` after the source's first start. Steps, for upstream table ``X`` of source ``S``
(the source closed: nothing of its stream is read or moved)::

    1. snapshot  X read afresh, consistent with stream position P  (Resyncable.snapshot_table)
    2. binding   (T, P) minted in S.remap, T above every binding and output upper
    3. output    X's relation: the difference "snapshot - what it holds" appended at T,
                 sealed to T + 1, since moved to T

- The binding is the one a running source would have minted had its upper been ``P``:
  the next session replays it for the other outputs (their transactions below ``P`` at
  ``T``) and writes ``X``'s transactions from ``P`` on after ``T``, so ``X`` holds the
  table as of ``P`` at ``T`` and every change after, exactly once. The other outputs and
  the slot are not touched (the slot keeps everything from the least output upper on).
- What the output holds is its snapshot at ``upper - 1`` plus any updates appended and
  not sealed (a kill during an earlier resync): the difference accounts for both, so a
  resync cut short by a kill is completed by running it again.
- ``since`` moves to ``T``: lamina does not know what the table held between the stall
  and ``T``, so reads before ``T`` are refused rather than answered with stale rows.
- If the table's columns or key no longer fit the relation (an ADD COLUMN, ...), the
  relation is dropped and created again with the new columns (relations do not change
  their schema); its history then starts at ``T``.

A kill between 2 and 3 leaves a binding the next session replays as any other (``X``,
still below ``T``, takes its stream changes as before, or stalls again for the same
cause); the resync is then run again. The runner runs this between two sessions of a
running source (``POST /v1/sources/<name>/resync``); ``lamina ingest resync`` runs it on
its own when no ``lamina ingest`` serves the source.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import structlog

from lamina.consolidate import consolidate_updates
from lamina.errors import RelationNotFoundError, SourceStalledError
from lamina.ingest.reclock import append_at, contents, fits, negated
from lamina.ingest.remap import Remap
from lamina.ingest.settings import SourceSettings
from lamina.ingest.source import Resyncable, Source
from lamina.schema import DIFF, TIME
from lamina.store import Store

log = structlog.get_logger(__name__)


def resolve_table(settings: SourceSettings, table: str) -> str:
    """The upstream name of ``table`` (``public.orders``, ``orders`` or the output relation
    ``shop.orders``); SourceStalledError naming the choices when it is none of them."""
    outputs = settings.outputs()
    qualified = table if "." in table else "public." + table
    for upstream, relation in outputs.items():
        if table in (upstream, relation) or qualified == upstream:
            return upstream
    raise SourceStalledError(
        f"source {settings.name!r} has no table {table!r}",
        hint=f"name one of {sorted(outputs)} (or its relation: {sorted(outputs.values())})")


def resync(store: Store, settings: SourceSettings, source: Source, table: str, *,
           clock: Callable[[], float] = time.time) -> dict[str, Any]:
    """Resync ``table`` of ``settings``' source (see the module docstring); the source
    must be closed. Returns what was done (relation, binding time and offset, rows of the
    snapshot, rows inserted and retracted, whether the relation was created again)."""
    if not isinstance(source, Resyncable):
        raise SourceStalledError(
            f"a {settings.kind} source cannot resync one table",
            hint="a files source re-reads its files: drop the relation and restart "
                 "`lamina ingest`, which fills it again by replay")
    upstream = resolve_table(settings, table)
    how = settings.output_settings()[upstream]
    blog = log.bind(source=settings.name, table=upstream, relation=how.relation)
    remap = Remap(store, settings.remap_relation, decode=source.decode_offset,
                  retention=settings.retention)
    remap.hold()
    blog.info("resync.snapshot")
    snap = source.snapshot_table(upstream)
    bindings = remap.load()
    if bindings and snap.offset < bindings[-1].upper:
        raise SourceStalledError(   # cannot happen with a closed source: P is current
            f"the fresh snapshot of {upstream} is at {source.encode_offset(snap.offset)}, "
            f"below the newest binding's {bindings[-1].text}",
            hint="stop every other reader of the source's slot and run the resync again")
    uppers = []
    for relation in settings.outputs().values():
        with contextlib.suppress(RelationNotFoundError):
            uppers.append(store.relation(relation).upper)
    t = remap.next_time(int(clock() * 1000), settings.interval_ms, uppers)
    remap.mint(t, snap.offset, source.encode_offset(snap.offset), retire_below=None)
    recreated = False
    try:
        rel = store.relation(how.relation)
        if not fits(rel, snap.spec):
            blog.warning("resync.relation_recreated", old=str(rel.schema),
                         new=str(snap.spec.schema))
            store.drop_relation(how.relation)
            raise RelationNotFoundError(how.relation)
        held = contents(rel)
    except RelationNotFoundError:
        rel = store.create_relation(how.relation, snap.spec.schema, list(snap.spec.key),
                                    time_unit="ms")
        held = rel.schema.append(pa.field(DIFF, pa.int64())).empty_table()
        recreated = True
    diff = _difference(rel.meta.row_columns, rel.meta.sort_columns, snap.rows, held,
                       context=f"resync of {how.relation}")
    append_at(rel, diff, t)
    rel.seal(t + 1)
    rel.allow_compaction(t)
    inserted = int(pc.sum(pc.max_element_wise(diff.column(DIFF), 0)).as_py() or 0)
    retracted = int(-(pc.sum(pc.min_element_wise(diff.column(DIFF), 0)).as_py() or 0))
    result = {"source": settings.name, "table": upstream, "relation": how.relation,
              "binding_time": t, "offset": source.encode_offset(snap.offset),
              "rows": snap.rows.num_rows, "inserted": inserted, "retracted": retracted,
              "recreated": recreated}
    blog.info("resync.done", **{k: v for k, v in result.items()
                                if k not in ("source", "table", "relation")})
    return result


def _difference(row_columns: list[str], sort_columns: list[str], new: pa.Table,
                held: pa.Table, *, context: str) -> pa.Table:
    """``new - held`` consolidated: row columns and ``_diff`` (no zero diffs)."""
    names = [*row_columns, DIFF]
    schema = held.select(names).schema
    both = pa.concat_tables([new.select(names).cast(schema), negated(held.select(names))])
    both = both.append_column(TIME, pa.repeat(pa.scalar(0, pa.uint64()), both.num_rows))
    return consolidate_updates(both, row_columns, sort_columns, context=context).select(names)
