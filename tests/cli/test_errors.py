"""Every command fails in one line, never a traceback: a closed pipe, Ctrl-C and SIGTERM in
the middle of writing ``--output`` (no partial file), bad arguments, a directory that is not
a data directory (nothing created), binary data as CSV. Real subprocesses, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import lamina as package
from lamina.store import Store
from tests.cli.procs import LAMINA, SCHEMA, lamina, one_line, orders, updates

BROKEN_PIPE = 141


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("errors") / "data"
    orders(root, rows=20_000)
    return root


def test_version_and_python_dash_m() -> None:
    out = lamina("--version")
    assert out.returncode == 0
    assert out.stdout.decode() == f"lamina {package.__version__}\n"
    import sys

    mod = subprocess.run([sys.executable, "-m", "lamina", "--version"], capture_output=True,
                         check=False, timeout=60)
    assert mod.returncode == 0
    assert mod.stdout == out.stdout
    from importlib.metadata import version

    assert version("lamina") == package.__version__  # pyproject takes it from the package
    assert subprocess.run([sys.executable, "-m", "lamina", "--help"], capture_output=True,
                          check=False, timeout=60).returncode == 0


@pytest.mark.parametrize("args", [
    ["status"], ["status", "--json"], ["verify"], ["relations"], ["relations", "--json"],
    ["describe", "orders"], ["describe", "orders", "--json"],
    ["snapshot", "orders"], ["snapshot", "orders", "--format", "jsonl"],
    ["snapshot", "orders", "--format", "parquet"], ["snapshot", "orders", "--format", "arrow"],
    ["lookup", "orders", "1", "2", "--format", "jsonl"],
    ["subscribe", "orders"],  # blocks until CLOSED: ends by its first write failing
    ["--version"], ["--help"], ["snapshot", "--help"],
], ids=" ".join)
def test_a_closed_pipe_ends_every_command_quietly(data: Path, args: list[str]) -> None:
    """Standard output whose reader is gone (``| head`` that exited): exit 141, as for a
    Unix tool killed by SIGPIPE, and nothing on standard error: no BrokenPipeError, no
    "Exception ignored" from the interpreter's last flush."""
    argparse_only = "--help" in args or "--version" in args
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to write_end now fails with EPIPE
    try:
        out = subprocess.run([LAMINA, *args, *([] if argparse_only else
                                               ["--data-dir", str(data)])],
                             stdout=write_end, stderr=subprocess.PIPE, timeout=120,
                             check=False)
    finally:
        os.close(write_end)
    assert out.stderr == b""
    # argparse's --help and --version swallow the failed write themselves (exit 0)
    assert out.returncode == (0 if argparse_only else BROKEN_PIPE)


def test_status_json_into_head_c1(data: Path) -> None:
    """The issue's pipelines, in a real shell: only head's byte, no traceback."""
    for command in (f"{LAMINA} status --json --data-dir {data} | head -c1",
                    f"{LAMINA} verify --data-dir {data} | head -c1",
                    f"{LAMINA} snapshot orders --format jsonl --data-dir {data} | head -c1"):
        out = subprocess.run(["bash", "-c", f"set -o pipefail; {command}"],
                             capture_output=True, timeout=120, check=False)
        assert len(out.stdout) == 1, command
        assert out.stderr == b"", (command, out.stderr)
        assert out.returncode in (0, BROKEN_PIPE), command


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A relation large enough that writing its JSON lines takes seconds (1.5M rows, about
    70 MB)."""
    root = tmp_path_factory.mktemp("big") / "data"
    with Store.open(root, fsync="never") as store:
        rel = store.create_relation("big", SCHEMA, key=["id"])
        for i in range(6):
            ids = np.arange(i * 250_000, (i + 1) * 250_000, dtype=np.int64)
            rel.append(updates(ids, ["x" * 24] * len(ids), 0))
        rel.seal(1)
    return root


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_write_leaves_no_output(big: Path, tmp_path: Path,
                                             sig: signal.Signals) -> None:
    """Ctrl-C (SIGINT, what a terminal sends) or SIGTERM while ``lamina snapshot --output``
    is writing: one line, exit 128 + the signal, and neither the output file nor its
    temporary file is left."""
    target = tmp_path / "out" / "snap.jsonl"
    target.parent.mkdir()
    for _ in range(3):  # the rare run that finished before the signal landed: run again
        proc = subprocess.Popen([LAMINA, "snapshot", "big", "--data-dir", str(big),
                                 "--format", "jsonl", "--output", str(target)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while not any(p.stat().st_size > 0 for p in target.parent.iterdir()) and \
                proc.poll() is None:
            assert time.monotonic() < deadline, "the snapshot never started writing"
            time.sleep(0.01)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
        if proc.returncode != 0:
            break
        target.unlink()
    assert proc.returncode == 128 + sig, stderr
    assert one_line(stderr) == ("interrupted" if sig == signal.SIGINT else
                                "interrupted (SIGTERM)")
    assert stdout == b""
    assert list(target.parent.iterdir()) == [], "a partial or temporary file was left"


def test_output_appears_whole(data: Path, tmp_path: Path) -> None:
    target = tmp_path / "snap.csv"
    target.write_bytes(b"an older file, replaced whole")
    out = lamina("snapshot", "orders", "--data-dir", str(data), "--output", str(target))
    assert out.returncode == 0, out.stderr
    assert out.stderr == b""  # not a terminal: no progress, no summary
    assert [p.name for p in tmp_path.iterdir()] == ["snap.csv"]
    assert target.read_bytes().count(b"\n") == 20_001


def test_a_path_that_is_not_a_data_directory_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    empty = tmp_path / "empty"
    empty.mkdir()
    for root in (missing, empty):
        for args in (["status"], ["verify"], ["relations"], ["describe", "x"],
                     ["snapshot", "x"], ["lookup", "x", "1"], ["subscribe", "x"],
                     ["drop", "x", "--yes"]):
            out = lamina(*args, "--data-dir", str(root))
            assert out.returncode == 1, (args, out.stderr)
            assert "is not a lamina data directory" in one_line(out.stderr), args
    assert not missing.exists()
    assert list(empty.iterdir()) == []


def test_usage_errors_are_exit_2_and_name_the_problem(data: Path) -> None:
    cases = {
        ("snapshot", "orders", "--as-of", "soon"): "--as-of 'soon' is not a time",
        ("drop", "orders"): "run it again with --yes",
        ("lookup", "orders", "x"): "keys do not parse",
    }
    for args, message in cases.items():
        out = lamina(*args, "--data-dir", str(data))
        assert out.returncode == 2, (args, out.stderr)
        assert message in one_line(out.stderr), args
    bad = lamina("snapshot")  # argparse's own usage message, exit 2
    assert bad.returncode == 2
    assert b"Traceback" not in bad.stderr


def test_missing_relation_and_failed_reads_are_one_line(data: Path) -> None:
    out = lamina("snapshot", "nope", "--data-dir", str(data))
    assert out.returncode == 1
    assert "does not exist" in one_line(out.stderr)
    late = lamina("snapshot", "orders", "--as-of", "5", "--data-dir", str(data))
    assert late.returncode == 1
    assert "outside [since, upper)" in one_line(late.stderr)


def test_csv_of_binary_that_is_not_utf8(tmp_path: Path) -> None:
    """The issue's traceback: --format csv on a binary column holding non-UTF-8 bytes."""
    import base64

    import pyarrow as pa

    with Store.open(tmp_path, fsync="never") as store:
        rel = store.create_relation("blobs", pa.schema([("id", pa.int64()),
                                                        ("b", pa.binary())]), key=["id"])
        rel.append(pa.table({"id": pa.array([1, 2], pa.int64()),
                             "b": pa.array([b"\xff\xfe\x00", b"ok"]),
                             "_time": pa.array([0, 0], pa.uint64()),
                             "_diff": pa.array([1, 1], pa.int64())}))
        rel.seal(1)
    out = lamina("snapshot", "blobs", "--data-dir", str(tmp_path), "--format", "csv")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.decode().splitlines()
    assert lines[0] == '"id","b","_diff"'
    assert [base64.b64decode(line.split(",")[1].strip('"')) for line in lines[1:]] == \
        [b"\xff\xfe\x00", b"ok"]
