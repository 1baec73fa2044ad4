"""A function mapped over items on a few threads, results in item order: how the read
path decodes parts (:mod:`lamina.read.snapshot`) and merges key ranges
(:func:`lamina.consolidate.merge_runs`, :func:`lamina.packed.merge_packed`) on every core.

Not ``concurrent.futures.ThreadPoolExecutor``: a snapshot in a fresh process is a
benchmarked figure (``bench.cold_read``), and that import brings ``logging``,
``traceback`` and ``string`` with it, 6 to 11 ms against a read of about 300 ms (the
minimum and the median of 21 fresh interpreters each, 2026-11-29). What the read path
needs is smaller than a pool: a few threads that live for one call, the calling thread one
of them, the work itself in Arrow and numpy kernels that release the GIL.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

T = TypeVar("T")
R = TypeVar("R")


def map_on_threads(fn: Callable[[T], R], items: Sequence[T], *, name: str,
                   workers: int | None = None) -> list[R]:
    """``[fn(x) for x in items]`` on ``workers`` threads (default: one per item), the
    calling thread one of them and the others new (named ``name-1``, ``name-2``, ...);
    each thread takes the next item not yet taken, in order. Every thread is joined
    before it returns or raises. Once an item raised no thread takes another, and the
    exception of the first item that raised, in item order, is re-raised, as
    ``ThreadPoolExecutor.map`` would."""
    results: list[R | None] = [None] * len(items)
    errors: list[BaseException | None] = [None] * len(items)
    taken = itertools.count()  # next() on it is atomic: one C call under the GIL
    failed = threading.Event()

    def run() -> None:
        while not failed.is_set() and (i := next(taken)) < len(items):
            try:
                results[i] = fn(items[i])
            except BaseException as exc:  # re-raised on the calling thread, after the joins
                errors[i] = exc
                failed.set()

    count = len(items) if workers is None else max(1, min(workers, len(items)))
    threads = [threading.Thread(target=run, name=f"{name}-{i}", daemon=True)
               for i in range(1, count)]
    for t in threads:
        t.start()
    try:
        run()
    finally:
        for t in threads:
            t.join()
    for exc in errors:
        if exc is not None:
            raise exc
    return cast("list[R]", results)  # every slot was set: nothing raised
