"""The readers on a trace in S3 (the test server): the streaming snapshot, key lookups and
subscriptions give exactly what ``snapshot`` gives, reading parts through ranged gets."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from lamina.frontier import CLOSED
from lamina.read.subscribe import Progress
from tests.read.data import relation


def test_stream_lookup_and_subscribe_on_an_s3_trace(tmp_path: Path, s3_bucket: str) -> None:
    with relation(tmp_path, 21, rounds=16, trace_url=f"s3://{s3_bucket}/r") as (rel, oracle):
        assert rel.store.layout.trace_url() == f"s3://{s3_bucket}/r"
        for as_of in oracle.as_of_points(3):
            want = rel.snapshot(as_of)
            assert want.to_pylist() == oracle.snapshot(as_of)
            assert rel.snapshot_reader(as_of).read_all().to_pylist() == want.to_pylist()
            keys = [r["id"] for r in want.to_pylist()[::3]] + [10**9]
            got = rel.lookup({"id": keys}, as_of).to_pylist()
            assert got == [r for r in want.to_pylist() if r["id"] in set(keys)]
        last = oracle.upper - 1
        rel.seal(CLOSED)
        items = list(rel.subscribe(oracle.since))
        assert items[-1] == Progress(CLOSED)
        head = next(i for i, item in enumerate(items) if isinstance(item, Progress))
        snap = [t for t in items[:head] if isinstance(t, pa.Table)]  # before the first Progress
        got = pa.concat_tables(snap).drop_columns(["_time"]).to_pylist() if snap else []
        assert sorted(map(str, got)) == sorted(map(str, rel.snapshot(oracle.since).to_pylist()))
        assert rel.snapshot(last).to_pylist() == oracle.snapshot(last)
