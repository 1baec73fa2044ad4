"""lamina.hugepages: numpy's arrays allocated inside small_pages() carry no MADV_HUGEPAGE.

What the kernel was told is read back from ``/proc/self/smaps``: a mapping advised with
``MADV_HUGEPAGE`` lists ``hg`` among its ``VmFlags``.

Each check runs in a fresh interpreter. In a process that has lived a while (a pytest
worker after a few hundred tests), malloc may hand a 64 MiB array memory from its heap
that an earlier array had advised; the advice stays with those pages, whatever numpy's
setting now. A fresh interpreter's heap has no such block, so every 64 MiB array is a
mapping of its own and its flags say what numpy did for it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SMAPS = Path("/proc/self/smaps")
ROOT = Path(__file__).resolve().parents[1]

PRELUDE = '''
import threading
from pathlib import Path

import numpy as np

from lamina.hugepages import small_pages


def advised(array):
    """Whether the mapping holding the middle of the array's data is advised for huge
    pages (numpy advises from the first page boundary on, so the first page may not be)."""
    address = array.ctypes.data + array.nbytes // 2
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    raise AssertionError("no mapping holds the array")


def big():
    return np.empty(64 << 20, dtype=np.uint8)


if not advised(big()):
    print("SKIP")
    raise SystemExit(0)
'''


def _check(body: str, tmp_path: Path) -> None:
    """Run PRELUDE + ``body`` in a fresh interpreter; its asserts are the test's."""
    if not SMAPS.exists():
        pytest.skip("no /proc/self/smaps")
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body) + '\nprint("OK")\n'],
        check=False, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if done.stdout.strip() == "SKIP":
        pytest.skip("numpy does not advise huge pages here (NUMPY_MADVISE_HUGEPAGE=0, or "
                    "a kernel without transparent huge pages)")
    assert done.stdout.strip() == "OK", done.stdout


def test_arrays_inside_go_without_huge_pages_and_the_setting_comes_back(
        tmp_path: Path) -> None:
    _check("""
        with small_pages():
            assert not advised(big())
            with small_pages():  # nested: the inner exit leaves it off
                assert not advised(big())
            assert not advised(big())
        assert advised(big())
    """, tmp_path)


def test_overlapping_reads_on_threads_restore_it_at_the_last_exit(tmp_path: Path) -> None:
    """numpy's hint, and Arrow's pool where the default is mimalloc, come back at the last
    exit only."""
    _check("""
        import pyarrow as pa

        entered, release = threading.Event(), threading.Event()

        def other_read():
            with small_pages():
                entered.set()
                release.wait(10)

        before = pa.default_memory_pool().backend_name
        thread = threading.Thread(target=other_read)
        with small_pages():
            thread.start()
            assert entered.wait(10)
        assert not advised(big())  # the other read is still inside
        inside = "jemalloc" if before == "mimalloc" else before
        assert pa.default_memory_pool().backend_name == inside
        release.set()
        thread.join(10)
        assert advised(big())
        assert pa.default_memory_pool().backend_name == before
    """, tmp_path)


def test_a_snapshot_restores_numpy_s_setting(tmp_path: Path) -> None:
    _check("""
        import pyarrow as pa

        from lamina import Store

        with Store.open(Path("data"), fsync="never") as store:
            rel = store.create_relation("r", pa.schema([("id", pa.int64())]), key=["id"])
            rel.append(pa.table({"id": pa.array(np.arange(1000)),
                                 "_time": pa.array(np.zeros(1000, dtype=np.uint64)),
                                 "_diff": pa.array(np.ones(1000, dtype=np.int64))}))
            rel.seal(1)
            assert rel.snapshot().num_rows == 1000
        assert advised(big())
    """, tmp_path)


def _fresh(body: str, tmp_path: Path, **env: str) -> None:
    """Run ``body`` in a fresh interpreter (no smaps needed); its asserts are the test's."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body) + '\nprint("OK")\n'], check=False,
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "OK", done.stdout


ARROW_POOL = """
    import pyarrow as pa

    from lamina.hugepages import small_pages

    assert pa.default_memory_pool().backend_name == "mimalloc"
    with small_pages():
        assert pa.default_memory_pool().backend_name == "jemalloc"
        kept = pa.array(range(100_000))  # allocated from jemalloc, freed after the exit
        with small_pages():  # nested: the inner exit keeps jemalloc
            pass
        assert pa.default_memory_pool().backend_name == "jemalloc"
    assert pa.default_memory_pool().backend_name == "mimalloc"
    assert kept.sum().as_py() == sum(range(100_000))
    del kept
"""


def test_arrow_allocates_from_jemalloc_inside_and_the_pool_comes_back(tmp_path: Path) -> None:
    import pyarrow as pa

    if pa.default_memory_pool().backend_name != "mimalloc":
        pytest.skip("this pyarrow's default pool is not mimalloc")
    _fresh(ARROW_POOL, tmp_path, ARROW_DEFAULT_MEMORY_POOL="mimalloc")


def test_a_pool_the_user_chose_is_left_alone(tmp_path: Path) -> None:
    _fresh("""
        import pyarrow as pa

        from lamina.hugepages import small_pages

        with small_pages():
            assert pa.default_memory_pool().backend_name == "system"
        assert pa.default_memory_pool().backend_name == "system"
    """, tmp_path, ARROW_DEFAULT_MEMORY_POOL="system")


def test_a_snapshot_decodes_and_merges_from_jemalloc(tmp_path: Path) -> None:
    """A fresh interpreter's snapshot of a string-keyed relation (the general merge, not
    packed keys) and of its converted trace: Arrow's mimalloc pool allocates nothing
    during either, jemalloc holds the rows, and the default pool is mimalloc again after."""
    import pyarrow as pa

    if pa.default_memory_pool().backend_name != "mimalloc":
        pytest.skip("this pyarrow's default pool is not mimalloc")
    _fresh("""
        import pyarrow as pa

        from lamina import Store
        from lamina.datadir import DataDir
        from lamina.trace.trace import Trace
        from tests.trace.helpers import convert

        n = 200_000
        from pathlib import Path

        with Store.open(Path("data"), fsync="never", segment_bytes=1 << 20) as store:
            rel = store.create_relation("r", pa.schema([("id", pa.int64()),
                                                        ("item", pa.string())]), key=["id"])
            for t in range(4):
                rel.append(pa.table({"id": pa.array(range(n)),
                                     "item": pa.array([f"v{i % 997}-{t}" for i in range(n)]),
                                     "_time": pa.array([t] * n, pa.uint64()),
                                     "_diff": pa.array([1] * n, pa.int64())}))
                rel.seal(t + 1)
        layout = DataDir(Path("data"))
        trace = Trace.open(layout.trace_store("r"), layout.relation("r").meta)
        convert(trace, layout.wal_dir("r"), per_plan=64)
        mimalloc, jemalloc = pa.mimalloc_memory_pool(), pa.jemalloc_memory_pool()
        before = mimalloc.bytes_allocated()
        with Store.open(Path("data"), read_only=True) as store:
            rows = store.relation("r").snapshot()
        assert rows.num_rows == 4 * n
        assert jemalloc.max_memory() >= rows.nbytes
        assert mimalloc.bytes_allocated() == before
        assert pa.default_memory_pool().backend_name == "mimalloc"
    """, tmp_path, ARROW_DEFAULT_MEMORY_POOL="mimalloc",
        PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
