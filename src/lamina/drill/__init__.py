"""Restart-recovery drills: a coordinator workload, an oracle of acknowledged writes, and
the driver that kills and restarts processes and checks one against the other."""

from lamina.drill.driver import run_drill_cli

__all__ = ["run_drill_cli"]
