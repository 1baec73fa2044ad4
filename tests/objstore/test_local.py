"""The file:// store: every operation goes through the injected FileSystem (the fault
seam), publishes are crash-safe (temp file, fsync, rename or link, fsync dir), temp files
are never listed, and OS failures come out as StorageError with nothing published."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from lamina.errors import ConfigError, ObjectExistsError, StorageError
from lamina.fs import FileSystem
from lamina.objstore import open_store
from lamina.objstore.local import LocalObjectStore
from lamina.testing.faults import CountingFileSystem, FailingFileSystem


class ReadCountingFileSystem(CountingFileSystem):
    """Counts reads too (reads are not primitives of the fault shim)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def read_bytes(self, path: Path) -> bytes:
        self.reads.append(f"read_bytes {path.name}")
        return super().read_bytes(path)

    def read_range(self, path: Path, start: int, end: int) -> bytes:
        self.reads.append(f"read_range {path.name} {start} {end}")
        return super().read_range(path, start, end)


def test_every_operation_goes_through_the_injected_fs(tmp_path: Path) -> None:
    fs = ReadCountingFileSystem()
    store = open_store((tmp_path / "t").as_uri(), fs=fs)
    assert isinstance(store, LocalObjectStore)
    assert store.fs is fs
    store.put("a/b", b"hello")
    kinds = [op.kind for op in fs.ops]
    assert "write" in kinds
    assert "fdatasync" in kinds
    assert "rename" in kinds
    assert kinds[-1] == "fsync_dir"  # the directory entry is made durable last
    n = len(fs.ops)
    store.put_if_absent("a/c", b"world")
    kinds = [op.kind for op in fs.ops[n:]]
    assert "link" in kinds
    assert "rename" not in kinds
    assert kinds[-1] == "fsync_dir"
    assert store.get("a/b") == b"hello"
    assert store.get_range("a/c", 1, 3) == b"or"
    assert fs.reads == ["read_bytes b", "read_range c 1 3"]
    n = len(fs.ops)
    store.delete("a/b")
    assert [op.kind for op in fs.ops[n:]] == ["unlink"]  # a delete needs no directory sync
    n = len(fs.ops)
    store.delete_prefix("a")
    assert next(op.kind for op in fs.ops[n:]) == "unlink"


def test_failed_publish_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "t"
    store = open_store(root.as_uri(), fs=FailingFileSystem({"link": 1}))
    with pytest.raises(StorageError) as info:
        store.put_if_absent("state/1", b"v1")
    assert info.value.errno == errno.EIO
    assert store.list() == []
    assert [p.name for p in (root / "state").iterdir()] == []  # the temp file is gone too
    store.put_if_absent("state/1", b"v1")  # the retry works
    assert store.get("state/1") == b"v1"

    store = open_store(root.as_uri(), fs=FailingFileSystem({"fdatasync": 1}, errno.ENOSPC))
    with pytest.raises(StorageError) as info:
        store.put("state/1", b"v2")
    assert info.value.errno == errno.ENOSPC
    assert store.get("state/1") == b"v1"


def test_temp_files_and_directories_are_not_objects(tmp_path: Path) -> None:
    root = tmp_path / "t"
    store = open_store(root.as_uri())
    store.put("batches/b1/part-00000.parquet", b"x")
    (root / "batches" / "b1" / ".part-00001.parquet.abc.tmp").write_bytes(b"half")
    (root / "batches" / "empty").mkdir()
    (root / ".hidden-dir").mkdir()
    (root / ".hidden-dir" / "f").write_bytes(b"y")
    assert [m.key for m in store.list()] == ["batches/b1/part-00000.parquet"]


def test_put_if_absent_same_bytes_is_the_writers_own(tmp_path: Path) -> None:
    store = open_store(tmp_path.as_uri())
    store.put_if_absent("k", b"mine")
    store.put_if_absent("k", b"mine")
    with pytest.raises(ObjectExistsError):
        store.put_if_absent("k", b"theirs")


def test_local_urls(tmp_path: Path) -> None:
    assert open_store(f"file://localhost{tmp_path}").url == tmp_path.as_uri()
    for bad in ("file:relative", "file://otherhost/x"):
        with pytest.raises(ConfigError):
            open_store(bad)
    with pytest.raises(ConfigError):
        LocalObjectStore(Path("relative"), FileSystem())


def test_free_bytes_is_the_room_on_the_keys_filesystem(tmp_path: Path) -> None:
    """``free_bytes`` answers for a key whose directories do not exist yet (a step's scratch
    runs) from the nearest directory that does: the free space of the filesystem, as
    ``statvfs`` gives it to an unprivileged process (other tests write beside this one,
    hence the slack)."""
    import shutil

    store = LocalObjectStore(tmp_path / "root")
    store.put("a/b", b"x")
    for key in ("", "a", "a/c/d.scratch", "nowhere/yet"):
        got = store.free_bytes(key)
        assert got is not None
        assert abs(got - shutil.disk_usage(tmp_path).free) < 256 << 20, key
    assert LocalObjectStore(tmp_path / "not-made").free_bytes("x/y") is not None
