"""Plumbing shared by lamina's long-running services (``lamina serve``, the compacter, and
``lamina ingest``): settings loading, the health/readiness/metrics endpoints, the metrics
registry and systemd notifications."""
