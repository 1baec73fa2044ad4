"""The lamina contender of :mod:`bench.peers_contenders`.

The run creates the relation, starts ``lamina serve`` on the data directory (Spark
``local[*]``, poll 0.2 s, GC every ``GC_INTERVAL`` s with no grace and ``KEEP_VERSIONS``
kept trace versions: for ``lamina`` one, the same retention as Delta's
``vacuum(retention_hours=0)``, only the current version's files are kept; for
``lamina-default`` the daemon's default) and waits for its ``/readyz`` before the clock
starts, so Spark's start-up is neither timed nor counted. It then appends the cell's stream
through :class:`lamina.Store` with fsync "always" (``append`` then ``seal(i + 1)`` per
append; ``allow_compaction(upper - lag)`` every ``M`` appends), 4 MiB WAL segments rolled
on age after 5 s. At the end the store is closed (finishing the open segment) and the run
waits until the daemon has settled (the trace has caught up, ``trace_upper ==
sealed_upper`` as ``lamina status --json`` shows it, and no merge is due: Delta's last
maintenance pass has also finished when its run ends) and two GC rounds passed; the
daemon's process tree gives the maintenance CPU seconds and bytes written, its start-up
excluded. Reads open the store
with fsync "never" and call ``Relation.snapshot``.

For recovery, :func:`lamina_writer` appends on (each append at time ``upper``, sealed to
``upper + 1``) and :func:`lamina_recover` reopens the store and reads the latest snapshot.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from bench.peers_measure import DiskSampler, disk, latencies, proc_io, timed_reads, tree_usage
from bench.peers_stream import KEY, ROWS, SCHEMA, Cell, appends, checksum
from bench.procs import serve_ready, start_serve, stop_group
from lamina.wal.record import Compression

SEGMENT_BYTES = 4 << 20
SEGMENT_MAX_AGE = 5.0
GC_INTERVAL = 2.0
KEEP_VERSIONS = {"lamina": 1, "lamina-default": 8, "lamina-lz4": 1, "lamina-zstd": 1}
"""Trace versions the daemon's GC keeps (``LAMINA_KEEP_VERSIONS``), per contender. With no
grace and one version only the current version's files stay, as with Delta's
zero-retention vacuum (``lamina``, the one held against the targets); ``lamina-default``
keeps the daemon's default 8, which readers of older states rely on, to show what that
retention costs on disk."""
WAL_COMPRESSION: dict[str, Compression] = {"lamina-lz4": "lz4", "lamina-zstd": "zstd"}
"""The WAL compression of the writing store (``Store.open(wal_compression=...)``), per
contender; the others write with the default ("none")."""
DAEMON_SETTINGS: dict[str, dict[str, str]] = {
    "lamina-zstd": {"LAMINA_SCRATCH_COMPRESSION": "zstd",
                    "LAMINA_MAX_BYTES_PER_JOB": str(128 << 20)}}
"""Daemon settings over the defaults, per contender. ``lamina-zstd`` runs the configuration
docs/operations.md ("Disk") gives a disk short of room: besides the writers' ``zstd``,
scratch runs in ZSTD and conversions of at most 128 MiB of decoded updates (4 of this
benchmark's segments), so that a conversion holds less scratch and its segments go sooner.
``lamina-lz4`` changes the writers only."""
WAL_BACKLOG_BYTES: dict[str, int] = {"lamina-zstd": 4 << 20}
"""The writing store's ``wal_backlog_bytes`` per contender (lamina.wal.throttle): the
small-disk configuration bounds the unconverted WAL too, so appends wait for the daemon
rather than land the whole stream on disk first (the others: no bound)."""
RELATION = "peers"


def _open_store(data: Path, fsync: Literal["always", "never"],
                compression: Compression = "none", backlog_bytes: int | None = None) -> Any:
    from lamina import Store

    return Store.open(data, fsync=fsync, segment_bytes=SEGMENT_BYTES,
                      segment_max_age_seconds=SEGMENT_MAX_AGE, wal_compression=compression,
                      wal_backlog_bytes=backlog_bytes)


def _start_daemon(data: Path, log: Path, keep_versions: int,
                  settings: Mapping[str, str]) -> subprocess.Popen[bytes]:
    proc, port = start_serve(data, log, master="local[*]", env={
        "LAMINA_POLL_INTERVAL": "0.2", "LAMINA_GC_INTERVAL_SECONDS": str(GC_INTERVAL),
        "LAMINA_GC_GRACE_SECONDS": "0", "LAMINA_KEEP_VERSIONS": str(keep_versions),
        "LAMINA_SHUTDOWN_GRACE_SECONDS": "0", **settings})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if serve_ready(port):
            return proc
        time.sleep(0.1)
    stop_group(proc, 60)
    raise RuntimeError(f"lamina serve did not become ready; see {log}")


def _lamina_rows(table: pa.Table) -> pa.Table:
    return table.select([*ROWS, "_diff"]).rename_columns([*ROWS, "count"])


def _settled(data: Path) -> tuple[bool, dict[str, Any]]:
    """Whether the daemon has nothing left to do, and the relation's status: the trace has
    caught up with the sealed upper and no merge is due (no two adjacent batches share a
    level), as Delta's maintenance has finished when its run ends. Until then the bytes
    on disk would count a merge half written and the batches it is about to replace."""
    from lamina.datadir import DataDir
    from lamina.status import relation_status
    from lamina.trace.plan import plan_merge

    layout = DataDir(data)
    status = relation_status(layout, RELATION)
    if status["trace_upper"] != status["sealed_upper"]:
        return False, status
    state = layout.relation(RELATION).state()
    return state is not None and plan_merge(state) is None, status


def run_lamina(cell: Cell, work: Path, budget: float, *, every: int, behind: int,
               keep_versions: int, compression: Compression = "none",
               settings: Mapping[str, str] | None = None,
               backlog_bytes: int | None = None) -> dict[str, Any]:
    """One run: ingest, catch up, measure (``every``: ``M``; ``behind``: the lag;
    ``compression``: the WAL compression the appends write with; ``settings``: the
    daemon's environment over the benchmark's; ``backlog_bytes``: the writing store's
    ``wal_backlog_bytes``)."""
    data = work / "data"
    # created with the run's compression: the relation's first segment is opened here, and
    # a writer keeps an uncompressed (version 1) open segment uncompressed until it finishes
    with _open_store(data, "always", compression) as store:
        store.create_relation(RELATION, SCHEMA, key=KEY)
    settings = dict(settings or {})
    daemon = _start_daemon(data, work / "daemon.log", keep_versions, settings)
    out: dict[str, Any] = {"keep_versions": keep_versions, "wal_compression": compression,
                           "wal_backlog_bytes": backlog_bytes, "daemon_settings": settings}
    try:
        base = tree_usage(daemon.pid)
        lat: list[float] = []
        io0 = proc_io()["write_bytes"]
        with DiskSampler(data) as sampler:
            started = time.perf_counter()
            with _open_store(data, "always", compression, backlog_bytes) as store:
                rel = store.relation(RELATION)
                for i, table in enumerate(appends(cell)):
                    t0 = time.perf_counter()
                    rel.append(table)
                    rel.seal(i + 1)
                    lat.append(time.perf_counter() - t0)
                    if (i + 1) % every == 0 and i + 1 > behind:
                        rel.allow_compaction(i + 1 - behind)
                    if time.perf_counter() - started > budget:
                        out["finished"] = False
                        break
                upper = rel.upper
                since = rel.since
                out["backlog_wait_seconds"] = round(rel.wal_backlog_wait_seconds, 3)
            ingest = time.perf_counter() - started
            append_written = proc_io()["write_bytes"] - io0
            deadline = time.monotonic() + 600
            caught_up = None
            settled, status = _settled(data)
            while not settled and time.monotonic() < deadline and daemon.poll() is None:
                if caught_up is None and status["trace_upper"] == status["sealed_upper"]:
                    caught_up = time.perf_counter() - started
                time.sleep(0.2)
                settled, status = _settled(data)
            quiet = time.perf_counter() - started
            caught_up = quiet if caught_up is None else caught_up
            time.sleep(2 * GC_INTERVAL + 0.5)  # two GC rounds after the last merge
            used = tree_usage(daemon.pid)
        out.update(caught_up=status["trace_upper"] == status["sealed_upper"], settled=settled,
                   catch_up_seconds=round(caught_up - ingest, 3),
                   settle_seconds=round(quiet - ingest, 3),
                   status_at_end={k: status[k] for k in ("sealed_upper", "since",
                                                         "trace_upper", "batches_by_level",
                                                         "wal_segments_pending")})
    finally:
        stop_group(daemon, 60)
    end_bytes, end_files = disk(data)
    with _open_store(data, "never") as store:
        rel = store.relation(RELATION)
        first_s, latest_s, latest = timed_reads(lambda: rel.snapshot(upper - 1))
        _, old_s, _ = timed_reads(lambda: rel.snapshot(since))
        half = len(lat) // 2
        try:
            rel.snapshot(half)
            travel = True
        except Exception as exc:  # the answer is whether it answers
            travel = False
            out["time_travel_error"] = f"{type(exc).__name__}: {exc}"[:200]
    out.update(appends=len(lat), updates=cell.per_append * len(lat), upper=upper,
               since=since, ingest_seconds=round(ingest, 3),
               latency=latencies(lat), append_write_bytes=append_written,
               maintenance_cpu_seconds=round(used["cpu_seconds"] - base["cpu_seconds"], 2),
               maintenance_write_bytes=used["write_bytes"] - base["write_bytes"],
               peak_bytes=sampler.peak_bytes, peak_files=sampler.peak_files,
               end_bytes=end_bytes, end_files=end_files,
               read_latest_seconds=round(latest_s, 4), read_old_seconds=round(old_s, 4),
               read_latest_first_seconds=round(first_s, 4),
               time_travel_half={"as_of": half, "answers": travel},
               checksum=checksum(_lamina_rows(latest)), rows=latest.num_rows)
    out.setdefault("finished", True)
    return out


def lamina_writer(cell: Cell, work: Path, compression: Compression = "none") -> int:
    """Append on after the run, printing ``acked <upper>`` once each append is durable."""
    store = _open_store(work / "data", "always", compression)
    rel = store.relation(RELATION)
    upper = rel.upper
    for table in appends(cell):
        rel.append(table.set_column(2, "_time", pa.array(np.full(table.num_rows, upper,
                                                                 np.uint64))))
        upper += 1
        rel.seal(upper)
        print(f"acked {upper}", flush=True)
    return 0


def lamina_recover(work: Path) -> tuple[int, int]:
    """Reopen after the writer was killed: the recovered upper and the latest rows."""
    with _open_store(work / "data", "never") as store:
        rel = store.relation(RELATION)
        recovered = rel.upper
        rows = rel.snapshot(recovered - 1).num_rows
    return recovered, rows
