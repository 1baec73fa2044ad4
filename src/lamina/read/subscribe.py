"""Subscriptions: a relation's snapshot, then its changes as the upper advances.

``subscribe(as_of)`` yields ``pa.Table`` batches of updates (row columns, ``_time``,
``_diff``) and :class:`Progress` markers:

1. the snapshot at ``as_of``, its rows at time ``as_of``, streamed in key order
   (lamina.read.stream), then ``Progress(as_of + 1)``;
2. for each newly sealed interval ``[lower, upper)``: its updates, consolidated (no two
   rows with equal row and time, no zero diff) and ordered by key and time, then
   ``Progress(upper)``. After ``Progress(u)`` every update at a time below ``u`` was
   delivered exactly once and none at or beyond it.

A consumer that stored the last ``Progress(u)`` resumes with
``subscribe(u - 1, snapshot=False)``: the updates from ``u`` on, the same ones it would
have received.

**Exactly once under compaction.** Each interval is read with the state-first protocol of
lamina.read (trace state, then the WAL tail that must start right after its
``converted_through``; :func:`lamina.read.unsealed.read_interval`), so a segment converted
and deleted meanwhile is read from the trace instead, never twice, never missed. Only the
times in ``[lower, upper)`` are kept: batches wholly below ``lower`` are skipped, whatever
compaction did to them. A batch that straddles ``lower`` and whose ``since`` is at or above
``lower`` has had times already delivered forwarded into the interval; those cannot be
told apart any more, so the subscription raises
:class:`~lamina.errors.SubscriptionBehindError` (it fell behind ``since``).

**Its lease.** The subscription keeps one lease (lamina.trace.lease) for its whole life,
moved to the state each interval pins and renewed meanwhile, so nothing an interval
reads is collected under it; between intervals it holds the state of the last one. The
lease is released when the iterator ends, is closed or is garbage-collected. (The first
snapshot is a streaming snapshot with its own lease.)

**Waiting.** The subscription reads the WAL directory's newest segments' names, sizes and
modification times (one ``stat`` each); only when they change does it read the frontiers
again. Between checks it sleeps, from 1 ms doubling to ``max_wait`` (0.05 s by default)
while nothing changes, so an idle subscription costs about 20 directory listings and 40
stat calls per second, and a seal is noticed within ``max_wait``. Nothing here takes a
lock or writes anything but its lease: a slow consumer (which simply does not pull the
iterator) holds back neither the writer nor the compacter.

Reading the frontiers reads the newest segment's frame headers and frontier records
only, seeking past update payloads (lamina.wal.segment.read_frontiers), so a check costs
a few bytes read per record, not a read and checksum of the whole open segment.

**Cost.** Each interval decodes the WAL records appended since the previous interval and
the trace batches overlapping the interval (none for a consumer that keeps up, since
conversions lag the upper). Decoded segments are kept (:class:`TailCache`: only their
updates at or after the frontier, until converted): a finished segment is decoded once,
the open one is read on from where the last interval stopped (its bytes before that
never change), and decoded whole once more when it is finished. The interval's updates
are held in memory once.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from lamina import columns
from lamina.datadir import RelationFiles
from lamina.errors import (
    InvalidArgumentError,
    RelationNotFoundError,
    SubscriptionBehindError,
)
from lamina.frontier import CLOSED, time_arg
from lamina.read.stream import snapshot_batches
from lamina.read.unsealed import read_interval
from lamina.read.view import filter_times, new_lease, resolve_as_of
from lamina.schema import TIME, RelationMeta
from lamina.trace.batch import BatchDesc
from lamina.trace.lease import Lease
from lamina.wal.reader import appended_updates, segment_updates, updates_of
from lamina.wal.segment import SegmentFile, scan_file

MIN_WAIT = 0.001


@dataclass(frozen=True)
class Progress:
    """Every update at a time below ``upper`` has been delivered (``CLOSED``: all of them,
    the subscription ends)."""

    upper: int


def _signature(files: RelationFiles) -> tuple[tuple[str, int, int], ...]:
    """Names, sizes and mtimes of the newest two segments: changes when the writer appends,
    seals, rotates or advances since."""
    out = []
    for seg in files.segments()[-2:]:
        try:
            st = os.stat(seg.path)
        except FileNotFoundError:
            out.append((seg.path.name, -1, -1))
            continue
        out.append((seg.path.name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _upper(files: RelationFiles) -> int:
    """The relation's upper; a WAL directory gone means the relation was dropped."""
    try:
        return files.frontiers()[0]
    except FileNotFoundError:
        raise RelationNotFoundError(f"relation {files.name!r} was dropped while subscribed; "
                                    "the subscription ends") from None


def _with_time(table: pa.Table, as_of: int) -> pa.Table:
    times = columns.array(np.full(table.num_rows, as_of, dtype=np.uint64))
    return table.add_column(table.num_columns - 1, TIME, times)


class TailCache:
    """Decoded WAL segments, kept between intervals, only their updates at or after the
    subscription's frontier; an entry goes once the trace has converted its segment. A
    finished segment never changes; the open one only grows, so only the records appended
    since the last interval are read and decoded (:func:`appended_updates`)."""

    def __init__(self, meta: RelationMeta) -> None:
        self.meta = meta
        self._entries: dict[int, list[pa.Table]] = {}  # by segment sequence number
        self._open: tuple[int, int] | None = None  # seq and valid end of the open segment

    def _read_open(self, seg: SegmentFile) -> list[pa.Table]:
        schema = self.meta.update_schema
        if self._open is not None and self._open[0] == seg.seq:
            new, end = appended_updates(seg, schema, self._open[1])
            tables = self._entries[seg.seq] = [*self._entries[seg.seq], *new]
        else:
            scan, _ = scan_file(seg, self.meta.name)
            tables = list(updates_of(scan, schema))
            if not scan.records:  # a torn header: nothing to continue from
                return tables
            end = scan.valid_end
            self._entries[seg.seq] = tables
        self._open = (seg.seq, end)
        return tables

    def read(self, seg: SegmentFile) -> list[pa.Table]:
        if not seg.finished:
            return self._read_open(seg)
        if self._open is not None and self._open[0] == seg.seq:  # finished since: re-read
            self._open = None
            del self._entries[seg.seq]
        if seg.seq not in self._entries:
            self._entries[seg.seq] = segment_updates(seg, self.meta.name,
                                                     self.meta.update_schema)
        return self._entries[seg.seq]

    def advance(self, lower: int, converted_through: int) -> None:
        """Drop converted segments and the updates below ``lower``."""
        for seq in list(self._entries):
            if seq <= converted_through:
                del self._entries[seq]
                if self._open is not None and self._open[0] == seq:
                    self._open = None
            else:
                self._entries[seq] = [
                    kept for t in self._entries[seq]
                    if (kept := filter_times(t, lower, CLOSED)).num_rows]


def interval_updates(files: RelationFiles, lower: int, upper: int,
                     tail: TailCache | None = None, lease: Lease | None = None) -> pa.Table:
    """The consolidated updates with times in ``[lower, upper)``, by key and time."""
    name = files.name

    def behind(b: BatchDesc) -> SubscriptionBehindError:
        return SubscriptionBehindError(
            f"relation {name!r}: the subscription at frontier {lower} fell behind since: "
            f"compaction forwarded times before {b.since} (batch [{b.lower}, {b.upper})), so "
            "updates it already delivered can no longer be told apart; start a new "
            "subscription from a snapshot at a time in [since, upper)")

    got = read_interval(files, lower, upper, behind=behind, lease=lease,
                        segments=tail.read if tail is not None else None,
                        what="subscription")
    if tail is not None and upper < CLOSED:  # after CLOSED nothing is read again
        tail.advance(upper, got.converted_through)
    return got.updates


def subscribe(files: RelationFiles, as_of: object = None, *, snapshot: bool = True,
              stop: threading.Event | None = None,
              max_wait: float = 0.05) -> Iterator[pa.Table | Progress]:
    """See the module docstring (``as_of`` None: the latest readable time, or with
    ``snapshot=False`` the upper less one: what is sealed from now on). Arguments are
    checked now, before the iterator is returned; ``stop`` ends the iteration at the next
    wait."""
    if not max_wait > 0:
        raise InvalidArgumentError(f"max_wait must be > 0 seconds, got {max_wait!r}")
    upper, since = files.frontiers()
    if snapshot:
        at = resolve_as_of(files, as_of, upper=upper, since=since)
    else:
        at = upper - 1 if as_of is None else time_arg(as_of, files.meta.time_unit, "as_of")
        if not -1 <= at < upper:
            raise InvalidArgumentError(
                f"relation {files.name!r}: a subscription resumes after a Progress(u) it "
                f"received, with as_of = u - 1 in [-1, upper - 1] = [-1, {upper - 1}]; got "
                f"{as_of!r}")
    lease = new_lease(files, "subscription")
    items = _run(files, at, upper=upper, snapshot=snapshot, stop=stop or threading.Event(),
                 max_wait=max_wait, lease=lease)
    weakref.finalize(items, lease.release)  # an iterator dropped before its end
    return items


def _run(files: RelationFiles, as_of: int, *, upper: int, snapshot: bool,
         stop: threading.Event, max_wait: float,
         lease: Lease) -> Iterator[pa.Table | Progress]:
    try:
        if snapshot:
            reader = snapshot_batches(files, as_of, upper=upper, since=0)
            for batch in reader:
                if batch.num_rows:
                    yield _with_time(pa.Table.from_batches([batch]), as_of)
        lower = as_of + 1
        tail = TailCache(files.meta)
        yield Progress(lower)
        while lower < CLOSED:
            seen = _signature(files)
            upper = _upper(files)
            wait = MIN_WAIT
            while upper <= lower:
                if stop.wait(wait):
                    return
                now = _signature(files)
                if now == seen:
                    wait = min(wait * 2, max_wait)
                    continue
                seen, wait = now, MIN_WAIT
                upper = _upper(files)
            table = interval_updates(files, lower, upper, tail, lease)
            if table.num_rows:
                yield table
            yield Progress(upper)
            lower = upper
            if stop.is_set():
                return
    finally:
        lease.release()
