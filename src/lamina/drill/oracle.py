"""The oracle of acknowledged writes, in plain Python (no lamina storage code).

The workload records every operation in an *ack log* (JSON lines, fsynced)::

    {"op": 7, "intent": "append", "rows": [[id, val, time, diff], ...]}   before the call
    {"op": 7, "ack": true}                                                after it returned

An operation with an intent but no ack was cut short by a kill: it may or may not have
reached the log. Each append carries a marker row (``id = -op``), so the data itself
tells which; :meth:`Oracle.resolve` settles every such operation before comparing.
Seals and compaction frontiers are settled from the relation's frontiers the same way.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Row = tuple[int, str]


@dataclass
class Oracle:
    """Every update the store must hold, and the frontiers it must report."""

    updates: list[tuple[int, str, int, int]] = field(default_factory=list)
    upper: int = 0
    since: int = 0
    in_doubt: dict[int, dict[str, Any]] = field(default_factory=dict)
    ops: int = 0

    @classmethod
    def load(cls, path: Path) -> Oracle:
        oracle = cls()
        intents: dict[int, dict[str, Any]] = {}
        if not path.exists():
            return oracle
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a torn last line: its op is in doubt via the intent, or absent
            op = int(rec["op"])
            if "intent" in rec:
                intents[op] = rec
            elif rec.get("ack") and op in intents:
                oracle.apply(intents.pop(op))
        oracle.in_doubt = intents
        return oracle

    def apply(self, rec: dict[str, Any]) -> None:
        kind = rec["intent"]
        self.ops += 1
        if kind == "append":
            self.updates.extend((int(r[0]), str(r[1]), int(r[2]), int(r[3]))
                                for r in rec["rows"])
        elif kind == "seal":
            self.upper = max(self.upper, int(rec["value"]))
        elif kind == "since":
            self.since = max(self.since, int(rec["value"]))

    def resolve(self, present_markers: set[int], upper: int, since: int) -> list[int]:
        """Settle in-doubt operations from what the store holds; return the applied ops."""
        applied = []
        for op, rec in sorted(self.in_doubt.items()):
            kind = rec["intent"]
            hit = ((kind == "append" and op in present_markers)
                   or (kind == "seal" and upper >= int(rec["value"]))
                   or (kind == "since" and since >= int(rec["value"])))
            if hit:
                self.apply(rec)
                applied.append(op)
        self.in_doubt = {}
        return applied

    def snapshot(self, as_of: int) -> list[tuple[int, str, int]]:
        """Rows (id, val, diff) with a non-zero diff sum over updates at times <= as_of."""
        sums: dict[Row, int] = defaultdict(int)
        for i, v, t, d in self.updates:
            if t <= as_of:
                sums[(i, v)] += d
        return sorted((i, v, d) for (i, v), d in sums.items() if d != 0)
