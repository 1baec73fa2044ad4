"""The part of a daemon's Prometheus metrics every daemon shares.

:class:`ServiceMetrics` owns a registry of its own (no globals) holding the process and
platform collectors, the daemon's readiness gauge (``1`` when ``/readyz`` answers 200;
its name is the daemon's: ``lamina_ready``, ``lamina_ingest_ready``) and
``lamina_build_info{version}`` (always 1). A daemon's metrics object derives from it and
adds its own metrics to ``self.registry``; :mod:`lamina.service.http` serves it.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

import lamina

__all__ = ["ServiceMetrics"]


class ServiceMetrics:
    """A registry with the process and platform collectors, ``ready`` and ``build_info``."""

    def __init__(self, registry: CollectorRegistry | None, *, ready_name: str,
                 ready_help: str) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.ready = Gauge(ready_name, ready_help, registry=self.registry)
        self.build_info = Gauge("lamina_build_info", "Build information", ["version"],
                                registry=self.registry)
        self.build_info.labels(version=lamina.__version__).set(1)

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)
