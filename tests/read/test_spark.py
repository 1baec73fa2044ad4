"""lamina.spark.read_snapshot against Relation.snapshot, on the shared local session."""

from __future__ import annotations

import datetime
import decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from lamina import Store
from lamina.errors import AsOfOutOfRangeError, RelationNotFoundError
from lamina.spark import read_snapshot
from tests.read.data import relation

pytestmark = pytest.mark.spark


def test_spark_snapshot_equals_snapshot(spark: Any, tmp_path: Path) -> None:
    """Batches (merged, with forwarded times), pending parts and a WAL tail."""
    with relation(tmp_path, 11) as (rel, oracle):
        state_points = oracle.as_of_points(3)
        for as_of in state_points:
            df = read_snapshot(spark, tmp_path, rel.name, as_of)
            got = df.toArrow()
            want = rel.snapshot(as_of)
            assert got.column_names == want.column_names
            assert got.to_pylist() == want.to_pylist() == oracle.snapshot(as_of)
        assert df.rdd.getNumPartitions() >= 1
        with pytest.raises(AsOfOutOfRangeError):
            read_snapshot(spark, tmp_path, rel.name, oracle.upper)
        with pytest.raises(RelationNotFoundError):
            read_snapshot(spark, tmp_path, "nope", 0)


def test_spark_snapshot_of_an_s3_trace(spark: Any, tmp_path: Path, s3_bucket: str,
                                       spark_s3_env: None) -> None:
    """With the trace on S3 the parts are read by Python tasks through the object store
    (Spark has no S3 connector here): the same rows as ``snapshot``."""
    with relation(tmp_path, 12, rounds=16, trace_url=f"s3://{s3_bucket}/t") as (rel, oracle):
        assert rel.store.layout.trace_url().startswith("s3://")
        for as_of in oracle.as_of_points(3):
            df = read_snapshot(spark, tmp_path, rel.name, as_of)
            got = df.toArrow()
            want = rel.snapshot(as_of)
            assert got.column_names == want.column_names
            assert got.to_pylist() == want.to_pylist() == oracle.snapshot(as_of)


def test_spark_snapshot_of_other_types_and_an_empty_relation(spark: Any,
                                                             tmp_path: Path) -> None:
    schema = pa.schema([("k", pa.string()), ("d", pa.date32()), ("n", pa.decimal128(9, 2)),
                        ("b", pa.bool_()), ("i", pa.int32())])
    with Store.open(tmp_path, fsync="never", segment_bytes=4096) as store:
        rel = store.create_relation("t", schema, ["k"])
        rel.seal(1)
        empty = read_snapshot(spark, tmp_path, "t", 0).toArrow()
        assert empty.num_rows == 0
        rows = {"k": ["b", "a", None, "a"],
                "d": [datetime.date(2024, 1, i) for i in (1, 2, 3, 2)],
                "n": [decimal.Decimal("1.25"), None, decimal.Decimal("-3.00"),
                      None], "b": [True, None, False, None], "i": [1, 2, 3, 2],
                "_time": pa.array([1, 1, 2, 3], pa.uint64()), "_diff": [1, 2, 1, -1]}
        rel.append(pa.table(rows, schema=rel.meta.loose_update_schema))
        rel.seal(4)
        from lamina.trace.trace import Trace
        from tests.trace.helpers import convert

        rel.seal(2**64)
        convert(Trace.open(store.layout.trace_store("t"), rel.meta), rel.wal_dir, per_plan=64)
        for as_of in (1, 2, 3):
            got = read_snapshot(spark, tmp_path, "t", as_of).toArrow()
            want = rel.snapshot(as_of)
            assert got.to_pylist() == want.to_pylist(), as_of


def test_spark_snapshot_as_of_omitted_a_datetime_and_its_lease(spark: Any,
                                                               tmp_path: Path) -> None:
    """``as_of`` omitted is the latest readable time; a relation in epoch milliseconds
    takes a timezone-aware datetime; the DataFrame holds a lease on its state until
    ``release`` (or until it is garbage-collected)."""
    from datetime import UTC, datetime, timedelta

    from lamina.spark import release
    from lamina.trace.trace import Trace
    from tests.trace.helpers import convert, table_of

    with relation(tmp_path / "a", 14, rounds=12) as (rel, oracle):
        got = read_snapshot(spark, tmp_path / "a", rel.name).toArrow()
        assert got.to_pylist() == rel.snapshot(oracle.upper - 1).to_pylist()
    t0 = datetime(2026, 5, 1, tzinfo=UTC)
    ms = (t0 - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)
    root = tmp_path / "b"
    with Store.open(root, fsync="never") as store:
        rel = store.create_relation("clicks", pa.schema([("id", pa.int64()),
                                                         ("item", pa.string())]),
                                    ["id"], time_unit="ms")
        rel.append(table_of([(1, "a", ms, 1), (2, "b", ms + 2, 1)]))
        rel.seal(t0 + timedelta(milliseconds=3))
        rel.close()
        convert(Trace.open(store.layout.trace_store("clicks"), rel.meta), rel.wal_dir)
        leases = store.layout.trace_dir("clicks") / "leases"
        df = read_snapshot(spark, root, "clicks", t0 + timedelta(microseconds=1500))
        assert len(list(leases.iterdir())) == 1
        assert df.toArrow().to_pylist() == [{"id": 1, "item": "a", "_diff": 1}]
        release(df)
        assert not leases.exists() or not list(leases.iterdir())
        release(df)  # idempotent
        assert read_snapshot(spark, root, "clicks").count() == 2
