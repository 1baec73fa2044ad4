"""Every trace step through an unreliable object store (persist's ``UnreliableBlob``
drill): conversions, merges, segment retirement and garbage collection run through
:class:`~lamina.testing.unreliable.UnreliableStore`, which fails, times out and loses the
responses of a seeded share of every kind of request. The driver does what the compacter
does after a failed pass: it reopens the trace from storage (the state in memory may be
behind a publication whose response was lost) and tries again.

However the faults fall, nothing is lost or doubled: every snapshot equals the oracle's,
the state loads and passes every invariant, and a final collection leaves exactly the
objects the state names. On a directory and on S3.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lamina.errors import StorageError
from lamina.store import Store
from lamina.testing.unreliable import UnreliableStore
from lamina.trace.trace import Trace
from tests.trace.helpers import (
    KEY,
    NAME,
    SCHEMA,
    Oracle,
    append_rounds,
    check_snapshots,
    check_trace,
    collect_all,
    data_files,
    pending_spans,
    recover,
    run_step,
)

ATTEMPTS = 400


@pytest.mark.parametrize("seed", [1, 2])
def test_steps_through_an_unreliable_store_lose_and_double_nothing(
        tmp_path: Path, trace_url: str | None, seed: int) -> None:
    oracle = Oracle()
    with Store.open(tmp_path, segment_bytes=4096, fsync="never", trace_url=trace_url) as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        unreliable = UnreliableStore(store.layout.trace_store(NAME), seed=seed)
        for op in ("get", "get_range", "put", "create", "list", "delete"):
            unreliable.inject(op, "fail", probability=0.04)
            unreliable.inject(op, "lose_response", probability=0.04)
        unreliable.inject("create", "timeout", probability=0.05)
        trace: Trace | None = None
        failures = 0
        for r in range(6):
            append_rounds(rel, oracle, 8, 8 * r)
            oracle.allow_compaction(rel, max(oracle.since, oracle.upper - 6))
            for step in ("convert", "merge", "gc"):
                for _ in range(ATTEMPTS):
                    try:
                        if trace is None:  # what the compacter does after a failed pass
                            trace = Trace.open(unreliable, rel.meta)
                        run_step(step, trace, rel.wal_dir)
                        break
                    except StorageError:
                        failures += 1
                        trace = None
                else:
                    raise AssertionError(f"{step} never got through the faults")
            check_snapshots(rel, oracle)
        assert failures >= 5, "the faults should have struck"
        assert {i.action for i in unreliable.injected} >= {"fail", "lose_response"}
        unreliable.clear()
        traces = store.layout.trace_store(NAME)
        done = recover(traces, rel.wal_dir, rel.meta)
        assert not pending_spans(done, rel.wal_dir)
        collect_all(done)
        state = check_trace(traces, rel.meta)
        assert state is not None
        assert data_files(traces) == state.files()
        check_snapshots(rel, oracle)
