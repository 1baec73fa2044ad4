"""``lamina verify``: every checksum and invariant of a data directory, read-only.

Per relation: ``relation.json`` parses; every kept trace state version parses and passes
its checksum; the newest passes the state invariants, and every file it names passes its
checksum, row count and the row invariants (time ranges, order, consolidation), batch by
batch, so that each damaged file is named; every WAL segment is scanned (a finished
segment must be intact; the open one may end in a torn tail, which the writer cuts on its
next open, reported as a note); every update record decodes and matches the schema; the
finished segments not yet converted form an unbroken chain (each ``lower`` is the previous
``upper``) starting right after the trace's ``converted_through``. A quarantine marker is
reported as a problem, with its reason.

What a report says is what was checked, nothing inferred: a damaged segment is one problem
(its file and offset), not also a "missing" one after it, and the chain's start is checked
only against a trace state that could be read. Each problem is bounded in length
(:data:`MAX_PROBLEM`), and a relation with problems gets one line of what to do
(:attr:`RelationReport.remedy`).

It runs beside a working daemon: a segment converted and deleted, or a state version
pruned, while verify reads is not a problem; a trace that moved on between reading its
state and listing the WAL is verified again from the new state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from lamina.datadir import DataDir
from lamina.errors import CorruptionError, LaminaError, RelationNotFoundError
from lamina.layout import QUARANTINE_NAME, TraceLayout
from lamina.schema import RelationMeta
from lamina.trace.invariants import check_data, check_state
from lamina.trace.state import StateStore, TraceState
from lamina.wal.reader import updates_of
from lamina.wal.segment import SegmentFile, list_segments, scan_file

MAX_PROBLEM = 400
"""Characters of one problem line; the rest of a longer message is cut."""
_ATTEMPTS = 5

Advance = Callable[[int], None]
"""Told how many bytes were just checked (``lamina verify``'s progress)."""


@dataclass
class RelationReport:
    name: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    segments: int = 0
    batches: int = 0
    files: int = 0
    remedy: str = ""
    """What to do about the problems (empty when there are none)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def problem(self, text: object) -> None:
        line = " ".join(str(text).split())
        self.problems.append(line if len(line) <= MAX_PROBLEM else
                             line[:MAX_PROBLEM - 3] + "...")


def verify_relation(layout: DataDir, name: str, advance: Advance | None = None
                    ) -> RelationReport:
    """Check one relation (the module docstring); ``advance`` follows the bytes read."""
    for _ in range(_ATTEMPTS):
        report, before = _verify_once(layout, name, advance)
        if report.ok or before == _newest_version(layout, name):
            break
        # the trace moved on while we read (a conversion deleted segments we expected):
        # check again against its new state
    if not report.ok:
        marker = layout.wal_dir(name) / QUARANTINE_NAME
        report.remedy = (
            "find the cause (disk errors in dmesg, a full disk, a copy gone wrong), then "
            "restore the named files, or the whole relation, from a backup "
            "(docs/operations.md, LaminaRelationQuarantined) and run lamina verify again"
            + (f"; then remove {marker}" if marker.exists() else ""))
    return report


def _newest_version(layout: DataDir, name: str) -> int | None:
    try:
        versions = StateStore(layout.trace_store(name)).versions()
    except (LaminaError, OSError):
        return None
    return versions[-1] if versions else None


def _verify_once(layout: DataDir, name: str, advance: Advance | None
                 ) -> tuple[RelationReport, int | None]:
    report = RelationReport(name)
    reason = layout.quarantine_reason(name)
    if reason is not None:
        report.problem(f"quarantined: {reason}")
    try:
        meta = layout.read_meta(name)
    except (CorruptionError, RelationNotFoundError) as exc:
        report.problem(exc)
        return report, None
    state, readable = _verify_trace(layout, meta, report, advance)
    converted = state.converted_through if state is not None else 0
    _verify_wal(layout, meta, report, advance,
                chain_from=converted + 1 if readable else None, converted=converted)
    return report, state.version if state is not None else None


def _verify_trace(layout: DataDir, meta: RelationMeta, report: RelationReport,
                  advance: Advance | None) -> tuple[TraceState | None, bool]:
    """Check the trace; return its newest state (None: nothing published, or none
    readable) and whether it could be read."""
    try:
        store = StateStore(layout.trace_store(meta.name))
        versions = store.versions()
    except (LaminaError, OSError) as exc:
        report.problem(exc)
        return None, False
    states: list[TraceState] = []
    readable = True
    for v in versions:
        try:
            states.append(store.load(v))
        except FileNotFoundError:
            continue  # pruned by garbage collection since it was listed
        except LaminaError as exc:
            report.problem(exc)
            readable = readable and v != versions[-1]
    if not states or not readable:
        return None, readable
    state = states[-1]
    if state.relation_id != meta.relation_id:
        return None, True  # an older incarnation's trace, dropped and not yet removed
    try:
        check_state(state, store.dir)
    except CorruptionError as exc:
        report.problem(exc)
        return state, False
    report.batches = len(state.batches)
    report.files = len(state.files())
    parts = [replace(state, batches=(b,), pending=()) for b in state.batches]
    parts += [replace(state, batches=(), pending=(p,)) for p in state.pending]
    for part in parts:
        try:
            check_data(store.store, part, meta)
        except FileNotFoundError as exc:
            report.problem(f"a file the newest trace state names is missing: {exc}")
        except LaminaError as exc:
            report.problem(exc)
        if advance is not None:
            advance(part.bytes)
    orphans = _unnamed_files(store, states)
    if orphans:
        report.notes.append(f"{orphans} data files no kept state version names (garbage, "
                            "deleted by the compacter after its grace period)")
    return state, True


def _verify_wal(layout: DataDir, meta: RelationMeta, report: RelationReport,
                advance: Advance | None, *, chain_from: int | None, converted: int) -> None:
    """Scan every segment; check the chain of unconverted ones (from ``chain_from``, the
    sequence number the trace expects next, when it is known)."""
    expected_seq, expected_lower = chain_from, None
    for seg in list_segments(layout.wal_dir(meta.name)):
        size = _size(seg)
        try:
            scan, _ = scan_file(seg, meta.name)
            for _ in updates_of(scan, meta.update_schema):
                pass
        except FileNotFoundError:
            continue  # converted and deleted by the compacter since it was listed
        except LaminaError as exc:
            report.segments += 1
            report.problem(exc)
            expected_seq, expected_lower = seg.seq + 1, None  # where it ends is unknown
            continue
        finally:
            if advance is not None:
                advance(size)
        report.segments += 1
        if scan.torn_at is not None:
            report.notes.append(f"{seg.path.name}: torn tail at byte {scan.torn_at} "
                                f"({scan.torn_reason}); the writer cuts it on its next open")
        if seg.seq <= converted:
            report.notes.append(f"{seg.path.name}: converted, awaiting deletion")
            continue
        if expected_seq is not None and seg.seq != expected_seq:
            report.problem(f"{seg.path.name}: expected segment {expected_seq} next (a "
                           "segment is missing)")
        if expected_lower is not None and scan.records and scan.lower != expected_lower:
            report.problem(f"{seg.path.name}: starts at {scan.lower}, the previous segment "
                           f"ended at {expected_lower}")
        expected_seq = seg.seq + 1
        expected_lower = scan.upper if scan.records else expected_lower


def _size(seg: SegmentFile) -> int:
    try:
        return seg.path.stat().st_size
    except FileNotFoundError:
        return 0


def _unnamed_files(store: StateStore, states: list[TraceState]) -> int:
    named: set[str] = set()
    for s in states:
        named |= s.files()
    return sum(1 for sub in TraceLayout.DATA_DIRS for obj in store.store.list(sub)
               if obj.key not in named)


def planned_bytes(layout: DataDir, name: str) -> int:
    """About how many bytes :func:`verify_relation` reads: the WAL segments and the files
    the newest trace state names (a progress bar's total)."""
    total = sum(_size(seg) for seg in list_segments(layout.wal_dir(name)))
    try:
        state = StateStore(layout.trace_store(name)).load_latest()
    except (LaminaError, OSError):
        return total
    return total + (state.bytes if state is not None else 0)


def verify_store(layout: DataDir, advance: Advance | None = None) -> list[RelationReport]:
    return [verify_relation(layout, name, advance) for name in layout.relation_names()]
