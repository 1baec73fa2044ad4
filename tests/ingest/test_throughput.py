"""Throughput of the files source end to end (the figure in docs/ingestion.md):

    .venv/bin/pytest tests/ingest/test_throughput.py -s

500,000 JSON lines already in the directory; the time from HTTP up to the binding that
covers them all, through a real ``lamina ingest`` (parse, reclock, WAL append + fsync).
The bound asserted is loose (a shared 2-core machine); the printed figure is the result.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.ingest.procs import Ingest, caught_up, files_source_toml, write_config

LINES = 500_000


@pytest.mark.slow
def test_files_source_throughput(tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    with open(src / "a.jsonl", "w") as f:
        for i in range(LINES):
            f.write(json.dumps({"id": i, "name": f"name-{i}"}) + "\n")
    cfg = write_config(tmp_path / "ingest.toml", tmp_path / "data",
                       [files_source_toml("s", src, interval=0.1)])
    proc = Ingest(cfg, tmp_path / "ingest.log")
    try:
        proc.wait_port()
        t0 = time.monotonic()
        st = proc.wait_for(caught_up("s", src, "a.jsonl"), timeout=300)
        seconds = time.monotonic() - t0
        assert proc.terminate() == 0
    finally:
        proc.kill()
    rate = LINES / seconds
    print(f"\nfiles source: {LINES:,} lines in {seconds:.2f} s = {rate:,.0f} lines/s "
          f"({st['s']['transactions']} transactions)")
    assert st["s"]["outputs"][0]["changes"] == LINES
    assert rate > 20_000
