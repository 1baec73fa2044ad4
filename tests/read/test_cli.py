"""snapshot, lookup and subscribe as a user runs them: subprocesses, signals, output."""

from __future__ import annotations

import json
import os
import random
import selectors
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa

from lamina import CLOSED, Store
from tests.read.data import random_rows
from tests.read.test_subscribe import Acc, state_at
from tests.trace.helpers import KEY, NAME, SCHEMA, Oracle

LAMINA = str(Path(sys.executable).with_name("lamina"))


def lamina(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([LAMINA, *args], capture_output=True, timeout=120, check=False)


def written(root: Path, rounds: int = 10, seed: int = 2) -> Oracle:
    oracle = Oracle()
    rng = random.Random(seed)
    with Store.open(root, segment_bytes=4096, fsync="never") as store:
        rel = store.create_relation(NAME, SCHEMA, KEY)
        for _ in range(rounds):
            oracle.append(rel, random_rows(rng, oracle.upper, 8, 15))
            oracle.seal(rel, oracle.upper + 2)
    return oracle


def test_snapshot_output_errors_are_one_line(tmp_path: Path) -> None:
    written(tmp_path)
    out = lamina("snapshot", NAME, "--as-of", "1", "--data-dir", str(tmp_path),
                 "--output", str(tmp_path / "no" / "such" / "dir.csv"))
    assert out.returncode == 1
    err = out.stderr.decode()
    assert err.startswith("lamina: cannot write --output"), err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err


def test_snapshot_arrow_and_lookup(tmp_path: Path) -> None:
    oracle = written(tmp_path)
    as_of = oracle.upper - 1
    out = lamina("snapshot", NAME, "--as-of", str(as_of), "--data-dir", str(tmp_path),
                 "--format", "arrow")
    assert out.returncode == 0, out.stderr
    assert pa.ipc.open_stream(out.stdout).read_all().to_pylist() == oracle.snapshot(as_of)
    out = lamina("lookup", NAME, "3", "7", "--as-of", str(as_of), "--data-dir",
                 str(tmp_path), "--format", "jsonl")
    assert out.returncode == 0, out.stderr
    got = [json.loads(line) for line in out.stdout.splitlines()]
    assert got == [r for r in oracle.snapshot(as_of) if r["id"] in (3, 7)]
    bad = lamina("lookup", NAME, "x", "--as-of", str(as_of), "--data-dir", str(tmp_path))
    assert bad.returncode == 2
    assert b"do not parse" in bad.stderr


class Subscriber:
    """``lamina subscribe`` as a subprocess whose JSON lines are read as they come."""

    def __init__(self, root: Path, *args: str) -> None:
        self.proc = subprocess.Popen([LAMINA, "subscribe", NAME, "--data-dir", str(root),
                                      *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)
        self.buf = b""
        self.lines: list[dict[str, Any]] = []

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.sel.close()
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()

    def read_until(self, pred: Any, timeout: float = 30) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while not (self.lines and pred(self.lines[-1])):
            assert time.monotonic() < deadline, self.lines[-3:]
            if self.sel.select(0.1):
                chunk = self.proc.stdout.read() or b""
                if not chunk and self.proc.poll() is not None:
                    raise AssertionError(f"subscriber exited: {self.proc.stderr.read()!r}")  # type: ignore[union-attr]
                self.buf += chunk
                *full, self.buf = self.buf.split(b"\n")
                self.lines.extend(json.loads(line) for line in full)


def test_subscribe_killed_and_resumed(tmp_path: Path) -> None:
    """A subscriber killed with SIGKILL resumes from the last progress it printed; with
    what it printed before, the output equals the oracle; SIGTERM stops it cleanly, and a
    CLOSED upper ends it by itself."""
    oracle = written(tmp_path, rounds=4)
    rng = random.Random(4)
    acc: Acc = defaultdict(int)
    with Store.open(tmp_path, segment_bytes=4096, fsync="never") as store:
        rel = store.relation(NAME)
        first = Subscriber(tmp_path, "--as-of", "2")
        first.read_until(lambda r: "_progress" in r)
        for _ in range(5):
            oracle.append(rel, random_rows(rng, oracle.upper, 5, 15))
            oracle.seal(rel, oracle.upper + 2)
        target = oracle.upper
        first.read_until(lambda r: r.get("_progress") == target)
        first.close()  # SIGKILL
        resume = max(r["_progress"] for r in first.lines if "_progress" in r)
        for r in first.lines:
            if "_progress" not in r:
                acc[(r["id"], r["item"], r["_time"])] += r["_diff"]
        second = Subscriber(tmp_path, "--as-of", str(resume - 1), "--no-snapshot")
        for _ in range(5):
            oracle.append(rel, random_rows(rng, oracle.upper, 5, 15))
            oracle.seal(rel, oracle.upper + 2)
        target = oracle.upper
        second.read_until(lambda r: r.get("_progress") == target)
        second.proc.send_signal(signal.SIGTERM)
        assert second.proc.wait(10) == 0
        second.close()
        for r in second.lines:
            if "_progress" not in r:
                acc[(r["id"], r["item"], r["_time"])] += r["_diff"]
        for t in range(2, oracle.upper):
            assert state_at(acc, t) == oracle.snapshot(t), t
        third = Subscriber(tmp_path, "--as-of", str(oracle.upper - 1), "--no-snapshot")
        rel.seal(CLOSED)
        third.read_until(lambda r: r.get("_progress") == CLOSED)
        assert third.proc.wait(10) == 0
        third.close()
