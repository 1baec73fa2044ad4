"""A stateful property test of the whole write-and-compact cycle against an oracle.

Hypothesis drives a relation through random appends (present and future times,
retractions, repeated rows), seals, since advances, conversions of 1..3 finished segments
in one plan, single merges and merges to completion, garbage collection with no grace
period, deletion of converted segments and reopenings of the store and of the trace. After
every step it proves:

- the state on disk is the writer's state and passes every state and data invariant
  (lamina.trace.invariants: contiguous batches, levels, since, sorted consolidated rows,
  checksums);
- ``rel.snapshot(as_of)`` equals the oracle's snapshot (the model of docs/architecture.md, computed
from a list of
  every update ever appended) at several ``as_of`` across ``[since, upper)``: nothing is
  lost, counted twice or applied early, whatever mix of WAL, batches and pending parts
  holds the updates;
- once merging is done, the batch count stays within ``2*log2(conversions) + 2``;
- the pending area stays bounded.

It runs twice: with the trace under the data directory, and (fewer examples) with the
trace on the test S3 server, where every state, part and pending part is an object.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from lamina.compacter.executors import reference
from lamina.frontier import CLOSED
from lamina.store import Relation, Store
from lamina.trace import pending
from lamina.trace.invariants import check_data, check_state
from lamina.trace.plan import plan_conversion, plan_merge
from lamina.trace.state import StateStore
from lamina.trace.trace import Trace

if TYPE_CHECKING:
    from tests.objstore.s3server import S3Server
from tests.trace.helpers import (
    KEY,
    NAME,
    SCHEMA,
    NoSyncFileSystem,
    Oracle,
    Update,
    batch_bound,
    check_snapshots,
    collect_all,
    convert,
    pending_spans,
)

settings.register_profile(
    "trace-state-machine", max_examples=25, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

ITEMS = ["a", "b", "c"]


class TraceMachine(RuleBasedStateMachine):
    """One relation, its WAL (4 KiB segments), its trace and an oracle of every update."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="lamina-sm-"))
        self.fs = NoSyncFileSystem()  # durability is the crash suites' business
        self.store = Store.open(self.root, segment_bytes=4096, fsync="never", fs=self.fs,
                                trace_url=self.trace_url())
        self.rel: Relation = self.store.create_relation(NAME, SCHEMA, key=KEY)
        self.trace = self._open_trace()
        self.oracle = Oracle()
        self.conversions = 0
        self.steps = 0
        self.checked: set[str] = set()  # batch ids and pending paths whose data was checked

    def _open_trace(self) -> Trace:
        return Trace.open(self.store.layout.trace_store(NAME, self.fs), self.rel.meta, fs=self.fs)

    def trace_url(self) -> str | None:
        """Where this example's trace lives (None: under the data directory)."""
        return None

    def teardown(self) -> None:
        # Coverage, shown by --hypothesis-show-statistics.
        state = self.trace.state
        event(f"conversions: {min(self.conversions, 8)}{'+' if self.conversions >= 8 else ''}")
        event(f"max level: {max((b.level for b in state.batches), default=-1)}")
        event(f"pending parts at the end: {min(len(state.pending), 3)}")
        event(f"closed: {self.oracle.upper == CLOSED}")
        event(f"since advanced: {self.oracle.since > 0}")
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)

    @initialize(data=st.data(), first=st.integers(0, 5), rounds=st.integers(4, 20))
    def start(self, data: st.DataObject, first: int, rounds: int) -> None:
        """Relations start at upper 0; sometimes seal a little before the first append.
        Most runs start with a history of a few segments, so the compacter has work."""
        if first:
            self.oracle.seal(self.rel, first)
        self._rounds(data, rounds)

    # --- the coordinator ----------------------------------------------------------------
    @precondition(lambda self: self.oracle.upper < CLOSED)
    @rule(data=st.data(), n=st.integers(1, 6), repeat=st.booleans())
    def append(self, data: st.DataObject, n: int, repeat: bool) -> None:
        """One append call of ``n`` rows (see :meth:`_append`)."""
        self._append(data, n, repeat)

    @precondition(lambda self: self.oracle.upper < CLOSED)
    @rule(data=st.data(), rounds=st.integers(2, 6))
    def burst(self, data: st.DataObject, rounds: int) -> None:
        """Several rounds of append then seal: a busy coordinator, filling segments
        (about six appends fill a 4 KiB segment) so conversions have work."""
        self._rounds(data, rounds)

    def _rounds(self, data: st.DataObject, rounds: int) -> None:
        for _ in range(rounds):
            self._append(data, data.draw(st.integers(1, 4), label="n"), repeat=False)
            self.oracle.seal(self.rel, self.oracle.upper + data.draw(st.integers(1, 3),
                                                                     label="step"))

    def _append(self, data: st.DataObject, n: int, repeat: bool) -> None:
        """Rows at the upper or in the future (up to 40 ahead), diffs of either sign;
        sometimes retracting rows that exist, sometimes repeating a row in one call."""
        upper = self.oracle.upper
        known = sorted({(k, item) for k, item, _, _ in self.oracle.updates})
        rows: list[Update] = []
        for _ in range(n):
            retract: bool = bool(known) and data.draw(st.booleans(), label="retract")
            if retract:
                k, item = data.draw(st.sampled_from(known), label="existing row")
                diff = -data.draw(st.integers(1, 2), label="retraction")
            else:
                k = data.draw(st.integers(0, 4), label="id")
                item = data.draw(st.sampled_from(ITEMS), label="item")
                diff = data.draw(st.integers(-2, 3), label="diff")
            dt = data.draw(st.one_of(st.integers(0, 3), st.integers(0, 40)), label="ahead")
            rows.append((k, item, upper + dt, diff))
        if repeat:
            rows.append(rows[0])
        self.oracle.append(self.rel, rows)

    @precondition(lambda self: self.oracle.upper < CLOSED)
    @rule(step=st.integers(1, 6), dice=st.integers(0, 15))
    def seal(self, step: int, dice: int) -> None:
        """Advance the upper; rarely (late in a run) close the relation for ever: the
        empty frontier, converted to a batch ending at 2**64, future updates and all."""
        if dice == 11 and self.steps > 15:
            self.oracle.seal(self.rel, CLOSED)
        else:
            self.oracle.seal(self.rel, self.oracle.upper + step)

    @precondition(lambda self: self.oracle.since < self.oracle.upper)
    @rule(step=st.integers(1, 8))
    def allow_compaction(self, step: int) -> None:
        self.oracle.allow_compaction(self.rel, min(self.oracle.since + step, self.oracle.upper))

    # --- the compacter ------------------------------------------------------------------
    @precondition(lambda self: bool(pending_spans(self.trace, self.rel.wal_dir)))
    @rule(k=st.integers(1, 3))
    def convert(self, k: int) -> None:
        """One conversion of the next 1..k finished segments (one batch). The segments
        stay until a later step deletes them: readers must skip converted segments."""
        spans = pending_spans(self.trace, self.rel.wal_dir)[:k]
        reference.convert(self.trace, plan_conversion(self.trace.state, spans))
        self.conversions += 1

    @precondition(lambda self: bool(pending_spans(self.trace, self.rel.wal_dir)))
    @rule(k=st.integers(1, 3), delete=st.booleans())
    def compact(self, k: int, delete: bool) -> None:
        """The compacter's cycle: convert every finished segment, ``k`` per batch, merging
        to completion after each conversion; then delete the converted segments (or not).
        """
        self.conversions += convert(self.trace, self.rel.wal_dir, per_plan=k)
        assert len(self.trace.state.batches) <= batch_bound(self.conversions)
        if delete:
            self.trace.delete_converted_segments(self.rel.wal_dir)
            assert not pending_spans(self.trace, self.rel.wal_dir)

    @precondition(lambda self: plan_merge(self.trace.state) is not None)
    @rule(everything=st.booleans())
    def merge(self, everything: bool) -> None:
        """One merge step, or merges until no two adjacent batches share a level."""
        while (plan := plan_merge(self.trace.state)) is not None:
            reference.merge(self.trace, plan)
            if not everything:
                return
        assert len(self.trace.state.batches) <= batch_bound(self.conversions)

    @rule(keep=st.integers(1, 3), delete=st.booleans())
    def collect_garbage(self, keep: int, delete: bool) -> None:
        """Garbage collection with no grace period, keeping ``keep`` state versions, after
        deleting the converted segments (or not)."""
        if delete:
            self.trace.delete_converted_segments(self.rel.wal_dir)
        collect_all(self.trace, keep_versions=keep)
        versions = self.trace.states.versions()
        assert len(versions) <= keep
        if versions:
            assert versions[-1] == self.trace.state.version

    @rule(store=st.booleans(), trace=st.booleans())
    def reopen(self, store: bool, trace: bool) -> None:
        """Restart the coordinator (close and reopen the Store: the WAL writer recovers)
        and/or the compacter (the trace state is read back from disk)."""
        if store:
            self.store.close()
            self.store = Store.open(self.root, segment_bytes=4096, fsync="never", fs=self.fs)
            self.rel = self.store.relation(NAME)
        if trace:
            before = self.trace.state
            self.trace = self._open_trace()
            assert self.trace.state == before

    # --- what must hold after every step --------------------------------------------------
    @invariant()
    def trace_is_sound(self) -> None:
        self.steps += 1
        state = self.trace.state
        on_disk = StateStore(self.trace.store).load_latest()
        if on_disk is not None:
            assert on_disk == state
        else:
            assert state.version == 0
        check_state(state)
        # Files are immutable: read each batch and pending part once, when it appears.
        fresh = replace(state, batches=tuple(b for b in state.batches
                                             if b.id not in self.checked),
                        pending=tuple(p for p in state.pending
                                      if p.part.path not in self.checked))
        check_data(self.trace.store, fresh, self.rel.meta)
        self.checked.update(b.id for b in fresh.batches)
        self.checked.update(p.part.path for p in fresh.pending)
        assert len(state.pending) <= pending.MAX_PARTS + 65
        if plan_merge(state) is None:
            assert len(state.batches) <= batch_bound(self.conversions)

    @invariant()
    def snapshots_match_oracle(self) -> None:
        assert (self.rel.upper, self.rel.since) == (self.oracle.upper, self.oracle.since)
        check_snapshots(self.rel, self.oracle, self.oracle.as_of_points(3))


TraceMachine.TestCase.settings = settings.get_profile("trace-state-machine")
TestTraceMachine = pytest.mark.slow(TraceMachine.TestCase)  # about a minute


class S3TraceMachine(TraceMachine):
    """The same machine with the trace on the test S3 server, a bucket per example."""

    server: ClassVar[S3Server | None] = None

    def __init__(self) -> None:
        super().__init__()
        assert self.trace.store.url.startswith("s3://"), self.trace.store.url

    def trace_url(self) -> str | None:
        assert self.server is not None, "the s3_machine fixture sets the server"
        return f"s3://{self.server.make_bucket()}/sm"


@pytest.fixture
def s3_machine(s3_server: S3Server, s3_bucket: str) -> Iterator[None]:
    """The S3 server for S3TraceMachine (``s3_bucket`` sets the AWS environment)."""
    S3TraceMachine.server = s3_server
    yield
    S3TraceMachine.server = None


settings.register_profile(
    "trace-state-machine-s3", max_examples=6, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
S3TraceMachine.TestCase.settings = settings.get_profile("trace-state-machine-s3")
TestS3TraceMachine = pytest.mark.usefixtures("s3_machine")(S3TraceMachine.TestCase)
