"""The fault-injecting wrapper: failures, timeouts, delays and lost responses on chosen
calls or by seeded probability; a retrying writer under random faults loses and doubles
nothing."""

from __future__ import annotations

import contextlib
import errno
import uuid
from pathlib import Path

import pytest

from lamina.errors import InvalidArgumentError, ObjectExistsError, StorageError
from lamina.objstore import ObjectStore, open_store
from lamina.testing.unreliable import Injected, OpKind, UnreliableStore


@pytest.fixture
def local(tmp_path: Path) -> ObjectStore:
    return open_store((tmp_path / "t").as_uri())


def test_fail_chosen_calls(local: ObjectStore) -> None:
    flaky = UnreliableStore(local).inject("put", "fail", calls=[2])
    flaky.put("a", b"1")
    with pytest.raises(StorageError, match="not performed") as info:
        flaky.put("b", b"2")
    assert info.value.errno == errno.EIO
    flaky.put("c", b"3")
    assert [m.key for m in local.list()] == ["a", "c"]
    assert flaky.injected == [Injected("put", 2, "fail", "b")]
    assert flaky.calls["put"] == 3


def test_free_bytes_is_the_inner_stores_and_never_faulted(local: ObjectStore) -> None:
    """A question about room is not an operation: rules on every kind leave it alone."""
    flaky = UnreliableStore(local).inject("get", "fail").inject("put", "fail")
    got, want = flaky.free_bytes("a/b"), local.free_bytes("a/b")
    assert got is not None
    assert want is not None
    assert abs(got - want) < 256 << 20  # other tests write beside this one
    assert not flaky.injected


def test_timeout_and_delay(local: ObjectStore) -> None:
    slept: list[float] = []
    flaky = (UnreliableStore(local, sleep=slept.append)
             .inject("put", "timeout", calls=[1], seconds=2.5)
             .inject("get", "delay", seconds=0.25))
    with pytest.raises(StorageError) as info:
        flaky.put("k", b"v")
    assert info.value.errno == errno.ETIMEDOUT
    assert local.list() == []  # a timed-out request did not reach the store
    flaky.put("k", b"v")
    assert flaky.get("k") == b"v"
    assert slept == [2.5, 0.25]


def test_lost_response_after_write(local: ObjectStore) -> None:
    flaky = (UnreliableStore(local).inject("put", "lose_response", calls=[1])
             .inject("delete", "lose_response"))
    with pytest.raises(StorageError, match="response was lost"):
        flaky.put("k", b"written")
    assert local.get("k") == b"written"
    with pytest.raises(StorageError):
        flaky.delete("k")
    assert local.list() == []


def test_put_if_absent_reads_through_the_faults(local: ObjectStore) -> None:
    """The read-back of put_if_absent is an operation of the wrapper: a failing read-back
    is an error, never a false win or a false loss."""
    local.put("k", b"theirs")
    flaky = UnreliableStore(local).inject("get", "fail", calls=[1])
    with pytest.raises(StorageError):
        flaky.put_if_absent("k", b"mine")
    with pytest.raises(ObjectExistsError):
        flaky.put_if_absent("k", b"mine")


def test_probability_is_seeded(local: ObjectStore) -> None:
    def run(seed: int) -> list[Injected]:
        flaky = UnreliableStore(local, seed=seed).inject("get_range", "fail", probability=0.5)
        local.put("k", b"0123456789")
        for _ in range(200):
            with contextlib.suppress(StorageError):
                flaky.get_range("k", 0, 4)
        return flaky.injected

    first = run(7)
    assert first == run(7)
    assert first != run(8)
    assert 60 < len(first) < 140


def test_bad_rules() -> None:
    flaky = UnreliableStore(open_store("s3://b/p"))
    with pytest.raises(InvalidArgumentError):
        flaky.inject("rename", "fail")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        flaky.inject("get", "explode")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        flaky.inject("get", "fail", probability=1.5)


def test_retrying_writer_loses_and_doubles_nothing(store: ObjectStore) -> None:
    """A writer publishing 30 versions by put_if_absent, retrying every StorageError,
    under random failures, timeouts and lost responses on creates and reads: every version
    ends up holding exactly its payload, each published once, and a rival's creates of the
    same versions all lose."""
    flaky = UnreliableStore(store, seed=3, sleep=lambda _s: None)
    ops: tuple[OpKind, ...] = ("create", "get")
    for op in ops:
        flaky.inject(op, "fail", probability=0.2)
        flaky.inject(op, "lose_response", probability=0.2)
        flaky.inject(op, "timeout", probability=0.1)
    nonce = uuid.uuid4().hex
    for v in range(30):
        payload = f"version {v} writer {nonce}".encode()
        for _attempt in range(100):
            try:
                flaky.put_if_absent(f"state/{v:020d}.json", payload)
                break
            except StorageError:
                continue
        else:
            pytest.fail(f"version {v} never published")
    assert {a for _op, _n, a, _k in ((i.op, i.number, i.action, i.key)
                                     for i in flaky.injected)} >= {"fail", "lose_response",
                                                                   "timeout"}
    listed = store.list("state")
    assert len(listed) == 30
    for v, meta in enumerate(listed):
        assert store.get(meta.key) == f"version {v} writer {nonce}".encode()
        with pytest.raises(ObjectExistsError):
            store.put_if_absent(meta.key, b"rival")
