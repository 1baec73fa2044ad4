"""One OpenBLAS thread in lamina's own processes.

numpy loads OpenBLAS, and OpenBLAS, as it loads, starts a thread per core that spins for a
while waiting for work. lamina sorts, sums and compares with numpy but calls no BLAS
routine (no matrix product, no linear algebra), so in a lamina process those threads only
burn CPU: importing numpy took 0.26 to 0.29 s of user CPU on this 2-core machine, and 0.14
to 0.16 s with ``OPENBLAS_NUM_THREADS=1`` (three fresh interpreters each, 2026-11-29). A
process that lives long pays it once; the processes that start often pay it every time:
each ``lamina`` command, each life of a drill's coordinator and daemon, each process a
supervisor restarts. A drill of 40 coordinator kills (``lamina drill --kills 40
--daemon-share 0 --executor inprocess --relations 12``) took 54 CPU-s without the setting
and 42 with it (docs/reliability.md, "One OpenBLAS thread per process").

OpenBLAS reads the variable once, when it loads, so it must be in the environment before
numpy's first import: the command line sets it first thing (:mod:`lamina.cli`, imported
before any module of lamina that imports numpy; ``import lamina`` imports none), and the
processes a command starts (a drill's coordinators and daemons, the daemon's Spark driver
and local Python workers) inherit it. An operator's own value wins. A program that
imports lamina as a library is left as it is: importing lamina changes no environment.
Spark's Python workers get ``OMP_NUM_THREADS`` from PySpark (the task's cores), which
OpenBLAS reads after this variable.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

VARIABLE = "OPENBLAS_NUM_THREADS"


def one_thread(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set :data:`VARIABLE` to 1 in ``environ`` unless it is set already."""
    environ.setdefault(VARIABLE, "1")
