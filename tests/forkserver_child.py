"""Targets for tests/test_forkserver.py, run in the fork server's children."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence

from lamina import failpoints


def report(argv: Sequence[str]) -> int:
    """Print what the child is (argv, pid, its environment's marker, its fail points,
    stdin's first bytes) as one JSON line on stdout, a line on stderr, and exit with
    ``argv[0]``."""
    print(json.dumps({"argv": list(argv), "pid": os.getpid(), "ppid": os.getppid(),
                      "marker": os.environ.get("FORKSERVER_MARKER"),
                      "failpoints": failpoints.CONFIG.env_spec,
                      "stdin": sys.stdin.read(8)}), flush=True)
    print("to stderr", file=sys.stderr)
    return int(argv[0])


def sleep(argv: Sequence[str]) -> None:
    """Say ``up`` on stdout, then sleep ``argv[0]`` seconds and exit 0."""
    print("up", flush=True)
    time.sleep(float(argv[0]))


def fail(argv: Sequence[str]) -> None:
    raise RuntimeError(f"failed on purpose: {list(argv)}")
