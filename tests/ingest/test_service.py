"""``lamina ingest`` as a real subprocess: SIGTERM drains, HTTP endpoints, a stalled source
beside a running one, configuration errors."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from lamina import Store
from tests.ingest.procs import (
    LAMINA,
    Ingest,
    caught_up,
    files_source_toml,
    write_config,
)


def snapshot_rows(data_dir: Path, relation: str) -> list[dict[str, Any]]:
    with Store.open(data_dir) as store:
        rel = store.relation(relation)
        assert rel.upper > 0
        return list(rel.snapshot(rel.upper - 1).to_pylist())


def test_sigterm_makes_what_was_read_durable_and_exits_0(tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    data = tmp_path / "data"
    # One binding at start, the next only after 60 s: what is read later is made durable
    # by the drain alone.
    cfg = write_config(tmp_path / "ingest.toml", data,
                       [files_source_toml("slow", src, interval=60.0)])
    (src / "a.jsonl").write_text("")
    proc = Ingest(cfg, tmp_path / "ingest.log")
    try:
        proc.wait_for(lambda st: st["slow"]["binding_time"] is not None)
        with open(src / "a.jsonl", "a") as f:
            for i in range(100):
                f.write(json.dumps({"id": i, "name": f"n{i}"}) + "\n")
        size = (src / "a.jsonl").stat().st_size
        st = proc.wait_for(lambda st: st["slow"]["source_upper"] == json.dumps(["a.jsonl", size]))
        assert st["slow"]["binding_upper"] == json.dumps(["a.jsonl", 0])   # read, not written
        assert proc.terminate() == 0
    finally:
        proc.kill()
    got = snapshot_rows(data, "slow")
    assert sorted(r["id"] for r in got) == list(range(100))
    assert all(r["_diff"] == 1 for r in got)
    events = [e["event"] for e in proc.events()]
    assert "ingest.stopping" in events
    assert events[-1] == "ingest.stopped"


def test_a_stalled_source_does_not_block_the_other_and_http_reports_it(tmp_path: Path) -> None:
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    data = tmp_path / "data"
    (bad / "x.csv").write_text("id,name\n1,a\nzz,b\n3,c\n")
    (good / "a.jsonl").write_text("".join(json.dumps({"id": i, "name": "g"}) + "\n"
                                          for i in range(10)))
    cfg = write_config(tmp_path / "ingest.toml", data, [
        files_source_toml("good", good), files_source_toml("bad", bad, fmt="csv")])
    proc = Ingest(cfg, tmp_path / "ingest.log")
    try:
        st = proc.wait_for(lambda st: st["bad"]["state"] == "stalled")
        assert "x.csv line 3" in st["bad"]["error"]
        assert "line 3" in st["bad"]["hint"]
        proc.wait_for(caught_up("good", good, "a.jsonl"))
        # the stalled source holds no one up: the good one keeps taking lines
        with open(good / "a.jsonl", "a") as f:
            for i in range(10, 20):
                f.write(json.dumps({"id": i, "name": "g"}) + "\n")
        st = proc.wait_for(caught_up("good", good, "a.jsonl"))
        assert st["good"]["outputs"][0]["state"] == "running"
        assert st["good"]["transactions"] >= 2
        assert st["bad"]["outputs"][0]["state"] == "stalled"

        assert proc.get("/healthz") == (200, b"ok\n")
        code, body = proc.get("/readyz")
        assert code == 503
        assert b"bad: stalled" in body
        code, body = proc.get("/metrics")
        text = body.decode()
        assert code == 200
        assert 'lamina_source_state{source="bad",state="stalled"} 1.0' in text
        assert 'lamina_source_state{source="good",state="running"} 1.0' in text
        assert 'lamina_source_changes_total{relation="good",source="good"} 20.0' in text
        assert 'lamina_source_lag_offsets{source="good"} 0.0' in text
        assert "lamina_source_bindings_total" in text
        assert "lamina_source_lag_seconds" in text
        # resync: a files source re-reads its files instead; bad requests are named
        assert post(proc, "/v1/sources/good/resync", {"table": "good"})[0] == 409
        code, answer = post(proc, "/v1/sources/nope/resync", {"table": "good"})
        assert code == 404
        assert "no source 'nope'" in answer["error"]
        code, answer = post(proc, "/v1/sources/good/resync", {"table": "other"})
        assert code == 404
        assert "has no table 'other'" in answer["error"]
        assert post(proc, "/v1/sources/good/resync", {"tab": 1})[0] == 400
        assert proc.terminate() == 0
    finally:
        proc.kill()
    assert sorted(r["id"] for r in snapshot_rows(data, "good")) == list(range(20))
    assert [r["id"] for r in snapshot_rows(data, "bad")] == [1]     # line 2 only, none after
    logged = [e for e in proc.events() if e.get("event") == "source.stalled"]
    assert logged
    assert logged[0]["source"] == "bad"
    assert "line 3" in logged[0]["error"]


def post(proc: Ingest, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://127.0.0.1:{proc.wait_port()}{path}",
                                 data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:  # noqa: S310
            return int(r.status), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        with exc:  # it holds the connection: closed here, not by the garbage collector
            return int(exc.code), json.loads(exc.read())


def test_restart_resumes_without_repeating(tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    data = tmp_path / "data"
    cfg = write_config(tmp_path / "ingest.toml", data, [files_source_toml("s", src)])
    for round_ in range(3):
        with open(src / "a.jsonl", "a") as f:
            for i in range(round_ * 5, round_ * 5 + 5):
                f.write(json.dumps({"id": i, "name": "x"}) + "\n")
        proc = Ingest(cfg, tmp_path / "ingest.log")
        try:
            st = proc.wait_for(caught_up("s", src, "a.jsonl"))
            assert st["s"]["resume_frontier"] >= 0
            assert proc.terminate() == 0
        finally:
            proc.kill()
    got = snapshot_rows(data, "s")
    assert sorted(r["id"] for r in got) == list(range(15))
    assert {r["_diff"] for r in got} == {1}


def test_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[[sources]]\nname = "s"\nkind = "files"\npath = "/tmp"\nformat = "jsonl"\n'
                   'schema = { id = "int65" }\n')
    t0 = time.monotonic()
    res = subprocess.run([*LAMINA, "ingest", "--config", str(cfg)], capture_output=True,
                         check=False,
                         text=True, timeout=60)
    assert res.returncode == 2
    assert "sources.0.files.schema" in res.stderr
    assert "int65" in res.stderr
    assert time.monotonic() - t0 < 30


def test_systemd_notify_ready_watchdog_stopping(tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    cfg = write_config(tmp_path / "ingest.toml", tmp_path / "data",
                       [files_source_toml("s", src)])
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(30)
    # WATCHDOG_PID unset: the watchdog is meant for the process systemd started
    proc = Ingest(cfg, tmp_path / "ingest.log",
                  {"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "200000"})
    try:
        got: list[str] = []
        while not ("READY=1" in got and got.count("WATCHDOG=1") >= 2):
            got.extend(sock.recv(4096).decode().splitlines())
        assert proc.terminate() == 0
        sock.settimeout(5)
        while "STOPPING=1" not in got:
            got.extend(sock.recv(4096).decode().splitlines())
    finally:
        proc.kill()
        sock.close()
    assert got.index("READY=1") < got.index("STOPPING=1")
