"""The command line as a user runs it: subprocesses, exit codes, output."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from lamina.compacter.executors import reference
from lamina.drill.oracle import Oracle
from lamina.objstore.local import LocalObjectStore
from lamina.status import KEYS
from lamina.store import Store
from lamina.trace.plan import plan_conversion, plan_merge
from lamina.trace.trace import Trace
from lamina.wal.reader import segment_spans
from tests.cli.procs import lamina


@pytest.fixture(scope="module")
def populated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Oracle]:
    """A data dir written by the drill workload, half converted into a trace."""
    root = tmp_path_factory.mktemp("cli")
    data, ack = root / "data", root / "ack.jsonl"
    subprocess.run([sys.executable, "-m", "lamina.drill.workload", str(data), str(ack),
                    "--ops", "150", "--seed", "5", "--segment-bytes", "4096"], check=True,
                   capture_output=True)
    with Store.open(data) as store:
        rel = store.relation("drill")
        trace = Trace.open(store.layout.trace_store("drill"), rel.meta)
        spans = list(segment_spans(rel.wal_dir, "drill"))
        for span in spans[: len(spans) // 2]:
            reference.convert(trace, plan_conversion(trace.state, [span]))
            while (plan := plan_merge(trace.state)) is not None:
                reference.merge(trace, plan)
        trace.delete_converted_segments(rel.wal_dir)
    return data, Oracle.load(ack)


def test_status_json_has_exactly_the_documented_keys(populated: tuple[Path, Oracle]) -> None:
    data, oracle = populated
    out = lamina("status", "--data-dir", str(data), "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [tuple(r) for r in rows] == [KEYS]
    (row,) = rows
    assert row["name"] == "drill"
    assert row["sealed_upper"] == oracle.upper
    assert row["since"] == oracle.since
    assert 0 < row["trace_upper"] < oracle.upper
    assert row["wal_segments_pending"] > 0
    assert row["wal_bytes_pending"] > 0
    assert sum(row["batches_by_level"].values()) >= 1
    assert row["trace_bytes"] > 0
    assert row["quarantined"] is False


def test_status_table(populated: tuple[Path, Oracle]) -> None:
    data, _ = populated
    out = lamina("status", "--data-dir", str(data))
    assert out.returncode == 0
    assert b"drill" in out.stdout
    assert b"sealed_upper" in out.stdout


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_snapshot_formats_match_the_oracle(populated: tuple[Path, Oracle], fmt: str,
                                           tmp_path: Path) -> None:
    data, oracle = populated
    as_of = oracle.upper - 1
    target = tmp_path / f"out.{fmt}"
    out = lamina("snapshot", "drill", "--as-of", str(as_of), "--data-dir", str(data),
                 "--format", fmt, "--output", str(target))
    assert out.returncode == 0, out.stderr
    if fmt == "csv":
        rows = [(int(r["id"]), r["val"], int(r["_diff"]))
                for r in csv.DictReader(io.StringIO(target.read_text()))]
    elif fmt == "jsonl":
        rows = [(d["id"], d["val"], d["_diff"])
                for d in map(json.loads, target.read_text().splitlines())]
    else:
        rows = [(d["id"], d["val"], d["_diff"]) for d in pq.read_table(target).to_pylist()]
    assert sorted(rows) == oracle.snapshot(as_of)
    assert [r[0] for r in rows] == sorted(r[0] for r in rows), "not ordered by key"


def test_snapshot_to_stdout_and_refusals(populated: tuple[Path, Oracle]) -> None:
    data, oracle = populated
    ok = lamina("snapshot", "drill", "--as-of", str(oracle.since), "--data-dir", str(data),
                "--format", "jsonl")
    assert ok.returncode == 0
    assert len(ok.stdout.splitlines()) == len(oracle.snapshot(oracle.since))
    late = lamina("snapshot", "drill", "--as-of", str(oracle.upper), "--data-dir", str(data))
    assert late.returncode == 1
    assert b"outside [since, upper)" in late.stderr
    missing = lamina("snapshot", "nope", "--as-of", "0", "--data-dir", str(data))
    assert missing.returncode == 1
    assert b"does not exist" in missing.stderr
    nodir = lamina("status", "--data-dir", str(data / "nowhere"))
    assert nodir.returncode == 1
    assert b"not a lamina data directory" in nodir.stderr


def test_verify_passes_then_finds_a_flipped_bit(populated: tuple[Path, Oracle],
                                                tmp_path: Path) -> None:
    data, _ = populated
    good = lamina("verify", "--data-dir", str(data))
    assert good.returncode == 0, good.stdout + good.stderr
    assert b"0 with problems" in good.stdout
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(data, copy)
    from lamina.trace.state import StateStore

    state = StateStore(LocalObjectStore(copy / "trace" / "drill")).load_latest()
    assert state is not None
    victim = copy / "trace" / "drill" / state.batches[0].parts[0].path
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    victim.write_bytes(bytes(raw))
    bad = lamina("verify", "--data-dir", str(copy))
    assert bad.returncode == 1
    assert b"checksum mismatch" in bad.stdout
    assert victim.name.encode() in bad.stdout
