"""``Relation.updates`` (lamina.read.unsealed) merges trace parts as sorted runs: the
interval equals the hash consolidation of every update in it, times forwarded by since,
whichever merge the rows take (packed integers, sorted runs of strings, floats that fall
back to hashing), with parts converted and merged, a WAL tail, and future updates."""

from __future__ import annotations

import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from lamina import Store
from lamina.consolidate import consolidate_updates
from lamina.trace.trace import Trace
from tests.trace.helpers import convert

ROWS = {
    # (id, val): packed into one uint64 with _time (lamina.packed)
    "packed": pa.schema([("id", pa.int64()), ("val", pa.int32())]),
    # strings do not pack: sorted runs (lamina.consolidate.merge_runs)
    "strings": pa.schema([("id", pa.int64()), ("val", pa.string())]),
    # floats: merge_runs declines, the hash consolidation does it
    "floats": pa.schema([("id", pa.int64()), ("val", pa.float64())]),
}


def _value(kind: str, v: int) -> Any:
    return {"packed": v, "strings": f"v{v}", "floats": v / 2}[kind]


Update = tuple[int, int, int, int]  # (id, value index, time, diff)

updates_strategy = st.lists(
    st.tuples(st.integers(0, 6), st.integers(0, 3), st.integers(0, 11),
              st.sampled_from([-2, -1, 1, 1, 2])),
    min_size=1, max_size=60)


def _table(kind: str, rows: list[Update]) -> pa.Table:
    schema = ROWS[kind]
    return pa.table({
        "id": pa.array([r[0] for r in rows], pa.int64()),
        "val": pa.array([_value(kind, r[1]) for r in rows], schema.field("val").type),
        "_time": pa.array([r[2] for r in rows], pa.uint64()),
        "_diff": pa.array([r[3] for r in rows], pa.int64())})


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(sorted(ROWS)), rows=updates_strategy,
       since=st.integers(0, 8), converted=st.integers(0, 12), lo=st.integers(0, 12),
       span=st.integers(1, 12))
def test_updates_equal_the_hash_consolidation(*, kind: str, rows: list[Update], since: int,
                                              converted: int, lo: int, span: int) -> None:
    """Updates at times 0..11, appended one time at a time and sealed at 10 (times 10 and
    11 are future updates: pending parts once converted, or the WAL tail), ``converted``
    segments converted and merged: ``updates(lower, upper)`` for a readable interval is
    the consolidation of the updates in it, times forwarded to ``since``."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "data"
        by_time: dict[int, list[Update]] = defaultdict(list)
        for r in rows:
            by_time[r[2]].append(r)
        with Store.open(root, segment_bytes=4096) as store:
            rel = store.create_relation("r", ROWS[kind], key=["id"])
            for t in range(12):
                if by_time[t]:
                    rel.append(_table(kind, by_time[t]))
                if t < 10:
                    rel.seal(t + 1)  # each seal finishes a segment
            rel.allow_compaction(since)
        with Store.open(root, segment_bytes=4096) as store:
            rel = store.relation("r")
            trace = Trace.open(store.layout.trace_store("r"), rel.meta)
            convert(trace, rel.wal_dir, per_plan=2, limit=converted)
            lower = 0 if lo < since else lo
            upper = max(lower + span, since + 1)
            got = rel.updates(lower, upper)
            table = _table(kind, rows)
            times = [max(t, since) for t in table.column("_time").to_pylist()]
            keep = [lower <= t < upper for t in times]
            wanted = pa.table({**{n: table.column(n) for n in ("id", "val", "_diff")},
                               "_time": pa.array(times, pa.uint64())}
                              ).select(["id", "val", "_time", "_diff"]).filter(pa.array(keep))
            want = consolidate_updates(wanted, ["id", "val"], ["id", "val"], context="test")
            assert got.to_pylist() == want.to_pylist()
            assert got.schema.equals(want.schema)
