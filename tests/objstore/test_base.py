"""The ObjectStore contract (lamina.objstore.base), run on file:// and on s3:// against a
real S3 server (moto on 127.0.0.1): round trips, ranged gets, listings, deletes, the
conditional create and its races, the lost response resolved by reading back, keys."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from lamina.errors import (
    ConfigError,
    InvalidArgumentError,
    LaminaError,
    ObjectExistsError,
    ObjectNotFoundError,
    StateConflictError,
    StorageError,
)
from lamina.objstore import ObjectStore, open_store
from lamina.objstore.local import LocalObjectStore
from lamina.objstore.s3 import S3ObjectStore
from lamina.testing.unreliable import UnreliableStore

RACE_CHILD = Path(__file__).with_name("race_child.py")


def test_open_store_by_scheme(tmp_path: Path) -> None:
    assert isinstance(open_store(tmp_path.as_uri()), LocalObjectStore)
    s3 = open_store("s3://bucket/some/prefix/")
    assert isinstance(s3, S3ObjectStore)
    assert (s3.bucket, s3.prefix, s3.url) == ("bucket", "some/prefix", "s3://bucket/some/prefix")
    for bad in ("gs://bucket/x", "relative/path", "file://host/x", "s3:///nobucket",
                "s3://user:pw@bucket/x", "s3://bucket/a//b"):
        with pytest.raises(ConfigError):
            open_store(bad)


def test_round_trip(store: ObjectStore) -> None:
    big = bytes(range(256)) * 4096  # 1 MiB, every byte value
    store.put("batches/b1/part-00000.parquet", big)
    store.put("state/1.json", b"")
    assert store.get("batches/b1/part-00000.parquet") == big
    assert store.get("state/1.json") == b""
    store.put("state/1.json", b"replaced")
    assert store.get("state/1.json") == b"replaced"


def test_missing_object(store: ObjectStore) -> None:
    store.put("a/b", b"x")
    for key in ("nope", "a/nope", "a"):  # "a" is a prefix, not an object
        with pytest.raises(ObjectNotFoundError) as info:
            store.get(key)
        assert isinstance(info.value, FileNotFoundError)
        assert isinstance(info.value, StorageError)
        with pytest.raises(ObjectNotFoundError):
            store.get_range(key, 0, 1)
        with pytest.raises(ObjectNotFoundError):
            store.get_range(key, 0, 0)


def test_ranged_get(store: ObjectStore) -> None:
    data = b"0123456789"
    store.put("r", data)
    for start, end in ((0, 10), (0, 5), (2, 4), (3, 100), (9, 10), (10, 10), (10, 15),
                       (12, 20), (4, 4), (0, 0)):
        assert store.get_range("r", start, end) == data[start:end], (start, end)
    for start, end in ((-1, 3), (5, 4)):
        with pytest.raises(InvalidArgumentError):
            store.get_range("r", start, end)


def test_list_sizes_prefixes_and_times(store: ObjectStore) -> None:
    before = time.time()
    store.put("batches/b1/part-00000.parquet", b"x" * 10)
    store.put("batches/b1/part-00001.parquet", b"x" * 20)
    store.put("batches/b10/part-00000.parquet", b"x" * 30)
    store.put("batches/b1.scratch/run-0", b"x" * 5)
    store.put("state/00000000000000000001.json", b"{}")
    listed = store.list("batches/b1")
    assert [(m.key, m.size) for m in listed] == [
        ("batches/b1/part-00000.parquet", 10), ("batches/b1/part-00001.parquet", 20)]
    assert store.list("batches/b1/") == listed
    assert [m.key for m in store.list("batches")] == [
        "batches/b1.scratch/run-0", "batches/b1/part-00000.parquet",
        "batches/b1/part-00001.parquet", "batches/b10/part-00000.parquet"]
    assert len(store.list("")) == 5
    assert store.list("nothing/here") == []
    for m in store.list():
        assert before - 120 < m.mtime < time.time() + 120, m


def test_delete_and_delete_prefix(store: ObjectStore) -> None:
    for key in ("batches/b1/p0", "batches/b1/p1", "batches/b2/p0", "state/1"):
        store.put(key, key.encode())
    store.delete("state/1")
    store.delete("state/1")  # idempotent
    store.delete("never/written")
    with pytest.raises(ObjectNotFoundError):
        store.get("state/1")
    store.delete_prefix("batches/b1")
    assert [m.key for m in store.list()] == ["batches/b2/p0"]
    store.delete_prefix("batches/absent")
    assert store.get("batches/b2/p0") == b"batches/b2/p0"


def test_put_if_absent(store: ObjectStore) -> None:
    store.put_if_absent("state/2", b"writer A")
    with pytest.raises(ObjectExistsError) as info:
        store.put_if_absent("state/2", b"writer B")
    assert isinstance(info.value, StateConflictError)
    assert store.get("state/2") == b"writer A"
    store.put_if_absent("state/2", b"writer A")  # the winner's retry: its own object
    assert [m.key for m in store.list("state")] == ["state/2"]


def _thread_race(store: ObjectStore, key: str, n: int) -> tuple[list[bytes], list[bytes]]:
    """``n`` threads race to create ``key`` with distinct payloads: (won, lost)."""
    start = threading.Barrier(n)
    won: list[bytes] = []
    lost: list[bytes] = []
    errors: list[BaseException] = []

    def race(payload: bytes) -> None:
        start.wait()
        try:
            store.put_if_absent(key, payload)
            won.append(payload)
        except ObjectExistsError:
            lost.append(payload)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=race, args=(f"writer {i} {uuid.uuid4()}".encode(),))
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return won, lost


def test_put_if_absent_thread_race(store: ObjectStore) -> None:
    """Eight threads race for each of four keys: exactly one wins each, and the object is
    the winner's bytes."""
    for round_ in range(4):
        key = f"state/{round_:020d}.json"
        won, lost = _thread_race(store, key, 8)
        assert len(won) == 1
        assert len(lost) == 7
        assert store.get(key) == won[0]


def test_put_if_absent_process_race(store_url: str, tmp_path: Path) -> None:
    """Three processes race for one key: exactly one wins."""
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, str(RACE_CHILD), store_url, "state/race",
                               f"process {i} {uuid.uuid4()}", str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(3)]
    time.sleep(1.0)  # let them import and open the store
    go.touch()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()
        outs.append(out.decode().strip())
    assert sorted(outs) == ["lost", "lost", "won"]
    winner = str(procs[outs.index("won")].args[4])  # type: ignore[index]
    assert open_store(store_url).get("state/race") == winner.encode()


def test_lost_response_resolved_by_reading_back(store: ObjectStore) -> None:
    """A create that reached the store but whose response was lost: the retry finds the
    writer's own bytes and succeeds; another writer still loses."""
    flaky = UnreliableStore(store).inject("create", "lose_response", calls=[1])
    mine = f"state 7 nonce {uuid.uuid4()}".encode()
    with pytest.raises(StorageError, match="response was lost"):
        flaky.put_if_absent("state/7", mine)
    assert store.get("state/7") == mine  # it was written
    flaky.put_if_absent("state/7", mine)  # the retry
    with pytest.raises(ObjectExistsError):
        flaky.put_if_absent("state/7", f"state 7 nonce {uuid.uuid4()}".encode())
    assert store.get("state/7") == mine


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/./b", "a/../b", ".hidden",
                                 "a/.tmp", "a\\b", "trailing/"])
def test_bad_keys_write_nothing(store: ObjectStore, key: str) -> None:
    for call in (lambda: store.put(key, b"x"), lambda: store.put_if_absent(key, b"x"),
                 lambda: store.get(key), lambda: store.delete(key)):
        with pytest.raises(InvalidArgumentError):
            call()
    assert store.list() == []


def test_errors_are_lamina_errors(store: ObjectStore) -> None:
    """Every failure above is a LaminaError (the boundary translates); spot-check that a
    failure's chain does not make a third-party type the raised one."""
    with pytest.raises(LaminaError) as info:
        store.get("missing")
    assert type(info.value).__module__ == "lamina.errors"


def test_child_children_size_and_readers(store: ObjectStore) -> None:
    """The helpers the trace is built on: a child store shares the objects under its
    prefix; ``children`` names the next level; ``size``; ``open_input`` reads like a file
    (seek, ranged reads through the buffer); ``writer`` publishes whole or not at all."""
    store.put("rel/state/1.json", b"{}")
    store.put("rel/batches/b/part-0.parquet", b"x" * 5000)
    store.put("other/state/1.json", b"{}")
    store.put("top", b"t")
    assert store.children() == ["other", "rel"]
    assert store.children("rel") == ["batches", "state"]
    rel = store.child("rel")
    assert rel.get("state/1.json") == b"{}"
    assert rel.url.endswith("/rel")
    assert [m.key for m in rel.list("batches")] == ["batches/b/part-0.parquet"]
    assert rel.size("batches/b/part-0.parquet") == 5000
    with pytest.raises(ObjectNotFoundError):
        rel.size("batches/b/none")
    payload = bytes(range(256)) * 40
    with rel.writer("runs/r.arrow", durable=False) as out:
        out.write(payload[:4000])
        out.write(memoryview(payload)[4000:])
        assert out.tell() == len(payload)
    assert rel.get("runs/r.arrow") == payload
    with rel.open_input("runs/r.arrow") as f:
        f.seek(5000)
        assert f.read(100) == payload[5000:5100]
        f.seek(-10, 2)
        assert f.read() == payload[-10:]
    def failing_write() -> None:
        with rel.writer("runs/failed.arrow") as out:
            out.write(b"half")
            raise RuntimeError("the writer failed")

    with pytest.raises(RuntimeError):
        failing_write()
    assert [m.key for m in rel.list("runs")] == ["runs/r.arrow"]
