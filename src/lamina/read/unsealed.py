"""Updates in a time interval, sealed or not: ``Relation.updates(lower, upper)``.

The updates with times in ``[lower, upper)``, consolidated (no two equal rows at one time,
no zero diff; fields nullable, as a snapshot's, empty or not) and ordered by key and time,
wherever they are stored: trace batches, the trace's pending parts (future updates) and
the WAL tail, read with the state-first protocol (:func:`lamina.read.view.pin`, holding a
lease). ``upper`` may lie beyond the sealed upper: updates appended but not sealed yet are
returned too (what a killed coordinator appended last, which ``lamina ingest`` reads back
through ``lamina.ingest.tail``); times at or beyond the sealed upper may still gain
updates.

Parts are sorted by row, then time, and stay so when times are forwarded, so they are
merged as sorted runs, as a snapshot's are (:func:`lamina.read.snapshot.consolidated`: no
hash grouping, which would load Acero and pandas in a fresh process, unless the rows hold
floats or sums that could leave int64, where the stored carries are kept as they are).

Logical compaction: a time before ``since`` is read as ``since`` (DESIGN.md section 1),
so no update remains before ``since`` and ``[since, upper)`` holds the whole history up
to ``upper`` (as ``[0, upper)`` does); updates at or after a ``lower`` strictly between 0
and ``since`` can no longer be told from earlier ones. So ``lower`` must be 0 or at least
``since``, and a non-empty interval must end above ``since``. Accumulating
``updates(0, t + 1)`` gives ``snapshot(t)``. A batch that compaction forwarded across
``lower`` (it starts below ``lower`` and its own since is at or above it: since moved on
after the frontiers were read) is refused the same way. Each interval of a subscription
is read here too (lamina.read.subscribe).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa

from lamina import columns, kernels
from lamina.consolidate import forward
from lamina.datadir import RelationFiles
from lamina.errors import AsOfOutOfRangeError, InvalidArgumentError
from lamina.frontier import fmt, frontier_arg
from lamina.read.snapshot import consolidated, loose
from lamina.read.view import filter_times, pin
from lamina.trace.batch import BatchDesc
from lamina.trace.lease import Lease
from lamina.wal.segment import SegmentFile


@dataclass(frozen=True)
class Interval:
    """The consolidated updates of an interval, and the last WAL segment the trace state
    it was read from had converted."""

    updates: pa.Table
    converted_through: int


def read_interval(files: RelationFiles, lower: int, upper: int, *,
                  behind: Callable[[BatchDesc], Exception], lease: Lease | None = None,
                  segments: Callable[[SegmentFile], list[pa.Table]] | None = None,
                  since: int = 0, what: str = "updates") -> Interval:
    """The updates with times in ``[lower, upper)`` (``lower < upper``), by key and time,
    times before ``since`` read as ``since``; ``behind(batch)`` is raised for a batch
    compacted across ``lower`` (module docstring). ``lease`` and ``segments``:
    :func:`lamina.read.view.pin`'s."""
    meta = files.meta
    parts: list[pa.Table] = []  # each sorted by row, then time
    with pin(files, lower, upper - 1, segments=segments, lease=lease, what=what) as view:
        for b, _ in view.batches:
            if b.lower < lower <= b.since:
                raise behind(b)
        for p, whole in view.parts(lower, upper - 1):
            t = p.file.read()
            parts.append(t if whole else filter_times(t, lower, upper - 1))
        wal = view.wal
        converted = view.state.converted_through if view.state is not None else 0
    parts = [kernels.cast_table(t, meta.update_schema) for t in parts]
    wal = [kernels.cast_table(t, meta.update_schema) for t in wal]
    if since > lower:  # lower == 0: the whole history, compacted. Forwarding keeps a
        # part sorted: it only raises the times below since to since.
        parts, wal = [forward(t, since) for t in parts], [forward(t, since) for t in wal]
    return Interval(consolidated(meta, parts, wal, timed=True, workers=pa.cpu_count(),
                                 context=f"{what} of {meta.name!r} [{lower}, {fmt(upper)})"),
                    converted)


def updates(files: RelationFiles, lower: object, upper: object, *, since: int) -> pa.Table:
    """``Relation.updates``: the module docstring; ``lower`` and ``upper`` are frontiers
    (ints, or timezone-aware datetimes where the relation counts milliseconds)."""
    unit = files.meta.time_unit
    lo = frontier_arg(lower, unit, "lower")
    hi = frontier_arg(upper, unit, "upper")
    if hi < lo:
        raise InvalidArgumentError(f"relation {files.name!r}: upper {fmt(hi)} is below lower "
                                   f"{fmt(lo)}; the interval is [lower, upper)")
    if hi == lo:
        return loose(columns.empty_table(files.meta.update_schema))  # as consolidated
    if 0 < lo < since or hi <= since:  # lo == since: the whole history, as from 0
        raise AsOfOutOfRangeError(
            f"relation {files.name!r}: [{lo}, {fmt(hi)}) is not readable at since {since}: "
            "times before since are read as since, so updates at or after a lower below "
            "since can no longer be told from earlier ones, and none remain before since; "
            "read from lower 0 (the whole history, compacted) or from a lower at or above "
            "since, to an upper above since")

    def behind(b: BatchDesc) -> Exception:
        return AsOfOutOfRangeError(
            f"relation {files.name!r}: compaction forwarded times before {b.since} (batch "
            f"[{b.lower}, {b.upper})) across lower {lo}; read from 0 or from a lower at or "
            "above since")

    return read_interval(files, 0 if lo <= since else lo, hi, behind=behind,
                         since=since).updates
