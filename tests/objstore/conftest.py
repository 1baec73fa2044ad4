"""Fixtures of the object-store suites: ``store``, the contract suite's store, once on
``file://`` and once on ``s3://`` (the S3 server and buckets: tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lamina.objstore import ObjectStore, open_store


@pytest.fixture(params=["file", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return (tmp_path / "trace").as_uri()
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/data/trace"


@pytest.fixture
def store(store_url: str) -> ObjectStore:
    return open_store(store_url)
