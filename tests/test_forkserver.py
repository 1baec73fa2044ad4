"""lamina.forkserver: children are real processes with their own argv, environment, fail
points, streams and exit status; signals reach only them; the server refuses to fork
when it is not single-threaded, and its death is reported, not waited on forever."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lamina.errors import ForkServerError, InvalidArgumentError
from lamina.forkserver import ForkServer

ROOT = Path(__file__).resolve().parents[1]
CHILD = "tests.forkserver_child"


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    with pytest.MonkeyPatch.context() as mp:  # the server imports tests.* by this path
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT),
                                                              os.environ.get("PYTHONPATH")])))
        forks = ForkServer([CHILD])
    try:
        yield forks
    finally:
        forks.close()


def run_report(server: ForkServer, tmp_path: Path, code: int, **env: str) -> tuple[
        dict[str, Any], str, int]:
    err = tmp_path / f"stderr-{code}"
    with err.open("wb") as f:
        child = server.spawn(f"{CHILD}:report", [str(code), "two words"],
                             env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=f)
    assert child.stdout is not None
    line = child.stdout.readline()
    exit_code = child.wait(30)
    child.stdout.close()
    return json.loads(line), err.read_text(), exit_code


def test_a_child_runs_the_target_with_its_own_argv_env_and_streams(
        server: ForkServer, tmp_path: Path) -> None:
    out, err, code = run_report(server, tmp_path, 3, FORKSERVER_MARKER="first")
    assert out["argv"] == ["3", "two words"]
    assert out["marker"] == "first"
    assert out["ppid"] == server.proc.pid  # a child of the server, not of this process
    assert out["stdin"] == ""  # /dev/null
    assert err == "to stderr\n"
    assert code == 3
    # the next child gets its own environment, not the last one's
    out2, _, code2 = run_report(server, tmp_path, 0)
    assert out2["marker"] is None
    assert out2["pid"] != out["pid"]
    assert code2 == 0


def test_a_child_reads_its_own_fail_points(server: ForkServer, tmp_path: Path) -> None:
    out, _, _ = run_report(server, tmp_path, 0, LAMINA_FAILPOINTS="wal.before_seal=kill@3")
    assert out["failpoints"] == "wal.before_seal=kill@3"
    out, _, _ = run_report(server, tmp_path, 0)
    assert out["failpoints"] is None


def test_signals_reach_the_child_and_its_exit_status_comes_back(server: ForkServer) -> None:
    for sig in (signal.SIGKILL, signal.SIGTERM):
        child = server.spawn(f"{CHILD}:sleep", ["60"], stdout=subprocess.PIPE)
        assert child.stdout is not None
        assert child.stdout.readline() == b"up\n"
        assert child.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(0.05)
        child.send_signal(sig)
        assert child.wait(30) == -sig
        child.stdout.close()
        child.kill()  # after the exit: nothing to signal, no error (as Popen)


def test_exceptions_and_bad_arguments_exit_non_zero(server: ForkServer,
                                                    tmp_path: Path) -> None:
    err = tmp_path / "stderr"
    with err.open("wb") as f:
        child = server.spawn(f"{CHILD}:fail", ["x"], stderr=f)
    assert child.wait(30) == 1
    assert "RuntimeError: failed on purpose: ['x']" in err.read_text()
    with err.open("wb") as f:  # argparse's SystemExit(2) is the exit code
        child = server.spawn("lamina.drill.workload:main", ["--no-such-flag"], stderr=f)
    assert child.wait(30) == 2
    assert "required: data_dir, ack_log" in err.read_text()


def test_many_threads_spawn_at_once(server: ForkServer, tmp_path: Path) -> None:
    results: dict[int, tuple[int, int]] = {}

    def worker(k: int) -> None:
        for j in range(4):
            child = server.spawn(f"{CHILD}:report", [str(k * 4 + j)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            results[k * 4 + j] = (child.pid, child.wait(60))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {n: code for n, (_, code) in results.items()} == {n: n for n in range(24)}
    assert len({pid for pid, _ in results.values()}) == 24


def test_bad_requests_are_refused_and_the_server_goes_on(server: ForkServer,
                                                        tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="module:function"):
        server.spawn("no_colon", [])
    with pytest.raises(InvalidArgumentError, match="stdout may be a pipe"):
        server.spawn(f"{CHILD}:report", ["0"], stderr=subprocess.PIPE)
    assert run_report(server, tmp_path, 5)[2] == 5


def test_a_preload_that_starts_a_thread_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    with pytest.raises(ForkServerError, match="2 threads after importing"):
        ForkServer(["tests.forkserver_threaded"])
    with pytest.raises(ForkServerError, match="No module named 'no_such_module'"):
        ForkServer(["no_such_module"])


def test_a_dead_server_is_reported_not_waited_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    forks = ForkServer([CHILD])
    try:
        child = forks.spawn(f"{CHILD}:sleep", ["60"], stdout=subprocess.PIPE)
        assert child.stdout is not None
        assert child.stdout.readline() == b"up\n"
        os.kill(forks.proc.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(ForkServerError, match="exit status of its child"):
            child.wait(60)
        assert time.monotonic() - started < 30
        assert not forks.alive()
        with pytest.raises(ForkServerError):
            forks.spawn(f"{CHILD}:report", ["0"])
        os.kill(child.pid, signal.SIGKILL)  # the orphan: init reaps it
        child.stdout.close()
    finally:
        forks.close()


def test_close_stops_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    forks = ForkServer([CHILD])
    child = forks.spawn(f"{CHILD}:report", ["0"], stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
    assert child.wait(30) == 0
    forks.close()
    assert forks.proc.returncode == 0


def test_the_server_starts_with_the_environment_it_is_given(tmp_path: Path) -> None:
    (tmp_path / "only_on_that_path.py").write_text("VALUE = 1\n")
    with pytest.raises(ForkServerError, match="only_on_that_path"):
        ForkServer(["only_on_that_path"])
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    with ForkServer(["only_on_that_path"], env=env) as forks:
        assert forks.alive()
