"""Shared fixtures: temp data dirs, a session-wide SparkSession, schemas and update helpers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

ORDERS = pa.schema([("id", pa.int64()), ("item", pa.string())])


def updates(rows: list[tuple[int, str, int, int]]) -> pa.Table:
    """A table of (id, item, _time, _diff) updates for the ORDERS schema."""
    return pa.table({
        "id": pa.array([r[0] for r in rows], pa.int64()),
        "item": pa.array([r[1] for r in rows], pa.string()),
        "_time": pa.array([r[2] for r in rows], pa.uint64()),
        "_diff": pa.array([r[3] for r in rows], pa.int64()),
    })


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "lamina-data"


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """One SparkSession for the whole test run (local[2])."""
    from lamina.compacter.spark import build_session

    session = build_session("local[2]", app_name="lamina-tests")
    yield session
    session.stop()
