"""A fork server: start many short-lived lamina processes without paying their imports
each time.

``lamina drill`` starts a coordinator (:mod:`lamina.drill.workload`) over a hundred and
fifty times in a run, and ``lamina drill-ingest`` restarts ``lamina ingest`` dozens of
times; each start of a fresh interpreter spends 0.3 s (the workload: numpy, pyarrow,
lamina's store) to 1.2 s (ingestion) of CPU importing before it does anything. A fork
server imports those modules once (``preload``) and then forks a child per request: a
real process with its own pid, arguments, environment, standard streams and exit status,
which its starter signals and waits for as it would a :class:`subprocess.Popen`. Only
the imports are shared; everything the target function does (settings, fail points,
logging, an event loop, opening a store) happens in the child.

Protocol. The client and the server share a ``SOCK_SEQPACKET`` Unix socket pair (the
server's end is the descriptor given by ``--fd``); every message is one JSON object:

- server -> client, once: ``{"ready": true}`` after the preload, or ``{"error": text}``;
- client -> server: ``{"target": "module:function", "argv": [...], "env": {...}}`` with
  three descriptors attached (``SCM_RIGHTS``): the child's stdin, stdout and stderr;
- server -> client: ``{"started": pid}`` for each request, in the order of the requests,
  and later ``{"exited": pid, "code": c}`` when that child ends (``c`` as
  ``Popen.returncode``: the exit status, or minus the signal that ended it). ``started``
  always comes before the same pid's ``exited``.

The child calls ``function(argv)`` with ``os.environ`` replaced by the request's
environment and lamina's fail points read from it again, and leaves with ``os._exit``:
the function's return value (``None`` is 0), a ``SystemExit``'s code, or 1 after printing
an exception's traceback to its stderr. ``atexit`` handlers do not run (lamina registers
none), so a target finishes its work before it returns. The child inherits the server's
jemalloc and OpenBLAS set-up (below), whatever its own environment says of them.

Invariants:

- **The server forks only while it is single-threaded** (``/proc/self/task``), so no
  other thread's lock is held in a child. It is started with pyarrow's jemalloc
  background thread and numpy's OpenBLAS pool turned off through the environment (unless
  the caller set them), which are the only threads its imports start; a preload that
  starts a thread makes the server refuse with ``{"error": ...}``.
- **Nothing but imports happens in the server** before a fork: no store, no Spark, no
  event loop.
- **A signal reaches only the child it was meant for.** :class:`Forked` opens a pidfd as
  soon as the child is reported started, and signals through it: once the server has
  reaped the child, the signal fails with ``ProcessLookupError`` inside ``send_signal``
  (and is dropped) instead of reaching a process that reused the pid.
- The server reaps its children every ``REAP_SECONDS`` and ends when the client's end of
  the socket closes; children still running then keep running, as a ``Popen``'s do when
  its parent exits.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import logging
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from typing import IO, Any, Protocol

from lamina.errors import ForkServerError, InvalidArgumentError

#: how often the server reaps its children when no request arrives
REAP_SECONDS = 0.01
#: the environment the server starts with unless the caller's sets these: the two pools
#: that importing numpy and pyarrow would otherwise start, which would make forking unsafe
SINGLE_THREADED = {"OPENBLAS_NUM_THREADS": "1",
                   "JE_ARROW_MALLOC_CONF": "background_thread:false"}
_MAX_MESSAGE = 1 << 20


class ChildProcess(Protocol):
    """What a drill needs of a child process: a ``subprocess.Popen`` or a :class:`Forked`."""

    pid: int
    returncode: int | None
    stdout: IO[bytes] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


# --- the client --------------------------------------------------------------------------

class ForkServer:
    """A running fork server that has imported ``preload``, and the children it started.
    Thread-safe: several threads may spawn and wait at once."""

    def __init__(self, preload: Sequence[str], *, env: Mapping[str, str] | None = None,
                 ready_timeout: float = 120.0) -> None:
        """Start a server that imports ``preload``, with ``env`` (default: this process's
        environment) over :data:`SINGLE_THREADED`."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**SINGLE_THREADED, **(os.environ if env is None else env)}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lamina.forkserver", "--fd", str(theirs.fileno()),
                 *preload], stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()], env=env)
        finally:
            theirs.close()
        self._sock = ours
        self._started: queue.Queue[int | str] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._cond = threading.Condition()
        self._spawning = threading.Lock()
        self._gone = False
        threading.Thread(target=self._read, name="forkserver-reader", daemon=True).start()
        try:
            first = self._started.get(timeout=ready_timeout)
        except queue.Empty:
            self.close()
            raise ForkServerError(f"the fork server did not import {list(preload)} within "
                                  f"{ready_timeout} s") from None
        if first != 0:
            self.close()
            raise ForkServerError(f"the fork server did not start: {first}")

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            if "ready" in msg:
                self._started.put(0)
            elif "error" in msg:
                self._started.put(str(msg["error"]))
            elif "started" in msg:
                self._started.put(int(msg["started"]))
            else:
                with self._cond:
                    self._exits[int(msg["exited"])] = int(msg["code"])
                    self._cond.notify_all()
        with self._cond:  # the server is gone: nothing more will be reported
            self._gone = True
            self._cond.notify_all()
        self._started.put("the fork server exited")

    def spawn(self, target: str, argv: Sequence[str], *,
              env: Mapping[str, str] | None = None, stdin: Any = subprocess.DEVNULL,
              stdout: Any = None, stderr: Any = None) -> Forked:
        """Fork a child that runs ``target`` (``"module:function"``) with ``argv`` and
        ``env`` (default: this process's environment). ``stdin``, ``stdout`` and
        ``stderr`` are as for ``subprocess.Popen``: ``None`` (this process's),
        ``subprocess.PIPE`` (``stdout`` only), ``subprocess.DEVNULL``, a descriptor or a
        file object."""
        if ":" not in target:
            raise InvalidArgumentError(f"target {target!r} is not 'module:function'")
        if subprocess.PIPE in (stdin, stderr):
            raise InvalidArgumentError("only a forked child's stdout may be a pipe")
        fds: list[int] = []
        closing: list[int] = []  # the child's ends we opened, closed once sent
        read_end: int | None = None
        try:
            for stream, default in ((stdin, 0), (stdout, 1), (stderr, 2)):
                if stream is None:
                    fds.append(default)
                elif stream == subprocess.DEVNULL:
                    fds.append(os.open(os.devnull, os.O_RDWR))
                    closing.append(fds[-1])
                elif stream == subprocess.PIPE:
                    read_end, write_end = os.pipe()
                    fds.append(write_end)
                    closing.append(write_end)
                elif isinstance(stream, int):
                    fds.append(stream)
                else:
                    fds.append(stream.fileno())
            request = json.dumps({"target": target, "argv": list(argv),
                                  "env": dict(os.environ if env is None else env)})
            with self._spawning:
                if self._gone:
                    raise ForkServerError("the fork server has exited")
                try:
                    socket.send_fds(self._sock, [request.encode()], fds)
                except OSError as exc:
                    raise ForkServerError(f"the fork server did not take the request: "
                                          f"{exc}") from exc
                answer = self._started.get()
        except BaseException:
            if read_end is not None:
                os.close(read_end)
            raise
        finally:
            for fd in closing:
                os.close(fd)
        if isinstance(answer, str):
            if read_end is not None:
                os.close(read_end)
            raise ForkServerError(f"the fork server did not fork {target}: {answer}")
        out = os.fdopen(read_end, "rb") if read_end is not None else None
        return Forked(self, answer, out)

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        """The exit code of child ``pid``, waiting up to ``timeout`` s (None: no limit);
        None if it has not ended by then. Raises ForkServerError if the server died
        first."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self._gone, timeout)
            if pid in self._exits:
                return self._exits[pid]
            if self._gone:
                raise ForkServerError(f"the fork server exited (code {self.proc.poll()}); "
                                      f"the exit status of its child {pid} is lost")
            return None

    def alive(self) -> bool:
        return not self._gone and self.proc.poll() is None

    def close(self) -> None:
        """Stop the server (its running children keep running)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Forked:
    """A child of the fork server, used like a ``subprocess.Popen``."""

    def __init__(self, server: ForkServer, pid: int, stdout: IO[bytes] | None) -> None:
        self.server = server
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._pidfd: int | None = None
        with contextlib.suppress(ProcessLookupError):  # already reaped: nothing to signal
            self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.returncode(self.pid, 0)
            self._release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.returncode(self.pid, timeout)
            self._release()
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the child, if it still runs (as ``Popen.send_signal``)."""
        if self._pidfd is None or self.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):  # ended since: as Popen does
            signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def _release(self) -> None:
        if self.returncode is not None and self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self._pidfd is not None:
                os.close(self._pidfd)


# --- the server ----------------------------------------------------------------------------

def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _send(sock: socket.socket, msg: Mapping[str, Any]) -> None:
    sock.send(json.dumps(msg).encode())


def _child(sock: socket.socket, request: Mapping[str, Any], fds: Sequence[int]) -> None:
    """In the forked child: become the request's process. Never returns."""
    code: Any = 1
    try:
        sock.close()
        for target_fd, fd in enumerate(fds):
            os.dup2(fd, target_fd)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        # new file objects: the server's may hold buffered bytes of its own
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(request["env"])
        from lamina import failpoints

        failpoints.read_env()  # the child's own LAMINA_FAILPOINTS
        module, function = str(request["target"]).split(":", 1)
        main = getattr(importlib.import_module(module), function)
        sys.argv = [module, *request["argv"]]
        code = main(list(request["argv"]))
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
        os._exit(0 if code is None else code if isinstance(code, int) else 1)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def serve(fd: int, preload: Sequence[str]) -> int:
    """The server's loop, on the socket ``fd``; returns when the client closes it."""
    sock = socket.socket(fileno=fd)
    try:
        for name in preload:
            importlib.import_module(name)
    except BaseException as exc:
        _send(sock, {"error": f"importing the preload failed: {exc!r}"})
        return 1
    if _threads() != 1:
        _send(sock, {"error": f"the server has {_threads()} threads after importing "
                              f"{list(preload)}; forking it would be unsafe"})
        return 1
    _send(sock, {"ready": True})
    while True:
        ready, _, _ = select.select([sock], [], [], REAP_SECONDS)
        _reap(sock)
        if not ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
        except ConnectionResetError:
            data, fds = b"", []
        if not data:
            break
        try:
            request = json.loads(data)
            if len(fds) != 3:
                raise ValueError(f"a request carries {len(fds)} descriptors, not 3")
            if _threads() != 1:
                raise RuntimeError(f"the server has {_threads()} threads")
        except (ValueError, RuntimeError) as exc:
            for f in fds:
                os.close(f)
            _send(sock, {"error": str(exc)})
            continue
        pid = os.fork()
        if pid == 0:
            _child(sock, request, fds)
        for f in fds:
            os.close(f)
        _send(sock, {"started": pid})
    _reap(sock)
    return 0


def main(argv: Sequence[str]) -> int:
    if len(argv) < 2 or argv[0] != "--fd":
        print("usage: python -m lamina.forkserver --fd FD [MODULE...]", file=sys.stderr)
        return 2
    try:
        return serve(int(argv[1]), argv[2:])
    except OSError as exc:
        if exc.errno in (errno.EPIPE, errno.ECONNRESET):
            return 0  # the client went away mid-answer
        raise


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
