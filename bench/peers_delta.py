"""The Delta Lake contenders of :mod:`bench.peers_contenders` (delta-rs ``deltalake``).

- ``delta``: ``write_deltalake(mode="append")`` per append of ``(id, qty, _time, _diff)``
  (``_time`` as int64), the upper in the commit (custom metadata and an app transaction
  ``APP_ID``, read back with ``transaction_version`` after a crash), then the fsyncs of
  :class:`DeltaSync`. Every ``M`` commits :func:`_delta_maintain`: the updates before
  ``since = upper - lag`` summed by row (zeros dropped) and rewritten at ``since - 1``
  with ``mode="overwrite"`` and the predicate ``_time < since``, ``optimize.compact()``
  and ``vacuum(retention_hours=0)``, each commit fsynced; the same once more at the end.
- ``delta-nofsync``: the same without the fsyncs (not durable against power loss).
- ``delta-merge``: a keyed table ``(id, qty, cnt)``; per append the append's updates summed
  by row, then ``MERGE`` (``cnt + d``, delete where it reaches zero, insert otherwise) and
  the fsyncs; ``optimize.compact()`` and ``vacuum`` every ``M`` commits and at the end.

Maintenance is measured in-process around its calls (:class:`Maintenance`: CPU and wall
seconds, ``/proc/self/io`` bytes written). Reads are a fresh reader's (:func:`delta_read`):
load the table's log, then DuckDB over its current files with as many threads as cores,
summing ``_diff`` by row up to the time (or reading ``cnt`` for the keyed table).

For recovery, :func:`delta_writer` appends on and :func:`delta_recover` reloads the table
and reads the latest rows.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bench.peers_measure import (
    DiskSampler,
    disk,
    fsync_path,
    latencies,
    proc_io,
    timed_reads,
)
from bench.peers_stream import ROWS, Cell, appends, checksum

APP_ID = "lamina-bench"


class DeltaSync:
    """The fsyncs delta-rs leaves out on a local disk: after a commit (or several), every
    data file the commits add, the commit files and the two directories."""

    def __init__(self, path: Path, durable: bool) -> None:
        self.path = path
        self.durable = durable
        self.synced = -1

    def after(self, version: int) -> None:
        if not self.durable:
            self.synced = version
            return
        log = self.path / "_delta_log"
        for v in range(self.synced + 1, version + 1):
            commit = log / f"{v:020d}.json"
            for line in commit.read_text().splitlines():
                action = json.loads(line)
                if "add" in action:
                    fsync_path(self.path / unquote(action["add"]["path"]))
            fsync_path(commit)
        fsync_path(self.path)
        fsync_path(log)
        self.synced = version


def _commit(upper: int) -> Any:
    from deltalake import CommitProperties, Transaction

    return CommitProperties(custom_metadata={"upper": str(upper)},
                            app_transactions=[Transaction(APP_ID, upper)])


def _as_delta(table: pa.Table) -> pa.Table:
    return table.set_column(2, "_time", pc.cast(table["_time"], pa.int64()))


def _summed(table: pa.Table) -> pa.Table:
    s = table.group_by(ROWS).aggregate([("_diff", "sum")]).rename_columns([*ROWS, "d"])
    return s.filter(pc.not_equal(s["d"], 0))


class Maintenance:
    """CPU seconds, wall seconds and bytes written by the maintenance calls."""

    def __init__(self) -> None:
        self.cpu = self.wall = 0.0
        self.written = self.passes = 0

    @contextlib.contextmanager
    def measure(self) -> Any:
        c, w, b = time.process_time(), time.perf_counter(), proc_io()["write_bytes"]
        yield
        self.cpu += time.process_time() - c
        self.wall += time.perf_counter() - w
        self.written += proc_io()["write_bytes"] - b
        self.passes += 1


def _delta_maintain(dt: Any, sync: DeltaSync, since: int | None, keep: Maintenance) -> None:
    from deltalake import write_deltalake

    with keep.measure():
        if since is not None and since > 0:
            old = dt.to_pyarrow_dataset().to_table(filter=pc.field("_time") < since)
            if old.num_rows:
                s = _summed(old)
                folded = pa.table({"id": s["id"], "qty": s["qty"],
                                   "_time": pa.array(np.full(s.num_rows, since - 1, np.int64)),
                                   "_diff": s["d"]})
                write_deltalake(dt, folded, mode="overwrite", predicate=f"_time < {since}")
                sync.after(dt.version())
        dt.optimize.compact()
        sync.after(dt.version())
        dt.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
        sync.after(dt.version())


def _duckdb(files: list[str], sql: str, *params: object) -> pa.Table:
    import duckdb

    con = duckdb.connect()
    con.execute(f"SET threads = {os.cpu_count() or 1}")
    if not files:
        return pa.table({"id": pa.array([], pa.int64()), "qty": pa.array([], pa.int64()),
                         "count": pa.array([], pa.int64())})
    out: pa.Table = con.sql(sql, params=[files, *params]).to_arrow_table()
    return out


def delta_read(path: Path, merge: bool, as_of: int | None, version: int | None = None
               ) -> pa.Table:
    """The rows at ``as_of`` (None: all) of the table (at ``version``), as a fresh
    reader would: load the log, then DuckDB over the current files."""
    from deltalake import DeltaTable

    dt = DeltaTable(path, version=version)
    files = dt.file_uris()
    if merge:
        return _duckdb(files, "SELECT id, qty, cnt::BIGINT AS count FROM read_parquet(?)")
    return _duckdb(files, "SELECT id, qty, sum(_diff)::BIGINT AS count FROM read_parquet(?) "
                          "WHERE _time <= ? GROUP BY id, qty HAVING sum(_diff) <> 0",
                   (1 << 62) if as_of is None else as_of)


def run_delta(cell: Cell, work: Path, budget: float, mode: str, *, every: int,
              behind: int) -> dict[str, Any]:
    """One run of ``mode`` (``every``: ``M``; ``behind``: the lag)."""
    from deltalake import DeltaTable, write_deltalake

    path = work / "table"
    merge = mode == "delta-merge"
    sync = DeltaSync(path, durable=mode != "delta-nofsync")
    keep = Maintenance()
    lat: list[float] = []
    versions: list[int] = []
    out: dict[str, Any] = {"finished": True}
    dt: Any = None
    io_appends = 0
    path.mkdir(parents=True)
    with DiskSampler(path) as sampler:
        started = time.perf_counter()
        for i, table in enumerate(appends(cell)):
            b0 = proc_io()["write_bytes"]
            t0 = time.perf_counter()
            if merge:
                s = _summed(table)
                if dt is None:
                    write_deltalake(path, s.rename_columns([*ROWS, "cnt"]), mode="append",
                                    commit_properties=_commit(i + 1))
                    dt = DeltaTable(path)
                else:
                    (dt.merge(s, "t.id = s.id AND t.qty = s.qty", source_alias="s",
                              target_alias="t", commit_properties=_commit(i + 1))
                     .when_matched_delete("t.cnt + s.d = 0")
                     .when_matched_update({"cnt": "t.cnt + s.d"})
                     .when_not_matched_insert({"id": "s.id", "qty": "s.qty", "cnt": "s.d"})
                     .execute())
            elif dt is None:
                write_deltalake(path, _as_delta(table), mode="append",
                                commit_properties=_commit(i + 1))
                dt = DeltaTable(path)
            else:
                write_deltalake(dt, _as_delta(table), mode="append",
                                commit_properties=_commit(i + 1))
            sync.after(dt.version())
            lat.append(time.perf_counter() - t0)
            io_appends += proc_io()["write_bytes"] - b0
            versions.append(dt.version())
            if (i + 1) % every == 0:
                _delta_maintain(dt, sync, None if merge else i + 1 - behind, keep)
            if time.perf_counter() - started > budget:
                out["finished"] = False
                break
        upper = len(lat)
        since = max(0, upper - behind)
        _delta_maintain(dt, sync, None if merge else since, keep)
        ingest = time.perf_counter() - started
    end_bytes, end_files = disk(path)
    first_s, latest_s, latest = timed_reads(lambda: delta_read(path, merge, None))
    if merge:
        old_s = None
    else:
        _, old_s, _ = timed_reads(lambda: delta_read(path, merge, since))
    half = len(lat) // 2
    try:
        delta_read(path, merge, None if merge else half, version=versions[half - 1])
        travel = True
    except Exception as exc:  # the answer is whether it answers
        travel = False
        out["time_travel_error"] = f"{type(exc).__name__}: {exc}"[:200]
    out.update(appends=len(lat), updates=cell.per_append * len(lat), upper=upper, since=since,
               version=dt.version(), ingest_seconds=round(ingest, 3), latency=latencies(lat),
               append_write_bytes=io_appends,
               maintenance_cpu_seconds=round(keep.cpu, 2),
               maintenance_wall_seconds=round(keep.wall, 2),
               maintenance_write_bytes=keep.written, maintenance_passes=keep.passes,
               peak_bytes=sampler.peak_bytes, peak_files=sampler.peak_files,
               end_bytes=end_bytes, end_files=end_files,
               read_latest_seconds=round(latest_s, 4),
               read_latest_first_seconds=round(first_s, 4),
               read_old_seconds=None if old_s is None else round(old_s, 4),
               time_travel_half={"version": versions[half - 1], "answers": travel},
               checksum=checksum(latest), rows=latest.num_rows)
    return out


def delta_writer(contender: str, cell: Cell, work: Path) -> int:
    """Append on after the run, printing ``acked <upper>`` once each append is durable."""
    from deltalake import DeltaTable, write_deltalake

    path = work / "table"
    dt = DeltaTable(path)
    sync = DeltaSync(path, durable=contender != "delta-nofsync")
    sync.synced = dt.version()
    upper = dt.transaction_version(APP_ID) or 0
    for table in appends(cell):
        if contender == "delta-merge":
            s = _summed(table)
            dt.merge(s, "t.id = s.id AND t.qty = s.qty", source_alias="s", target_alias="t",
                     commit_properties=_commit(upper + 1)).when_matched_delete(
                "t.cnt + s.d = 0").when_matched_update({"cnt": "t.cnt + s.d"}
                                                       ).when_not_matched_insert(
                {"id": "s.id", "qty": "s.qty", "cnt": "s.d"}).execute()
        else:
            t = table.set_column(2, "_time", pa.array(np.full(table.num_rows, upper, np.int64)))
            write_deltalake(dt, t.set_column(3, "_diff", table["_diff"]), mode="append",
                            commit_properties=_commit(upper + 1))
        upper += 1
        sync.after(dt.version())
        print(f"acked {upper}", flush=True)
    return 0


def delta_recover(work: Path, merge: bool) -> tuple[int, int]:
    """Reload after the writer was killed: the recovered upper and the latest rows."""
    from deltalake import DeltaTable

    recovered = DeltaTable(work / "table").transaction_version(APP_ID) or 0
    rows = delta_read(work / "table", merge, None).num_rows
    return recovered, rows
