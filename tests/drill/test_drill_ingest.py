"""``lamina drill --ingest files``: the final check catches a lost, a doubled and a foreign
line (fast), and a small drill of 8 kills (random and every ``ingest.*`` fail point) with
the compacter daemon running finds nothing (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from lamina import Store
from lamina.drill.ingest import POINTS, RANDOM, SOURCE, IngestDrill

LAMINA = str(Path(sys.executable).with_name("lamina"))


def _stored(tmp_path: Path, ids: list[int]) -> IngestDrill:
    data = tmp_path / "data"
    with Store.open(data) as store:
        rel = store.create_relation(SOURCE, pa.schema([pa.field("id", pa.int64(), False),
                                                       pa.field("text", pa.string())]), ["id"])
        rel.append(pa.table({"id": pa.array(ids, pa.int64()),
                             "text": [f"line {i}" for i in ids],
                             "_time": pa.array([i for i in range(len(ids))], pa.uint64()),
                             "_diff": pa.array([1] * len(ids), pa.int64())}))
        rel.seal(len(ids) + 1)
    return IngestDrill(data, tmp_path / "work", kills=0, seed=1, daemon=False)


def test_check_accepts_every_line_once(tmp_path: Path) -> None:
    drill = _stored(tmp_path, list(range(50)))
    drill._check(50)
    assert drill.report.violations == []
    assert drill.report.rows_checked == 50


@pytest.mark.parametrize(("ids", "what"), [
    ([i for i in range(50) if i != 17], "1 lines missing: [17]"),
    ([*range(50), 50], "1 rows not written: [50]"),
])
def test_check_catches_lost_and_foreign_lines(tmp_path: Path, ids: list[int],
                                              what: str) -> None:
    drill = _stored(tmp_path, ids)
    drill._check(50)
    assert drill.report.violations == [what]


def test_check_catches_a_doubled_line(tmp_path: Path) -> None:
    drill = _stored(tmp_path, list(range(50)))
    with Store.open(drill.data_dir) as store:  # line 3 applied a second time
        rel = store.relation(SOURCE)
        rel.append(pa.table({"id": pa.array([3], pa.int64()), "text": ["line 3"],
                             "_time": pa.array([60], pa.uint64()),
                             "_diff": pa.array([1], pa.int64())}))
        rel.seal(61)
    drill._check(50)
    assert drill.report.violations == ["1 rows with _diff != 1: [(3, 2)]"]


@pytest.mark.slow
def test_small_ingest_drill_finds_nothing(tmp_path: Path) -> None:
    """The daemon alongside runs the in-process executor: what is drilled is ingest's
    exactly-once across kills; the daemon only has to convert the output at the end."""
    report = tmp_path / "report.json"
    proc = subprocess.run([LAMINA, "drill", "--ingest", "files", "--kills", "8", "--seed",
                           "5", "--executor", "inprocess", "--data-dir",
                           str(tmp_path / "data"), "--report", str(report)],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(report.read_text())
    assert doc["executor"] == "inprocess"
    assert doc["violations"] == []
    assert doc["total_kills"] == 8
    assert set(doc["kills"]) == {RANDOM, *POINTS}, doc["kills"]
    assert doc["lines_written"] > 1000
    assert doc["rows_checked"] == doc["lines_written"]
    assert doc["daemon_caught_up"] is True
    assert doc["upper_checks"] == 8


def test_the_ingest_drill_refuses_a_mixed_executor(tmp_path: Path) -> None:
    proc = subprocess.run([LAMINA, "drill", "--ingest", "files", "--executor", "mixed",
                           "--data-dir", str(tmp_path / "data")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert "--executor mixed is for the store drill" in proc.stderr
    assert not (tmp_path / "data").exists()
