"""Relation.snapshot_reader (lamina.read.stream) against snapshot and the oracle."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lamina.errors import AsOfOutOfRangeError
from lamina.read import stream
from tests.read.data import relation


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), chunk=st.sampled_from([1, 100, 2000]))
def test_stream_equals_snapshot_and_oracle(seed: int, chunk: int) -> None:
    """At every readable time, with chunks as small as one row (``CHUNK_BYTES`` of 1: many
    rounds of the k-way merge, equal rows across chunk ends), the streamed rows equal
    snapshot and the oracle."""
    old = stream.CHUNK_BYTES
    stream.CHUNK_BYTES = chunk
    try:
        with tempfile.TemporaryDirectory() as d, relation(Path(d), seed) as (rel, oracle):
            state_batches = 0
            for as_of in range(oracle.since, oracle.upper):
                reader = rel.snapshot_reader(as_of)
                got = reader.read_all()
                assert got.schema == rel.snapshot(as_of).schema
                assert got.to_pylist() == rel.snapshot(as_of).to_pylist() \
                    == oracle.snapshot(as_of)
                state_batches += 1
            assert state_batches
    finally:
        stream.CHUNK_BYTES = old


def test_a_chunk_is_about_chunk_bytes_of_rows() -> None:
    """Rows per chunk: the byte target over the width, at least one, at most the cap."""
    assert stream.chunk_rows(36) == stream.CHUNK_BYTES // 36
    assert stream.chunk_rows(stream.CHUNK_BYTES * 4) == 1
    assert stream.chunk_rows(0) == stream.chunk_rows(1) == stream.MAX_CHUNK_ROWS


def test_stream_refuses_bad_as_of_before_reading(tmp_path: Path) -> None:
    with relation(tmp_path, 1, rounds=6) as (rel, oracle), pytest.raises(AsOfOutOfRangeError):
        rel.snapshot_reader(oracle.upper)


def test_duckdb_and_polars_read_the_stream(tmp_path: Path) -> None:
    """The documented one-liners (docs/reading.md)."""
    import duckdb
    import polars as pl

    with relation(tmp_path, 7) as (rel, oracle):
        as_of = oracle.upper - 1
        want = oracle.snapshot(as_of)
        reader = rel.snapshot_reader(as_of)
        got = duckdb.from_arrow(reader).order("id, item").to_arrow_table()
        assert got.to_pylist() == want
        con = duckdb.connect()
        snap = rel.snapshot_reader(as_of)  # noqa: F841 - named in the query below
        total = con.sql("select sum(_diff) from snap").fetchall()
        assert total == [(sum(r["_diff"] for r in want),)]
        df = pl.from_arrow(rel.snapshot_reader(as_of))
        assert isinstance(df, pl.DataFrame)
        assert df.to_dicts() == want
