"""The ingest service's Prometheus metrics, as one object injected where it is needed.

Its own registry (no globals), served on ``/metrics`` with the process collectors.
Times of bindings are lamina times (milliseconds since the Unix epoch).

| name | type | labels | meaning |
|---|---|---|---|
| lamina_source_state | gauge | source, state | 1 for the source's current state, else 0 |
| lamina_source_output_state | gauge | source, relation, state | the same per output |
| lamina_source_lag_offsets | gauge | source | upstream offsets not yet read (files: bytes; |
|  |  |  | PostgreSQL: WAL bytes); absent where a source cannot tell |
| lamina_source_lag_seconds | gauge | source | age of the oldest upstream commit not sealed |
|  |  |  | yet, on the upstream's clock (:mod:`lamina.ingest.lag`): rises as soon |
|  |  |  | as lamina falls behind, stops or retries |
| lamina_source_output_lag_seconds | gauge | source, relation | now minus the output's upper |
| lamina_source_changes_total | counter | source, relation | update rows written |
| lamina_source_transactions_total | counter | source | upstream transactions read |
| lamina_source_bindings_total | counter | source | bindings minted |
| lamina_source_resume_frontier | gauge | source | least upper of the outputs (the resume time) |
| lamina_source_binding_time | gauge | source | time of the newest binding written |
| lamina_source_retries_total | counter | source | transient errors retried |
| lamina_ingest_ready | gauge | | 1 when /readyz answers 200 (every source running) |
| lamina_build_info | gauge | version | always 1 |
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from lamina.ingest.health import STATES, State
from lamina.service.metrics import ServiceMetrics


class IngestMetrics(ServiceMetrics):
    """Every metric ``lamina ingest`` exports, in a registry of its own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry, ready_name="lamina_ingest_ready",
                         ready_help="1 when every source is running")
        r = self.registry
        self.state = Gauge("lamina_source_state", "1 for the source's current state",
                           ["source", "state"], registry=r)
        self.output_state = Gauge("lamina_source_output_state", "1 for the output's current "
                                  "state", ["source", "relation", "state"], registry=r)
        self.lag_offsets = Gauge("lamina_source_lag_offsets", "Upstream offsets not yet read",
                                 ["source"], registry=r)
        self.lag_seconds = Gauge("lamina_source_lag_seconds", "Age of the oldest upstream "
                                 "commit not sealed yet", ["source"], registry=r)
        self.output_lag_seconds = Gauge("lamina_source_output_lag_seconds", "Now minus the "
                                        "output's upper", ["source", "relation"], registry=r)
        self.changes = Counter("lamina_source_changes", "Update rows written",
                               ["source", "relation"], registry=r)
        self.transactions = Counter("lamina_source_transactions", "Upstream transactions read",
                                    ["source"], registry=r)
        self.bindings = Counter("lamina_source_bindings", "Bindings minted", ["source"],
                                registry=r)
        self.resume_frontier = Gauge("lamina_source_resume_frontier", "Least upper of the "
                                     "source's outputs", ["source"], registry=r)
        self.binding_time = Gauge("lamina_source_binding_time", "Time of the newest binding",
                                  ["source"], registry=r)
        self.retries = Counter("lamina_source_retries", "Transient errors retried",
                               ["source"], registry=r)

    def register_source(self, source: str, lag_seconds: Callable[[], float]) -> None:
        """Create a source's series (so ``increase()`` sees the first event)."""
        self.transactions.labels(source=source)
        self.bindings.labels(source=source)
        self.retries.labels(source=source)
        self.lag_seconds.labels(source=source).set_function(lag_seconds)
        self.set_state(source, "starting")

    def register_output(self, source: str, relation: str, upper: Callable[[], int]) -> None:
        self.changes.labels(source=source, relation=relation)

        def lag() -> float:
            return max(0.0, time.time() - upper() / 1000)

        self.output_lag_seconds.labels(source=source, relation=relation).set_function(lag)

    def set_state(self, source: str, state: State) -> None:
        for s in STATES:
            self.state.labels(source=source, state=s).set(1 if s == state else 0)

    def set_output_state(self, source: str, relation: str, state: State) -> None:
        for s in STATES:
            self.output_state.labels(source=source, relation=relation,
                                     state=s).set(1 if s == state else 0)

    def set_lag_offsets(self, source: str, lag: int | None) -> None:
        if lag is None:
            with contextlib.suppress(KeyError):
                self.lag_offsets.remove(source)
        else:
            self.lag_offsets.labels(source=source).set(lag)
