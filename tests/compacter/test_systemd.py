"""sd_notify over real AF_UNIX datagram sockets: a path socket and an abstract one."""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lamina.service.systemd import Notifier, watchdog_interval


def receive(sock: socket.socket) -> str:
    sock.settimeout(5)
    data, _ = sock.recvfrom(4096)
    return data.decode()


@pytest.fixture
def path_socket() -> Iterator[tuple[socket.socket, str]]:
    """A listening datagram socket at a filesystem path, as systemd's /run/systemd/notify.

    Under /tmp rather than tmp_path: AF_UNIX paths are limited to 108 bytes."""
    with tempfile.TemporaryDirectory(prefix="lamina-notify-") as d:
        path = str(Path(d) / "notify")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(path)
            yield sock, path


@pytest.fixture
def abstract_socket() -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket in the abstract namespace; NOTIFY_SOCKET spells it '@name'."""
    name = f"lamina-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        yield sock, "@" + name


@pytest.mark.parametrize("kind", ["path_socket", "abstract_socket"])
def test_notifications_arrive(kind: str, request: pytest.FixtureRequest) -> None:
    sock, address = request.getfixturevalue(kind)
    n = Notifier({"NOTIFY_SOCKET": address})
    assert n.enabled
    assert n.status("recovering 3 relations")
    assert receive(sock) == "STATUS=recovering 3 relations"
    assert n.ready()
    assert receive(sock) == "READY=1"
    assert n.watchdog()
    assert receive(sock) == "WATCHDOG=1"
    assert n.stopping()
    assert receive(sock) == "STOPPING=1"
    assert n.extend_timeout(2.5)
    assert receive(sock) == "EXTEND_TIMEOUT_USEC=2500000"
    assert n.notify("READY=1", "STATUS=serving")
    assert receive(sock) == "READY=1\nSTATUS=serving"
    # A multi-line status would be read as further assignments: it is flattened.
    assert n.status("line one\nWATCHDOG=trigger")
    assert receive(sock) == "STATUS=line one WATCHDOG=trigger"


def test_reads_os_environ_by_default(path_socket: tuple[socket.socket, str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    sock, address = path_socket
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    assert Notifier().ready()
    assert receive(sock) == "READY=1"


def test_no_socket_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier()
    assert not n.enabled
    assert not n.ready()
    assert not n.watchdog()
    assert not n.stopping()
    assert not n.status("x")


def test_send_errors_are_not_fatal() -> None:
    with tempfile.TemporaryDirectory(prefix="lamina-notify-") as d:
        n = Notifier({"NOTIFY_SOCKET": str(Path(d) / "nobody-listens")})
        assert n.enabled
        assert not n.ready()          # ENOENT: logged, reported, not raised
        assert not n.watchdog()
    assert not Notifier({"NOTIFY_SOCKET": "@lamina-nobody-" + uuid.uuid4().hex}).ready()
    # an unsupported address family is a warning and a no-op
    assert not Notifier({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled


def test_recovers_after_a_failed_send() -> None:
    with tempfile.TemporaryDirectory(prefix="lamina-notify-") as d:
        path = str(Path(d) / "notify")
        n = Notifier({"NOTIFY_SOCKET": path})
        assert not n.watchdog()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(path)
            assert n.watchdog()
            assert receive(sock) == "WATCHDOG=1"


def test_watchdog_interval() -> None:
    pid = str(os.getpid())
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": pid}) == 15.0
    # meant for another process (e.g. inherited by a child): not ours to ping
    assert watchdog_interval({"WATCHDOG_USEC": "30000000",
                              "WATCHDOG_PID": str(os.getpid() + 1)}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "x"}) is None


def test_watchdog_interval_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert watchdog_interval() == 0.5
