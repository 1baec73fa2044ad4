"""The log events of the compacter daemon: one registry, as :data:`lamina.failpoints.NAMES`
is for fail points.

Every event the daemon logs (``lamina serve``: :mod:`lamina.compacter` and the service
plumbing it runs on, :mod:`lamina.service`) is listed in :data:`EVENTS` with its level,
the logger (module) that emits it and when. The table in docs/operations.md ("Logs") is
rendered from it (:func:`table`), and the tests check that every event the code logs is
here with this level, and that the document shows exactly this table. ``error`` is used
for real errors only, events an operator must act on (the docs tell operators to alert on
``level == "error"``); what the daemon handles by itself (a retried job, a cancelled one, a
client's bad request) is a warning or below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Level = Literal["debug", "info", "warning", "error"]


@dataclass(frozen=True)
class Event:
    name: str
    level: Level
    logger: str
    """The emitting module, ``lamina.`` left out."""
    when: str


_D, _P, _X, _H, _S = ("compacter.daemon", "compacter.pipeline", "compacter.executors.spark",
                      "service.http", "service.systemd")

EVENTS: tuple[Event, ...] = (
    Event("daemon.starting", "info", _D, "start-up began (data directory, executor, master)"),
    Event("daemon.trace", "info", _D, "the trace location was checked (`url`)"),
    Event("spark.started", "info", _D, "the daemon's Spark session is up (`java_options`: "
          "what its driver's JVM was started with)"),
    Event("daemon.executor", "info", _D, "the Spark executor is ready (`stage_segments`, "
          "`pack_max_steps`, `pack_max_bytes`, `scratch_compression`)"),
    Event("daemon.ready", "info", _D, "every relation recovered (`duration_seconds`: the "
          "recovery)"),
    Event("daemon.stopped", "info", _D, "the process is about to exit"),
    Event("daemon.scan_failed", "error", _D, "a poll of the data directory failed; the next "
          "one runs after `poll_interval`"),
    Event("shutdown.requested", "info", _D, "first SIGTERM/SIGINT: no new work, in-flight "
          "jobs get `grace_seconds`"),
    Event("shutdown.escalated", "warning", _D, "second SIGTERM/SIGINT: every job is "
          "cancelled now"),
    Event("shutdown.grace_expired", "warning", _D, "the grace period ended with `jobs` still "
          "running: they are cancelled"),
    Event("spark.stop_failed", "warning", _D, "stopping Spark failed because its JVM was "
          "already gone (the signal reached the whole process group); the exit is clean"),
    Event("spark.accumulators_closed", "info", "compacter.spark", "the JVM's connection to "
          "PySpark's accumulator server ended mid-read: the JVM died first (a signal to the "
          "whole process group); nothing is lost"),
    Event("spark.accumulators_failed", "warning", "compacter.spark", "any other error of "
          "PySpark's accumulator server (`error`)"),
    Event("relation.recovered", "info", _P, "a relation's trace was loaded and checked"),
    Event("relation.metadata_unreadable", "error", _D, "a relation's `relation.json` does "
          "not parse: it is not served (restore the file)"),
    Event("relation.quarantined", "error", _P, "corruption found (or a lifted quarantine "
          "did not verify); the relation is refused until repaired (Quarantine, below)"),
    Event("relation.unquarantined", "info", _D, "the operator removed a quarantine marker "
          "and the relation's files verified: it is served again, no restart"),
    Event("relation.dropped", "info", _P, "the relation's WAL is gone, or holds another "
          "relation created again under the name (`reason`); its pipeline stops and the "
          "daemon takes up the new one"),
    Event("relation.forgotten", "info", _D, "a dropped relation's pipeline and steps were "
          "stopped (`jobs_cancelled`)"),
    Event("relation.wal_removed", "info", _D, "a dropped relation's WAL was deleted"),
    Event("relation.trace_removed", "info", _D, "a dropped relation's trace was deleted"),
    Event("relation.remove_failed", "warning", _D, "a dropped relation's files could not be "
          "deleted yet; tried again at the next poll"),
    Event("conversion.started", "info", _P, "a conversion was planned and submitted "
          "(`segments`, `wal_bytes`)"),
    Event("conversion.committed", "info", _P, "its batch was published (`rows_in`, "
          "`rows_out`, `duration_seconds`, from submit to commit)"),
    Event("step.scratch", "info", "compacter.step.driver", "a large conversion or merge "
          "(two Spark jobs) chose the codec of its scratch runs under `scratch_compression = "
          "\"auto\"` (`scratch_compression`: none or lz4, `input_bytes` decoded, `free_bytes` "
          "on the trace's filesystem)"),
    Event("merge.started", "info", _P, "a merge was submitted (`left`, `right`, "
          "`batch_level`)"),
    Event("merge.committed", "info", _P, "its batch was published (`batch_level_out`)"),
    Event("gc.collected", "info", _P, "garbage collection deleted `files`, `bytes`, "
          "`versions`"),
    Event("conversion.retrying", "warning", _P, "a conversion failed; retried after "
          "`retry_in_seconds` (doubling)"),
    Event("merge.retrying", "warning", _P, "the same for a merge"),
    Event("conversion.cancelled", "warning", _P, "a conversion was cancelled (shutdown, a "
          "dropped relation); nothing of it was committed"),
    Event("merge.cancelled", "warning", _P, "the same for a merge"),
    Event("conversion.replanned", "warning", _P, "the plan no longer matched the trace "
          "state; planned again from disk (not corruption)"),
    Event("merge.replanned", "warning", _P, "the same for a merge"),
    Event("pipeline.retrying", "error", _P, "a pass or a relation's recovery failed outside "
          "a job (`kind`: conversion, merge, gc or recovery; a disk error committing or "
          "deleting): retried after a backoff, but the disk needs a look"),
    Event("pipeline.state_conflict", "error", _P, "another process published this "
          "relation's trace state: its pipeline stops"),
    Event("trace.reload_failed", "error", _P, "after a failed pass the trace state could not "
          "be read back; tried again at the next pass"),
    Event("pack.started", "info", _X, "a Spark job of `steps` small steps of as many "
          "relations started (`pack`: its job tag, `bytes_in`)"),
    Event("pack.finished", "info", _X, "it ended (`failed`: steps that failed alone, "
          "retried by their relations; `duration_seconds`)"),
    Event("pack.failed", "warning", _X, "the pack's Spark job failed as a whole (a Python "
          "worker or an executor lost): its `relations` are retried, each alone"),
    Event("http.listening", "info", _H, "the HTTP server is bound (`address`)"),
    Event("http.stopped", "info", _H, "the HTTP server stopped"),
    Event("http.readiness_failed", "error", _H, "computing readiness raised; `/readyz` "
          "answered 503"),
    Event("http.status_failed", "error", "compacter.http", "computing `/v1/relations` "
          "raised; it answered 500"),
    Event("http.bad_request", "warning", _H, "a client sent a request the server refused "
          "(`status`, `reason`: e.g. headers over 8 KiB); nothing to do on the daemon"),
    Event("systemd.notify_socket_unsupported", "warning", _S, "`NOTIFY_SOCKET` names a "
          "socket the daemon cannot use; readiness is not reported to systemd"),
    Event("systemd.notify_recovered", "info", _S, "notifications to systemd work again"),
    Event("systemd.watchdog_usec_invalid", "warning", _S, "`WATCHDOG_USEC` does not parse; "
          "no watchdog pings"),
    Event("systemd.watchdog_pid_invalid", "warning", _S, "`WATCHDOG_PID` names another "
          "process; no watchdog pings"),
)

BY_NAME = {e.name: e for e in EVENTS}


def table() -> str:
    """The events as the markdown table of docs/operations.md."""
    rows = ["| event | level | logger | when |", "|---|---|---|---|"]
    rows += [f"| `{e.name}` | {e.level} | `lamina.{e.logger}` | {e.when} |" for e in EVENTS]
    return "\n".join(rows) + "\n"
