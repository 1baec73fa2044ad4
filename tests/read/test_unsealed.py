"""``Relation.updates`` (lamina.read.unsealed) merges trace parts as sorted runs: the
interval equals the sums of an oracle over every update in it, times forwarded by since,
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


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(sorted(ROWS)), rows=updates_strategy,
       since=st.integers(0, 8), before=st.integers(0, 12), after=st.integers(0, 12),
       lo=st.integers(0, 12), span=st.integers(1, 12))
def test_updates_equal_the_oracle(*, kind: str, rows: list[Update], since: int, before: int,
                                  after: int, lo: int, span: int) -> None:
    """Updates at times 0..11, appended one time at a time and sealed at 10 (times 10 and
    11 are future updates: pending parts once converted, or the WAL tail); ``before``
    segments converted and merged, then compaction allowed to ``since`` (so those batches
    keep their times and the read forwards them), then ``after`` more converted (those
    forwarded by the conversion): ``updates(lower, upper)`` for a readable interval is
    the updates in it, times forwarded to ``since``, summed per row and time, zero sums
    dropped, by key and time; its fields nullable, empty or not."""
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
            trace = Trace.open(store.layout.trace_store("r"), rel.meta)
            convert(trace, rel.wal_dir, per_plan=2, limit=before)
            rel.allow_compaction(since)
            convert(trace, rel.wal_dir, per_plan=2, limit=after)
            lower = 0 if lo < since else lo
            upper = max(lower + span, since + 1)
            got = rel.updates(lower, upper)
        sums: dict[tuple[int, Any, int], int] = defaultdict(int)
        for k, v, t, d in rows:
            if lower <= max(t, since) < upper:
                sums[(k, _value(kind, v), max(t, since))] += d
        want = [{"id": k, "val": v, "_time": t, "_diff": d}
                for (k, v, t), d in sorted(sums.items()) if d]
        assert got.to_pylist() == want
        assert got.schema == pa.schema([("id", pa.int64()), ("val", ROWS[kind].field("val").type),
                                        ("_time", pa.uint64()), ("_diff", pa.int64())])
