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

Fork server (one process start for many crashes)::

    python crash_child.py --serve STEP

reads lines ``CRASH_AT DATA_DIR`` on stdin; for each it forks a child that runs the step
as above (its JSON goes to ``DATA_DIR.json``) and answers with one line, the child's raw
wait status. The server imports everything once and must be single-threaded when it
forks (pyarrow's jemalloc background thread and numpy's OpenBLAS pool are turned off
through the environment; the server refuses to fork otherwise), so each crash costs a
fork instead of an interpreter start.

The repository root must be on PYTHONPATH (for ``tests.trace.helpers``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
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


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def serve(step: str) -> None:
    if threads() != 1:
        raise SystemExit(f"fork server has {threads()} threads; forking it would be unsafe "
                         f"(set {SINGLE_THREAD_ENV})")
    for line in sys.stdin:
        crash_at, root = line.split(maxsplit=1)
        root = root.strip()
        pid = os.fork()
        if pid == 0:  # the child: run the step, never return into the server loop
            code = 0
            try:
                Path(f"{root}.json").write_text(run(step, Path(root), int(crash_at)))
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(status, flush=True)


def main(argv: list[str]) -> None:
    if argv[0] == "--serve":
        serve(argv[1])
    else:
        print(run(argv[0], Path(argv[1]), int(argv[2])))


if __name__ == "__main__":
    main(sys.argv[1:])
