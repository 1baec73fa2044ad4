"""Child process of tests/trace/test_cas.py: one of two compacters racing on one trace.

    python cas_child.py DATA_DIR

Line protocol on stdin/stdout, one round at a time:

- ``convert`` or ``merge``: reload the trace state from disk, plan the step from it and
  write the step's data files, then answer ``ready <version planned from>``;
- ``go``: commit (publish version + 1 with compare-and-set) and answer ``won <version>``
  (after deleting the segments a won conversion converted) or ``lost`` on
  StateConflictError, in which case this writer's in-memory state is stale: it stops
  until the next round reloads from disk;
- end of input: exit 0.

The repository root must be on PYTHONPATH (for ``tests.trace.helpers``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from lamina.compacter.executors import reference
from lamina.errors import StateConflictError
from lamina.store import Store
from lamina.trace.plan import plan_conversion, plan_merge
from lamina.trace.trace import Trace
from tests.trace.helpers import NAME, pending_spans


def answer(line: str) -> None:
    print(line, flush=True)


def main(root: Path) -> None:
    store = Store.open(root)
    rel = store.relation(NAME)
    trace_dir = store.layout.trace_store(NAME)
    commands = iter(sys.stdin)
    for command in commands:
        trace = Trace.open(trace_dir, rel.meta)
        planned_from = trace.state.version
        if command.strip() == "convert":
            conversion = plan_conversion(trace.state, pending_spans(trace, rel.wal_dir))
            parts, pending = reference.run_conversion(trace, conversion)
            answer(f"ready {planned_from}")
            assert next(commands).strip() == "go"
            try:
                trace.commit_conversion(conversion, parts, pending)
            except StateConflictError:
                answer("lost")
                continue
            trace.delete_converted_segments(rel.wal_dir)
        else:
            merge = plan_merge(trace.state)
            assert merge is not None
            merged = reference.run_merge(trace, merge)
            answer(f"ready {planned_from}")
            assert next(commands).strip() == "go"
            try:
                trace.commit_merge(merge, merged)
            except StateConflictError:
                answer("lost")
                continue
        answer(f"won {trace.state.version}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
