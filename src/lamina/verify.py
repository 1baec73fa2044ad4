"""``lamina verify``: every checksum and invariant of a data directory, read-only.

Per relation: ``relation.json`` parses; every WAL segment is scanned (a finished segment
must be intact; the open one may end in a torn tail, which the writer cuts on its next
open, reported as a note); every update record decodes and matches the schema; finished
segments not yet converted form an unbroken chain (each ``lower`` is the previous
``upper``) starting right after the trace's ``converted_through``; every kept trace state
version parses and passes its checksum; the newest passes the state invariants; and every
file it names passes its checksum, row count and the row invariants (time ranges, order,
consolidation). A quarantined relation is reported as a problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lamina.errors import CorruptionError, LaminaError, RelationNotFoundError
from lamina.layout import Layout, TraceLayout
from lamina.trace.invariants import check_data, check_state
from lamina.trace.state import StateStore
from lamina.wal.reader import updates_of
from lamina.wal.segment import list_segments, scan_file


@dataclass
class RelationReport:
    name: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    segments: int = 0
    batches: int = 0
    files: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_relation(layout: Layout, name: str) -> RelationReport:
    report = RelationReport(name)
    reason = layout.quarantine_reason(name)
    if reason is not None:
        report.problems.append(f"quarantined: {reason}")
    wal_dir = layout.wal_dir(name)
    try:
        meta = layout.read_meta(name)
    except (CorruptionError, RelationNotFoundError) as exc:
        report.problems.append(str(exc))
        return report
    converted = 0
    try:
        store = StateStore(layout.trace_store(name))
        for v in store.versions():
            store.load(v)
        state = store.load_latest()
        if state is not None and state.relation_id == meta.relation_id:
            check_state(state, store.dir)
            check_data(store.store, state, meta)
            converted = state.converted_through
            report.batches = len(state.batches)
            report.files = len(state.files())
            orphans = _unnamed_files(store)
            if orphans:
                report.notes.append(f"{orphans} data files no kept state version names "
                                    "(garbage, deleted by the compacter after its grace "
                                    "period)")
    except (LaminaError, FileNotFoundError) as exc:
        report.problems.append(str(exc))
    expected_lower: int | None = None
    expected_seq = converted + 1
    for seg in list_segments(wal_dir):
        report.segments += 1
        try:
            scan, _ = scan_file(seg, name)
            for _ in updates_of(scan, meta.update_schema):
                pass
        except (LaminaError, FileNotFoundError) as exc:
            report.problems.append(str(exc))
            continue
        if scan.torn_at is not None:
            report.notes.append(f"{seg.path.name}: torn tail at byte {scan.torn_at} "
                                f"({scan.torn_reason}); the writer cuts it on its next open")
        if seg.seq <= converted:
            report.notes.append(f"{seg.path.name}: converted, awaiting deletion")
            continue
        if seg.seq != expected_seq:
            report.problems.append(f"{seg.path.name}: expected segment {expected_seq} next "
                                   "(a segment is missing)")
        if expected_lower is not None and scan.records and scan.lower != expected_lower:
            report.problems.append(f"{seg.path.name}: starts at {scan.lower}, the previous "
                                   f"segment ended at {expected_lower}")
        expected_seq = seg.seq + 1
        expected_lower = scan.upper if scan.records else expected_lower
    return report


def _unnamed_files(store: StateStore) -> int:
    named: set[str] = set()
    for v in store.versions():
        named |= store.load(v).files()
    return sum(1 for sub in TraceLayout.DATA_DIRS for obj in store.store.list(sub)
               if obj.key not in named)


def verify_store(layout: Layout) -> list[RelationReport]:
    return [verify_relation(layout, name) for name in layout.relation_names()]
