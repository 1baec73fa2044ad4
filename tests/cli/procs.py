"""Running ``lamina`` as a user does: a real subprocess, its exit code and its output; and
relations to run it on."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa

from lamina.store import Relation, Store

LAMINA = str(Path(sys.executable).with_name("lamina"))

SCHEMA = pa.schema([("id", pa.int64()), ("item", pa.string())])


def lamina(*args: str, env: Mapping[str, str] | None = None, cwd: Path | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
    """``lamina ARGS`` to completion, output captured; ``env`` adds to the environment
    (without the caller's own ``LAMINA_DATA_DIR``)."""
    full = {k: v for k, v in os.environ.items() if k != "LAMINA_DATA_DIR"}
    full.update(env or {})
    return subprocess.run([LAMINA, *args], capture_output=True, timeout=timeout,
                          check=False, env=full, cwd=cwd)


def one_line(stderr: bytes) -> str:
    """The single line ``lamina: ...`` a failed command printed (asserted so)."""
    text = stderr.decode()
    assert text.startswith("lamina: "), text
    assert text.count("\n") == 1, text
    assert text.endswith("\n"), text
    assert "Traceback" not in text
    return text[len("lamina: "):-1]


def updates(ids: np.ndarray, items: list[str] | np.ndarray, time: int,
            diff: int = 1) -> pa.Table:
    """Updates of SCHEMA built from numpy (no Python object per row)."""
    n = len(ids)
    return pa.Table.from_arrays(
        [pa.array(ids, pa.int64()), pa.array(items, pa.string()),
         pa.array(np.full(n, time, dtype=np.uint64)), pa.array(np.full(n, diff, np.int64))],
        names=["id", "item", "_time", "_diff"])


def orders(root: Path, rows: int = 10, *, name: str = "orders") -> Relation:
    """A relation ``name`` of SCHEMA with ``rows`` rows at time 0 (ids 0..rows-1), sealed
    at 1, in a closed store (the handle is for its metadata)."""
    with Store.open(root, fsync="never") as store:
        rel = store.create_relation(name, SCHEMA, key=["id"])
        ids = np.arange(rows, dtype=np.int64)
        rel.append(updates(ids, np.char.add("item-", ids.astype(str)).astype(object), 0))
        rel.seal(1)
    return rel
