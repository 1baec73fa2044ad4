"""lamina.hugepages: numpy's arrays allocated inside small_pages() carry no MADV_HUGEPAGE.

What the kernel was told is read back from ``/proc/self/smaps``: a mapping advised with
``MADV_HUGEPAGE`` lists ``hg`` among its ``VmFlags``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from lamina.hugepages import small_pages

SMAPS = Path("/proc/self/smaps")


def _advised(array: np.ndarray) -> bool:
    """Whether the mapping holding the middle of ``array``'s data is advised for huge
    pages (numpy advises from the first page boundary on, so the first page may not be)."""
    address = array.ctypes.data + array.nbytes // 2
    inside = False
    for line in SMAPS.read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    raise AssertionError("no mapping holds the array")


def _big() -> np.ndarray:
    return np.empty(64 << 20, dtype=np.uint8)


@pytest.fixture
def numpy_advises() -> None:
    if not SMAPS.exists():
        pytest.skip("no /proc/self/smaps")
    if not _advised(_big()):
        pytest.skip("numpy does not advise huge pages here (NUMPY_MADVISE_HUGEPAGE=0, or "
                    "a kernel without transparent huge pages)")


@pytest.mark.usefixtures("numpy_advises")
def test_arrays_inside_go_without_huge_pages_and_the_setting_comes_back() -> None:
    with small_pages():
        assert not _advised(_big())
        with small_pages():  # nested: the inner exit leaves it off
            assert not _advised(_big())
        assert not _advised(_big())
    assert _advised(_big())


@pytest.mark.usefixtures("numpy_advises")
def test_overlapping_reads_on_threads_restore_it_at_the_last_exit() -> None:
    entered, release = threading.Event(), threading.Event()

    def other_read() -> None:
        with small_pages():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other_read)
    with small_pages():
        thread.start()
        assert entered.wait(10)
    assert not _advised(_big())  # the other read is still inside
    release.set()
    thread.join(10)
    assert _advised(_big())


@pytest.mark.usefixtures("numpy_advises")
def test_a_snapshot_restores_numpy_s_setting(tmp_path: Path) -> None:
    import pyarrow as pa

    from lamina import Store

    with Store.open(tmp_path / "data", fsync="never") as store:
        rel = store.create_relation("r", pa.schema([("id", pa.int64())]), key=["id"])
        rel.append(pa.table({"id": pa.array(np.arange(1000)),
                             "_time": pa.array(np.zeros(1000, dtype=np.uint64)),
                             "_diff": pa.array(np.ones(1000, dtype=np.int64))}))
        rel.seal(1)
        assert rel.snapshot().num_rows == 1000
    assert _advised(_big())
