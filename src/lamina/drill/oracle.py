"""The oracle of acknowledged writes, in plain Python (no lamina storage code).

The workload records every operation in an *ack log* (JSON lines, fsynced)::

    {"op": 7, "intent": "append", "rows": [[id, val, time, diff], ...]}   before the call
    {"op": 7, "ack": true}                                                after it returned

A workload that writes several relations names each intent's relation (``"rel"``); an
oracle is kept per relation (``Oracle(relation=...)``) and reads only its own intents (the
acks pair with them by operation number, which counts across relations).

An operation with an intent but no ack was cut short by a kill: it may or may not have
reached the log. Each append's first row is a marker (``id = -op``, ``val = "marker"``) at
the append's lowest time, so the data itself tells which: :meth:`Oracle.resolve` settles
an in-doubt append from the markers present once the relation's upper has passed the
marker's time (until then none of its rows is readable, so it cannot matter). Seals and
compaction frontiers in doubt are settled from the relation's frontiers.

The oracle keeps updates at times at or before ``since`` summed per row (a read at
``as_of >= since`` sees them all), so its size follows the distinct rows plus the recent
updates, not the length of the history. Markers are kept apart, one entry per append.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Row = tuple[int, str]
MARKER = "marker"


@dataclass
class Oracle:
    """Every update the store must hold, and the frontiers it must report. ``relation``:
    read only the intents naming it (an intent naming none is every oracle's)."""

    relation: str | None = None
    upper: int = 0
    since: int = 0
    ops: int = 0
    markers: dict[int, int] = field(default_factory=dict)
    in_doubt: dict[int, dict[str, Any]] = field(default_factory=dict)
    resolved_applied: int = 0
    resolved_not_applied: int = 0
    max_op: int = 0
    _base: dict[Row, int] = field(default_factory=lambda: defaultdict(int))
    _recent: list[tuple[int, str, int, int]] = field(default_factory=list)
    _offset: int = 0

    @classmethod
    def load(cls, path: Path, relation: str | None = None) -> Oracle:
        oracle = cls(relation=relation)
        oracle.feed(path)
        return oracle

    def feed(self, path: Path) -> None:
        """Read the ack log's complete lines written since the last call. Call it only while
        no workload runs: an intent without an ack is then in doubt for good (the next
        workload starts with a new operation number)."""
        if not path.exists():
            return
        with path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        intents: dict[int, dict[str, Any]] = {}
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
                op = int(rec["op"])
            except (ValueError, KeyError, TypeError):
                continue  # a line torn by a kill: its op never started, or stays in doubt
            self.max_op = max(self.max_op, op)
            if "intent" in rec:
                if self.relation is None or rec.get("rel", self.relation) == self.relation:
                    intents[op] = rec
            elif rec.get("ack") and op in intents:
                self.apply(op, intents.pop(op))
        self.in_doubt.update(intents)

    def apply(self, op: int, rec: dict[str, Any]) -> None:
        kind = rec["intent"]
        self.ops += 1
        if kind == "append":
            rows = rec["rows"]
            marker = rows[0]
            if int(marker[0]) != -op or marker[1] != MARKER:
                raise ValueError(f"op {op}: append without its marker row first")
            self.markers[op] = int(marker[2])
            for r in rows[1:]:
                self._add(int(r[0]), str(r[1]), int(r[2]), int(r[3]))
        elif kind == "seal":
            self.upper = max(self.upper, int(rec["value"]))
        elif kind == "since":
            value = int(rec["value"])
            if value > self.since:
                self.since = value
                recent, self._recent = self._recent, []
                for i, v, t, d in recent:
                    self._add(i, v, t, d)

    def _add(self, i: int, v: str, t: int, d: int) -> None:
        if t <= self.since:
            self._base[(i, v)] += d
            if self._base[(i, v)] == 0:
                del self._base[(i, v)]
        else:
            self._recent.append((i, v, t, d))

    def marker_time(self, op: int) -> int:
        return int(self.in_doubt[op]["rows"][0][2])

    def resolve(self, present_markers: set[int] | None, upper: int,
                since: int) -> list[int]:
        """Settle in-doubt operations from what the store holds: ``present_markers`` are
        the marker ops readable at ``upper - 1``, ``upper``/``since`` the relation's
        frontiers. An append whose marker lies at or beyond ``upper`` stays in doubt, and
        so does every append when ``present_markers`` is None (nothing is readable while
        ``since == upper``). Returns the operations found applied."""
        applied = []
        for op, rec in sorted(self.in_doubt.items()):
            kind = rec["intent"]
            if kind == "append":
                if present_markers is None or self.marker_time(op) >= upper:
                    continue
                hit = op in present_markers
            elif kind == "seal":
                hit = upper >= int(rec["value"])
            else:
                hit = since >= int(rec["value"])
            del self.in_doubt[op]
            if hit:
                self.apply(op, rec)
                self.resolved_applied += 1
                applied.append(op)
            else:
                self.resolved_not_applied += 1
        return applied

    def snapshot(self, as_of: int) -> list[tuple[int, str, int]]:
        """Rows (id, val, diff) with a non-zero diff sum over updates at times <= as_of,
        for ``as_of >= since``, markers included, sorted."""
        if as_of < self.since:
            raise ValueError(f"the oracle holds no history before since {self.since}")
        sums: dict[Row, int] = defaultdict(int, self._base)
        for i, v, t, d in self._recent:
            if t <= as_of:
                sums[(i, v)] += d
        out = [(i, v, d) for (i, v), d in sums.items() if d != 0]
        out.extend((-op, MARKER, 1) for op, t in self.markers.items() if t <= as_of)
        out.sort()
        return out
