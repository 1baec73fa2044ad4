"""The trace location of a data directory (lamina.datadir): the default under ``trace/``,
a URL recorded once by ``Store.open(trace_url=...)`` or the daemon, and refusals that
change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from lamina.datadir import DataDir, TraceLocation
from lamina.errors import ConfigError, CorruptionError
from lamina.fs import FileSystem
from lamina.objstore.local import LocalObjectStore
from lamina.objstore.s3 import S3ObjectStore
from lamina.store import Store
from lamina.testing.faults import InjectingFileSystem, Op
from tests.conftest import ORDERS, tree_digest


def test_default_trace_location_is_the_trace_directory(tmp_path: Path) -> None:
    layout = DataDir(tmp_path)
    assert layout.trace_url() == (tmp_path / "trace").as_uri()
    store = layout.trace_store("orders")
    assert isinstance(store, LocalObjectStore)
    assert store.root == tmp_path / "trace" / "orders"
    assert store.location("state/x.json") == str(tmp_path / "trace" / "orders" / "state/x.json")


def test_a_recorded_url_is_where_every_opener_finds_the_traces(tmp_path: Path,
                                                               s3_bucket: str) -> None:
    """(A new URL is probed before it is recorded: the bucket is real.)"""
    with Store.open(tmp_path, trace_url=f"s3://{s3_bucket}/some/prefix/") as store:
        store.create_relation("orders", ORDERS, key=["id"])
    assert not (tmp_path / "trace").exists()
    layout = DataDir(tmp_path)
    assert layout.trace_url() == f"s3://{s3_bucket}/some/prefix"
    traces = layout.trace_store("orders")
    assert isinstance(traces, S3ObjectStore)
    assert traces.url == f"s3://{s3_bucket}/some/prefix/orders"
    with Store.open(tmp_path) as again:  # no URL: the recorded one stays
        assert again.layout.trace_url() == f"s3://{s3_bucket}/some/prefix"
    with Store.open(tmp_path, trace_url=f"s3://{s3_bucket}/some/prefix") as same:
        assert same.layout.trace_url() == f"s3://{s3_bucket}/some/prefix"


def test_a_different_url_later_is_refused_and_changes_nothing(tmp_path: Path,
                                                              s3_bucket: str) -> None:
    Store.open(tmp_path, trace_url=f"s3://{s3_bucket}/a").close()
    before = tree_digest(tmp_path)
    with pytest.raises(ConfigError, match=f"s3://{s3_bucket}/a, not s3://{s3_bucket}/b"):
        Store.open(tmp_path, trace_url=f"s3://{s3_bucket}/b")
    assert tree_digest(tmp_path) == before


def test_local_traces_cannot_move(tmp_path: Path) -> None:
    Store.open(tmp_path).close()
    (tmp_path / "trace" / "orders" / "state").mkdir(parents=True)
    before = tree_digest(tmp_path)
    with pytest.raises(ConfigError, match="already has traces"):
        DataDir(tmp_path).record_trace_url("s3://bucket/x", FileSystem())
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("url", ["ftp://host/x", "s3://", "s3://user:pw@bucket/x",
                                 "file://relative"])
def test_a_malformed_url_is_refused_before_it_is_recorded(tmp_path: Path, url: str) -> None:
    with pytest.raises(ConfigError):
        Store.open(tmp_path / "new", trace_url=url)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("data", [b"", b"{}", b'{"format_version": 2, "url": "s3://b/x"}',
                                  b'{"format_version": 1, "url": ""}'])
def test_a_damaged_location_file_is_corruption(tmp_path: Path, data: bytes) -> None:
    (tmp_path / "trace.json").write_bytes(data)
    with pytest.raises(CorruptionError, match=r"trace\.json"):
        DataDir(tmp_path).trace_url()


def test_location_round_trip() -> None:
    loc = TraceLocation("s3://b/p")
    assert TraceLocation.from_json(loc.to_json(), Path("trace.json")) == loc


def test_quarantining_a_relation_dropped_meanwhile_marks_nothing(tmp_path: Path) -> None:
    """The relation is dropped between the quarantine's check that its WAL directory
    exists and the marker's write (the daemon found damage while a coordinator dropped the
    relation): no error, no marker anywhere, the drop stands."""

    class DropAtMarker(InjectingFileSystem):
        def __init__(self) -> None:
            super().__init__()
            self.dropped = False

        def before(self, op: Op) -> None:
            if op.kind == "write" and "QUARANTINED" in op.path.name and not self.dropped:
                self.dropped = True
                with Store.open(tmp_path) as store:
                    store.drop_relation("orders")

    with Store.open(tmp_path) as store:
        store.create_relation("orders", ORDERS, key=["id"])
    fs = DropAtMarker()
    DataDir(tmp_path).quarantine("orders", "checksum mismatch", fs)
    assert fs.dropped
    assert not list(tmp_path.rglob("QUARANTINED*"))
    with Store.open(tmp_path) as store:
        assert store.relations() == []
