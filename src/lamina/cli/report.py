"""``lamina status`` and ``lamina verify``: what a data directory holds, and whether it is
intact (lamina.status, lamina.verify)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from lamina.cli.datadir import open_store
from lamina.cli.output import Progress, count, print_table
from lamina.frontier import fmt
from lamina.status import KEYS, store_status
from lamina.verify import planned_bytes, verify_relation


def status(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        rows = store_status(store.layout)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print_table(KEYS, [[_cell(r[k]) for k in KEYS] for r in rows])
    return 0


def _cell(v: Any) -> str:
    if isinstance(v, dict):
        return " ".join(f"L{k}:{n}" for k, n in v.items()) or "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return "-" if v is None else fmt(v) if isinstance(v, int) else str(v)


def verify(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        layout = store.layout
        names = layout.relation_names()
        total = sum(planned_bytes(layout, n) for n in names)
        bad = 0
        with Progress("verifying", unit="bytes", total=total) as progress:
            for name in names:
                r = verify_relation(layout, name, progress.advance)
                state = "OK" if r.ok else "PROBLEM"
                print(f"{state:8} {r.name}: {r.segments} segments, {r.batches} batches, "
                      f"{r.files} files")
                for p in r.problems:
                    print(f"  problem: {p}")
                for n in r.notes:
                    print(f"  note: {n}")
                if r.remedy:
                    print(f"  what to do: {r.remedy}")
                bad += not r.ok
        print(f"{len(names)} relations checked, {bad} with problems")
    progress.finish(f"checked {count(progress.done, 'bytes')} of {len(names)} relations")
    return 1 if bad else 0
