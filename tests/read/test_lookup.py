"""Relation.lookup (lamina.read.lookup) against snapshot + filter."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lamina import Store
from lamina.errors import (
    AsOfOutOfRangeError,
    CorruptionError,
    InvalidArgumentError,
    SchemaError,
)
from lamina.trace import batch
from tests.read.data import relation


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), keys=st.lists(st.integers(-3, 45), max_size=12),
       small_groups=st.booleans())
def test_lookup_equals_snapshot_filter(seed: int, keys: list[int], small_groups: bool) -> None:
    """Keys in batches, pending parts and the WAL tail, absent keys, repeated keys; row
    groups of 2 rows (many skipped) or the default."""
    old = batch.ROW_GROUP_ROWS
    batch.ROW_GROUP_ROWS = 2 if small_groups else old
    try:
        with tempfile.TemporaryDirectory() as d, relation(Path(d), seed) as (rel, oracle):
            wanted = set(keys)
            for as_of in oracle.as_of_points(3):
                got = rel.lookup({"id": keys}, as_of).to_pylist()
                want = [r for r in rel.snapshot(as_of).to_pylist() if r["id"] in wanted]
                assert got == want == [r for r in oracle.snapshot(as_of) if r["id"] in wanted]
    finally:
        batch.ROW_GROUP_ROWS = old


def test_lookup_reads_only_the_row_groups_that_can_hold_the_keys(tmp_path: Path) -> None:
    """A converted relation with many row groups: the key's group is found by statistics
    and the answer comes from it (the other groups are not needed: corrupting one of them
    leaves the lookup's answer intact)."""
    old = batch.ROW_GROUP_ROWS
    batch.ROW_GROUP_ROWS = 100
    try:
        with Store.open(tmp_path, fsync="never", segment_bytes=4096) as store:
            rel = store.create_relation("r", pa.schema([("id", pa.int64()),
                                                        ("v", pa.string())]), ["id"])
            n = 5000
            rel.append(pa.table({"id": pa.array(range(n), pa.int64()),
                                 "v": [f"v{i}" for i in range(n)],
                                 "_time": pa.array([0] * n, pa.uint64()),
                                 "_diff": pa.array([1] * n, pa.int64())}))
            rel.seal(1)
            rel.seal(2**64)
            from lamina.trace.trace import Trace
            from tests.trace.helpers import convert

            trace = Trace.open(store.layout.trace_store("r"), rel.meta)
            convert(trace, rel.wal_dir, per_plan=64)
            trace.delete_converted_segments(rel.wal_dir)
            part = trace.state.batches[0].parts[0]
            path = store.layout.trace_dir("r") / part.path
            md = pq.ParquetFile(path).metadata
            assert md.num_row_groups == n // 100
            assert md.row_group(0).column(0).statistics.has_min_max
            got = rel.lookup({"id": [4321, 17, 99999]}, 0)
            assert got.to_pylist() == [{"id": 17, "v": "v17", "_diff": 1},
                                       {"id": 4321, "v": "v4321", "_diff": 1}]
            # damage the last row group's data pages: lookups of other keys do not read it
            last = md.row_group(md.num_row_groups - 1).column(1)
            data = bytearray(path.read_bytes())
            off = last.data_page_offset + 20
            data[off:off + 8] = b"\xff" * 8
            path.write_bytes(bytes(data))
            assert rel.lookup({"id": [17]}, 0).num_rows == 1
            with pytest.raises(CorruptionError):  # a whole read checks the file's CRC32C
                rel.snapshot(0)
    finally:
        batch.ROW_GROUP_ROWS = old


def test_lookup_refusals(tmp_path: Path) -> None:
    with relation(tmp_path, 3, rounds=6) as (rel, oracle):
        with pytest.raises(AsOfOutOfRangeError):
            rel.lookup({"id": [1]}, oracle.upper)
        with pytest.raises(SchemaError):
            rel.lookup({"item": ["a"]}, oracle.upper - 1)
        with pytest.raises(SchemaError):
            rel.lookup({"id": ["x"]}, oracle.upper - 1)
        with pytest.raises(InvalidArgumentError):
            rel.lookup(42, oracle.upper - 1)  # type: ignore[arg-type]
        assert rel.lookup({"id": pa.array([], pa.int64())}, oracle.upper - 1).num_rows == 0


def test_lookup_with_a_two_column_key(tmp_path: Path) -> None:
    schema = pa.schema([("a", pa.int64()), ("b", pa.string()), ("v", pa.int64())])
    with Store.open(tmp_path, fsync="never") as store:
        rel = store.create_relation("r", schema, ["a", "b"])
        rel.append(pa.table({"a": [1, 1, 2, 2, None], "b": ["x", "y", "x", "y", "x"],
                             "v": [1, 2, 3, 4, 5], "_time": pa.array([0] * 5, pa.uint64()),
                             "_diff": [1] * 5}))
        rel.seal(1)
        got = rel.lookup({"a": [1, 2, None], "b": ["y", "x", "x"]}, 0).to_pylist()
        assert [(r["a"], r["b"]) for r in got] == [(None, "x"), (1, "y"), (2, "x")]
