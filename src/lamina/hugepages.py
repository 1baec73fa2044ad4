"""Short-lived read temporaries without transparent huge pages: numpy's and Arrow's.

numpy asks the kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``) on every
large array it allocates. Where the kernel's THP ``defrag`` setting is ``madvise`` (the
default of many distributions, and of this project's CI machines), a fault in such a
region compacts memory synchronously until it finds a free 2 MiB block. In a process
whose memory is fragmented (one that has just streamed a few hundred MiB through its
heap and the page cache, as a coordinator has), every fault of a read's fresh
temporaries then stalls: a snapshot's first call in such a process measured 0.90 s, 0.75
s of it system time over 11,000 faults, against 0.40 s (0.18 s system) with numpy's
huge pages off (docs/performance.md, "Packed keys, and first reads without huge
pages"). A read's temporaries live for milliseconds and are walked once, so huge pages
buy them nothing.

:func:`small_pages` turns numpy's hint off while a read consolidates, and restores it when
the last read inside it ends. The switch is numpy's own, process-wide
(``_set_madvise_hugepage``, which ``NUMPY_MADVISE_HUGEPAGE`` sets at import): arrays
another thread allocates meanwhile also go without the hint, which changes their speed,
never their contents. Where this numpy has no such switch, nothing changes.

The switch governs only what numpy advises now. Advice belongs to the pages: an array
that malloc places in heap memory an earlier, advised array left free is backed by
huge pages all the same (tests/test_hugepages.py checks in fresh interpreters for that
reason).

**Arrow's buffers.** pyarrow allocates from mimalloc by default, and mimalloc reserves a
1 GiB arena and advises the whole of it for huge pages (``strace`` shows one
``madvise(..., 1073741824, MADV_HUGEPAGE)``). So every Parquet page a read decodes and
every array its merge builds is faulted in as huge pages wherever the kernel finds free 2
MiB blocks: the cold read of bench/cold_read.py (1M updates, 50,000 keys, in a fresh
process right after another process's exit) took 60 to 85 ms in some runs and 110 to 260
ms in others, those with two to three times the system time; with huge pages off for the
process (``prctl(PR_SET_THP_DISABLE)``) every run took 79 to 91 ms (docs/performance.md,
"Cold reads without huge pages"). jemalloc, which pyarrow also carries, advises nothing.
So inside :func:`small_pages` pyarrow's default pool is the jemalloc pool where the
default is mimalloc and jemalloc is built in (:func:`_arrow_pool_jemalloc`): 177 to 195 ms a cold
read, import included, against 166 to 367 ms, and warm reads at the same speed (49 against
47 to 54 ms) with 40% less resident memory. The switch is pyarrow's
(``pa.set_memory_pool``), process-wide, like numpy's: what other threads allocate
meanwhile comes from jemalloc too, and every buffer goes back to the pool it came from,
so it changes speed, never contents. A default pool the user chose (another backend, set
through ``ARROW_DEFAULT_MEMORY_POOL`` or ``pa.set_memory_pool``) is left alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pyarrow as pa


def _switch() -> Callable[[bool], bool] | None:
    for path in ("_core", "core"):  # numpy 2, numpy 1
        module = getattr(np, path, None)
        found = getattr(getattr(module, "multiarray", None), "_set_madvise_hugepage", None)
        if callable(found):
            return found  # type: ignore[no-any-return]
    return None


Undo = Callable[[], None]
"""Puts back a process-wide setting that a change took away."""


def _numpy_hint_off() -> Undo | None:
    """numpy's huge-page hint off; None where this numpy has no switch."""
    switch = _switch()
    if switch is None:
        return None
    before = bool(switch(False))

    def undo() -> None:
        switch(before)
    return undo


def _jemalloc() -> pa.MemoryPool | None:
    try:
        return pa.jemalloc_memory_pool()
    except (NotImplementedError, pa.ArrowException):  # a pyarrow built without it
        return None


def _arrow_pool_jemalloc() -> Undo | None:
    """pyarrow's default pool jemalloc instead of mimalloc (module docstring); None where
    the default is another pool (the user's choice) or jemalloc is not built in."""
    current = pa.default_memory_pool()
    replacement = _jemalloc() if current.backend_name == "mimalloc" else None
    if replacement is None:
        return None
    pa.set_memory_pool(replacement)
    return lambda: pa.set_memory_pool(current)


class _WhileEntered:
    """Process-wide changes made at the first of nested or concurrent entries and undone at
    the last exit."""

    def __init__(self, *changes: Callable[[], Undo | None]) -> None:
        self._changes = changes
        self._lock = threading.Lock()
        self._depth = 0
        self._undo: list[Undo] = []

    def enter(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._undo = [u for change in self._changes if (u := change()) is not None]
            self._depth += 1

    def exit(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                for undo in reversed(self._undo):
                    undo()
                self._undo = []


_SMALL = _WhileEntered(_numpy_hint_off, _arrow_pool_jemalloc)


@contextmanager
def small_pages() -> Iterator[None]:
    """numpy's large allocations inside go without ``MADV_HUGEPAGE``, and Arrow's come
    from jemalloc rather than mimalloc (module docstring); nested and concurrent uses
    restore both settings once, at the last exit."""
    _SMALL.enter()
    try:
        yield
    finally:
        _SMALL.exit()
