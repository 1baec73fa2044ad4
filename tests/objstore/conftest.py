"""Fixtures of the object-store suites: a session-wide real S3 server (moto, 127.0.0.1), a
bucket per test with the AWS environment set for that test only, and ``store``: the
contract suite's store, once on ``file://`` and once on ``s3://``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lamina.objstore import ObjectStore, open_store
from tests.objstore.s3server import CLEARED_ENV, S3Server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    server = S3Server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket; the standard AWS environment points at the server for this test."""
    for name in CLEARED_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server.make_bucket()


@pytest.fixture(params=["file", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return (tmp_path / "trace").as_uri()
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/data/trace"


@pytest.fixture
def store(store_url: str) -> ObjectStore:
    return open_store(store_url)
