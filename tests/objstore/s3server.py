"""A real S3 server on 127.0.0.1 for the tests: moto's server (``python -m moto.server``) in
a subprocess, plus helpers to make buckets and the environment a test's store reads.

moto honours ``If-None-Match: *`` on PutObject (since 5.0.15), so conditional creates are
really conditional here; it serves one request at a time (tests/objstore/moto_serial.py) so
that they are also atomic, as on S3. Imported by fixtures; it must not import pytest.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY = "lamina-test-key"
SECRET_KEY = "lamina-test-secret-do-not-log"  # noqa: S105 - moto accepts any
REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

_ROOT = Path(__file__).resolve().parents[2]  # the repository: tests/ is a package there


@dataclass
class S3Server:
    """A running moto server; ``endpoint`` is its ``http://127.0.0.1:PORT``."""

    proc: subprocess.Popen[bytes]
    endpoint: str

    @classmethod
    def start(cls, timeout: float = 30.0) -> S3Server:
        last: Exception | None = None
        for _ in range(3):  # a port taken between free_port() and bind: try another
            port = free_port()
            proc = subprocess.Popen(  # one request at a time: see tests/objstore/moto_serial.py
                [sys.executable, "-m", "tests.objstore.moto_serial", "127.0.0.1", str(port)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=_ROOT)
            endpoint = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"{endpoint}/", timeout=2):  # noqa: S310
                        return cls(proc, endpoint)
                except urllib.error.HTTPError as exc:  # answering, not yet ready
                    exc.close()  # it holds the connection: closed here, not by the GC
                    last = RuntimeError(f"HTTP {exc.code} from {endpoint}/")
                    time.sleep(0.05)
                except (urllib.error.URLError, OSError) as exc:
                    last = exc
                    time.sleep(0.05)
            proc.kill()
            proc.wait()
        raise RuntimeError(f"moto server did not start: {last}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def make_bucket(self) -> str:
        """A new, empty bucket with a unique name."""
        name = f"lamina-{uuid.uuid4().hex[:16]}"
        req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")  # noqa: S310
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310
            assert resp.status == 200
        return name

    def env(self) -> dict[str, str]:
        """The standard AWS environment pointing at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION}


CLEARED_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT", "AWS_SESSION_TOKEN",
               "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_ALLOW_HTTP")


def child_env(server: S3Server) -> dict[str, str]:
    """os.environ for a child process, pointed at ``server``."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    env.update(server.env())
    with contextlib.suppress(KeyError):
        del env["AWS_CONFIG_FILE"]
    return env


class LossyProxy:
    """A TCP proxy on 127.0.0.1 in front of the S3 server that records requests and can lose
    responses: while
    ``lose_creates`` > 0, the next conditional create (a PUT carrying If-None-Match) is
    forwarded, the server's answer read and thrown away, and the client's connection
    closed. The object was written; the writer cannot know. ``lost`` counts them.
    ``bytes_up`` and ``bytes_down`` count what it forwarded each way (bench/trace_storage.py
    reads them with ``requests`` as the cost of a step)."""

    def __init__(self, upstream: str) -> None:
        import threading

        host, port = upstream.removeprefix("http://").split(":")
        self._upstream = (host, int(port))
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._mu = threading.Lock()
        self.lose_creates = 0
        self.lost = 0
        self.creates = 0
        """Conditional creates seen (a retry is seen again)."""
        self.requests: list[str] = []
        """The request line's method and path, of every request seen."""
        self.bytes_up = 0
        """Bytes forwarded from clients to the server (request lines, headers, bodies)."""
        self.bytes_down = 0
        """Bytes forwarded from the server to clients (status lines, headers, bodies)."""
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._sock.close()

    def _accept(self) -> None:
        import threading

        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        import threading

        up = socket.create_connection(self._upstream)
        state = {"drop": False}

        def pump_back() -> None:
            try:
                while data := up.recv(65536):
                    if state["drop"]:
                        with self._mu:
                            self.lost += 1
                        break
                    client.sendall(data)
                    with self._mu:
                        self.bytes_down += len(data)
            except OSError:
                pass
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)
            client.close()
            up.close()

        threading.Thread(target=pump_back, daemon=True).start()
        try:
            while data := client.recv(65536):
                method, _, rest = data.partition(b" ")
                if method in (b"GET", b"PUT", b"HEAD", b"POST", b"DELETE"):
                    with self._mu:
                        self.requests.append(f"{method.decode()} {rest.split(b' ')[0].decode()}")
                if data.startswith(b"PUT ") and b"if-none-match" in data.lower():
                    with self._mu:
                        self.creates += 1
                        if self.lose_creates > 0:
                            self.lose_creates -= 1
                            state["drop"] = True
                up.sendall(data)
                with self._mu:
                    self.bytes_up += len(data)
        except OSError:
            pass
