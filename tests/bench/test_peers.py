"""bench/peers.py runs end to end on its quick cell, so the benchmark code cannot rot.

The quick cell is 20,000 updates in 20 appends over 2,000 keys; one round of every
contender (lamina with its daemon, with its default retention and with its WAL compressed
by lz4 and by zstd; Delta durable, Delta without fsync, Delta MERGE), each in its own
process, including the kill -9 recovery and the correctness
gate. Results go to a temporary directory (``LAMINA_BENCH_RESULTS``), so the committed
results and docs/performance.md are left alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench.peers_contenders import CONTENDERS
from bench.peers_lamina import DAEMON_SETTINGS, WAL_BACKLOG_BYTES
from bench.peers_stream import CELLS, appends, checksum, ensure

from bench import peers

ROOT = Path(__file__).resolve().parents[2]


def test_the_stream_retracts_only_live_rows_and_its_checksum_is_the_live_rows() -> None:
    """The cached stream's running count of every row never goes negative, about a fifth
    of the updates are retractions, and expected.json's checksum is that of the rows the
    whole stream leaves live."""
    import pyarrow as pa

    cell = CELLS["quick"]
    expected = ensure(cell)
    counts: dict[tuple[int, int], int] = {}
    retractions = 0
    for table in appends(cell):
        d = table.to_pydict()
        # within an append inserts may come after the retraction of an older row
        for i, q, diff in zip(d["id"], d["qty"], d["_diff"], strict=True):
            if diff > 0:
                counts[(i, q)] = counts.get((i, q), 0) + diff
        for i, q, diff in zip(d["id"], d["qty"], d["_diff"], strict=True):
            if diff < 0:
                retractions += 1
                counts[(i, q)] += diff
                assert counts[(i, q)] >= 0
    assert 0.15 < retractions / cell.updates < 0.25
    live = {k: v for k, v in counts.items() if v}
    rows = pa.table({"id": [k[0] for k in live], "qty": [k[1] for k in live],
                     "count": list(live.values())})
    assert peers.gate({"x": {"finished": True, "checksums": [checksum(rows)]}},
                      str(expected["checksum"])) == {}


def test_a_rerun_of_some_contenders_keeps_the_others_with_their_run() -> None:
    """Rerunning a cell with a subset of the contenders replaces theirs and keeps the
    others' figures, each named with the run it comes from (also across two reruns); the
    ratios are taken over all of them."""
    def fig(v: float) -> dict[str, dict[str, float]]:
        return {"throughput": {"median": v}}

    first = {"when": "2026-11-24T08:14:56Z", "command": "first", "gate": "passed",
             "contenders": {"lamina": fig(1), "delta": fig(2), "delta-merge": fig(3)}}
    second = {"when": "2026-11-27T20:00:00Z", "command": "second", "gate": "passed",
              "ratios": {}, "contenders": {"lamina": fig(10), "delta": fig(20)}}
    merged = peers.keep_earlier(second, first)
    assert merged["contenders"] == {"lamina": fig(10), "delta": fig(20),
                                    "delta-merge": fig(3)}
    assert merged["earlier"] == {"delta-merge": {"when": first["when"], "command": "first"}}
    third = {**second, "when": "2026-11-28T00:00:00Z", "command": "third",
             "contenders": {"lamina": fig(100)}}
    again = peers.keep_earlier(third, merged)
    assert again["contenders"]["delta-merge"] == fig(3)
    # this run's lamina against the delta kept from the second run
    assert again["ratios"]["throughput"]["ratio"] == 5.0
    assert again["earlier"] == {"delta-merge": {"when": first["when"], "command": "first"},
                                "delta": {"when": second["when"], "command": "second"}}
    assert peers.keep_earlier(second, None) is second


@pytest.mark.slow  # lamina daemons (in-process executor) and Delta Lake: about 30 s
def test_the_quick_cell_runs_end_to_end_and_passes_the_gate(tmp_path: Path) -> None:
    """One round of every contender: all finish, all give the stream's checksum, the
    ratios against durable Delta are computed, and recovery lost no acknowledged append;
    a wrong expected checksum makes the gate name every contender."""
    # lamina's daemons run the in-process executor here (LAMINA_EXECUTOR, which the
    # bench's daemons inherit): what is tested is the harness (contenders, recovery, gate,
    # ratios, table), not the Spark jobs, and two JVMs cost the suite half a minute of CPU
    env = {**os.environ, "LAMINA_BENCH_RESULTS": str(tmp_path), "LAMINA_EXECUTOR": "inprocess"}
    proc = subprocess.run([sys.executable, "-m", "bench.peers", "--cells", "quick",
                           "--rounds", "1"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "peers.json").read_text())
    cell = doc["cells"]["quick"]
    assert cell["gate"] == "passed"
    assert set(cell["contenders"]) == set(CONTENDERS)
    for name, s in cell["contenders"].items():
        assert s["finished"] == 1, name
        assert s["checksums"] == [cell["expected"]["checksum"]], name
        assert s["lost_acked"]["max"] == 0, name
        assert s["end_bytes"]["median"] > 0, name
    assert cell["contenders"]["lamina"]["caught_up"]
    assert cell["contenders"]["lamina"]["settled"]  # caught up, and no merge was due
    assert cell["contenders"]["lamina"]["last"]["keep_versions"] == 1  # vacuum's retention
    assert cell["contenders"]["lamina-default"]["last"]["keep_versions"] == 8
    lamina, zstd = cell["contenders"]["lamina"]["last"], cell["contenders"]["lamina-zstd"]["last"]
    assert (lamina["wal_compression"], zstd["wal_compression"]) == ("none", "zstd")
    assert zstd["daemon_settings"] == DAEMON_SETTINGS["lamina-zstd"]  # the small-disk daemon
    assert zstd["wal_backlog_bytes"] == WAL_BACKLOG_BYTES["lamina-zstd"]  # and its writer
    assert lamina["wal_backlog_bytes"] is None
    assert lamina["backlog_wait_seconds"] == 0
    # the appends of the compressed contender wrote fewer bytes: the setting took effect
    assert zstd["append_write_bytes"] < 0.8 * lamina["append_write_bytes"]
    assert set(cell["ratios"]) == set(peers.TARGETS) | {
        "peak_bytes", "peak_bytes, WAL lz4", "peak_bytes, WAL zstd, small-disk daemon"}
    assert (tmp_path / "peers.png").stat().st_size > 0
    assert peers.gate(cell["contenders"], "0" * 64).keys() == set(CONTENDERS)
    assert "| quick | lamina |" in peers.table(tmp_path)
