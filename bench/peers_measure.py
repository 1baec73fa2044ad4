"""What every contender of :mod:`bench.peers_contenders` measures with.

- :func:`proc_io`: a process's ``/proc/<pid>/io`` counters (``write_bytes`` is what
  reached the block layer, page-cache writeback included).
- :func:`tree_usage`: CPU seconds and ``write_bytes`` of a process and its living
  descendants (lamina's daemon and its Spark JVM).
- :func:`disk` and :class:`DiskSampler`: apparent bytes and file count under a directory,
  at the end and at the peak (sampled every 0.25 s on a thread while the run goes on).
- :func:`fsync_path`: fsync of a file or directory by path.
- :func:`latencies`: p50, p99 and max of per-append latencies, and their growth (median
  of the last tenth over the first tenth).
- :func:`timed_reads`: a read's first call in the process (cold: the allocator has not
  grown yet, code paths are cold), timed apart, then the median wall time of ``READS``
  more calls, and the last answer.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench.procs import Sampler

READS = 5
"""How many times each read is repeated after its first call (their median is reported;
five, because single reads on this shared two-core machine vary by 2x and more)."""


def proc_io(pid: int | str = "self") -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def tree_usage(pid: int) -> dict[str, float]:
    """CPU seconds and bytes written by a process and its descendants (living ones)."""
    cpu = 0.0
    written = 0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {"cpu_seconds": 0.0, "write_bytes": 0}
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            t = p.cpu_times()
            cpu += t.user + t.system
            written += proc_io(p.pid)["write_bytes"]
    return {"cpu_seconds": cpu, "write_bytes": written}


def disk(path: Path) -> tuple[int, int]:
    """Bytes (apparent sizes) and files under ``path``."""
    total = files = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(dirpath, n)).st_size
                files += 1
    return total, files


class DiskSampler(Sampler):
    """The peak of :func:`disk` while it runs, sampled every 0.25 s and once more at the
    end."""

    def __init__(self, path: Path) -> None:
        super().__init__(0.25)
        self.path = path
        self.peak_bytes = self.peak_files = 0

    def sample(self) -> None:
        b, f = disk(self.path)
        self.peak_bytes, self.peak_files = max(self.peak_bytes, b), max(self.peak_files, f)

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.sample()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latencies(values: list[float]) -> dict[str, float]:
    a = np.array(values)
    tenth = max(1, len(a) // 10)
    first, last = float(np.median(a[:tenth])), float(np.median(a[-tenth:]))
    return {"p50_ms": round(float(np.percentile(a, 50)) * 1e3, 3),
            "p99_ms": round(float(np.percentile(a, 99)) * 1e3, 3),
            "max_ms": round(float(a.max()) * 1e3, 3),
            "first_tenth_p50_ms": round(first * 1e3, 3),
            "last_tenth_p50_ms": round(last * 1e3, 3),
            "growth": round(last / first, 3) if first > 0 else 0.0}


def timed_reads(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """``fn``'s first call's wall time, the median of ``READS`` more, and the last answer.
    The first call pays for the process's first large allocations (page faults while
    the allocator grows) and cold code paths; the median is a warm process's read."""
    started = time.perf_counter()
    out = fn()
    first = time.perf_counter() - started
    times = []
    for _ in range(READS):
        started = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - started)
    return first, float(np.median(times)), out
