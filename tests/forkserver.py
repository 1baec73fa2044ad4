"""A fork server for tests that start and kill -9 many short-lived lamina processes.

A ``lamina ingest`` process spends most of a short life importing (about 1.2 s of CPU:
pyarrow, numpy, aiohttp, structlog, pydantic), and on a loaded 2-core machine a test that
restarts it fifty times spent most of ten minutes there. The fork server imports lamina's
CLI once (``python -m tests.forkserver MODULE...``) and then forks a child per request
that runs ``lamina.cli.main.main(argv)`` with the request's environment and stderr: a real
process with its own pid, which the test signals (SIGKILL, SIGTERM, SIGSTOP) as it would a
``subprocess.Popen``. Only the imports are shared; everything ``main`` does (configuration,
fail points, logging, the event loop, connections) happens in the child.

Protocol (JSON lines): the test writes ``{"argv": [...], "env": {...}, "stderr": path}``
on the server's stdin; the server answers ``{"started": pid}``, and later
``{"exited": pid, "code": c}`` when the child ends (``c`` as ``Popen.returncode``: the
exit status, or minus the signal that ended it). The server is single-threaded (no thread
is running when it forks) and reaps its children between requests, every 20 ms.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]


class ForkServer:
    """The test side: a running server, and the children it started."""

    def __init__(self, preload: Sequence[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver", *preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1, cwd=ROOT)
        self._started: queue.Queue[int] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._cond = threading.Condition()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name="forkserver-reader", daemon=True).start()
        if self._started.get(timeout=120) != 0:  # the server's "ready"
            raise AssertionError("the fork server did not start")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            if "started" in msg:
                self._started.put(int(msg["started"]))
            else:
                with self._cond:
                    self._exits[int(msg["exited"])] = int(msg["code"])
                    self._cond.notify_all()
        with self._cond:  # the server is gone: nothing more will be reported
            self._cond.notify_all()

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], stderr: Path) -> Forked:
        """Start ``lamina`` with ``argv`` in a forked child."""
        with self._lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"argv": list(argv), "env": dict(env),
                                              "stderr": str(stderr)}) + "\n")
            self.proc.stdin.flush()
            pid = self._started.get(timeout=60)
        return Forked(self, pid)

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit code, waiting up to ``timeout`` s (None: no limit)."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self.proc.poll() is not None,
                                timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Forked:
    """A child of the fork server, used like a ``subprocess.Popen``."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.returncode(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.returncode(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"lamina (pid {self.pid})", timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped yet, so the pid is still this child's
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# --- the server ----------------------------------------------------------------------------

def _child(request: dict[str, Any]) -> None:
    """In the forked child: become ``lamina`` with the request's argv, env and stderr."""
    code: Any = 1
    try:
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(err, 2)
        os.close(null)
        os.close(err)
        # new file objects: the server's may hold locks or buffered bytes of its own
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(request["env"])
        from lamina import failpoints
        from lamina.cli.main import main

        failpoints.read_env()  # the child's own LAMINA_FAILPOINTS
        code = main(request["argv"])
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # exiting anyway
                stream.flush()
        os._exit(code if isinstance(code, int) else 1)


def _reap(out: IO[str]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        out.write(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
                  + "\n")
        out.flush()


def serve(preload: Sequence[str]) -> None:
    for name in preload:
        importlib.import_module(name)
    out = sys.stdout
    out.write(json.dumps({"started": 0}) + "\n")
    out.flush()
    buffered = ""
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.02)
        _reap(out)
        if not ready:
            continue
        chunk = os.read(sys.stdin.fileno(), 1 << 16).decode()
        if not chunk:
            break
        buffered += chunk
        while "\n" in buffered:
            line, buffered = buffered.split("\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(request)
            out.write(json.dumps({"started": pid}) + "\n")
            out.flush()
    _reap(out)  # stdin closed: the test is done; children still running are orphaned


if __name__ == "__main__":
    serve(sys.argv[1:])
