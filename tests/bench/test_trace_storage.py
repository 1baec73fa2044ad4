"""bench/trace_storage.py runs end to end at a tiny scale, so the benchmark code cannot rot.

Scale 0.01 (100,000 updates to convert, two batches of 50,000 rows to merge), one round:
both contenders (``file`` and ``s3`` on a moto server behind the counting proxy) in their
own processes with their own Spark sessions. Results go to a temporary directory
(``LAMINA_BENCH_RESULTS``), so the committed results and docs/performance.md are left
alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import trace_storage

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.spark
def test_a_tiny_run_goes_through_the_proxy_and_commits_the_same_trace(tmp_path: Path) -> None:
    """Every step has seconds for both contenders and their ratio; the s3 step read and
    wrote through the proxy (requests and bytes counted, none for the file step); both
    committed the same rows (same digest of batches and pending parts); the table renders."""
    env = {**os.environ, "LAMINA_BENCH_RESULTS": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "bench.trace_storage", "--scale", "0.01",
                           "--rounds", "1", "--master", "local[2]"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "trace_storage.json").read_text())
    assert doc["benchmark"] == "trace_storage"
    assert doc["command"].startswith(
        f"LAMINA_BENCH_RESULTS={tmp_path} .venv/bin/python -m bench.trace_storage")
    for step in trace_storage.STEPS:
        st = doc["steps"][step]
        file, s3 = st["contenders"]["file"], st["contenders"]["s3"]
        assert file["seconds"]["median"] > 0, step
        assert s3["seconds"]["median"] > 0, step
        assert st["ratio_s3_to_file"] > 0, step
        assert file["requests"]["median"] == 0, step
        assert s3["requests"]["median"] > 0, step
        assert s3["requests_by_kind"]["PUT"] > 0, step  # the parts and the state
        assert s3["bytes_up"]["median"] > 0, step
        assert st["same_content"], step
        assert s3["content"] == file["content"], step
        assert file["content"]["batches"]["rows"] == file["rows_out"] > 0, step
    # a merge reads its two parents from the store
    assert doc["steps"]["merge"]["contenders"]["s3"]["requests_by_kind"]["GET"] >= 2
    assert doc["steps"]["merge"]["contenders"]["s3"]["bytes_down"]["median"] > 0
    assert (tmp_path / "trace_storage.png").stat().st_size > 0
    assert "| convert |" in trace_storage.table(tmp_path)


def test_the_documented_table_is_the_one_the_results_render() -> None:
    """The block between this benchmark's markers of docs/performance.md is exactly
    ``table()`` of the committed bench/results/trace_storage.json: re-render with
    ``python -m bench.trace_storage --table``."""
    from bench.report import DEFAULT_RESULTS

    content = trace_storage.DOC.read_text()
    block = content.split(trace_storage.BEGIN, 1)[1].split(trace_storage.END, 1)[0]
    assert block.strip("\n") == trace_storage.table(DEFAULT_RESULTS), \
        "docs/performance.md is stale: run python -m bench.trace_storage --table"
