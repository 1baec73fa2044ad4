"""Child processes of tests/trace/test_crash_points.py: run one compacter step on a data
directory through a fault-injecting file system.

One shot::

    python crash_child.py STEP DATA_DIR CRASH_AT

STEP is ``convert`` (one conversion of every finished segment, then deletion of the
converted segments), ``merge`` (merges until done) or ``gc`` (garbage collection keeping
one state version, no grace period). CRASH_AT 0 is the dry run: every file operation is
counted and listed. Otherwise the process kills itself with SIGKILL right before file
operation number CRASH_AT (a number beyond the step's count is a normal run). A run that
completes prints ``{"ops": <count>, "log": [...]}`` as JSON on stdout.

Forked (one process start for many crashes): ``crash_child:forked`` is the target of a
:mod:`lamina.forkserver` server that preloads this module, started with
:data:`SINGLE_THREAD_ENV` (OpenMP off as well as the server's own two pools, so the count
of file operations is the same every run). ``forked([STEP, DATA_DIR, CRASH_AT])`` runs the
step as above and writes its JSON to ``DATA_DIR.json`` instead of stdout.

The repository root must be on PYTHONPATH (for ``tests.trace.helpers``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lamina.store import Store
from lamina.testing.faults import CountingFileSystem, CrashingFileSystem, InjectingFileSystem
from lamina.trace.trace import Trace
from tests.trace import helpers
from tests.trace.helpers import NAME

SINGLE_THREAD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
                     "JE_ARROW_MALLOC_CONF": "background_thread:false"}


def run_step(step: str, root: Path, fs: InjectingFileSystem) -> None:
    """Run ``step`` on the relation of the data directory ``root`` with ``fs``."""
    store = Store.open(root, fs=fs)
    rel = store.relation(NAME)
    trace = Trace.open(store.layout.trace_store(NAME, fs), rel.meta, fs=fs)
    try:
        helpers.run_step(step, trace, rel.wal_dir)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc


def run(step: str, root: Path, crash_at: int) -> str:
    """Run the step with the file system CRASH_AT asks for; the result as JSON."""
    fs: InjectingFileSystem = (CountingFileSystem() if crash_at == 0
                               else CrashingFileSystem(crash_at))
    run_step(step, root, fs)
    return json.dumps({"ops": fs.count, "log": [str(op) for op in fs.ops]})


def forked(argv: list[str]) -> None:
    """The fork server's target: the one-shot run, its JSON to ``DATA_DIR.json``."""
    step, root, crash_at = argv
    Path(f"{root}.json").write_text(run(step, Path(root), int(crash_at)))


def main(argv: list[str]) -> None:
    print(run(argv[0], Path(argv[1]), int(argv[2])))


if __name__ == "__main__":
    main(sys.argv[1:])
