"""Read leases (lamina.trace.lease) and garbage collection: a live lease keeps the state
version it holds and every file that version names, whatever ``keep_versions`` says; an
expired one holds nothing and GC deletes its object; taking a lease confirms the newest
version; leases are renewed while held; GC learns every lease from one listing, however
many there are; a store that refuses leases lets the read go on without one. On a
directory and on S3 (the ``trace_url`` fixture)."""

from __future__ import annotations

import errno
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lamina.errors import StorageError
from lamina.objstore.base import ObjectStore
from lamina.read.view import pin
from lamina.store import Relation, Store
from lamina.testing.unreliable import OpKind, UnreliableStore
from lamina.trace.invariants import check_data
from lamina.trace.lease import KEEPER, Lease, LeaseKey, scan
from lamina.trace.state import StateStore
from lamina.trace.trace import Trace
from tests.trace.helpers import (
    KEY,
    NAME,
    SCHEMA,
    Oracle,
    append_rounds,
    check_snapshots,
    convert,
    data_files,
)


class Recording(UnreliableStore):
    """The real store underneath, every operation recorded as (kind, key) (children share
    the record): counts through the object-store seam."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.ops: list[tuple[OpKind, str]] = []

    def _run(self, op: OpKind, key: str, call: Callable[[], Any]) -> Any:
        self.ops.append((op, key))
        return super()._run(op, key, call)


@pytest.fixture
def traced(tmp_path: Path, trace_url: str | None) -> Iterator[tuple[Relation, Oracle, Trace]]:
    """A relation with a trace of many versions (conversions and merges), on a directory
    or on S3, its trace opened through a :class:`Recording` store."""
    oracle = Oracle()
    with Store.open(tmp_path, segment_bytes=4096, fsync="never", trace_url=trace_url) as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        trace = Trace.open(Recording(store.layout.trace_store(NAME)), rel.meta)
        append_rounds(rel, oracle, 40, seed=1)
        convert(trace, rel.wal_dir)
        trace.delete_converted_segments(rel.wal_dir)
        yield rel, oracle, trace


def _more(rel: Relation, oracle: Oracle, trace: Trace, seed: int) -> None:
    """More conversions and merges: the batches of earlier versions are merged away."""
    append_rounds(rel, oracle, 8, seed=seed)
    convert(trace, rel.wal_dir, per_plan=2)
    trace.delete_converted_segments(rel.wal_dir)


def _lease_objects(store: ObjectStore) -> list[str]:
    return [o.key for o in store.list("leases")]


def test_a_live_lease_keeps_its_version_and_an_expired_one_nothing(
        traced: tuple[Relation, Oracle, Trace]) -> None:
    rel, oracle, trace = traced
    states = trace.states
    lease = Lease(trace.store, seconds=30, holder="test")
    held = lease.hold_newest(states)
    assert held == trace.state.version
    [key] = _lease_objects(trace.store)
    doc = json.loads(trace.store.get(key))
    assert doc["version"] == held
    assert doc["holder"].endswith("test")
    assert LeaseKey.parse(key) == LeaseKey(lease.id, held, round(doc["expires_at"] * 1000))
    pinned = states.load(held)
    _more(rel, oracle, trace, seed=50)
    only_pinned = pinned.files() - trace.state.files()
    assert only_pinned, "the later merges replaced some of the pinned state's files"

    # keep_versions=1 and no grace: without the lease the pinned files would go
    report = trace.collect_garbage(keep_versions=1, grace_seconds=0.0)
    assert report.versions_deleted > 0
    assert states.versions() == [held, trace.state.version]
    check_data(trace.store, pinned, rel.meta)  # every pinned file is there, intact
    assert only_pinned <= data_files(trace.store)

    # past its expiry the lease holds nothing, and its object goes too
    later = lease.expires_at + 1
    trace.collect_garbage(keep_versions=1, grace_seconds=0.0, now=later)
    assert states.versions() == [trace.state.version]
    assert data_files(trace.store) == trace.state.files()
    assert _lease_objects(trace.store) == []
    lease.release()  # its object is gone already: fine
    check_snapshots(rel, oracle)


def test_taking_a_lease_follows_a_version_published_meanwhile(
        traced: tuple[Relation, Oracle, Trace]) -> None:
    """A version published between the lease's put and its check: the read holds the new
    newest one instead (the protocol of lamina.trace.lease), one lease object in the end."""
    rel, oracle, trace = traced
    store = trace.store
    assert isinstance(store, Recording)
    v0 = trace.state.version
    published: list[int] = []

    class Racing(Recording):
        def put(self, key: str, data: bytes) -> None:
            super().put(key, data)
            if key.startswith("leases/") and not published:  # the compacter moves on
                append_rounds(rel, oracle, 2, seed=90)
                convert(trace, rel.wal_dir, per_plan=4, merge=False)
                published.append(trace.state.version)

    racing = Racing(store.inner)
    lease = Lease(racing, seconds=30, holder="test")
    held = lease.hold_newest(StateStore(racing))
    assert published
    assert published[0] > v0
    assert held == published[0] == lease.version
    assert [LeaseKey.parse(k).version for k in _lease_objects(store)] == [held]  # type: ignore[union-attr]
    lease.release()
    assert _lease_objects(store) == []


def test_the_keeper_renews_a_held_lease(traced: tuple[Relation, Oracle, Trace]) -> None:
    """A lease of 1.5 s held for 3 s is renewed (a later expiry, one object) and still
    holds its version then; released, it is gone and renewed no more."""
    _, _, trace = traced
    lease = Lease(trace.store, seconds=1.5, holder="test")
    held = lease.hold_newest(trace.states)
    first = lease.expires_at
    time.sleep(3.0)
    assert lease.expires_at > first + 1.0
    # one lease (a renewal in flight may briefly show its old key beside the new one)
    parsed = [LeaseKey.parse(k) for k in _lease_objects(trace.store)]
    assert {p.id for p in parsed if p is not None} == {lease.id}
    assert {p.version for p in parsed if p is not None} == {held}
    assert any(p is not None and p.live(time.time()) for p in parsed)
    assert scan(trace.store, time.time(), forget_before=0).held == {held}
    lease.release()
    assert _lease_objects(trace.store) == []
    assert lease not in KEEPER._leases


def test_gc_learns_every_lease_from_one_listing(
        traced: tuple[Relation, Oracle, Trace]) -> None:
    """A GC pass lists ``state/`` once, ``leases/`` once and each data directory once, and
    reads no lease, whether 3 or 300 leases hold the same versions: its operations are
    the same. A version's files are read once, then remembered (a version never
    changes)."""
    rel, oracle, trace = traced
    store = trace.store
    assert isinstance(store, Recording)
    versions = trace.states.versions()
    held = versions[-4:-1]

    def hold(n_leases: int) -> list[Lease]:
        leases = [Lease(store, seconds=60, holder=f"reader {i}") for i in range(n_leases)]
        for i, lease in enumerate(leases):
            lease.hold(held[i % len(held)])
        return leases

    def gc_pass(n_leases: int) -> list[tuple[OpKind, str]]:
        leases = hold(n_leases)
        fresh = Trace.open(store, rel.meta)
        store.ops.clear()
        fresh.collect_garbage(keep_versions=1, grace_seconds=0.0)
        ops = list(store.ops)
        store.ops.clear()
        fresh.collect_garbage(keep_versions=1, grace_seconds=0.0)
        again = list(store.ops)
        for lease in leases:
            lease.release()
        assert [op for op in again if op[0] in ("get", "get_range")] == []  # remembered
        return ops

    steady = hold(3)  # the steady state: every version no lease holds pruned
    trace.collect_garbage(keep_versions=1, grace_seconds=0.0)
    for lease in steady:
        lease.release()
    few, many = gc_pass(3), gc_pass(300)
    assert sorted(few) == sorted(many)
    lists = [key for op, key in many if op == "list"]
    assert sorted(lists) == ["batches", "leases", "pending", "state"]
    assert not any(key.startswith("leases/") for op, key in many if op != "delete")
    assert {key for op, key in many if op == "get"} == {
        trace.states.key(v) for v in [*held, versions[-1]]}
    check_snapshots(rel, oracle)


class Refusing(UnreliableStore):
    """A store where this reader may not write (a read-only copy): puts refused."""

    def put(self, key: str, data: bytes) -> None:
        raise StorageError(errno.EACCES, f"{self.url}: access denied to {key!r} (test)")


def test_a_store_that_refuses_leases_lets_the_read_go_on(
        traced: tuple[Relation, Oracle, Trace]) -> None:
    rel, oracle, trace = traced
    refusing = Refusing(trace.store)
    lease = Lease(refusing, seconds=30, holder="test")
    with pytest.warns(RuntimeWarning, match="reading without one"):
        view = pin(rel.files, 0, oracle.upper - 1, lease=lease)
    with view:
        assert view.state is not None
        assert view.state.version == trace.state.version
    assert not lease.writable
    assert lease.version is None
    assert _lease_objects(trace.store) == []
    lease.release()
    check_snapshots(rel, oracle)


def test_a_read_releases_its_lease(traced: tuple[Relation, Oracle, Trace]) -> None:
    """Every way of reading leaves no lease behind once it ended: a snapshot, a lookup,
    a drained or an abandoned snapshot_reader, a finished subscription."""
    rel, oracle, trace = traced
    as_of = oracle.upper - 1
    rel.snapshot(as_of)
    rel.lookup({"id": [1, 2]}, as_of)
    reader = rel.snapshot_reader(as_of)
    assert len(_lease_objects(trace.store)) == 1  # held while the reader lives
    reader.read_all()
    assert _lease_objects(trace.store) == []
    abandoned = rel.snapshot_reader(as_of)
    assert len(_lease_objects(trace.store)) == 1
    del abandoned  # never read: garbage collection of the reader ends its lease
    assert _lease_objects(trace.store) == []
    rel.seal(2**64)
    items = list(rel.subscribe(as_of))
    assert items
    assert _lease_objects(trace.store) == []
    assert KEEPER.held() == 0
