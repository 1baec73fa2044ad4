"""Fixtures of the PostgreSQL source's tests: one real server per session, a database per test."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from tests.ingest.postgres.server import PgServer, running_server

_counter = itertools.count()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """A PostgreSQL server for the session, stopped at the end even when tests fail."""
    with running_server() as server:
        yield server


@pytest.fixture
def pg(pg_server: PgServer) -> Iterator[PgServer]:
    """A fresh database on the session's server, dropped (with its slots) afterwards."""
    db = pg_server.database(f"t{next(_counter)}")
    try:
        yield db
    finally:
        db.drop_database()
