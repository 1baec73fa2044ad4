"""lamina.fs: gathered writes (``AppendFile.writev``, the WAL's append path).

Real files in tmp dirs; the short writes are real ``os.writev`` calls on fewer bytes than
offered, by a FileSystem subclass overriding the ``os_writev`` primitive (the same seam the
fault-injecting file systems use)."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from lamina.errors import StorageError
from lamina.fs import IOV_MAX, FileSystem
from lamina.testing.faults import CountingFileSystem, FailingFileSystem


def pieces() -> list[Any]:
    return [b"head", memoryview(b"0123456789")[2:], pa.py_buffer(b"arrow-buffer"), b"",
            bytearray(b"tail!")]


def joined(bufs: Sequence[Any]) -> bytes:
    return b"".join(bytes(b) for b in bufs)


class ShortWritevFS(FileSystem):
    """Writes at most ``limit`` bytes per writev (a real, shorter writev); counts calls."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.calls: list[int] = []  # buffers offered per call

    def os_writev(self, fd: int, buffers: Sequence[Any], path: Path) -> int:
        self.calls.append(len(buffers))
        left, cut = self.limit, []
        for b in buffers:
            view = memoryview(b)[:left]
            cut.append(view)
            left -= len(view)
            if not left:
                break
        return os.writev(fd, cut)


class WriteOnlyFS(FileSystem):
    """Overrides os_write alone, as the fault-injecting file systems do."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def os_write(self, fd: int, data: memoryview, path: Path) -> int:
        self.writes.append(bytes(data))
        return super().os_write(fd, data, path)


def test_writev_writes_the_concatenation(tmp_path: Path) -> None:
    """Bytes, memoryviews, bytearrays, Arrow buffers and empty pieces land in order, after
    what the file held; ``size`` follows."""
    path = tmp_path / "f"
    path.write_bytes(b"old")
    handle = FileSystem().open_append(path)
    handle.writev(pieces())
    handle.writev([])
    handle.close()
    assert path.read_bytes() == b"old" + joined(pieces())
    assert handle.size == 3 + len(joined(pieces()))


@pytest.mark.parametrize("limit", [1, 3, 4, 5, 11, 12, 25, 1000])
def test_short_writevs_resume_where_they_stopped(tmp_path: Path, limit: int) -> None:
    """A writev that writes fewer bytes than offered (ending inside a buffer or on a
    boundary) is resumed from the first unwritten byte, never repeated or skipped."""
    fs = ShortWritevFS(limit)
    handle = fs.open_append(tmp_path / "f", create=True)
    handle.writev(pieces())
    handle.close()
    total = len(joined(pieces()))
    assert (tmp_path / "f").read_bytes() == joined(pieces())
    assert handle.size == total
    assert len(fs.calls) == max(1, -(-total // limit))


def test_more_buffers_than_iov_max(tmp_path: Path) -> None:
    """More pieces than one writev takes are written in several calls, in order."""
    fs = ShortWritevFS(1 << 30)
    bufs = [i.to_bytes(2, "little") for i in range(2 * IOV_MAX + 5)]
    handle = fs.open_append(tmp_path / "f", create=True)
    handle.writev(bufs)
    handle.close()
    assert (tmp_path / "f").read_bytes() == b"".join(bufs)
    assert max(fs.calls) <= IOV_MAX
    assert len(fs.calls) == 3


def test_writev_without_progress_or_with_an_error_raises(tmp_path: Path) -> None:
    """A writev that writes nothing, or fails, raises StorageError naming the file."""
    handle = ShortWritevFS(0).open_append(tmp_path / "f", create=True)
    with pytest.raises(StorageError, match="no progress"):
        handle.writev(pieces())
    handle.close()
    full = FailingFileSystem({"write": 1}, errno.ENOSPC)
    handle = full.open_append(tmp_path / "g", create=True)
    with pytest.raises(StorageError) as info:
        handle.writev(pieces())
    assert info.value.errno == errno.ENOSPC
    assert str(tmp_path / "g") in str(info.value)
    handle.close()


def test_a_filesystem_overriding_only_os_write_sees_one_write(tmp_path: Path) -> None:
    """A subclass written for plain writes (every fault-injecting one) gets the pieces
    joined into one os_write per writev: it sees every byte, and as many operations as
    before gathered writes existed."""
    assert FileSystem.native_writev
    assert ShortWritevFS.native_writev
    assert not WriteOnlyFS.native_writev
    assert not CountingFileSystem.native_writev
    fs = WriteOnlyFS()
    handle = fs.open_append(tmp_path / "f", create=True)
    handle.writev(pieces())
    handle.close()
    assert fs.writes == [joined(pieces())]
    counting = CountingFileSystem()
    handle = counting.open_append(tmp_path / "g", create=True)
    handle.writev(pieces())
    handle.close()
    assert [(op.kind, op.size) for op in counting.ops] == [("write", len(joined(pieces())))]
