"""The compacter's one long-lived SparkSession, and running Spark actions under job tags.

Session (:func:`build_session`)
    One SparkSession per daemon process (Spark allows one SparkContext per JVM). The
    defaults serve a laptop and a small standalone cluster alike:

    - no web UI and no console progress bar; the JVM's log level is ``ERROR``;
    - ``spark.sql.shuffle.partitions`` of twice the local cores: lamina's shuffles are
      sized by the jobs themselves (:mod:`lamina.compacter.step`), this only bounds
      incidental ones;
    - Arrow batches of 64 Ki rows between the JVM and the Python workers, plain (not
      "large") Arrow string/binary types and the session time zone UTC, so that the
      Arrow types the jobs produce and the ones Spark expects agree exactly;
    - ANSI mode on (Spark 4's default, pinned because arithmetic must raise, not wrap), and
      case-sensitive column names (a relation may have columns ``a`` and ``A``);
    - ``PYSPARK_PYTHON`` is this interpreter (``sys.executable``), also for executors of a
      standalone cluster on the same machine or an identical image, so tasks import the same
      ``lamina`` and ``pyarrow`` as the daemon (``spark.pyspark.python`` in ``conf``
      overrides it);
    - for a local master (``local[...]``) or a cluster on the loopback address the driver
      binds to 127.0.0.1, so nothing depends on the host name resolving;
    - ``spark.driver.memory`` from the ``driver_memory`` argument (it only takes effect
      when this call starts the JVM, i.e. the first session of the process).

    The daemon adds :func:`daemon_conf` (its JVMs compile with C1 only:
    :data:`DAEMON_JAVA_OPTIONS`) before the operator's ``spark_conf``.

Tagged actions (:class:`JobTags`)
    The daemon runs each step's blocking Spark calls in a worker thread (never on the event
    loop) under a per-relation tag. PySpark's default *pinned thread mode* gives every
    Python thread its own JVM thread, so the thread-local job properties set here
    (``SparkContext.addJobTag``, ``setInterruptOnCancel(True)``, a job description) apply
    exactly to the jobs this thread starts, including the SQL jobs of DataFrame actions.
    :meth:`JobTags.cancel`, from any other thread, marks the tag cancelled and calls
    ``SparkContext.cancelJobsWithTag``, which kills running tasks (interrupting their
    threads). Because a step may start several Spark jobs one after another, a cancel that
    lands between two of them is caught by :func:`check_cancelled`, which the jobs call
    before each action, and by :meth:`JobTags.run` itself when the step returns; either way
    the step ends with :class:`JobCancelledError` and nothing is committed.
    :func:`run_in_group` and :func:`cancel_group` are the same through one process-wide
    :class:`JobTags` per session (what ``lamina.compacter.executors.spark`` calls).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import structlog

from lamina.errors import JobCancelledError

T = TypeVar("T")
log = structlog.get_logger(__name__)

DEFAULT_APP_NAME = "lamina-compacter"
DEFAULT_DRIVER_MEMORY = "2g"
DEFAULT_LOG_LEVEL = "ERROR"


DAEMON_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1"
"""JVM options of the daemon's driver and of a cluster's executors (``spark.driver`` and
``spark.executor.defaultJavaOptions``, :func:`daemon_conf`): C1 only, no C2 compiler.

The daemon's JVM schedules jobs of Python tasks and passes them a few rows of metadata;
no data goes through it, so C2's optimized code barely pays, while compiling it costs CPU
for as long as the daemon runs new code paths. Measured on 2 cores, a fresh ``local[*]``
session as the daemon builds it, then 250 jobs of 32 tasks through the steps' own job
runner (``step.driver._run_tasks``; JVM CPU from ``/proc``, two runs each, alternating,
2026-11-29): the session's start 20.9 and 21.3 s of JVM CPU with the JVM's default
compilers, 12.1 and 10.9 s with C1 only; jobs 50 to 250, 0.325 and 0.292 s of JVM CPU a
job against 0.254 and 0.228 s, and 0.27 and 0.23 s of wall time a job against 0.24 and
0.20 s. The daemon of the peers benchmark's ``10m-churn`` cell used 18.5 to 20.6 s of CPU
instead of 23.5 to 25.9 s (docs/performance.md, "The daemon's JVM: C1 only"). They are defaults:
``spark.driver.extraJavaOptions`` of the operator's ``spark_conf`` (or ``spark-defaults``)
come after them and win; ``spark.driver.defaultJavaOptions`` in ``spark_conf`` replaces
them. A standalone cluster's executors get the same options for the same reason (they
run the Python tasks and carry no data either); they were not measured apart. Sessions
other than the daemon's (readers, benchmarks) keep the JVM's defaults."""


def daemon_conf() -> dict[str, str]:
    """The Spark configuration the daemon sets before the operator's ``spark_conf``."""
    return {"spark.driver.defaultJavaOptions": DAEMON_JAVA_OPTIONS,
            "spark.executor.defaultJavaOptions": DAEMON_JAVA_OPTIONS}


def java_options(session: Any) -> list[str]:
    """The options the driver's JVM was started with (what an operator wants to see in the
    log when they tune it); empty if the JVM cannot be asked."""
    try:
        bean = session.sparkContext._jvm.java.lang.management.ManagementFactory
        return [str(a) for a in bean.getRuntimeMXBean().getInputArguments()]
    except Exception:  # py4j: the JVM is gone
        return []


def _cores() -> int:
    return max(1, os.cpu_count() or 1)


def _loopback_master(master: str) -> bool:
    if master.startswith("local"):
        return True
    host = master.removeprefix("spark://").split(":", 1)[0]
    return host in ("127.0.0.1", "localhost")


def default_conf(master: str, *, driver_memory: str = DEFAULT_DRIVER_MEMORY) -> dict[str, str]:
    """The configuration :func:`build_session` applies before the caller's overrides."""
    conf = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": str(2 * _cores()),
        "spark.sql.adaptive.enabled": "true",
        "spark.sql.ansi.enabled": "true",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.caseSensitive": "true",
        "spark.sql.execution.arrow.maxRecordsPerBatch": "65536",
        "spark.sql.execution.arrow.useLargeVarTypes": "false",
        "spark.python.worker.reuse": "true",
        # The JVM talks to its Python workers over a Unix socket, not TCP: over TCP every
        # task of a step waited about 40 ms for its one-row input (Nagle's algorithm
        # against delayed ACKs; docs/performance.md, "Forty milliseconds a task").
        "spark.python.unix.domain.socket.enabled": "true",
        "spark.pyspark.python": sys.executable,
        "spark.pyspark.driver.python": sys.executable,
        "spark.driver.memory": driver_memory,
    }
    if _loopback_master(master):
        conf["spark.driver.host"] = "127.0.0.1"
        conf["spark.driver.bindAddress"] = "127.0.0.1"
    return conf


def build_session(master: str, *, app_name: str = DEFAULT_APP_NAME,
                  conf: Mapping[str, str] | None = None,
                  driver_memory: str = DEFAULT_DRIVER_MEMORY,
                  log_level: str = DEFAULT_LOG_LEVEL) -> Any:
    """Build (or return the process's existing) SparkSession for ``master``.

    ``conf`` entries override the defaults of :func:`default_conf`. Returns a
    ``pyspark.sql.SparkSession`` (typed ``Any``: PySpark ships no type information that
    mypy --strict accepts)."""
    settings = default_conf(master, driver_memory=driver_memory)
    settings.update(conf or {})
    # PySpark takes the workers' interpreter from the environment, not from the conf
    os.environ["PYSPARK_PYTHON"] = settings["spark.pyspark.python"]
    settings.setdefault("spark.executorEnv.PYSPARK_PYTHON", settings["spark.pyspark.python"])
    if _loopback_master(master):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in settings.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel(log_level)
    _log_accumulator_errors(session)
    return session


def _log_accumulator_errors(session: Any) -> None:
    """Errors of PySpark's accumulator server as events of the log, not tracebacks.

    The accumulator server is a thread of this process that the JVM keeps a connection
    to. When the JVM dies first (a SIGTERM to the daemon's whole process group, systemd's
    ``KillMode=control-group``), that connection ends in the middle of a read and
    ``socketserver`` printed the ``EOFError``'s traceback on stderr, which is the
    compacter's log: in two of two such stops of an idle daemon. Its ``handle_error``
    (``socketserver``'s hook for this) now logs ``spark.accumulators_closed`` for that end
    and ``spark.accumulators_failed`` with the error for any other."""
    server = getattr(session.sparkContext, "_accumulatorServer", None)
    if server is None:
        return

    def handle_error(request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, EOFError):
            log.info("spark.accumulators_closed")
        else:
            log.warning("spark.accumulators_failed", error=f"{type(exc).__name__}: {exc}")

    server.handle_error = handle_error


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from ``/proc``; none where there is none)."""
    out = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def stop_python_workers(spark: Any, *, wait_seconds: float = 5.0) -> int:
    """End the Python workers of a local session quietly, before ``spark.stop()``.

    PySpark runs the workers of a local session under a daemon of its own
    (``pyspark.daemon``, a child of the JVM, in its own process group) and keeps finished
    workers for the next task. ``spark.stop()`` closes the idle workers' sockets before it
    tells that daemon to end them, and a worker that wakes first to the closed socket
    flushes its error report into it and prints the ``BrokenPipeError`` traceback of that
    flush (``pyspark/daemon.py``) on the JVM's stderr, which is the compacter's log: in 5
    of 14 runs of tests/compacter/test_daemon_lifecycle.py's group-signal test next to
    three CPU-bound processes. SIGTERM to the daemon's process group
    first ends the workers at once (they take SIGTERM's default action) and the daemon
    with them; ``spark.stop()`` then finds nothing to close. Returns how many worker
    daemons were signalled (0 for a cluster's executors, a JVM already gone, or a system
    without ``/proc``)."""
    try:
        jvm = int(spark.sparkContext._jvm.ProcessHandle.current().pid())
    except Exception:  # py4j: the JVM is gone (a stop signal reached the whole group)
        return 0
    daemons = []
    for pid in _children(jvm):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if b"pyspark.daemon" in argv and os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGTERM)
                daemons.append(pid)
        except OSError:
            continue  # it ended meanwhile
    signalled = len(daemons)
    deadline = time.monotonic() + wait_seconds
    while daemons and time.monotonic() < deadline:  # until they are gone (or reaped)
        alive = set(_children(jvm))
        daemons = [d for d in daemons if d in alive]
        if daemons:
            time.sleep(0.02)
    return signalled


# --- tagged actions -------------------------------------------------------------------------

_local = threading.local()


def current_tag() -> str | None:
    """The tag of the step running in this thread (None outside :meth:`JobTags.run`)."""
    tag: str | None = getattr(_local, "tag", None)
    return tag


def check_cancelled() -> None:
    """Raise JobCancelledError if the step running in this thread was cancelled. The jobs
    call it before every Spark action, so a cancel between two actions stops the step."""
    tags: JobTags | None = getattr(_local, "tags", None)
    tag = current_tag()
    if tags is not None and tag is not None and tags.cancelled(tag):
        raise JobCancelledError(f"Spark step {tag!r} was cancelled")


CANCEL_REPEAT_SECONDS = 0.25
"""How often a cancel is repeated while the cancelled step still runs (JobTags.cancel)."""


class JobTags:
    """Runs blocking Spark steps under job tags and cancels them from other threads."""

    def __init__(self, spark: Any) -> None:
        self.spark = spark
        self._mu = threading.Lock()
        self._running: dict[str, int] = {}
        self._cancelled: set[str] = set()

    def cancelled(self, tag: str) -> bool:
        with self._mu:
            return tag in self._cancelled

    def running(self) -> list[str]:
        with self._mu:
            return sorted(self._running)

    @contextmanager
    def tagged(self, tag: str, description: str = "") -> Iterator[None]:
        """Within the block, Spark jobs this thread starts carry ``tag``."""
        if not tag or "," in tag:
            raise ValueError(f"a Spark job tag must be non-empty and contain no comma: {tag!r}")
        sc = self.spark.sparkContext
        with self._mu:
            self._running[tag] = self._running.get(tag, 0) + 1
        previous = (getattr(_local, "tag", None), getattr(_local, "tags", None))
        _local.tag, _local.tags = tag, self
        sc.addJobTag(tag)
        sc.setInterruptOnCancel(True)
        if description:
            sc.setJobDescription(description)
        try:
            yield
        finally:
            sc.removeJobTag(tag)
            if description:
                sc.setJobDescription(None)
            _local.tag, _local.tags = previous
            with self._mu:
                left = self._running.get(tag, 1) - 1
                if left:
                    self._running[tag] = left
                else:  # the step is over: a later step under this tag starts afresh
                    self._running.pop(tag, None)
                    self._cancelled.discard(tag)

    def run(self, tag: str, fn: Callable[[], T], description: str = "") -> T:
        """Call ``fn`` (blocking Spark work) with its jobs tagged ``tag``. Raises
        JobCancelledError when :meth:`cancel` was called for ``tag`` meanwhile, even if
        ``fn`` finished: its output must then not be committed."""
        with self.tagged(tag, description):
            try:
                check_cancelled()
                result = fn()
            except JobCancelledError:
                raise
            except Exception as exc:
                if self.cancelled(tag):
                    raise JobCancelledError(f"Spark step {tag!r} was cancelled") from exc
                raise
            if self.cancelled(tag):
                raise JobCancelledError(f"Spark step {tag!r} was cancelled")
            return result

    def cancel(self, tag: str) -> bool:
        """Cancel the step running under ``tag`` (if any); returns whether one was running.
        Safe to call from any thread, including the event loop's (it does not block on the
        jobs' ending).

        Spark cancels only jobs already submitted, and a step submits its jobs one after
        another: a job submitted after this call (the step had passed its last
        :func:`check_cancelled` and not yet reached Spark) would run to its end. So the
        cancel is repeated every ``CANCEL_REPEAT_SECONDS`` until the step is over."""
        with self._mu:
            active = tag in self._running
            first = active and tag not in self._cancelled
            if active:
                self._cancelled.add(tag)
        if active:
            self.spark.sparkContext.cancelJobsWithTag(tag)
        if first:
            threading.Thread(target=self._keep_cancelling, args=(tag,), daemon=True,
                             name=f"lamina-cancel-{tag}").start()
        return active

    def _keep_cancelling(self, tag: str) -> None:
        while True:
            time.sleep(CANCEL_REPEAT_SECONDS)
            with self._mu:
                if tag not in self._running or tag not in self._cancelled:
                    return
            with contextlib.suppress(Exception):  # Spark stopping: the step ends anyway
                self.spark.sparkContext.cancelJobsWithTag(tag)

    def cancel_all(self) -> list[str]:
        """Cancel every running step; returns their tags."""
        tags = self.running()
        for tag in tags:
            self.cancel(tag)
        return tags


_registries: dict[int, JobTags] = {}
_registries_mu = threading.Lock()


def tags_for(spark: Any) -> JobTags:
    """The process-wide :class:`JobTags` of a session."""
    with _registries_mu:
        tags = _registries.get(id(spark))
        if tags is None or tags.spark is not spark:
            tags = _registries[id(spark)] = JobTags(spark)
        return tags


def run_in_group(spark: Any, group: str, description: str, fn: Callable[[], T]) -> T:
    """Run blocking Spark work ``fn`` in this (worker) thread with its jobs tagged
    ``group``; see :meth:`JobTags.run`."""
    return tags_for(spark).run(group, fn, description)


def cancel_group(spark: Any, group: str) -> bool:
    """Cancel the work running under ``group`` from any thread; see :meth:`JobTags.cancel`."""
    return tags_for(spark).cancel(group)


def relation_tag(relation: str) -> str:
    """The prefix of a relation's job tags: the Spark executor tags each step
    ``<prefix>-<n>`` and cancels a dropped relation's steps by them (relation names never
    contain commas)."""
    return f"lamina-rel-{relation}"
