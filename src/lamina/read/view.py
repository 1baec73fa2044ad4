"""Pinning: the state-first protocol, the pinned view of a read, its open parts, and the
``as_of`` rules every way of reading shares (the contract: :mod:`lamina.read`).

:func:`pin` opens, for times in ``[lo, hi]``, the trace's batch and pending parts of the
newest state (held by a lease, :mod:`lamina.trace.lease`) and decodes the WAL tail after that
state's ``converted_through``: a :class:`PinnedView`. Parts are objects of the relation's
trace store, kept open (:class:`OpenPart`) and read whole or row group by row group: with
``verify`` the file is first streamed once through CRC32C (bounded memory); lookups, which
must not read whole files, rely on Parquet's page checksums instead (parts are written with
them, lamina.trace.batch).

``as_of`` (:func:`resolve_as_of`): omitted (None) it is the latest readable time,
``upper - 1``; an int must lie in ``[since, upper)``; a relation whose times are epoch
milliseconds also takes a timezone-aware datetime (lamina.frontier).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pyarrow as pa

from lamina import columns, kernels
from lamina.datadir import RelationFiles
from lamina.errors import AsOfOutOfRangeError, StorageError
from lamina.frontier import as_time, fmt, time_arg
from lamina.objstore.base import ObjectStore
from lamina.schema import TIME
from lamina.trace.batch import BatchDesc, OpenPart, PartFile
from lamina.trace.lease import Lease
from lamina.trace.parquet import FileMetaData
from lamina.trace.state import PendingPart, StateStore, TraceState
from lamina.wal.reader import segment_updates
from lamina.wal.segment import SegmentFile

_RETRIES = 20


def resolve_as_of(files: RelationFiles, as_of: object, *, upper: int, since: int) -> int:
    """The time a read at ``as_of`` reads (module docstring), or AsOfOutOfRangeError
    (InvalidArgumentError for a wrong type) saying why none."""
    name = files.name
    if as_of is None:
        if upper == 0 or upper - 1 < since:
            raise AsOfOutOfRangeError(
                f"relation {name!r} has nothing readable yet: upper {fmt(upper)}, since "
                f"{since}" + ("; nothing is sealed: seal a time first" if upper == 0 else
                              "; every sealed time was compacted away: seal further first"))
        return upper - 1
    as_of = time_arg(as_of, files.meta.time_unit, "as_of")
    if not since <= as_of < upper:
        raise AsOfOutOfRangeError(
            f"relation {name!r}: as_of {as_of} is outside [since, upper) = "
            f"[{since}, {fmt(upper)}); "
            + ("history before since was compacted away" if as_of < since
               else "times at or after the upper may still change; seal further first"))
    return as_of


def filter_times(table: pa.Table, lo: int, hi: int) -> pa.Table:
    """The rows of an update table with ``lo <= _time <= hi`` (``hi`` may be a frontier's
    ``CLOSED``, which bounds nothing)."""
    times = table.column(TIME)
    keep = kernels.less_equal(times, columns.scalar(as_time(hi), pa.uint64()))
    if lo > 0:
        keep = kernels.and_(kernels.greater_equal(times, columns.scalar(lo, pa.uint64())), keep)
    return kernels.filter(table, keep)


@dataclass
class PinnedView:
    """The files of one consistent read, opened: trace parts (batch by batch, in key
    order within a batch), pending parts and the WAL tail's segments (read at open time).
    Close it when done (the parts, and the lease if the view took its own); :func:`pin`
    builds it with the state-first protocol."""

    state: TraceState | None
    batches: list[tuple[BatchDesc, list[OpenPart]]]
    pending: list[tuple[PendingPart, OpenPart]]
    wal: list[pa.Table]
    lease: Lease | None = field(default=None, repr=False)
    """The lease this view took for itself (released by :meth:`close`), if any."""

    @property
    def since(self) -> int:
        return self.state.since if self.state is not None else 0

    def parts(self, lo: int, hi: int) -> Iterator[tuple[OpenPart, bool]]:
        """Every opened part, batch parts first (in batch order, key order within a
        batch), then pending parts, each with ``whole``: True when all its times are known
        to lie in ``[lo, hi]`` (a batch with ``lo <= lower`` and ``upper - 1 <= hi``: its
        times are below its upper, or forwarded to its since, which readers keep at or below
        ``hi``), so the reader needs no time filter; pending parts are never whole."""
        for b, parts in self.batches:
            whole = lo <= b.lower and b.upper - 1 <= hi
            for p in parts:
                yield p, whole
        for _, p in self.pending:
            yield p, False

    def close(self) -> None:
        for _, parts in self.batches:
            for p in parts:
                p.close()
        for _, p in self.pending:
            p.close()
        if self.lease is not None:
            self.lease.release()

    def __enter__(self) -> PinnedView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Footers = Callable[[ObjectStore, PartFile], "FileMetaData | None"]
"""Known footers of immutable part files (lamina.read.lookup caches them), or None."""


def new_lease(files: RelationFiles, what: str) -> Lease:
    """A lease for a read of ``files`` (held by :func:`pin`), lasting the data
    directory's ``lease_seconds``."""
    return Lease(files.trace, seconds=files.lease_seconds, holder=f"{what} of {files.name!r}")


def pinned_state(files: RelationFiles, lease: Lease) -> TraceState | None:
    """The newest trace state of this incarnation of the relation, held by ``lease``
    (lamina.trace.lease), or None (holding nothing) when there is none."""
    states = StateStore(files.trace)
    version = lease.hold_newest(states)
    if version is None:
        return None
    state = files.own(states.load(version))
    if state is None:
        lease.drop()  # a trace of a dropped relation of the same name: nothing to hold
    return state


def pin(files: RelationFiles, lo: int, hi: int, *, verify: bool = True,
        footers: Footers | None = None,
        segments: Callable[[SegmentFile], list[pa.Table]] | None = None,
        lease: Lease | None = None, what: str = "read") -> PinnedView:
    """Open, with the state-first protocol (lamina.read), every file that may hold updates
    with times in ``[lo, hi]``: the trace's batch and pending parts of the newest state
    (kept open, read lazily; :meth:`PinnedView.parts` says which need a time filter) and
    the WAL tail (decoded now, by ``segments`` if given, filtered to ``[lo, hi]``).

    The state is held by ``lease`` (a subscription passes the one it keeps across
    intervals) or by a lease of the view's own, released when the view closes (or is
    garbage-collected unclosed). Close the view when done."""
    own = lease is None
    held = lease if lease is not None else new_lease(files, what)
    try:
        for _ in range(_RETRIES):
            try:
                state = pinned_state(files, held)
                converted_through = state.converted_through if state is not None else 0
                tail = [s for s in files.segments() if s.seq > converted_through]
                if [s.seq for s in tail] != list(range(converted_through + 1,
                                                       converted_through + 1 + len(tail))):
                    continue  # segments were converted and deleted after the state was read
                meta = files.meta
                wal = []
                for seg in tail:
                    decoded = segments(seg) if segments is not None else \
                        segment_updates(seg, meta.name, meta.update_schema)
                    for t in decoded:
                        kept = filter_times(t, lo, hi)
                        if kept.num_rows:
                            wal.append(kept)
                batches, pending = open_view(files, state, lo, hi, verify=verify,
                                             footers=footers)
            except FileNotFoundError:
                continue
            view = PinnedView(state, batches, pending, wal, lease=held if own else None)
            if own:
                weakref.finalize(view, held.release)  # a view dropped unclosed
            return view
    except BaseException:
        if own:
            held.release()
        raise
    if own:
        held.release()
    raise StorageError(f"relation {files.name!r}: files kept vanishing while reading ("
                       f"{_RETRIES} attempts); did the read's lease expire (a process paused "
                       "longer than lease_seconds), or does the store refuse leases?")


def open_view(files: RelationFiles, state: TraceState | None,
              lo: int, hi: int, *, verify: bool, footers: Footers | None = None) -> tuple[
                  list[tuple[BatchDesc, list[OpenPart]]], list[tuple[PendingPart, OpenPart]]]:
    """Open the batch and pending parts of ``state`` whose time range meets ``[lo, hi]``.
    A batch may also hold times forwarded to its since; readers that need them (snapshots,
    lo = 0) get them, and a subscription checks they do not cross its frontier
    (lamina.read.subscribe). FileNotFoundError passes through (retry from a fresh state)."""
    if state is None:
        return [], []
    store = files.trace
    batches: list[tuple[BatchDesc, list[OpenPart]]] = []
    pending: list[tuple[PendingPart, OpenPart]] = []
    try:
        for b in state.batches:
            if b.lower <= hi and b.upper > lo:
                parts: list[OpenPart] = []
                batches.append((b, parts))
                for p in b.parts:
                    md = footers(store, p) if footers is not None else None
                    parts.append(OpenPart(store, p, verify=verify, metadata=md))
        for pp in state.pending:
            if pp.lower <= hi and pp.upper > lo:
                md = footers(store, pp.part) if footers is not None else None
                pending.append((pp, OpenPart(store, pp.part, verify=verify, metadata=md)))
    except BaseException:
        PinnedView(state, batches, pending, []).close()
        raise
    return batches, pending
