"""Restart-recovery drills: a coordinator workload, an oracle of acknowledged writes, and
the driver that kills and restarts processes and checks one against the other.

Nothing is imported here eagerly: ``python -m lamina.drill.workload`` (started once per
coordinator life) must not pay for, or re-import, the driver."""

from __future__ import annotations

import argparse


def run_drill_cli(args: argparse.Namespace) -> int:
    """``lamina drill`` (see lamina.drill.driver)."""
    from lamina.drill.driver import run_drill_cli as run

    return run(args)


__all__ = ["run_drill_cli"]
