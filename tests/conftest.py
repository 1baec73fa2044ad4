"""Shared fixtures: temp data dirs, a session-wide SparkSession, schemas and update helpers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pytest
from hypothesis import settings

from lamina import blas
from tests import spark_jvm

if TYPE_CHECKING:
    from tests.objstore.s3server import S3Server

# Property tests assert behaviour, not speed: no per-example deadline, so a pause of the
# machine (the other test worker, a JVM starting) cannot fail one.
settings.register_profile("lamina", deadline=None)
settings.load_profile("lamina")

# Every JVM a test starts (the shared sessions, the daemons, drills and clusters the tests
# spawn, which inherit the environment) gets the suite's options and class-data archive:
# tests/spark_jvm.py says what and why; `make pytest` dumps the archive first.
for _name, _value in spark_jvm.environment().items():
    os.environ.setdefault(_name, _value)
spark_jvm.write_properties()

# Every Python process a test starts (coordinators, crash children, fork servers, the
# pytest-xdist workers themselves, spawned after this file is read) starts OpenBLAS with
# one thread, as lamina's command line does for its own (src/lamina/blas.py says why).
blas.one_thread()

ORDERS = pa.schema([("id", pa.int64()), ("item", pa.string())])


def updates(rows: list[tuple[int, str, int, int]]) -> pa.Table:
    """A table of (id, item, _time, _diff) updates for the ORDERS schema."""
    return pa.table({
        "id": pa.array([r[0] for r in rows], pa.int64()),
        "item": pa.array([r[1] for r in rows], pa.string()),
        "_time": pa.array([r[2] for r in rows], pa.uint64()),
        "_diff": pa.array([r[3] for r in rows], pa.int64()),
    })


# The suite runs on pytest-xdist workers (pyproject.toml: -n 4 --dist load
# --maxschedchunk 1), each with its own session-scoped SparkSession, PostgreSQL server and
# S3 server, started when a test of that worker first needs one (a few seconds each,
# against minutes of imbalance when one worker had to run every test of a server). A
# worker holds at most two tests it has not started, taken in collection order, so the
# order decides the tail: the longest tests first, each followed by a quick one, so that
# no worker queues a long test behind another one and none is left with a drill at the
# end while the others have nothing to do.
#: the longest tests (about 2 to 5 minutes each on a 2-core machine), one per worker, first
LONGEST = (
    "tests/drill/test_drill.py::test_drill_100_kills_over_every_phase",
    "tests/drill/test_drill.py::test_drill_with_the_trace_on_s3",
    "tests/ingest/postgres/test_ingest_e2e.py::test_kill_9_and_restart_exactly_once",
    "tests/compacter/test_bounded_memory.py::test_backlog_four_times_the_driver_memory_converts",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        if item.nodeid in LONGEST:
            return LONGEST.index(item.nodeid)
        return len(LONGEST) if item.get_closest_marker("slow") else len(LONGEST) + 1

    # a stable sort and a fixed interleaving: the same order in every worker, as xdist
    # requires
    ordered = sorted(items, key=rank)
    slow = [i for i in ordered if rank(i) <= len(LONGEST)]
    quick = [i for i in ordered if rank(i) > len(LONGEST)]
    interleaved: list[pytest.Item] = []
    for n, item in enumerate(slow):
        interleaved.append(item)
        if n < len(quick):
            interleaved.append(quick[n])
    interleaved.extend(quick[len(slow):])
    items[:] = interleaved


#: set by ``python -m bench.suite_cpu``: each test's CPU inside its xdist worker (setup,
#: call and teardown; every thread of the worker, no child process) is appended there as a
#: JSON line, since a worker's own CPU cannot be told apart by test from /proc
CPU_LOG = os.environ.get("LAMINA_TEST_CPU_LOG")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if CPU_LOG is None:
        yield
        return
    import json

    before = os.times()
    yield
    after = os.times()
    cpu = (after.user - before.user) + (after.system - before.system)
    with open(CPU_LOG, "a", encoding="utf-8") as log:  # one short line: one write
        log.write(json.dumps({"test": item.nodeid, "cpu": round(cpu, 3)}) + "\n")


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "lamina-data"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A real S3 server (moto) on 127.0.0.1 for the whole run (tests/objstore/s3server.py)."""
    from tests.objstore.s3server import S3Server

    server = S3Server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket; the standard AWS environment points at the server for this test."""
    from tests.objstore.s3server import CLEARED_ENV

    for name in CLEARED_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server.make_bucket()


@pytest.fixture
def spark_s3_env(spark: Any, s3_server: S3Server) -> Iterator[None]:
    """The S3 server's endpoint and credentials in the session's executor environment
    (what ``spark.executorEnv.AWS_*`` sets at start-up): tasks created meanwhile run in
    Python workers that reach the server, as a cluster's executors would."""
    env = spark.sparkContext.environment
    saved = dict(env)
    env.update(s3_server.env())
    yield
    env.clear()
    env.update(saved)


@pytest.fixture(params=["file", "s3"])
def trace_url(request: pytest.FixtureRequest) -> str | None:
    """Where a test's traces live: None (the default, ``<data>/trace``) or an ``s3://``
    prefix on the test server; ``Store.open(root, trace_url=trace_url)`` records it."""
    if request.param == "file":
        return None
    return f"s3://{request.getfixturevalue('s3_bucket')}/traces"


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """One SparkSession for the whole test run (local[2])."""
    from lamina.compacter.spark import build_session

    session = build_session("local[2]", app_name="lamina-tests")
    yield session
    session.stop()


# --- helpers for the WAL and store suites ---------------------------------------------------

def tree_digest(root: Path) -> dict[str, str]:
    """Every file and directory under ``root`` by relative path: a SHA-256 of a file's
    bytes, ``"dir"`` for a directory. Two equal digests mean the disk did not change."""
    import hashlib

    out: dict[str, str] = {}
    if not root.exists():
        return out
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out
