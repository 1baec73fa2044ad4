"""Updates above a relation's upper are found wherever they are stored: in the WAL tail and,
once the compacter converted (and deleted) their segment, in the trace's pending parts."""

from __future__ import annotations

from pathlib import Path

from lamina import Store
from lamina.ingest.tail import unsealed_updates
from lamina.store import Relation
from lamina.trace.trace import Trace
from tests.trace.helpers import KEY, NAME, SCHEMA, convert, table_of


def _rows(rel: Relation) -> list[tuple[object, ...]]:
    t = unsealed_updates(rel)
    return sorted((r["id"], r["item"], r["_time"], r["_diff"]) for r in t.to_pylist())


def test_future_updates_in_converted_segments_and_the_wal_tail(tmp_path: Path) -> None:
    with Store.open(tmp_path, fsync="never") as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        rel.append(table_of([(1, "a", 1, 1), (2, "b", 5, 1), (3, "c", 7, 1)]))
        rel.seal(3)
        rel.close()                         # finish the segment: it can be converted
        trace = Trace.open(store.layout.trace_store(NAME), rel.meta)
        assert convert(trace, rel.wal_dir, merge=False) == 1
        trace.delete_converted_segments(rel.wal_dir)
        assert trace.state.pending, "times 5 and 7 are above the upper: pending parts"
        rel.append(table_of([(4, "d", 4, 1)]))                    # in the WAL tail
        assert rel.upper == 3
        assert _rows(rel) == [(2, "b", 5, 1), (3, "c", 7, 1), (4, "d", 4, 1)]
        rel.seal(6)
        assert _rows(rel) == [(3, "c", 7, 1)]


def test_nothing_above_the_upper_is_an_empty_table(tmp_path: Path) -> None:
    with Store.open(tmp_path, fsync="never") as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        assert unsealed_updates(rel).num_rows == 0
        rel.append(table_of([(1, "a", 0, 1)]))
        rel.seal(1)
        t = unsealed_updates(rel)
        assert t.num_rows == 0
        assert t.schema == rel.meta.loose_update_schema  # as every read's result
