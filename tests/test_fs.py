"""lamina.fs: the storage layer's durability rules, observed through FileSystem subclasses
that override the ``os_*`` primitives (the sanctioned seam; nothing is patched)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lamina.errors import PathNotFoundError, StorageError
from lamina.fs import FileSystem, crc32c, crc32c_raw


class RecordingFS(FileSystem):
    """Logs every primitive call, in order, as (operation, path name)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def os_write(self, fd: int, data: memoryview, path: Path) -> int:
        self.calls.append(("write", path.name))
        return super().os_write(fd, data, path)

    def os_fdatasync(self, fd: int, path: Path) -> None:
        self.calls.append(("fdatasync", path.name))
        super().os_fdatasync(fd, path)

    def os_fsync_dir(self, path: Path) -> None:
        self.calls.append(("fsync_dir", path.name))
        super().os_fsync_dir(path)

    def os_rename(self, src: Path, dst: Path) -> None:
        self.calls.append(("rename", dst.name))
        super().os_rename(src, dst)

    def os_link(self, src: Path, dst: Path) -> None:
        self.calls.append(("link", dst.name))
        super().os_link(src, dst)

    def ops(self) -> list[str]:
        return [c[0] for c in self.calls]


class TrickleFS(FileSystem):
    """A disk that accepts at most ``chunk`` bytes per write (short writes)."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.writes = 0

    def os_write(self, fd: int, data: memoryview, path: Path) -> int:
        self.writes += 1
        return os.write(fd, data[: self.chunk])


class FailingFS(FileSystem):
    """Raises OSError(err) from one primitive."""

    def __init__(self, op: str, err: int) -> None:
        self.op = op
        self.err = err

    def os_write(self, fd: int, data: memoryview, path: Path) -> int:
        if self.op == "write":
            raise OSError(self.err, os.strerror(self.err))
        return super().os_write(fd, data, path)

    def os_fdatasync(self, fd: int, path: Path) -> None:
        if self.op == "fdatasync":
            raise OSError(self.err, os.strerror(self.err))
        super().os_fdatasync(fd, path)

    def os_rename(self, src: Path, dst: Path) -> None:
        if self.op == "rename":
            raise OSError(self.err, os.strerror(self.err))
        super().os_rename(src, dst)


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_write_atomic_is_temp_sync_rename_syncdir(tmp_path: Path) -> None:
    """write_atomic writes a temp file in the same directory, fdatasyncs it, renames it
    over the target and fsyncs the directory, in that order (crash-safety rule 2,
    docs/architecture.md); no temp
    file is left and an existing file is replaced whole."""
    fs = RecordingFS()
    target = tmp_path / "state.json"
    target.write_bytes(b"old")
    fs.write_atomic(target, b"new contents")
    assert target.read_bytes() == b"new contents"
    assert _names(tmp_path) == ["state.json"]
    assert fs.ops() == ["write", "fdatasync", "rename", "fsync_dir"]
    assert fs.calls[0][1].startswith(".state.json.")
    assert fs.calls[0][1].endswith(".tmp")


def test_write_atomic_failure_leaves_target_and_no_temp(tmp_path: Path) -> None:
    """A failed fsync or rename raises StorageError and leaves the old file untouched and
    no temp file behind."""
    target = tmp_path / "f"
    target.write_bytes(b"old")
    for op in ("fdatasync", "rename"):
        with pytest.raises(StorageError) as info:
            FailingFS(op, errno.EIO).write_atomic(target, b"new")
        assert info.value.errno == errno.EIO
        assert target.read_bytes() == b"old"
        assert _names(tmp_path) == ["f"]


def test_publish_exclusive_is_a_compare_and_set(tmp_path: Path) -> None:
    """The first publish wins; a second returns False and changes nothing; no temp file
    survives either way."""
    fs = RecordingFS()
    target = tmp_path / "v1"
    assert fs.publish_exclusive(target, b"first")
    assert "link" in fs.ops()
    assert fs.ops()[-1] == "fsync_dir"
    assert not fs.publish_exclusive(target, b"second")
    assert target.read_bytes() == b"first"
    assert _names(tmp_path) == ["v1"]


def test_short_writes_are_completed(tmp_path: Path) -> None:
    """AppendFile.write loops over short writes until every byte is written."""
    fs = TrickleFS(chunk=3)
    path = tmp_path / "f"
    handle = fs.open_append(path, create=True)
    data = bytes(range(256)) * 4
    handle.write(data)
    handle.sync()
    handle.close()
    assert path.read_bytes() == data
    assert handle.size == len(data)
    assert fs.writes == -(-len(data) // 3)


def test_patch_overwrites_in_place_in_a_file_opened_for_appending(tmp_path: Path) -> None:
    """AppendFile.patch writes at its offset although the file is O_APPEND (where Linux's
    pwrite would append), later writes append again, a patch beyond what was written is
    refused, and start_writeback is a hint that changes no byte."""
    path = tmp_path / "f"
    handle = FileSystem().open_append(path, create=True)
    handle.write(bytes(9) + b"payload" * 1000)
    handle.start_writeback(4096, handle.size)
    handle.start_writeback(10, 10)  # empty: nothing to do
    handle.patch(0, b"HEADER123")
    handle.write(b"tail")
    assert handle.size == 9 + 7000 + 4
    with pytest.raises(ValueError, match="lies outside"):
        handle.patch(handle.size - 2, b"abc")
    handle.sync()
    handle.close()
    assert path.read_bytes() == b"HEADER123" + b"payload" * 1000 + b"tail"


def test_zero_progress_write_is_an_error(tmp_path: Path) -> None:
    """A write that makes no progress raises StorageError instead of spinning."""
    handle = TrickleFS(chunk=0).open_append(tmp_path / "f", create=True)
    with pytest.raises(StorageError, match="no progress"):
        handle.write(b"abc")
    handle.close()


@pytest.mark.parametrize(("op", "err"), [("write", errno.ENOSPC), ("write", errno.EIO),
                                         ("fdatasync", errno.EIO)])
def test_os_errors_become_storage_errors(tmp_path: Path, op: str, err: int) -> None:
    """ENOSPC and EIO come out as StorageError (an OSError) with the errno, the operation
    and the path in the message."""
    fs = FailingFS(op, err)
    path = tmp_path / "f"
    handle = fs.open_append(path, create=True)
    if op == "write":
        with pytest.raises(StorageError) as info:
            handle.write(b"x")
    else:
        handle.write(b"x")
        with pytest.raises(StorageError) as info:
            handle.sync()
    handle.close()
    assert info.value.errno == err
    assert isinstance(info.value, OSError)
    assert op in str(info.value)
    assert str(path) in str(info.value)


def test_a_path_gone_is_a_storage_error_and_a_file_not_found_error(tmp_path: Path) -> None:
    """An ENOENT from a write-side operation (a directory renamed away meanwhile, as a
    dropped relation's WAL directory is) comes out as PathNotFoundError: a StorageError
    with the errno, the operation and the path, and a FileNotFoundError, so code that
    treats a vanished path as a drop catches it."""
    gone = tmp_path / "gone"
    with pytest.raises(PathNotFoundError) as info:
        FileSystem().fsync_dir(gone)
    assert isinstance(info.value, StorageError)
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.errno == errno.ENOENT
    assert "fsync of directory" in str(info.value)
    assert str(gone) in str(info.value)
    with pytest.raises(FileNotFoundError):
        FileSystem().open_append(gone / "f", create=True)


def test_open_append_create_is_exclusive(tmp_path: Path) -> None:
    """open_append(create=True) refuses an existing file; without create it appends."""
    fs = FileSystem()
    path = tmp_path / "f"
    h = fs.open_append(path, create=True)
    h.write(b"ab")
    h.close()
    with pytest.raises(StorageError):
        fs.open_append(path, create=True)
    h = fs.open_append(path)
    assert h.size == 2
    h.write(b"cd")
    h.truncate(3)
    h.close()
    assert path.read_bytes() == b"abc"


def test_makedirs_syncs_each_new_parent(tmp_path: Path) -> None:
    """makedirs creates missing parents and fsyncs the parent of each new directory."""
    fs = RecordingFS()
    fs.makedirs(tmp_path / "a" / "b" / "c")
    assert (tmp_path / "a" / "b" / "c").is_dir()
    assert fs.calls == [("fsync_dir", tmp_path.name), ("fsync_dir", "a"), ("fsync_dir", "b")]
    fs.calls.clear()
    fs.makedirs(tmp_path / "a")
    assert fs.calls == []


def test_create_synced_publishes_on_success_only(tmp_path: Path) -> None:
    """create_synced publishes the file (sync, rename, dir sync) when the block ends;
    an exception inside leaves neither the target nor a temp file."""
    fs = RecordingFS()
    target = tmp_path / "part.parquet"
    with fs.create_synced(target) as f:
        f.write(b"hello ")
        f.write(b"world")
    assert target.read_bytes() == b"hello world"
    assert fs.ops()[-3:] == ["fdatasync", "rename", "fsync_dir"]
    other = tmp_path / "other"

    def fail_midway() -> None:
        with fs.create_synced(other) as f:
            f.write(b"partial")
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_midway()
    assert _names(tmp_path) == ["part.parquet"]


def test_unlink_rename_and_rmtree(tmp_path: Path) -> None:
    """unlink tolerates a missing file (or refuses it with missing_ok=False), rename syncs
    both directories, rmtree removes a nested tree and syncs its parent."""
    fs = RecordingFS()
    fs.unlink(tmp_path / "absent")
    with pytest.raises(FileNotFoundError):
        fs.unlink(tmp_path / "absent", missing_ok=False)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "f").write_bytes(b"1")
    fs.calls.clear()
    fs.rename(tmp_path / "a" / "f", tmp_path / "b" / "f")
    assert fs.calls == [("rename", "f"), ("fsync_dir", "b"), ("fsync_dir", "a")]
    (tmp_path / "b" / "deep" / "er").mkdir(parents=True)
    (tmp_path / "b" / "deep" / "er" / "g").write_bytes(b"2")
    fs.rmtree(tmp_path / "b")
    assert _names(tmp_path) == ["a"]
    fs.rmtree(tmp_path / "b")  # already gone: no error


def test_read_bytes_errors(tmp_path: Path) -> None:
    """A missing file passes through as FileNotFoundError (readers racing a deleter);
    other read errors are StorageErrors."""
    fs = FileSystem()
    with pytest.raises(FileNotFoundError):
        fs.read_bytes(tmp_path / "absent")
    with pytest.raises(StorageError):
        fs.read_bytes(tmp_path)  # a directory


def test_crc32c_is_the_crc32c_package_s() -> None:
    """The extension loaded without the package's __init__ computes what the package's
    own function does, continuing from any value."""
    import crc32c as package

    data = os.urandom(100_003)
    for value in (0, 1, 0xFFFFFFFF, package.crc32c(b"lamina")):
        for piece in (b"", b"a", data[:7], data):
            assert crc32c(piece, value) == crc32c_raw(piece, value) == \
                package.crc32c(piece, value)
    assert crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C


def test_a_cold_read_leaves_crc32c_s_init_and_the_subscription_unloaded(
        tmp_path: Path) -> None:
    """A fresh interpreter that opens a store and reads a snapshot (whose parts and WAL
    records are checksummed) loads neither the crc32c package's __init__ (importlib.metadata
    and argparse behind it) nor the subscription's modules; ``lamina.Progress`` still
    resolves, on first use."""
    import numpy as np
    import pyarrow as pa

    from lamina import Store

    root = tmp_path / "data"
    with Store.open(root) as store:
        rel = store.create_relation("t", pa.schema([("id", pa.int64())]), key=["id"])
        rel.append(pa.table({"id": pa.array(np.arange(10)),
                             "_time": pa.array(np.zeros(10, dtype=np.uint64)),
                             "_diff": pa.array(np.ones(10, dtype=np.int64))}))
        rel.seal(1)
    child = textwrap.dedent(f"""
        import json, sys
        startup = set(sys.modules)
        from lamina import Store
        with Store.open({str(root)!r}, read_only=True) as store:
            rows = store.relation("t").snapshot().num_rows
        loaded = set(sys.modules) - startup
        watched = ["crc32c", "importlib.metadata", "argparse", "lamina.read.subscribe"]
        before = [m for m in watched if m in loaded]
        import lamina
        print(json.dumps({{"rows": rows, "loaded": before,
                          "progress": lamina.Progress.__name__}}))
        """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         check=True, timeout=120)
    assert json.loads(out.stdout) == {"rows": 10, "loaded": [], "progress": "Progress"}, \
        out.stderr
