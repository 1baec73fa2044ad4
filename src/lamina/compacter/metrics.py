"""The compacter's Prometheus metrics, as one object injected where it is needed.

Names follow Prometheus conventions: ``lamina_`` prefix, base units (seconds, bytes),
``_total`` for counters. Each metric lives in the object's own registry (no globals), which
``/metrics`` serves together with the process and platform collectors.

| name | type | labels | meaning |
|---|---|---|---|
| lamina_wal_pending_bytes | gauge | relation | bytes of finished WAL segments not yet converted |
| lamina_wal_pending_segments | gauge | relation | finished WAL segments not yet converted |
| lamina_conversion_lag_seconds | gauge | relation | age of the oldest finished segment not yet |
|  |  |  | converted (0 when none waits): how far the trace is behind, in time |
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
| lamina_spark_jobs_total | counter | shape | Spark jobs run (shape: pack, one job for the |
|  |  |  | small steps of many relations; step, the jobs of a large step run alone) |
| lamina_pack_steps | histogram | | steps (relations) per pack |
| lamina_steps_waiting | gauge | | steps queued for a Spark job slot |
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

**Per-relation series.** The gauges labelled ``relation`` are read from the daemon's memory
at each scrape (:class:`RelationGauges`, one per relation, from its pipeline), never
computed by a timer, so an idle relation costs nothing between scrapes. A relation has
``7 + L`` series, ``L`` its occupied levels (at most about ``log2`` of its conversions).
With ``relation_metrics = false`` each is exported once without the ``relation`` label
instead: sums for bytes, segments, rows, batches and quarantined relations, the maximum
for the two lags, so ``sum()`` and ``max()`` queries and the shipped alerts read the same
in both modes while the series count stays fixed whatever the number of relations."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lamina.service.metrics import ServiceMetrics

JOB_KINDS = ("conversion", "merge", "gc")
OUTCOMES = ("success", "failure", "cancelled")
JOB_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800)
PACK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class RelationGauges:
    """One relation's gauges, as its pipeline knows them at a scrape."""

    relation: str
    wal_pending_bytes: int = 0
    wal_pending_segments: int = 0
    conversion_lag_seconds: float = 0.0
    trace_bytes: int = 0
    trace_rows: int = 0
    frontier_lag: int = 0
    quarantined: bool = False
    batches_by_level: Mapping[int, int] = field(default_factory=dict)


# name, help, the RelationGauges field, how series combine without the relation label
_RELATION_GAUGES: tuple[tuple[str, str, str, Callable[[Iterable[float]], float]], ...] = (
    ("lamina_wal_pending_bytes", "Bytes of finished WAL segments not yet converted",
     "wal_pending_bytes", sum),
    ("lamina_wal_pending_segments", "Finished WAL segments not yet converted",
     "wal_pending_segments", sum),
    ("lamina_conversion_lag_seconds", "Age of the oldest finished WAL segment not yet "
     "converted", "conversion_lag_seconds", lambda xs: max(xs, default=0.0)),
    ("lamina_trace_bytes", "Bytes of trace batches and pending parts", "trace_bytes", sum),
    ("lamina_trace_rows", "Update rows in trace batches", "trace_rows", sum),
    ("lamina_frontier_lag", "Sealed upper minus trace upper", "frontier_lag",
     lambda xs: max(xs, default=0)),
    ("lamina_relation_quarantined", "1 while the relation is quarantined", "quarantined",
     sum),
)
RelationSource = Callable[[], Iterable[RelationGauges]]


class _RelationCollector(Collector):
    """The per-relation gauges, read from the daemon's memory at each scrape."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        rows = list(self.metrics.relation_source())
        per = self.metrics.relation_metrics
        for name, text, attr, combine in _RELATION_GAUGES:
            fam = GaugeMetricFamily(name, text, labels=["relation"] if per else [])
            if per:
                for g in rows:
                    fam.add_metric([g.relation], float(getattr(g, attr)))
            else:
                fam.add_metric([], float(combine(float(getattr(g, attr)) for g in rows)))
            yield fam
        batches = GaugeMetricFamily("lamina_trace_batches", "Trace batches per level",
                                    labels=["relation", "level"] if per else ["level"])
        totals: dict[int, int] = {}
        for g in rows:
            for level, count in sorted(g.batches_by_level.items()):
                if per:
                    batches.add_metric([g.relation, str(level)], count)
                totals[level] = totals.get(level, 0) + count
        if not per:
            for level, count in sorted(totals.items()):
                batches.add_metric([str(level)], count)
        yield batches


class Metrics(ServiceMetrics):
    """Every metric the compacter exports, in a registry of its own. The per-relation
    gauges come from ``relation_source`` (the daemon sets it: :meth:`watch_relations`);
    ``relation_metrics`` False exports them without the relation label (module
    docstring)."""

    def __init__(self, registry: CollectorRegistry | None = None, *,
                 relation_metrics: bool = True) -> None:
        super().__init__(registry, ready_name="lamina_ready",
                         ready_help="1 when the daemon is ready")
        r = self.registry
        self.relation_metrics = relation_metrics
        self.relation_source: RelationSource = tuple
        r.register(_RelationCollector(self))
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
        self.spark_jobs = Counter("lamina_spark_jobs", "Spark jobs run: packs of small steps "
                                  "of many relations, and the jobs of large steps run alone",
                                  ["shape"], registry=r)
        self.pack_steps = Histogram("lamina_pack_steps", "Steps (relations) per pack",
                                    buckets=PACK_BUCKETS, registry=r)
        self.steps_waiting = Gauge("lamina_steps_waiting", "Steps queued for a Spark job slot",
                                   registry=r)
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
        for shape in ("pack", "step"):
            self.spark_jobs.labels(shape=shape)

    def watch_relations(self, source: RelationSource) -> None:
        """Serve the per-relation gauges from ``source`` (called at each scrape, from the
        HTTP server's thread: it must be thread-safe and must not block)."""
        self.relation_source = source
