"""The README, followed in order, works: every Python block and every shell command of
README.md runs, in the order it is written, in a fresh directory, each exiting 0.

The shell commands run against a real daemon, started the way the README says (``make
run`` is ``.venv/bin/lamina serve`` on ./lamina-data) with ``executor = "inprocess"`` (no
JVM, so the test stays short) on a free port; the ``s3://my-bucket`` block runs against the
test S3 server (a real one, moto) with a bucket of that name. The directory holds
``.venv`` and ``examples`` as links to this repository's, so the commands run as written.

Excepted, because they are the set-up this test itself stands in for:

- ``make run``: creates .venv and starts the daemon in the foreground, for ever; the test
  starts the same ``lamina serve`` itself (above), so it can stop it.
- ``make test``: runs this whole suite, this test included.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tests.objstore.s3server import S3Server, free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXCEPTED = ("make run", "make test")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def readme_blocks() -> list[tuple[str, str]]:
    """``(language, code)`` of every fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(README.read_text())]


def shell_commands(code: str) -> list[str]:
    """The commands of a shell block: one per line, comments and blank lines dropped."""
    return [line.split(" #", 1)[0].strip() for line in code.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


class Daemon:
    """``lamina serve`` as ``make run`` starts it, in-process executor, on a free port."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.log = open(cwd.parent / "daemon.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [".venv/bin/lamina", "serve", "--http", f"127.0.0.1:{self.port}"], cwd=cwd,
            env={**env, "LAMINA_EXECUTOR": "inprocess", "LAMINA_POLL_INTERVAL": "0.2",
                 "LAMINA_LOG_FORMAT": "json"}, stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_for(lambda: self.get("/readyz")[0] == 200, "ready")

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}",
                                        timeout=5) as r:
                return int(r.status), bytes(r.read())
        except urllib.error.HTTPError as exc:
            with exc:  # it holds the connection: closed here, not by the garbage collector
                return int(exc.code), bytes(exc.read())
        except OSError:
            return 0, b""

    def wait_for(self, done: Callable[[], bool], what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert self.proc.poll() is None, f"daemon exited: {self.tail()}"
            assert time.monotonic() < deadline, f"daemon not {what}: {self.tail()}"
            time.sleep(0.1)

    def wait_converted(self, relation: str) -> None:
        """Until the trace of ``relation`` holds something (/v1/relations)."""

        def converted() -> bool:
            code, body = self.get("/v1/relations")
            rows = json.loads(body) if code == 200 else []
            return any(r["name"] == relation and r["trace_upper"] > 0 for r in rows)

        self.wait_for(converted, "converting")

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(60)
        self.log.close()
        return code


def test_the_readme_runs_in_order(tmp_path: Path, s3_server: S3Server) -> None:
    work = tmp_path / "readme"
    work.mkdir()
    (work / ".venv").symlink_to(Path(sys.executable).parent.parent)
    (work / "examples").symlink_to(ROOT / "examples")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LAMINA_", "AWS_"))} | s3_server.env()
    bucket = urllib.request.Request(f"{s3_server.endpoint}/my-bucket",  # noqa: S310 - ours
                                    method="PUT")
    urllib.request.urlopen(bucket, timeout=10).close()  # noqa: S310

    blocks = readme_blocks()
    assert [lang for lang, _ in blocks].count("python") >= 3
    ran: list[str] = []
    excepted: list[str] = []
    daemon: Daemon | None = None
    try:
        for lang, code in blocks:
            if lang == "python":
                out = subprocess.run([sys.executable, "-c", code], cwd=work, env=env,
                                     capture_output=True, timeout=120, check=False)
                assert out.returncode == 0, (code, out.stderr.decode()[-3000:])
                ran.append(code.splitlines()[0])
                continue
            assert lang == "sh", f"a README block in {lang!r}: this test runs only python/sh"
            for command in shell_commands(code):
                if command.startswith(EXCEPTED):
                    excepted.append(command)
                    continue
                if daemon is None:
                    daemon = Daemon(work, env)
                out = subprocess.run(["bash", "-c", command], cwd=work, env=env,
                                     capture_output=True, timeout=120, check=False)
                assert out.returncode == 0, (command, out.stderr.decode()[-3000:])
                assert out.stderr == b"", (command, out.stderr)  # piped: no progress lines
                ran.append(command)
                if "examples/coordinator.py" in command:
                    # the README: "lamina status shows the compacter catching up"
                    daemon.wait_converted("orders")
    finally:
        stopped = daemon.stop() if daemon is not None else 0
    assert stopped == 0
    assert excepted == list(EXCEPTED)
    assert any(c.startswith(".venv/bin/lamina drop") for c in ran)
    assert (work / "lamina-s3-data" / "trace.json").exists()
    assert not (work / "lamina-data" / "wal" / "orders").exists()  # the last command dropped it
