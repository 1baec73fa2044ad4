"""Progress on standard error when it is a terminal (a real pseudo-terminal), one summary
line at the end; nothing extra when it is a pipe."""

from __future__ import annotations

import os
import pty
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from lamina.store import Store
from tests.cli.procs import LAMINA, SCHEMA, updates

ROWS = 300_000


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("progress") / "data"
    with Store.open(root, segment_bytes=1 << 20, fsync="never") as store:
        rel = store.create_relation("orders", SCHEMA, key=["id"])
        for i in range(3):
            ids = np.arange(i * (ROWS // 3), (i + 1) * (ROWS // 3), dtype=np.int64)
            rel.append(updates(ids, ["item"] * len(ids), i))
            rel.seal(i + 1)
    return root


def on_terminal(*args: str) -> tuple[int, bytes, bytes]:
    """Run ``lamina ARGS`` with standard error on a pseudo-terminal and standard output on
    a pipe; return the exit code, what the terminal showed and what stdout got."""
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "LAMINA_DATA_DIR"}
    env.update(TERM="xterm-256color", COLUMNS="120")
    proc = subprocess.Popen([LAMINA, *args], stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the process closed its end of the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    assert proc.stdout is not None
    stdout = proc.stdout.read()
    proc.stdout.close()
    return proc.wait(60), shown, stdout


def last_line(shown: bytes) -> str:
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.decode(errors="replace"))
    return [line.strip() for line in re.split(r"[\r\n]", text) if line.strip()][-1]


def test_snapshot_shows_progress_and_a_summary_on_a_terminal(data: Path,
                                                             tmp_path: Path) -> None:
    target = tmp_path / "out.parquet"
    code, shown, stdout = on_terminal("snapshot", "orders", "--data-dir", str(data),
                                      "--format", "parquet", "--output", str(target))
    assert code == 0, shown
    assert stdout == b""
    assert b"reading orders at latest" in shown  # the bar's description
    assert re.fullmatch(rf"wrote 300,000 rows to {re.escape(str(target))} in \d+\.\d s",
                        last_line(shown)), shown[-400:]


def test_verify_shows_progress_and_a_summary_on_a_terminal(data: Path) -> None:
    code, shown, stdout = on_terminal("verify", "--data-dir", str(data))
    assert code == 0, shown
    assert stdout.decode().splitlines()[-1] == "1 relations checked, 0 with problems"
    assert b"verifying" in shown
    assert re.fullmatch(r"checked \d+\.\d MB of 1 relations in \d+\.\d s",
                        last_line(shown)), shown[-400:]


def test_nothing_extra_when_piped(data: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LAMINA_DATA_DIR"}
    for args in (["snapshot", "orders", "--format", "parquet", "--output",
                  str(tmp_path / "o.parquet")], ["verify"]):
        out = subprocess.run([LAMINA, *args, "--data-dir", str(data)], capture_output=True,
                             timeout=120, check=False, env=env)
        assert out.returncode == 0
        assert out.stderr == b"", args
