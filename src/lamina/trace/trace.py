"""A relation's trace: its state versions and the steps that advance them.

:class:`Trace` is the only writer of a trace (the compacter, or tests); the trace is an
:class:`~lamina.objstore.base.ObjectStore` rooted at the relation (a directory or an S3
prefix, :meth:`lamina.datadir.DataDir.trace_store`). It holds
the newest state in memory, and every step follows the crash-safety rules of docs/architecture.md:

1. data files of the step are written and synced (by an executor: reference or Spark),
2. the next state version is published with compare-and-set,
3. only then are inputs deleted (WAL segments now converted; merged parents' files are
   left to garbage collection, since readers of older versions may still read them).

Garbage collection (:meth:`Trace.collect_garbage`) prunes state versions beyond ``keep``
(and, if asked, those superseded less than ``keep_versions_seconds`` ago), never a version
a live read lease holds (lamina.trace.lease: what keeps a read's files alive), and deletes
data objects that no kept version names (and leftovers of failed writes), once they are
older than a grace period (an object younger than that may belong to a step still
running), and the objects of leases that expired longer ago than that. One pass lists
``state/`` once, then ``leases/`` once (every lease is in its key: none is read), then
each data directory; it reads only the kept versions it has not read before (a version
never changes). It lists and deletes through the store, so it is the same on every
storage.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from lamina import failpoints
from lamina.errors import StalePlanError
from lamina.fs import FileSystem
from lamina.layout import TraceLayout
from lamina.objstore.base import ObjectStore
from lamina.schema import RelationMeta
from lamina.trace.batch import BatchDesc, PartFile
from lamina.trace.invariants import check_state
from lamina.trace.lease import scan as lease_scan
from lamina.trace.plan import ConversionPlan, MergePlan, merged_level
from lamina.trace.staging import retire_staged
from lamina.trace.state import PendingPart, StateStore, TraceState
from lamina.wal.retire import delete_converted


@dataclass(frozen=True)
class GcReport:
    versions_deleted: int
    files_deleted: int
    bytes_deleted: int
    versions_leased: int = 0
    """State versions that live read leases held when it ran: what they name is kept until
    they end, so a later pass has something to do (the daemon schedules one)."""


class Trace:
    """The writer's handle on one relation's trace (``fs``: the WAL's storage layer, for
    deleting converted segments)."""

    def __init__(self, store: ObjectStore, meta: RelationMeta, fs: FileSystem,
                 state: TraceState) -> None:
        self.store = store
        self.meta = meta
        self.fs = fs
        self.states = StateStore(store)
        self._state = state
        self._named: dict[int, frozenset[str]] = {}  # files each version names (GC)

    @classmethod
    def open(cls, store: ObjectStore, meta: RelationMeta, fs: FileSystem | None = None
             ) -> Trace:
        """Load the newest state (checking invariants). A trace left by a dropped relation of
        the same name (another ``relation_id``) is removed first.

        The state versions are made durable before the state is used (``sync``: on a
        directory, its fsync): the newest version may have been published by a writer that
        died (or whose fsync failed) before it fsynced the directory, and this writer
        deletes the inputs that version replaced (crash-safety rule 3,
        docs/architecture.md), which must never become durable before the version itself."""
        fs = fs or FileSystem()
        states = StateStore(store)
        state = states.load_latest()
        if state is not None and state.relation_id != meta.relation_id:
            store.delete_prefix("")
            state = None
        if state is None:
            state = TraceState.empty(meta.name, meta.relation_id)
        else:
            states.sync()
        check_state(state, states.dir)
        return cls(store, meta, fs, state)

    @property
    def state(self) -> TraceState:
        return self._state

    def _publish(self, new: TraceState) -> TraceState:
        check_state(new, self.states.dir)
        self.states.publish(new)
        self._state = new
        return new

    # --- steps --------------------------------------------------------------------------
    def commit_conversion(self, plan: ConversionPlan, parts: Iterable[PartFile],
                          new_pending: Iterable[PendingPart]) -> TraceState:
        """Compare-and-append: the batch of ``plan`` (from its written ``parts``) and the
        rewritten pending area, against the state the plan was made from."""
        st = self._state
        if st.upper != plan.lower or st.converted_through + 1 != plan.segments[0].seq:
            raise StalePlanError(
                f"conversion of segments {plan.segments[0].seq}..{plan.converted_through} was "
                f"planned at upper {plan.lower} after segment {plan.segments[0].seq - 1}, but "
                f"the trace {self.states.dir} is at upper {st.upper} after segment "
                f"{st.converted_through}; nothing was committed: plan again from this state")
        batches = st.batches
        if plan.upper > plan.lower:
            batch = BatchDesc(id=plan.batch_id, lower=plan.lower, upper=plan.upper,
                              since=plan.since, level=0, parts=tuple(parts))
            batches = (*batches, batch)
        new = st.next(upper=plan.upper, since=plan.since, batches=batches,
                      converted_through=plan.converted_through,
                      pending=(*plan.keep, *new_pending))
        failpoints.hit("trace.after_batch_written")
        published = self._publish(new)
        failpoints.hit("trace.after_state_published")
        return published

    def commit_merge(self, plan: MergePlan, parts: Iterable[PartFile]) -> TraceState:
        """Replace the plan's two batches by the merged one."""
        st = self._state
        i = plan.index
        if st.batches[i:i + 2] != (plan.left, plan.right):
            raise StalePlanError(
                f"merge of batches {plan.left.id} and {plan.right.id} was planned against "
                f"batches the trace {self.states.dir} no longer has at index {i}; nothing was "
                "committed: plan again from this state")
        parts = tuple(parts)
        rows = sum(p.rows for p in parts)
        merged = BatchDesc(id=plan.batch_id, lower=plan.lower, upper=plan.upper,
                           since=plan.since, level=merged_level(plan, rows), parts=parts)
        failpoints.hit("trace.mid_merge")
        published = self._publish(st.next(batches=(*st.batches[:i], merged,
                                                   *st.batches[i + 2:])))
        failpoints.hit("trace.after_state_published")
        return published

    def delete_converted_segments(self, wal_dir: Path) -> int:
        """Delete the WAL segments this trace's published state marks converted, and their
        staged copies (only ever after publication); lamina.wal.retire keeps the one that
        holds the frontiers. Raises RelationReplacedError, deleting nothing, when
        ``wal_dir`` no longer holds this trace's relation (dropped, perhaps created again):
        the WAL's deletion checks that first, and the staged copies go after it."""
        deleted = delete_converted(wal_dir, self.meta.name, self.meta.relation_id,
                                   self._state.converted_through, self.fs)
        retire_staged(self.store, self._state.converted_through)
        return deleted

    # --- garbage collection ---------------------------------------------------------------
    def collect_garbage(self, *, keep_versions: int = 8, grace_seconds: float = 600.0,
                        keep_versions_seconds: float = 0.0,
                        now: float | None = None) -> GcReport:
        """Prune old state versions, then delete unnamed files older than the grace period.

        A version stays while it is one of the newest ``keep_versions``, while it was
        superseded less than ``keep_versions_seconds`` ago (0: by count only), or while a
        live read lease holds it; the files a kept version names stay with it. The
        versions are listed before the leases (lamina.trace.lease says why)."""
        now = time.time() if now is None else now
        cutoff = now - grace_seconds
        listed = self.states.listed()
        leases = lease_scan(self.store, now, forget_before=cutoff)
        pruned = self.states.prune(
            max(keep_versions, 1), held=leases.held, listed=listed,
            superseded_before=now - keep_versions_seconds if keep_versions_seconds > 0
            else None)
        named = set(self._state.files())
        gone = set(pruned)
        for v, _ in listed:
            if v not in gone:
                named |= self._files_of(v)
        self._named = {v: files for v, files in self._named.items() if v not in gone}
        files = nbytes = 0
        for sub in TraceLayout.DATA_DIRS:
            for obj in self.store.list(sub):
                if obj.key in named or obj.mtime >= cutoff:
                    continue
                failpoints.hit("gc.before_delete")
                self.store.delete(obj.key)
                failpoints.hit("gc.after_delete")
                files += 1
                nbytes += obj.size
        for obj in leases.expired:
            self.store.delete(obj.key)
        for sub in (*TraceLayout.DATA_DIRS, TraceLayout.STATE, TraceLayout.LEASES):
            files += self.store.sweep(sub, cutoff)
        return GcReport(versions_deleted=len(pruned), files_deleted=files, bytes_deleted=nbytes,
                        versions_leased=len(leases.held))

    def _files_of(self, version: int) -> frozenset[str]:
        """The files state ``version`` names (read once: a version never changes)."""
        files = self._named.get(version)
        if files is None:
            try:
                files = frozenset(self.states.load(version).files())
            except FileNotFoundError:
                return frozenset()
            self._named[version] = files
        return files
