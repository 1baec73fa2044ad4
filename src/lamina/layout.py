"""Where things live: every file name of a data directory and of a trace is spelled here,
and nothing else happens here (no I/O, no object stores, no quarantine rules: reading
and writing those files is :mod:`lamina.datadir`'s).

A data directory (:class:`Layout`)::

    <data>/compacter.lock                 flock of the one compacter (docs/architecture.md)
    <data>/wal/<relation>/relation.json   RelationMeta, written once
    <data>/wal/<relation>/LOCK            flock of the one writer
    <data>/wal/<relation>/QUARANTINED     present when corruption was found (JSON reason)
    <data>/wal/<relation>/*.wal[.open]    segments (names: lamina.wal.segment)
    <data>/wal/.dropped/<relation>.<id>/  a dropped relation's WAL, until it is removed
    <data>/trace/<relation>/              the relation's trace (:class:`TraceLayout`)
    <data>/trace.json                     where the traces live, when not under
                                          <data>/trace (an ``s3://`` URL;
                                          lamina.datadir.TraceLocation)

The traces of a data directory live under one URL: by default ``file://<data>/trace``
(:meth:`Layout.default_trace_url`); ``Store.open(path, trace_url=...)`` records another in
``trace.json`` once. One relation's trace is the object store ``<trace url>/<relation>``
(:meth:`lamina.datadir.DataDir.trace_store`).

Inside one relation's trace (:class:`TraceLayout`; names relative to the trace directory,
so the same names serve a directory and an object-store prefix)::

    state/<version>.json                  versioned trace state (lamina.trace.state)
    batches/<batch id>/part-00000.parquet parts of one batch, written by parallel tasks
    batches/<batch id>.scratch/...        a conversion's intermediate runs, until it is done
    pending/<part id>.parquet             future updates (lamina.trace.pending)
    staging/<segment seq>.wal             a finished WAL segment staged for decode tasks
                                          on other machines (lamina.trace.staging)
    leases/<id>.v<version>.x<expiry>.json a reader's lease on a state version
                                          (lamina.trace.lease)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lamina.schema import validate_name

META_NAME = "relation.json"
LOCK_NAME = "LOCK"
QUARANTINE_NAME = "QUARANTINED"
TRACE_LOCATION_NAME = "trace.json"


class TraceLayout:
    """Names inside one relation's trace, relative to its directory."""

    STATE = "state"
    BATCHES = "batches"
    PENDING = "pending"
    STAGING = "staging"
    LEASES = "leases"
    DATA_DIRS = (BATCHES, PENDING)
    """Directories of data files: what garbage collection and verify walk."""

    @staticmethod
    def batch_dir(batch_id: str) -> str:
        return f"{TraceLayout.BATCHES}/{batch_id}"

    @staticmethod
    def batch_part(batch_id: str, index: int) -> str:
        return f"{TraceLayout.BATCHES}/{batch_id}/part-{index:05d}.parquet"

    @staticmethod
    def scratch(batch_id: str) -> str:
        """A step's scratch directory (its runs), removed before its state is published."""
        return f"{TraceLayout.BATCHES}/{batch_id}.scratch"

    @staticmethod
    def staged_segment(seq: int) -> str:
        return f"{TraceLayout.STAGING}/{seq:020d}.wal"

    @staticmethod
    def pending_part(part_id: str) -> str:
        return f"{TraceLayout.PENDING}/{part_id}.parquet"

    @staticmethod
    def lease(lease_id: str, version: int, expires_ms: int) -> str:
        """A lease's key: its id, the state version it holds and when it expires (epoch
        milliseconds), so one listing tells garbage collection every lease."""
        return f"{TraceLayout.LEASES}/{lease_id}.v{version}.x{expires_ms}.json"


@dataclass(frozen=True)
class Layout:
    """The names of a data directory rooted at ``root``."""

    root: Path

    @property
    def wal(self) -> Path:
        return self.root / "wal"

    @property
    def trace(self) -> Path:
        return self.root / "trace"

    @property
    def dropped(self) -> Path:
        return self.wal / ".dropped"

    @property
    def compacter_lock(self) -> Path:
        return self.root / "compacter.lock"

    def wal_dir(self, name: str) -> Path:
        return self.wal / validate_name(name)

    def trace_dir(self, name: str) -> Path:
        """The local directory of a ``file://`` trace under ``<data>/trace`` (tests and
        tools that inspect files; everything else uses the relation's trace store)."""
        return self.trace / validate_name(name)

    @property
    def trace_location_path(self) -> Path:
        return self.root / TRACE_LOCATION_NAME

    def default_trace_url(self) -> str:
        return self.trace.absolute().as_uri()

    def meta_path(self, name: str) -> Path:
        return self.wal_dir(name) / META_NAME

    def lock_path(self, name: str) -> Path:
        return self.wal_dir(name) / LOCK_NAME

    def quarantine_path(self, name: str) -> Path:
        return self.wal_dir(name) / QUARANTINE_NAME
