"""lamina.verify beside a working compacter: segments converted and deleted while verify
reads are not "missing"; it checks again against the state that converted them."""

from __future__ import annotations

from pathlib import Path

from lamina.store import Store
from lamina.trace.trace import Trace
from lamina.verify import verify_relation
from tests.cli.test_verify import segments
from tests.trace.helpers import convert


def test_segments_converted_while_verify_reads_are_not_missing(tmp_path: Path) -> None:
    """The first segment checked triggers a conversion of the first three and their
    deletion (what the daemon does at any moment): verify's listing then names files that
    are gone and a chain that starts too early; it sees the trace moved on and checks
    again from the new state."""
    segments(tmp_path)
    listed = len(list((tmp_path / "wal" / "r").glob("*.wal*")))
    with Store.open(tmp_path) as store:
        rel = store.relation("r")
        trace = Trace.open(store.layout.trace_store("r"), rel.meta)
        calls = 0

        def daemon_meanwhile(nbytes: int) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                assert convert(trace, rel.wal_dir, per_plan=3, limit=3) == 1
                trace.delete_converted_segments(rel.wal_dir)

        report = verify_relation(store.layout, "r", daemon_meanwhile)
    assert report.ok, report.problems
    assert calls == listed + 1 + (listed - 3)  # then: the batch and the segments left
    assert (report.batches, report.segments) == (1, listed - 3)
    assert report.remedy == ""
