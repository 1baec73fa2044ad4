"""Exactly once across kill -9: ``lamina ingest`` on a growing directory, SIGKILLed at
random moments and at each ingest fail point, restarted; at the end every output holds
every line exactly once (compared with an oracle the writer keeps)."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lamina import Store
from tests.ingest.procs import Ingest, caught_up, files_source_toml, write_config

FAILPOINTS = ("ingest.binding_sealed", "ingest.outputs_appended", "ingest.outputs_sealed",
              "ingest.offset_committed", "wal.after_write")


class Writer(threading.Thread):
    """Appends lines to rotating files, some split across two writes (partial lines),
    some malformed (they belong in the errors relation). Keeps the oracle."""

    def __init__(self, directory: Path, seed: int) -> None:
        super().__init__(daemon=True)
        self.dir = directory
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.good: list[int] = []
        self.bad: list[tuple[str, int]] = []      # (file, line number)
        self.file = ""
        self.next_id = 0

    def run(self) -> None:
        n_file = 0
        while not self.stop.is_set():
            n_file += 1
            self.file = f"part-{n_file:04d}.jsonl"
            line_no = 0
            with open(self.dir / self.file, "ab", buffering=0) as f:
                for _ in range(self.rng.randint(20, 120)):
                    if self.stop.is_set():
                        break
                    line_no += 1
                    if self.rng.random() < 0.03:
                        data = b'{"id": "oops", "name": 1}\n'
                        self.bad.append((self.file, line_no))
                    else:
                        i = self.next_id
                        self.next_id += 1
                        data = (json.dumps({"id": i, "name": f"n{i}"}) + "\n").encode()
                        self.good.append(i)
                    if self.rng.random() < 0.1:       # a partial line, completed later
                        cut = self.rng.randint(1, len(data) - 1)
                        f.write(data[:cut])
                        time.sleep(0.01)
                        f.write(data[cut:])
                    else:
                        f.write(data)
                    time.sleep(self.rng.uniform(0, 0.004))


@pytest.mark.slow
def test_every_line_exactly_once_across_kill_9(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    src = tmp_path / "in"
    src.mkdir()
    data = tmp_path / "data"
    cfg = write_config(tmp_path / "ingest.toml", data,
                       [files_source_toml("s", src, interval=0.02, errors="relation")])
    writer = Writer(src, seed)
    writer.start()
    log = tmp_path / "ingest.log"
    kills: list[str] = []
    try:
        for round_ in range(10):
            env: dict[str, str] = {}
            if round_ % 2 == 1:
                point = FAILPOINTS[(round_ // 2) % len(FAILPOINTS)]
                env["LAMINA_FAILPOINTS"] = f"{point}=kill@{rng.randint(1, 12)}"
            proc = Ingest(cfg, log, env)
            try:
                proc.wait_event("source.running")
                # a fail point's round lasts until it fires (the writer keeps adding files
                # to bind), with a bound; a random kill's round a moment
                deadline = time.monotonic() + (30.0 if env else rng.uniform(0.2, 1.0))
                while time.monotonic() < deadline and proc.proc.poll() is None:
                    time.sleep(0.02)
            finally:
                died = proc.proc.poll() is not None
                proc.kill()
            kills.append(f"{env.get('LAMINA_FAILPOINTS', 'random')}:{'fp' if died else 'sig'}")
        writer.stop.set()
        writer.join()
        proc = Ingest(cfg, log)
        try:
            # a bound, not a pause: the backlog of ten rounds, on a loaded machine
            proc.wait_for(caught_up("s", src, writer.file), timeout=240)
            assert proc.terminate() == 0
        finally:
            proc.kill()
    finally:
        writer.stop.set()
    with Store.open(data) as store:
        rel = store.relation("s")
        got: list[dict[str, Any]] = rel.snapshot(rel.upper - 1).to_pylist()
        err = store.relation("s.errors")
        bad = err.snapshot(err.upper - 1).to_pylist()
        remap = store.relation("s.remap")
        bindings = remap.snapshot(remap.upper - 1).to_pylist()
        assert rel.upper == err.upper      # every output sealed to the same time
    context = f"seed={seed} kills={kills}"
    assert [r["id"] for r in got] == sorted(writer.good), context
    assert {r["_diff"] for r in got} == {1}, context
    assert sorted((r["file"], r["line"]) for r in bad) == sorted(writer.bad), context
    assert {r["_diff"] for r in bad} <= {1}, context
    assert len(bindings) <= 3, context     # old bindings are retracted
    assert any(k.endswith(":fp") for k in kills), context   # fail points did fire
