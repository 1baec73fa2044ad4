"""Restart-recovery drills: a coordinator workload, an oracle of acknowledged writes, and
the driver that kills and restarts processes and checks one against the other.

Nothing is imported here eagerly: ``python -m lamina.drill.workload`` (started once per
coordinator life) must not pay for, or re-import, the driver."""

from __future__ import annotations

import argparse
import sys


def run_drill_cli(args: argparse.Namespace) -> int:
    """``lamina drill``: the store drill (lamina.drill.driver), or with ``--ingest`` the
    ingestion drill (lamina.drill.ingest)."""
    if getattr(args, "ingest", None) is not None:
        if args.kills < 0:
            print("lamina drill: --kills must be >= 0", file=sys.stderr)
            return 2
        from lamina.drill.ingest import run_ingest_drill_cli

        return run_ingest_drill_cli(args)
    from lamina.drill.driver import run_drill_cli as run

    return run(args)


__all__ = ["run_drill_cli"]
