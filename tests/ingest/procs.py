"""Running ``lamina ingest`` as a real process in tests: config files, the HTTP port it
bound, waiting on /v1/sources, signals.

Each process is a child of this test worker's fork server (:mod:`lamina.forkserver`,
started on first use with lamina's CLI and ingestion imported): a real process that runs
``lamina ingest`` and is killed with real signals, without paying the imports on every one
of the hundred-odd restarts of the kill tests."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lamina.forkserver import ForkServer

#: what the fork server imports before it forks: everything ``lamina ingest`` needs, and
#: pandas, which pyarrow imports the first time ingestion builds an array from Python rows
PRELOAD = ("lamina.cli.main", "lamina.ingest.service", "lamina.ingest.postgres.source",
           "lamina.ingest.files", "uvloop", "pandas")
LAMINA = [sys.executable, "-c",
          "import sys; from lamina.cli.main import main; sys.exit(main(sys.argv[1:]))"]
"""``lamina`` as a fresh interpreter (for the tests that run it to completion)."""
_servers: dict[int, ForkServer] = {}
_servers_lock = threading.Lock()


def fork_server() -> ForkServer:
    """This process's fork server (started on first use, stopped at exit)."""
    with _servers_lock:
        server = _servers.get(os.getpid())
        if server is None or not server.alive():
            server = _servers[os.getpid()] = ForkServer(PRELOAD)
            atexit.register(server.close)
        return server


def files_source_toml(name: str, path: Path, *, fmt: str = "jsonl",
                      schema: Mapping[str, str] | None = None, key: tuple[str, ...] = ("id",),
                      interval: float = 0.05, errors: str = "stall") -> str:
    cols = schema or {"id": "int64", "name": "string"}
    schema_s = ", ".join(f'{k} = "{v}"' for k, v in cols.items())
    key_s = ", ".join(f'"{k}"' for k in key)
    return (f'[[sources]]\nname = "{name}"\nkind = "files"\npath = "{path}"\n'
            f'format = "{fmt}"\nschema = {{ {schema_s} }}\nkey = [{key_s}]\n'
            f'timestamp_interval_seconds = {interval}\nerrors = "{errors}"\n'
            f"poll_interval_seconds = 0.02\n")


def write_config(path: Path, data_dir: Path, sources: list[str]) -> Path:
    path.write_text(f'data_dir = "{data_dir}"\nlog_format = "json"\n'
                    f"shutdown_grace_seconds = 20\n\n" + "\n".join(sources))
    return path


class Ingest:
    """One ``lamina ingest`` process; stderr (JSON logs) goes to ``log``."""

    def __init__(self, config: Path, log: Path, env: Mapping[str, str] | None = None) -> None:
        self.log = log
        self.offset = log.stat().st_size if log.exists() else 0
        full = {k: v for k, v in os.environ.items()
                if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        full.update(env or {})
        log.touch()
        with log.open("ab") as err:
            self.proc = fork_server().spawn("lamina.cli.main:main",
                                            ["ingest", "--config", str(config),
                                             "--http", "127.0.0.1:0"], env=full,
                                            stdout=subprocess.DEVNULL, stderr=err)
        self.port: int | None = None

    def events(self) -> list[dict[str, Any]]:
        with open(self.log, "rb") as f:
            f.seek(self.offset)
            out = []
            for line in f.read().splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
            return out

    def wait_port(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ev in self.events():
                if ev.get("event") == "ingest.starting":
                    self.port = int(ev["http"][0].rpartition(":")[2])
                    return self.port
            if self.proc.poll() is not None:
                raise AssertionError(f"lamina ingest exited with {self.proc.returncode}: "
                                     f"{self.log.read_text()[-3000:]}")
            time.sleep(0.02)
        raise AssertionError("lamina ingest did not start serving HTTP")

    def wait_event(self, name: str, timeout: float = 30.0) -> bool:
        """Wait until the log holds event ``name``; False if the process died first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(ev.get("event") == name for ev in self.events()):
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.02)
        raise AssertionError(f"no {name} event within {timeout} s")

    def get(self, path: str) -> tuple[int, bytes]:
        port = self.port or self.wait_port()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return int(r.status), bytes(r.read())
        except urllib.error.HTTPError as exc:
            with exc:  # it holds the connection: closed here, not by the garbage collector
                return int(exc.code), bytes(exc.read())

    def sources(self) -> dict[str, dict[str, Any]]:
        status, body = self.get("/v1/sources")
        assert status == 200, body
        return {s["name"]: s for s in json.loads(body)}

    def wait_for(self, cond: Callable[[dict[str, dict[str, Any]]], bool],
                 timeout: float = 30.0) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        last: dict[str, dict[str, Any]] = {}
        while time.monotonic() < deadline:
            last = self.sources()
            if cond(last):
                return last
            if self.proc.poll() is not None:
                raise AssertionError(f"lamina ingest exited with {self.proc.returncode}")
            time.sleep(0.05)
        raise AssertionError(f"condition not reached; last status: {json.dumps(last)[:3000]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def caught_up(name: str, directory: Path, last_file: str) -> Callable[
        [dict[str, dict[str, Any]]], bool]:
    """A condition: the source's newest binding covers every byte of ``last_file``."""
    size = (directory / last_file).stat().st_size
    want = json.dumps([last_file, size])

    def cond(st: dict[str, dict[str, Any]]) -> bool:
        s = st.get(name)
        return bool(s and s["state"] == "running" and s["binding_upper"] == want)
    return cond
