"""The compacter's Prometheus metrics, as one object injected where it is needed.

Names follow Prometheus conventions: ``lamina_`` prefix, base units (seconds, bytes),
``_total`` for counters. Each metric lives in the object's own registry (no globals), which
``/metrics`` serves together with the process and platform collectors.

| name | type | labels | meaning |
|---|---|---|---|
| lamina_wal_pending_bytes | gauge | relation | bytes of finished WAL segments not yet converted |
| lamina_wal_pending_segments | gauge | relation | finished WAL segments not yet converted |
| lamina_jobs_total | counter | kind, outcome | steps run (kind: conversion, merge, gc; |
|  |  |  | outcome: success, failure, cancelled) |
| lamina_job_duration_seconds | histogram | kind | wall time of a step, from submit to commit |
| lamina_job_retries_total | counter | kind | failed attempts that were retried |
| lamina_job_input_rows_total | counter | kind | update rows read by steps (conversion: |
|  |  |  | the updates of its WAL segments plus the pending rows it brings in; |
|  |  |  | merge: the rows of both parents) |
| lamina_job_output_rows_total | counter | kind | update rows written by steps |
| lamina_job_input_bytes_total | counter | kind | bytes read by steps (segments, parts) |
| lamina_job_output_bytes_total | counter | kind | bytes written by steps |
| lamina_trace_batches | gauge | relation, level | trace batches per compaction level |
| lamina_trace_bytes | gauge | relation | bytes of trace batches and pending parts |
| lamina_trace_rows | gauge | relation | update rows in trace batches |
| lamina_frontier_lag | gauge | relation | sealed upper minus trace upper (time units) |
| lamina_relation_quarantined | gauge | relation | 1 while the relation is quarantined |
| lamina_relations | gauge | | relations known to the daemon |
| lamina_gc_deleted_files_total | counter | | files deleted by garbage collection |
| lamina_gc_deleted_bytes_total | counter | | bytes deleted by garbage collection |
| lamina_recovery_seconds | gauge | | duration of the last start-up recovery |
| lamina_ready | gauge | | 1 when /readyz answers 200 |
| lamina_build_info | gauge | version | always 1 |
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lamina.service.metrics import ServiceMetrics

JOB_KINDS = ("conversion", "merge", "gc")
OUTCOMES = ("success", "failure", "cancelled")
JOB_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800)


class Metrics(ServiceMetrics):
    """Every metric the compacter exports, in a registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry, ready_name="lamina_ready",
                         ready_help="1 when the daemon is ready")
        r = self.registry
        self.wal_pending_bytes = Gauge("lamina_wal_pending_bytes", "Bytes of finished WAL "
                                       "segments not yet converted", ["relation"], registry=r)
        self.wal_pending_segments = Gauge("lamina_wal_pending_segments", "Finished WAL segments "
                                          "not yet converted", ["relation"], registry=r)
        self.jobs = Counter("lamina_jobs", "Compaction steps run", ["kind", "outcome"],
                            registry=r)
        self.job_seconds = Histogram("lamina_job_duration_seconds", "Wall time of a step",
                                     ["kind"], buckets=JOB_BUCKETS, registry=r)
        self.job_retries = Counter("lamina_job_retries", "Failed step attempts retried",
                                   ["kind"], registry=r)
        self.rows_in = Counter("lamina_job_input_rows", "Update rows read by steps", ["kind"],
                               registry=r)
        self.rows_out = Counter("lamina_job_output_rows", "Update rows written by steps",
                                ["kind"], registry=r)
        self.bytes_in = Counter("lamina_job_input_bytes", "Bytes read by steps", ["kind"],
                                registry=r)
        self.bytes_out = Counter("lamina_job_output_bytes", "Bytes written by steps", ["kind"],
                                 registry=r)
        self.trace_batches = Gauge("lamina_trace_batches", "Trace batches per level",
                                   ["relation", "level"], registry=r)
        self.trace_bytes = Gauge("lamina_trace_bytes", "Bytes of trace batches and pending "
                                 "parts", ["relation"], registry=r)
        self.trace_rows = Gauge("lamina_trace_rows", "Update rows in trace batches",
                                ["relation"], registry=r)
        self.frontier_lag = Gauge("lamina_frontier_lag", "Sealed upper minus trace upper",
                                  ["relation"], registry=r)
        self.quarantined = Gauge("lamina_relation_quarantined", "1 while the relation is "
                                 "quarantined", ["relation"], registry=r)
        self.relations = Gauge("lamina_relations", "Relations known to the daemon", registry=r)
        self.gc_files = Counter("lamina_gc_deleted_files", "Files deleted by garbage "
                                "collection", registry=r)
        self.gc_bytes = Counter("lamina_gc_deleted_bytes", "Bytes deleted by garbage "
                                "collection", registry=r)
        self.recovery_seconds = Gauge("lamina_recovery_seconds", "Duration of the last "
                                      "start-up recovery", registry=r)
        for kind in JOB_KINDS:  # series exist from the start, so increase() sees the first
            self.job_retries.labels(kind=kind)
            self.job_seconds.labels(kind=kind)
            for outcome in OUTCOMES:
                self.jobs.labels(kind=kind, outcome=outcome)

    def forget_relation(self, relation: str) -> None:
        """Drop every series of a relation that no longer exists."""
        for g in (self.wal_pending_bytes, self.wal_pending_segments, self.trace_bytes,
                  self.trace_rows, self.frontier_lag, self.quarantined):
            with contextlib.suppress(KeyError):
                g.remove(relation)
        for labels in list(self._level_labels(relation)):
            self.trace_batches.remove(relation, labels)

    def _level_labels(self, relation: str) -> list[str]:
        return [s.labels["level"] for m in self.trace_batches.collect() for s in m.samples
                if s.labels.get("relation") == relation]

    def set_levels(self, relation: str, levels: dict[int, int]) -> None:
        for old in self._level_labels(relation):
            if int(old) not in levels:
                self.trace_batches.remove(relation, old)
        for level, count in levels.items():
            self.trace_batches.labels(relation=relation, level=str(level)).set(count)
