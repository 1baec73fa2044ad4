"""Short-lived numpy temporaries without transparent huge pages.

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
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np


def _switch() -> Callable[[bool], bool] | None:
    for path in ("_core", "core"):  # numpy 2, numpy 1
        module = getattr(np, path, None)
        found = getattr(getattr(module, "multiarray", None), "_set_madvise_hugepage", None)
        if callable(found):
            return found  # type: ignore[no-any-return]
    return None


class _Hint:
    """numpy's hint, off while any :func:`small_pages` is entered."""

    def __init__(self, switch: Callable[[bool], bool] | None) -> None:
        self._switch = switch
        self._lock = threading.Lock()
        self._depth = 0
        self._before = True

    def enter(self) -> None:
        if self._switch is None:
            return
        with self._lock:
            if self._depth == 0:
                self._before = bool(self._switch(False))
            self._depth += 1

    def exit(self) -> None:
        if self._switch is None:
            return
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._switch(self._before)


_HINT = _Hint(_switch())


@contextmanager
def small_pages() -> Iterator[None]:
    """numpy's large allocations inside go without ``MADV_HUGEPAGE`` (module
    docstring); nested and concurrent uses restore the setting once, at the last exit."""
    _HINT.enter()
    try:
        yield
    finally:
        _HINT.exit()
