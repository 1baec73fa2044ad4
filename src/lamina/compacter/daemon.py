"""The compacter daemon: discovery, per-relation pipelines, lifecycle.

Start-up (all before READY=1 and a passing ``/readyz``):

1. take ``<data>/compacter.lock`` (flock): a second daemon on the same data directory
   refuses with LockedError;
2. serve HTTP (``/healthz`` answers from here on);
3. start the SparkSession (off the event loop), unless ``executor = "inprocess"``;
4. recover every relation: load the newest trace state, check invariants, delete segments
   already converted; the time this takes is ``lamina_recovery_seconds``.

Then every ``poll_interval`` it polls the data directory, in one thread and without
reading any data (no in-memory link to coordinators):

- the WAL directory is listed again only when its mtime moved (a relation created or
  dropped; :class:`lamina.compacter.watch.DirStamp`): new relations get a
  :class:`~lamina.compacter.pipeline.RelationPipeline`, and what dropped relations left
  (``wal/.dropped/*``, or a trace without a WAL) is removed from disk;
- every relation's :class:`~lamina.compacter.watch.WalWatch` is polled (two ``stat``
  calls); a relation whose finished segments changed has its pipeline woken, the others
  stay asleep;
- a quarantined relation whose ``QUARANTINED`` marker was removed is verified
  (:func:`lamina.verify.verify_relation`) and, if its files pass, taken back: a fresh
  pipeline starts on it, no restart needed. If they do not pass, it is quarantined again
  with what was found.

So 1,000 idle relations cost about 2,000 ``stat`` calls per poll. Metrics, ``/readyz``
and ``/v1/relations`` are answered from the pipelines' memory.

A dropped relation's pipeline task is cancelled and so are its queued and running steps
(:meth:`~lamina.compacter.executors.Executor.cancel_relation`; the other relations of a
pack go on).

SIGTERM/SIGINT: stop taking work, let in-flight steps finish for up to
``shutdown_grace_seconds``, then cancel their jobs; STOPPING=1; exit 0. A second
SIGTERM/SIGINT during that grace period cancels every job at once and exits (0) without
waiting further. The same holds when the signal went to the whole process group
(``timeout``, supervisord's ``stopasgroup``, systemd's ``KillMode=control-group``) and
the Spark JVM died first: its steps fail, nothing is committed, and stopping the session
that is already gone is not an error. Every step is crash-safe, so SIGKILL is only a
delay.

Log events: the registry :mod:`lamina.events` lists each one this module logs (logger
``lamina.compacter.daemon``) with its level and meaning.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiofiles
import structlog

from lamina.compacter.executors import Executor
from lamina.compacter.executors.inprocess import InProcessExecutor
from lamina.compacter.metrics import Metrics, RelationGauges
from lamina.compacter.pipeline import RelationPipeline
from lamina.compacter.settings import Settings
from lamina.compacter.watch import DirStamp
from lamina.datadir import DataDir
from lamina.errors import CorruptionError, LaminaError
from lamina.fs import FileSystem
from lamina.layout import META_NAME, QUARANTINE_NAME, TraceLayout
from lamina.lock import DirLock
from lamina.schema import RelationMeta

if TYPE_CHECKING:
    from lamina.objstore.base import ObjectStore
    from lamina.objstore.s3 import S3Settings

log = structlog.get_logger(__name__)

_TRACE_NAMES = {TraceLayout.STATE, *TraceLayout.DATA_DIRS, TraceLayout.STAGING,
                TraceLayout.LEASES}
"""What a relation's trace holds at its top: a name under the trace root without any of
these is not lamina's, and a dropped relation's cleanup leaves it alone."""


@dataclass
class _Scan:
    """What one poll of the data directory found (:meth:`Daemon._scan`)."""

    names: set[str] | None = None
    """Relations in the WAL directory, when it was listed again (None: unchanged)."""
    woken: list[str] = field(default_factory=list)
    """Relations whose finished segments changed."""
    unmarked: list[str] = field(default_factory=list)
    """Quarantined relations whose marker is gone."""


class Daemon:
    """The compacter. ``await Daemon(settings).run()`` returns the process exit code."""

    def __init__(self, settings: Settings, *, metrics: Metrics | None = None,
                 fs: FileSystem | None = None, executor: Executor | None = None) -> None:
        self.settings = settings
        self.layout = DataDir(settings.data_dir, s3=settings.s3.to_settings())
        self.metrics = metrics or Metrics(relation_metrics=settings.relation_metrics)
        self.metrics.watch_relations(self._gauges)
        self.fs = fs or FileSystem()
        self.executor = executor
        self.pipelines: dict[str, RelationPipeline] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.stop = asyncio.Event()
        self.escalated = asyncio.Event()
        """Set by a second stop signal: cancel every job now, do not wait for them."""
        self.recovered = False
        self._spark: Any = None
        self.trace_root: ObjectStore | None = None
        """The root of every relation's trace, once :meth:`_open_trace_root` checked it."""
        self._wal_stamp = DirStamp()
        self._cleanup = True
        """Whether what dropped relations left may be on disk (checked at start-up, and
        after the WAL directory changed)."""

    # --- readiness and status (served over HTTP, from memory) ---------------------------
    def readiness(self) -> tuple[bool, str]:
        if not self.recovered:
            return False, "recovering"
        pipes = list(self.pipelines.values())
        quarantined = sorted(p.name for p in pipes if p.quarantined)
        if quarantined:
            return False, f"quarantined relations: {', '.join(quarantined)}"
        backlog = sum(p.backlog_bytes for p in pipes)
        if backlog > self.settings.ready_backlog_bytes:
            return False, (f"WAL backlog {backlog} bytes exceeds "
                           f"{self.settings.ready_backlog_bytes}")
        return True, "ready"

    def status(self) -> list[dict[str, Any]]:
        """``/v1/relations``: every relation's status object, from the pipelines' memory
        (as of the last poll; ``lamina status`` reads the same from disk)."""
        return [p.status() for p in sorted(list(self.pipelines.values()),
                                           key=lambda p: p.name)]

    def _gauges(self) -> list[RelationGauges]:
        now = time.time()
        return [p.gauges(now) for p in list(self.pipelines.values())]

    # --- main -----------------------------------------------------------------------------
    async def run(self) -> int:
        from lamina.compacter.http import build_app, start_http
        from lamina.service.systemd import Notifier, watchdog_interval, watchdog_loop

        started = time.monotonic()
        self.fs.makedirs(self.layout.wal)
        lock = DirLock(self.layout.compacter_lock, f"data directory {self.settings.data_dir}")
        notifier = Notifier()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._request_stop, sig)
        runner = await start_http(build_app(self.metrics, self.status, self._ready_gauge),
                                  self.settings.http_host, self.settings.http_port)
        log.info("daemon.starting", data_dir=str(self.settings.data_dir),
                 executor=self.settings.executor, spark_master=self.settings.spark_master,
                 http=self.settings.http)
        watchdog = asyncio.create_task(watchdog_loop(notifier, watchdog_interval()))
        try:
            await asyncio.to_thread(self._open_trace_root)
            if self.executor is None and self.settings.executor == "inprocess":
                self.executor = InProcessExecutor(self.settings.max_concurrent_jobs)
            elif self.executor is None:
                self._spark = await asyncio.to_thread(self._build_spark)
                if self.stop.is_set():
                    return 0
                self.executor = self._spark_executor()
            await self._poll()
            await asyncio.gather(*(p.recover() for p in self.pipelines.values()
                                   if p.trace is None and p.quarantined is None))
            self.recovered = True
            elapsed = time.monotonic() - started
            self.metrics.recovery_seconds.set(elapsed)
            self._ready_gauge()
            notifier.ready()
            notifier.status(f"serving {len(self.pipelines)} relations")
            log.info("daemon.ready", relations=len(self.pipelines),
                     duration_seconds=round(elapsed, 3))  # the recovery's
            for name in self.pipelines:
                self._start(name)
            while not self.stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), self.settings.poll_interval)
                if not self.stop.is_set():
                    try:
                        await self._poll()
                    except Exception as exc:  # a failed scan is retried at the next one
                        log.exception("daemon.scan_failed", error=str(exc))
                    self._ready_gauge()
            notifier.stopping()
            await self._shutdown()
            return 0
        finally:
            watchdog.cancel()
            await runner.cleanup()
            if self._spark is not None:
                await asyncio.to_thread(self._stop_spark)
            lock.close()
            log.info("daemon.stopped", duration_seconds=round(time.monotonic() - started, 3))

    def _spark_executor(self) -> Executor:
        from lamina.compacter.executors.spark import SparkExecutor
        from lamina.compacter.step.work import JobTuning

        s = self.settings
        stage = s.stages_segments(self.layout.trace_url())
        log.info("daemon.executor", executor="spark", stage_segments=stage,
                 pack_max_steps=s.pack_max_steps, pack_max_bytes=s.pack_max_bytes,
                 scratch_compression=s.scratch_compression)
        return SparkExecutor(self._spark, s.max_concurrent_jobs, stage_segments=stage,
                             pack_max_steps=s.pack_max_steps, pack_max_bytes=s.pack_max_bytes,
                             tuning=JobTuning(run_compression=s.scratch_compression),
                             metrics=self.metrics)

    def _stop_spark(self) -> None:
        """Stop the SparkSession, its local Python workers first (quietly:
        :func:`lamina.compacter.spark.stop_python_workers`); a JVM that is already gone (the
        stop signal reached the whole process group) is not an error."""
        from lamina.compacter.spark import stop_python_workers

        try:
            stop_python_workers(self._spark)
            self._spark.stop()
        except Exception as exc:  # py4j's ConnectionRefusedError, Py4JError, ...
            log.warning("spark.stop_failed", error=f"{type(exc).__name__}: {exc}")

    def _open_trace_root(self) -> None:
        """Record the configured trace URL (once per data directory), and refuse an object
        store whose conditional puts cannot serve as the state's compare-and-set."""
        from lamina.objstore.base import open_store
        from lamina.objstore.probe import check_conditional_put

        if self.settings.trace_url is not None:
            self.layout.record_trace_url(self.settings.trace_url, self.fs)
        url = self.layout.trace_url()
        root = open_store(url, self.layout.s3, fs=self.fs)
        if url == self.layout.default_trace_url():
            self.fs.makedirs(self.layout.trace)
        elif not url.startswith("file:"):
            check_conditional_put(root)
        self.trace_root = root
        log.info("daemon.trace", url=url)

    def _build_spark(self) -> Any:
        from lamina.compacter.spark import build_session, java_options

        session = build_session(self.settings.spark_master, app_name="lamina-compacter",
                                conf=self.session_conf())
        log.info("spark.started", java_options=java_options(session))
        return session

    def session_conf(self) -> dict[str, str]:
        """The configuration of the daemon's session: the daemon's JVM options
        (:data:`lamina.compacter.spark.DAEMON_JAVA_OPTIONS`), the driver memory and S3
        credentials of the settings, then the operator's ``spark_conf``, which wins."""
        from lamina.compacter.spark import daemon_conf

        return {**daemon_conf(), "spark.driver.memory": self.settings.spark_driver_memory,
                **_credentials_env(self.settings.s3.to_settings()),
                **self.settings.spark_conf}

    def _request_stop(self, sig: signal.Signals) -> None:
        """The first signal stops taking work; a second one cancels every job now."""
        if not self.stop.is_set():
            log.info("shutdown.requested", signal=sig.name,
                     grace_seconds=self.settings.shutdown_grace_seconds)
            self.stop.set()
        elif not self.escalated.is_set():
            log.warning("shutdown.escalated", signal=sig.name,
                        jobs=sum(not t.done() for t in self.tasks.values()))
            self.escalated.set()

    def _ready_gauge(self) -> tuple[bool, str]:
        ok, why = self.readiness()
        self.metrics.ready.set(1 if ok else 0)
        return ok, why

    # --- the poll -------------------------------------------------------------------------
    async def _poll(self) -> None:
        """One poll of the data directory (module docstring): new and dropped relations,
        work that became ready, quarantines lifted, what dropped relations left."""
        scan = await asyncio.to_thread(self._scan)
        for name in scan.woken:
            pipe = self.pipelines.get(name)
            if pipe is not None:
                pipe.wake.set()
        if scan.names is not None:
            for name in sorted(scan.names - self.pipelines.keys()):
                await self._add(name)
            for name in sorted(self.pipelines.keys() - scan.names):
                await self._forget(name)
        for name, pipe in list(self.pipelines.items()):
            if pipe.stopped == "relation dropped":
                await self._forget(name)
                await self._add(name)  # a relation created again under the name, if any
        for name in scan.unmarked:
            await self._lift_quarantine(name)
        if self._cleanup:
            self._cleanup = not await asyncio.to_thread(self._remove_dropped,
                                                        set(self.pipelines))
        self.metrics.relations.set(len(self.pipelines))

    def _scan(self) -> _Scan:
        """The blocking half of :meth:`_poll`: ``stat`` calls, and listings where they
        changed."""
        now = time.time()
        scan = _Scan()
        if self._wal_stamp.changed(self.layout.wal, now):
            scan.names = self._relation_names()
            self._cleanup = True
        for name, pipe in list(self.pipelines.items()):
            if pipe.quarantined is not None:
                if not (self.layout.wal_dir(name) / QUARANTINE_NAME).exists():
                    scan.unmarked.append(name)
                continue
            try:
                if pipe.watch.poll(now):
                    scan.woken.append(name)
            except FileNotFoundError:
                continue  # dropped: the WAL directory's listing says so
        return scan

    def _relation_names(self) -> set[str]:
        """Relations in the WAL directory: known ones by name, new ones once their
        ``relation.json`` exists (a relation's directory appears whole)."""
        names = set()
        with os.scandir(self.layout.wal) as entries:
            for e in entries:
                if e.name.startswith(".") or not e.is_dir():
                    continue
                if e.name in self.pipelines or os.path.exists(os.path.join(e.path, META_NAME)):
                    names.add(e.name)
        return names

    # --- relations ------------------------------------------------------------------------
    async def _add(self, name: str) -> None:
        """A relation found in the WAL directory: a pipeline, started once recovered (at
        start-up the daemon recovers every relation before it is ready)."""
        try:
            meta = await self._read_meta(name)
        except FileNotFoundError:
            return
        except CorruptionError as exc:
            log.error("relation.metadata_unreadable", relation=name, error=str(exc))
            return
        pipe = RelationPipeline(name=name, meta=meta, layout=self.layout,
                                settings=self.settings, executor=self._executor(),
                                metrics=self.metrics, fs=self.fs, polled=True)
        pipe.quarantined = await asyncio.to_thread(self.layout.quarantine_reason, name)
        self.pipelines[name] = pipe
        if self.recovered:
            self._start(name)  # its run() recovers it first

    async def _lift_quarantine(self, name: str) -> None:
        """The operator removed a quarantined relation's marker: take it back if its files
        verify, else quarantine it again with what was found."""
        from lamina.verify import verify_relation

        report = await asyncio.to_thread(verify_relation, self.layout, name)
        old = self.pipelines.get(name)
        if old is None or old.quarantined is None:
            return
        if not report.ok:
            await old.quarantine(CorruptionError("; ".join(report.problems)))
            return
        self.pipelines.pop(name)
        self.tasks.pop(name, None)
        await self._add(name)
        log.info("relation.unquarantined", relation=name, previous_reason=old.quarantined)

    def _executor(self) -> Executor:
        assert self.executor is not None
        return self.executor

    async def _read_meta(self, name: str) -> RelationMeta:
        """Read ``relation.json`` without blocking the loop (aiofiles' thread pool)."""
        async with aiofiles.open(self.layout.meta_path(name), "rb") as f:
            data = await f.read()
        return self.layout.parse_meta(name, data)

    def _start(self, name: str) -> None:
        pipe = self.pipelines[name]
        if name not in self.tasks and pipe.quarantined is None:
            self.tasks[name] = asyncio.create_task(pipe.run(self.stop), name=f"pipeline-{name}")

    async def _forget(self, name: str) -> None:
        """Stop a dropped relation's pipeline and cancel its queued and running steps."""
        task = self.tasks.pop(name, None)
        jobs = self.executor.cancel_relation(name) if self.executor is not None else 0
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, LaminaError):
                await task
        self.pipelines.pop(name, None)
        self._cleanup = True
        log.info("relation.forgotten", relation=name, jobs_cancelled=jobs)

    def _remove_dropped(self, live: set[str]) -> bool:
        """Delete WALs of dropped relations and traces that no live relation owns; True
        when nothing is left to remove. A directory that cannot be removed now (a cancelled
        job's thread still writing in it, a disk error) is left for the next poll."""
        done = True
        if self.layout.dropped.exists():
            for d in self.layout.dropped.iterdir():
                if self._remove(d):
                    log.info("relation.wal_removed", path=str(d))
                else:
                    done = False
        root = self.trace_root
        if root is None:
            return done
        for name in root.children():
            if (name not in live and not name.startswith("_")
                    and not self.layout.wal_dir(name).exists()
                    and _TRACE_NAMES & set(root.child(name).children())):  # a trace only
                try:
                    root.delete_prefix(name)
                except OSError as exc:  # a cancelled job still writing, a store error
                    log.warning("relation.remove_failed", path=root.location(name),
                                error=str(exc))
                    done = False
                    continue
                log.info("relation.trace_removed", relation=name)
        return done

    def _remove(self, path: Path) -> bool:
        try:
            self.fs.rmtree(path)
        except OSError as exc:
            log.warning("relation.remove_failed", path=str(path), error=str(exc))
            return False
        return True

    async def _shutdown(self) -> None:
        """Wait for the pipelines up to the grace period (or a second signal), then cancel
        what still runs: its jobs first, then the tasks awaiting them."""
        deadline = time.monotonic() + self.settings.shutdown_grace_seconds
        pending = {t for t in self.tasks.values() if not t.done()}
        escalated = asyncio.create_task(self.escalated.wait())
        try:
            while pending and not self.escalated.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                done, _ = await asyncio.wait(pending | {escalated}, timeout=left,
                                             return_when=asyncio.FIRST_COMPLETED)
                pending -= done
        finally:
            escalated.cancel()
        if pending:
            if not self.escalated.is_set():
                log.warning("shutdown.grace_expired", jobs=len(pending))
            if self.executor is not None:
                self.executor.cancel_all()
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)


def _credentials_env(s3: S3Settings) -> dict[str, str]:
    """Explicit S3 credentials as Spark executor environment variables: a pickled store
    carries none (lamina.objstore.s3), so tasks read them from their environment."""
    names = {"AWS_ACCESS_KEY_ID": s3.access_key_id,
             "AWS_SECRET_ACCESS_KEY": s3.secret_access_key,
             "AWS_SESSION_TOKEN": s3.session_token}
    return {f"spark.executorEnv.{k}": v for k, v in names.items() if v}
