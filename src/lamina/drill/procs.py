"""Run ``lamina serve`` and the drill workload as real processes: start, wait until
ready, signal, wait. Shared by ``lamina drill`` and the end-to-end tests. The workload
runs as a fresh interpreter, or as a child of a fork server (:mod:`lamina.forkserver`)
when the caller starts many."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from lamina.forkserver import ChildProcess, ForkServer

LAMINA = str(Path(sys.executable).with_name("lamina"))
#: the drill workload's module, run as ``python -m`` or by a fork server
WORKLOAD = "lamina.drill.workload"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DaemonProcess:
    """A compacter subprocess with fast polling, its logs captured to a file. With
    ``new_session`` it leads a process group of its own (as under a supervisor), which
    :meth:`signal_group` signals whole: the daemon, its Spark JVM and Python workers."""

    def __init__(self, data_dir: Path, log_path: Path, *, master: str = "local[2]",
                 extra_env: Mapping[str, str] | None = None,
                 new_session: bool = False) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.log_path = log_path
        env = dict(os.environ)
        env.update({
            "LAMINA_POLL_INTERVAL": "0.2", "LAMINA_GC_INTERVAL_SECONDS": "1",
            "LAMINA_GC_GRACE_SECONDS": "2", "LAMINA_RETRY_INITIAL_SECONDS": "0.2",
            "LAMINA_LOG_FORMAT": "json", "LAMINA_SHUTDOWN_GRACE_SECONDS": "20",
            "LAMINA_SPARK_DRIVER_MEMORY": "1g",
        })
        env.update(extra_env or {})
        self.env = env
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            [LAMINA, "serve", "--data-dir", str(data_dir), "--spark-master", master,
             "--http", f"127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=new_session)

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return int(r.status), bytes(r.read())
        except urllib.error.HTTPError as exc:
            with exc:  # it holds the connection: closed here, not by the garbage collector
                return int(exc.code), bytes(exc.read())

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n"
                                     + self.log_path.read_text()[-4000:])
            try:
                code, _ = self.get("/readyz")
                if code == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("daemon not ready in time:\n" + self.log_path.read_text()[-4000:])

    def relations(self) -> list[dict[str, Any]]:
        code, body = self.get("/v1/relations")
        assert code == 200
        rows: list[dict[str, Any]] = json.loads(body)
        return rows

    def wait_caught_up(self, relation: str, sealed_upper: int, timeout: float = 180.0) -> None:
        """Until the trace covers every finished segment and no segment is pending.

        The daemon answers ``/v1/relations`` as of its last poll, so just after a writer
        finished a segment it can still say nothing is pending. Its word is therefore
        checked against the disk: ``lamina status`` (same environment, so the same trace
        URL and credentials) lists the WAL directory after it reads the trace's state."""
        deadline = time.monotonic() + timeout
        rows: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            try:
                rows = self.relations()
            except OSError:  # a slow answer on a busy machine: ask again
                rows = []
            if _caught_up(rows, relation, sealed_upper):
                rows = self.disk_status()
                if _caught_up(rows, relation, sealed_upper):
                    return
            if self.proc.poll() is not None:
                raise AssertionError("daemon died:\n" + self.log_path.read_text()[-4000:])
            time.sleep(0.3)
        raise AssertionError(f"daemon did not catch up: {rows}\n"
                             + self.log_path.read_text()[-3000:])

    def disk_status(self) -> list[dict[str, Any]]:
        """``lamina status --json`` of the data directory, read from disk while it runs."""
        out = subprocess.run([LAMINA, "status", "--data-dir", str(self.data_dir), "--json"],
                             capture_output=True, text=True, env=self.env, timeout=120,
                             check=True)
        rows: list[dict[str, Any]] = json.loads(out.stdout)
        return rows

    def signal_group(self, sig: signal.Signals) -> None:
        """Signal the whole process group (``new_session`` only): what ``timeout``,
        supervisord's ``stopasgroup`` and systemd's ``KillMode=control-group`` do."""
        os.killpg(self.proc.pid, sig)

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._log.close()


def start_workload(data_dir: Path, ack: Path, *, seed: int, ops: int, pause: float = 0.0,
                   segment_bytes: int = 4096, env: Mapping[str, str] | None = None,
                   quiet: bool = False, first_op: int | None = None, final: bool = False,
                   stdout: Any = None, stderr: Any = None,
                   relation: str | None = None, relations: int = 1,
                   forks: ForkServer | None = None) -> ChildProcess:
    """Start the drill workload (lamina.drill.workload) as a process: a child of ``forks``
    when given (the workload's imports paid once, lamina.forkserver), else a fresh
    interpreter. ``quiet`` sends its output to /dev/null; ``stdout``/``stderr`` (file
    objects or ``subprocess.PIPE``) override that."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    out = subprocess.DEVNULL if quiet else None
    argv = [str(data_dir), str(ack), "--seed", str(seed), "--ops", str(ops),
            "--segment-bytes", str(segment_bytes), "--pause", str(pause)]
    if first_op is not None:
        argv += ["--first-op", str(first_op)]
    if final:
        argv.append("--final")
    if relation is not None:
        argv += ["--relation", relation]
    if relations > 1:
        argv += ["--relations", str(relations)]
    stdout = out if stdout is None else stdout
    stderr = out if stderr is None else stderr
    if forks is not None:
        return forks.spawn(WORKLOAD + ":main", argv, env=full_env, stdout=stdout,
                           stderr=stderr)
    return subprocess.Popen([sys.executable, "-m", WORKLOAD, *argv], env=full_env,
                            stdout=stdout, stderr=stderr)


def _caught_up(rows: list[dict[str, Any]], relation: str, sealed_upper: int) -> bool:
    """``relation``'s status says: no finished segment waits, a trace exists, and the WAL
    is sealed to ``sealed_upper``."""
    return any(r["name"] == relation and r["wal_segments_pending"] == 0
               and r["trace_upper"] > 0 and r["sealed_upper"] == sealed_upper for r in rows)
