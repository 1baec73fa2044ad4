"""Diff bounds and overflow, end to end (issue 11).

The contract (lamina.schema, lamina.consolidate, docs/operations.md "Diff overflow"):

- an append whose ``_diff`` lies outside ``[-2**62, 2**62]`` is refused with
  DiffOutOfRangeError naming the update and the bound, and nothing is written;
- a sum outside int64 that builds up later (many appends to one row at one time, or
  ``allow_compaction`` folding times together) is kept exactly in the trace as a carry:
  conversion, merge, the daemon and ``lamina verify`` all go on, nothing is quarantined;
- a snapshot at a time where a row's sum lies outside int64 raises DiffOverflowError
  naming that row, with ``rest`` (every other row, exact) and ``overflows`` (the offending
  rows with their exact sums); snapshots at other times work, and appending a correcting
  diff at a later time makes later snapshots whole again.
"""

from __future__ import annotations

import asyncio
import os
import signal
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest

from lamina.consolidate import INT64_MAX, INT64_MIN, carries_only
from lamina.errors import (
    DiffOutOfRangeError,
    DiffOverflowError,
    InvalidArgumentError,
)
from lamina.objstore.local import LocalObjectStore
from lamina.schema import MAX_DIFF
from lamina.store import Relation, Store
from lamina.trace.batch import read_part
from lamina.trace.trace import Trace
from lamina.verify import verify_relation
from tests.conftest import ORDERS, tree_digest, updates
from tests.trace.helpers import check_trace, convert, pending_spans

BIG = "x" * 5000  # one such row pushes a 4 KiB segment past its size: it finishes at a seal


def rows_of(table: pa.Table) -> list[tuple[object, ...]]:
    return [tuple(r.values()) for r in table.to_pylist()]


def _fill(rel: Relation) -> None:
    """Rows that stay readable throughout: 1 and 2 at time 0."""
    rel.append(updates([(1, "a", 0, 1), (2, "b", 0, 1)]))
    rel.seal(1)


# --- the bound at append ------------------------------------------------------------------

@pytest.mark.parametrize("diff", [MAX_DIFF + 1, -MAX_DIFF - 1, INT64_MAX, INT64_MIN])
def test_append_refuses_a_diff_outside_the_bound(tmp_path: Path, diff: int) -> None:
    with Store.open(tmp_path / "d") as store:
        rel = store.create_relation("orders", ORDERS, key=["id"])
        _fill(rel)
        before = tree_digest(store.layout.root)
        with pytest.raises(DiffOutOfRangeError) as info:
            rel.append(updates([(3, "c", 5, 1), (4, "d", 5, diff), (5, "e", 5, diff)]))
        assert isinstance(info.value, InvalidArgumentError)
        msg = str(info.value)
        assert "'orders'" in msg
        assert "update 1 {'id': 4, 'item': 'd', '_time': 5}" in msg
        assert f"_diff {diff}" in msg
        assert "[-2**62, 2**62]" in msg
        assert "1 more updates" in msg
        assert "nothing was written" in msg
        assert tree_digest(store.layout.root) == before
        rel.seal(6)
        assert rows_of(rel.snapshot(5)) == [(1, "a", 1), (2, "b", 1)]


def test_the_bound_is_checked_in_every_chunk_and_slice() -> None:
    """check_diffs reads the diffs of a table of several chunks, sliced (its check runs
    over the value buffers): an offending diff in any chunk is found, one sliced away is
    not."""
    from lamina.schema import RelationMeta, check_diffs, conform_updates

    meta = RelationMeta.new("orders", ORDERS, ["id"])
    ok = conform_updates(meta, updates([(1, "a", 0, 1), (2, "b", 0, -MAX_DIFF)]))
    bad = conform_updates(meta, updates([(3, "c", 0, MAX_DIFF + 1), (4, "d", 0, 2)]))
    chunked = pa.concat_tables([ok, ok.slice(0, 0), bad, ok])
    assert chunked.column("_diff").num_chunks == 4
    for table in (chunked, chunked.slice(2), chunked.slice(1, 2)):
        with pytest.raises(DiffOutOfRangeError, match="update"):
            check_diffs(meta, table)
    for table in (chunked.slice(0, 2), chunked.slice(3, 3), chunked.slice(0, 0)):
        assert check_diffs(meta, table) is table


def test_the_bound_itself_is_accepted(tmp_path: Path) -> None:
    with Store.open(tmp_path / "d") as store:
        rel = store.create_relation("orders", ORDERS, key=["id"])
        rel.append(updates([(1, "a", 0, MAX_DIFF), (2, "b", 0, -MAX_DIFF)]))
        rel.seal(1)
        assert rows_of(rel.snapshot(0)) == [(1, "a", MAX_DIFF), (2, "b", -MAX_DIFF)]


def test_the_issue_case_is_refused_at_the_first_append(tmp_path: Path) -> None:
    """Two appends of 2**63 - 1 to one row at one time: the first is refused already."""
    with Store.open(tmp_path / "d") as store:
        rel = store.create_relation("orders", ORDERS, key=["id"])
        with pytest.raises(DiffOutOfRangeError):
            rel.append(updates([(7, "big", 6, INT64_MAX)]))
        assert rel.upper == 0


# --- sums that leave int64 later ------------------------------------------------------------

def _overflowing(rel: Relation) -> None:
    """Row 7 sums to 2**63 and row 8 to -3 * 2**62 at time 6; rows 1 and 2 stay sane."""
    _fill(rel)
    for _ in range(2):
        rel.append(updates([(7, "big", 6, MAX_DIFF), (8, "neg", 6, -MAX_DIFF)]))
    rel.append(updates([(8, "neg", 6, -MAX_DIFF), (9, "ok", 6, 3)]))
    rel.seal(8)


def _check_overflowing_reads(rel: Relation) -> None:
    assert rows_of(rel.snapshot(5)) == [(1, "a", 1), (2, "b", 1)]
    with pytest.raises(DiffOverflowError) as info:
        rel.snapshot(7)
    err = info.value
    assert isinstance(err, ArithmeticError)
    assert "{'id': 7, 'item': 'big'} sum to 9223372036854775808" in str(err)
    assert "1 more rows overflow too" in str(err)
    assert "'rest'" in str(err)
    assert "docs/operations.md" in str(err)
    assert err.rest is not None
    assert err.overflows is not None
    assert rows_of(err.rest) == [(1, "a", 1), (2, "b", 1), (9, "ok", 3)]
    assert err.rest.schema.field("_diff").type == pa.int64()
    assert rows_of(err.overflows) == [(7, "big", Decimal(2**63)),
                                      (8, "neg", Decimal(-3 * 2**62))]


def test_snapshot_names_the_row_and_keeps_the_rest(tmp_path: Path) -> None:
    with Store.open(tmp_path / "d") as store:
        rel = store.create_relation("orders", ORDERS, key=["id"])
        _overflowing(rel)
        before = tree_digest(store.layout.root)
        _check_overflowing_reads(rel)
        assert tree_digest(store.layout.root) == before  # a read changes nothing
        # the correction: diffs for the offending rows at a time at or after the upper
        rel.append(updates([(7, "big", 8, -1), (8, "neg", 8, MAX_DIFF)]))
        rel.seal(9)
        assert rows_of(rel.snapshot(8)) == [(1, "a", 1), (2, "b", 1), (7, "big", INT64_MAX),
                                            (8, "neg", INT64_MIN), (9, "ok", 3)]
        with pytest.raises(DiffOverflowError):
            rel.snapshot(7)  # history keeps its exact (unreadable) value


def _batch_rows(trace: Trace) -> list[tuple[object, ...]]:
    tables = [read_part(trace.store, p) for b in trace.state.batches for p in b.parts]
    rows = pa.concat_tables(tables).select(["id", "_time", "_diff"]) if tables else None
    return [] if rows is None else rows_of(rows)


def test_conversion_keeps_the_sum_as_a_carry(tmp_path: Path) -> None:
    """The reference conversion (what the in-process daemon runs) stores row 7's 2**63 as
    INT64_MAX + 1 and row 8's -3 * 2**62 as -INT64_MAX + (-2**62 - 1); the trace passes
    every invariant and reads are what they were before the conversion."""
    with Store.open(tmp_path / "d", segment_bytes=4096) as store:
        rel = store.create_relation("orders", ORDERS, key=["id"])
        _overflowing(rel)
        rel.append(updates([(20, BIG, 8, 1)]))
        rel.seal(9)
    with Store.open(tmp_path / "d", segment_bytes=4096) as store:
        rel = store.relation("orders")
        trace = Trace.open(store.layout.trace_store("orders"), rel.meta)
        assert convert(trace, rel.wal_dir) >= 1
        trace.delete_converted_segments(rel.wal_dir)
        assert not pending_spans(trace, rel.wal_dir)
        assert [r for r in _batch_rows(trace) if r[1] == 6] == [
            (7, 6, INT64_MAX), (7, 6, 1), (8, 6, -INT64_MAX), (8, 6, -(2**62) - 1), (9, 6, 3)]
        check_trace(trace.store.root, rel.meta)
        assert verify_relation(store.layout, "orders").problems == []
        _check_overflowing_reads(rel)


def test_forwarding_folds_times_into_a_carry_and_a_correction_folds_it_back(
        tmp_path: Path) -> None:
    """``allow_compaction`` folds row 7's two times (each 2**62) into one, where they sum
    to 2**63: the merge that forwards them stores a carry. A correcting update appended
    at a later time, once compaction forwards it onto the same time, folds the carry back
    into one row."""
    root = tmp_path / "d"
    with Store.open(root, segment_bytes=4096) as store:
        rel = store.create_relation("orders", ORDERS, key=["id"])
        _fill(rel)
        rel.append(updates([(7, "big", 2, MAX_DIFF), (21, BIG, 2, 1)]))
        rel.seal(3)  # each seal finishes a segment: one conversion each
        rel.append(updates([(7, "big", 4, MAX_DIFF), (22, BIG, 4, 1)]))
        rel.seal(5)
        assert rows_of(rel.snapshot(3))[2] == (7, "big", MAX_DIFF)
        rel.allow_compaction(5)
        for t in (5, 6):
            rel.append(updates([(20 + t, BIG, t, 1)]))
            rel.seal(t + 1)
    with Store.open(root, segment_bytes=4096) as store:
        rel = store.relation("orders")
        trace = Trace.open(store.layout.trace_store("orders"), rel.meta)
        assert convert(trace, rel.wal_dir, per_plan=1) == 4  # merges cascade into one batch
        trace.delete_converted_segments(rel.wal_dir)
        assert [(b.lower, b.upper, b.since) for b in trace.state.batches] == [(0, 7, 5)]
        assert [r for r in _batch_rows(trace) if r[0] == 7] == [(7, 5, INT64_MAX), (7, 5, 1)]
        check_trace(trace.store.root, rel.meta)
        # the interval keeps the carry as stored: its rows cannot be summed in int64
        assert [(r["id"], r["_time"], r["_diff"]) for r in rel.updates().to_pylist()
                if r["id"] == 7] == [(7, 5, INT64_MAX), (7, 5, 1)]
        with pytest.raises(DiffOverflowError, match="9223372036854775808") as info:
            rel.snapshot(6)
        assert info.value.rest is not None
        assert [r[0] for r in rows_of(info.value.rest)] == [1, 2, 21, 22, 25, 26]
        # correct at a later time; snapshots from then on are whole at once
        rel.append(updates([(7, "big", 7, -2), (27, BIG, 7, 1)]))
        rel.seal(8)
        assert (7, "big", 2**63 - 2) in rows_of(rel.snapshot(7))
        rel.allow_compaction(8)
        for t in (8, 9, 10):
            rel.append(updates([(20 + t, BIG, t, 1)]))
            rel.seal(t + 1)
    with Store.open(root, segment_bytes=4096) as store:
        rel = store.relation("orders")
        trace = Trace.open(store.layout.trace_store("orders"), rel.meta)
        assert convert(trace, rel.wal_dir, per_plan=1) == 4
        trace.delete_converted_segments(rel.wal_dir)
        assert [(b.lower, b.upper, b.since) for b in trace.state.batches] == [(0, 11, 8)]
        assert [r for r in _batch_rows(trace) if r[0] == 7] == [(7, 8, 2**63 - 2)]
        check_trace(trace.store.root, rel.meta)
        assert (7, "big", 2**63 - 2) in rows_of(rel.snapshot(10))


def test_carries_only_accepts_exactly_the_carry_form() -> None:
    def table(diffs: list[int]) -> pa.Table:
        return pa.table({"k": pa.array([1] * len(diffs), pa.int64()),
                         "_diff": pa.array(diffs, pa.int64())})

    assert carries_only(table([INT64_MAX, 1]), ["k"])
    assert carries_only(table([-INT64_MAX, -INT64_MAX, -3]), ["k"])
    assert carries_only(table([5]), ["k"])
    assert not carries_only(table([2, 3]), ["k"])  # fits int64: should be one row
    assert not carries_only(table([INT64_MAX, 2, -1]), ["k"])  # mixed signs
    assert not carries_only(table([2**62, 2**62, 2**62]), ["k"])  # more rows than needed


# --- the compacter daemon ------------------------------------------------------------------

def test_daemon_compacts_an_overflowing_relation_without_quarantine(tmp_path: Path) -> None:
    """The daemon (in-process executor) converts a relation whose sums leave int64 beside a
    healthy one: no quarantine, ``lamina verify`` clean, reads as specified. A relation
    quarantined for a diff overflow by an older lamina comes back by the documented step
    (remove its QUARANTINED marker)."""
    from lamina.compacter.daemon import Daemon
    from lamina.drill.procs import free_port
    from tests.compacter.backlog import backlog, settings, until

    backlog(tmp_path, "good", rounds=4)
    with Store.open(tmp_path, segment_bytes=4096) as store:
        rel = store.create_relation("orders", ORDERS, key=["id"])
        _overflowing(rel)
        rel.append(updates([(20, BIG, 8, 1)]))
        rel.seal(9)
        layout = store.layout
        layout.quarantine("orders", "conversion of 'orders' to 9: diffs of one row at one "
                          "time sum to 9223372036854775808, outside the int64 range",
                          store.fs)
    assert layout.quarantine_reason("orders") is not None
    (layout.wal_dir("orders") / "QUARANTINED").unlink()  # docs/operations.md, Diff overflow

    daemon = Daemon(settings(tmp_path, http=f"127.0.0.1:{free_port()}"))

    def caught_up(name: str) -> bool:
        with Store.open(tmp_path) as store:
            r = store.relation(name)
            trace_dir = store.layout.trace_dir(name)
            if not (trace_dir / "state").exists():
                return False
            return not pending_spans(Trace.open(LocalObjectStore(trace_dir), r.meta), r.wal_dir)

    async def run() -> int:
        task = asyncio.create_task(daemon.run())
        await until("both relations", lambda: caught_up("orders") and caught_up("good"))
        assert daemon.readiness()[0], daemon.readiness()
        os.kill(os.getpid(), signal.SIGTERM)
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(run()) == 0
    assert layout.quarantine_reason("orders") is None
    assert verify_relation(layout, "orders").problems == []
    with Store.open(tmp_path) as store:
        _check_overflowing_reads(store.relation("orders"))
