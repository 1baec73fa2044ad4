"""The PostgreSQL source: logical replication with ``pgoutput`` (see docs/ingestion.md).

- :mod:`~lamina.ingest.postgres.pgoutput`: the protocol 1 message decoder.
- :mod:`~lamina.ingest.postgres.types`: PostgreSQL types to Arrow, text-format parsing.
- :mod:`~lamina.ingest.postgres.spool`: the initial snapshot's ``COPY`` into a spool file
  by a thread, read while it grows.
- :mod:`~lamina.ingest.postgres.source`: :class:`PostgresSource`.
"""

from lamina.ingest.postgres.source import PostgresSource

__all__ = ["PostgresSource"]
