"""The contenders of bench/peers.py, each run as its own process.

    .venv/bin/python -m bench.peers_contenders CONTENDER CELL WORKDIR     # one run
    .venv/bin/python -m bench.peers_contenders --writer CONTENDER CELL WORKDIR

A run ingests the cell's stream (:mod:`bench.peers_stream`) into ``WORKDIR``, measures,
and prints one JSON line (the last line of stdout). Contenders:

- ``lamina``: :class:`lamina.Store` with fsync "always" (``append`` then ``seal(i + 1)``
  per append; ``allow_compaction(upper - lag)`` every ``M`` appends), 4 MiB WAL segments
  rolled on age after 5 s, and ``lamina serve`` (Spark ``local[*]``, poll 0.2 s, GC every
  2 s with no grace) compacting as it runs. At the end the store is closed (finishing the
  open segment) and the run waits until the trace has caught up (``trace_upper ==
  sealed_upper``, as ``lamina status --json`` shows it) and two GC rounds passed.
- ``delta``: ``write_deltalake(mode="append")`` per append with the upper in the commit
  (custom metadata and an app transaction), then fsync of the commit's data files, the
  commit file and both directories (delta-rs does not fsync on a local disk); every ``M``
  commits the consolidation a Delta user would write (updates before ``since = upper -
  lag`` summed by row and rewritten at ``since - 1`` with ``mode="overwrite"`` and a
  predicate), ``optimize.compact()`` and ``vacuum`` with no retention (as lamina's GC
  grace); the same once more at the end.
- ``delta-nofsync``: the same without the fsyncs (not durable against power loss).
- ``delta-merge``: a keyed table ``(id, qty, cnt)``; per append the append's updates summed
  by row, then ``MERGE`` (``cnt + d``, delete where it reaches zero, insert otherwise) and
  the fsyncs; ``optimize.compact()`` and ``vacuum`` every ``M`` commits and at the end.
  It keeps no history but Delta's versions.

Measured in the child: latency of each durable append (``append`` to fsynced), wall time
of the whole ingest (maintenance included), maintenance CPU seconds and bytes written
(``/proc/self/io`` around it for Delta; the daemon's process tree for lamina, its start-up
excluded), bytes written by the appends, bytes and files on disk at the end and at the
peak (sampled every 0.25 s), the latest snapshot and the one at ``since`` (DuckDB over the
current files, as many threads as cores, for Delta; ``Relation.snapshot`` for lamina)
with the checksum of the latest, whether a time halfway through still answers, and
recovery: a writer process (``--writer``) appends on, is killed with SIGKILL, and the
time to reopen and read the latest snapshot is taken, with the last acknowledged upper
against the recovered one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc

from bench.peers_stream import CELLS, KEY, ROWS, SCHEMA, Cell, appends, checksum

CONTENDERS = ("lamina", "delta", "delta-nofsync", "delta-merge")
SEGMENT_BYTES = 4 << 20
SEGMENT_MAX_AGE = 5.0
GC_INTERVAL = 2.0
APP_ID = "lamina-bench"
READS = 3
RELATION = "peers"


def maintenance_every(cell: Cell) -> int:
    """``M``: commits between maintenance passes (ten passes per run)."""
    return max(10, cell.appends // 10)


def lag(cell: Cell) -> int:
    """How far ``since`` trails the upper: a tenth of the run."""
    return max(2, cell.appends // 10)


def proc_io(pid: int | str = "self") -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def tree_usage(pid: int) -> dict[str, float]:
    """CPU seconds and bytes written by a process and its descendants (living ones)."""
    cpu = 0.0
    written = 0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {"cpu_seconds": 0.0, "write_bytes": 0}
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            t = p.cpu_times()
            cpu += t.user + t.system
            written += proc_io(p.pid)["write_bytes"]
    return {"cpu_seconds": cpu, "write_bytes": written}


def disk(path: Path) -> tuple[int, int]:
    """Bytes (apparent sizes) and files under ``path``."""
    total = files = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(dirpath, n)).st_size
                files += 1
    return total, files


class DiskSampler:
    """The peak of :func:`disk` while it runs, sampled every 0.25 s."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.peak_bytes = self.peak_files = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> None:
        b, f = disk(self.path)
        self.peak_bytes, self.peak_files = max(self.peak_bytes, b), max(self.peak_files, f)

    def _loop(self) -> None:
        while not self._stop.wait(0.25):
            self.sample()

    def __enter__(self) -> DiskSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latencies(values: list[float]) -> dict[str, float]:
    a = np.array(values)
    tenth = max(1, len(a) // 10)
    first, last = float(np.median(a[:tenth])), float(np.median(a[-tenth:]))
    return {"p50_ms": round(float(np.percentile(a, 50)) * 1e3, 3),
            "p99_ms": round(float(np.percentile(a, 99)) * 1e3, 3),
            "max_ms": round(float(a.max()) * 1e3, 3),
            "first_tenth_p50_ms": round(first * 1e3, 3),
            "last_tenth_p50_ms": round(last * 1e3, 3),
            "growth": round(last / first, 3) if first > 0 else 0.0}


def timed_median(fn: Callable[[], Any]) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(READS):
        started = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - started)
    return float(np.median(times)), out


# --- lamina ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _open_store(data: Path, fsync: str) -> Any:
    import inspect

    from lamina import Store

    kw: dict[str, Any] = {"fsync": fsync, "segment_bytes": SEGMENT_BYTES}
    if "segment_max_age_seconds" in inspect.signature(Store.open).parameters:
        kw["segment_max_age_seconds"] = SEGMENT_MAX_AGE
    return Store.open(data, **kw)


def _start_daemon(data: Path, log: Path) -> subprocess.Popen[bytes]:
    port = _free_port()
    env = {**os.environ, "LAMINA_LOG_FORMAT": "json", "LAMINA_POLL_INTERVAL": "0.2",
           "LAMINA_GC_INTERVAL_SECONDS": str(GC_INTERVAL), "LAMINA_GC_GRACE_SECONDS": "0",
           "LAMINA_SHUTDOWN_GRACE_SECONDS": "0", "SPARK_LOCAL_IP": "127.0.0.1"}
    lamina = Path(sys.executable).with_name("lamina")
    with log.open("wb") as err:
        proc = subprocess.Popen([str(lamina), "serve", "--data-dir", str(data), "--spark-master",
                                 "local[*]", "--http", f"127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=err, env=env,
                                start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(urllib.error.URLError, OSError), \
                urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as resp:
            if resp.status == 200:
                return proc
        time.sleep(0.1)
    _stop_daemon(proc)
    raise RuntimeError(f"lamina serve did not become ready; see {log}")


def _stop_daemon(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _lamina_rows(table: pa.Table) -> pa.Table:
    return table.select([*ROWS, "_diff"]).rename_columns([*ROWS, "count"])


def run_lamina(cell: Cell, work: Path, budget: float) -> dict[str, Any]:
    from lamina.layout import Layout
    from lamina.status import relation_status

    data = work / "data"
    with _open_store(data, "always") as store:
        store.create_relation(RELATION, SCHEMA, key=KEY)
    daemon = _start_daemon(data, work / "daemon.log")
    out: dict[str, Any] = {}
    try:
        base = tree_usage(daemon.pid)
        every, behind = maintenance_every(cell), lag(cell)
        lat: list[float] = []
        io0 = proc_io()["write_bytes"]
        with DiskSampler(data) as sampler:
            started = time.perf_counter()
            with _open_store(data, "always") as store:
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
            ingest = time.perf_counter() - started
            append_written = proc_io()["write_bytes"] - io0
            deadline = time.monotonic() + 600
            status = relation_status(Layout(data), RELATION)
            while status["trace_upper"] != status["sealed_upper"] and \
                    time.monotonic() < deadline and daemon.poll() is None:
                time.sleep(0.2)
                status = relation_status(Layout(data), RELATION)
            caught_up = time.perf_counter() - started
            time.sleep(2 * GC_INTERVAL + 0.5)  # two GC rounds after the last merge
            used = tree_usage(daemon.pid)
        out.update(caught_up=status["trace_upper"] == status["sealed_upper"],
                   catch_up_seconds=round(caught_up - ingest, 3),
                   status_at_end={k: status[k] for k in ("sealed_upper", "since",
                                                         "trace_upper", "batches_by_level",
                                                         "wal_segments_pending")})
    finally:
        _stop_daemon(daemon)
    end_bytes, end_files = disk(data)
    with _open_store(data, "never") as store:
        rel = store.relation(RELATION)
        latest_s, latest = timed_median(lambda: rel.snapshot(upper - 1))
        old_s, _ = timed_median(lambda: rel.snapshot(since))
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
               time_travel_half={"as_of": half, "answers": travel},
               checksum=checksum(_lamina_rows(latest)), rows=latest.num_rows)
    out.setdefault("finished", True)
    return out


# --- Delta -----------------------------------------------------------------------------------

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


def run_delta(cell: Cell, work: Path, budget: float, mode: str) -> dict[str, Any]:
    from deltalake import DeltaTable, write_deltalake

    path = work / "table"
    merge = mode == "delta-merge"
    sync = DeltaSync(path, durable=mode != "delta-nofsync")
    every, behind = maintenance_every(cell), lag(cell)
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
    latest_s, latest = timed_median(lambda: delta_read(path, merge, None))
    if merge:
        old_s = None
    else:
        old_s, _ = timed_median(lambda: delta_read(path, merge, since))
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
               read_old_seconds=None if old_s is None else round(old_s, 4),
               time_travel_half={"version": versions[half - 1], "answers": travel},
               checksum=checksum(latest), rows=latest.num_rows)
    return out


# --- recovery after kill -9 ------------------------------------------------------------------

def writer(contender: str, cell: Cell, work: Path) -> int:
    """Append on after the run, printing ``acked <upper>`` once each append is durable."""
    from deltalake import DeltaTable, write_deltalake

    if contender == "lamina":
        store = _open_store(work / "data", "always")
        rel = store.relation(RELATION)
        upper = rel.upper
        for table in appends(cell):
            rel.append(table.set_column(2, "_time", pa.array(np.full(table.num_rows, upper,
                                                                     np.uint64))))
            upper += 1
            rel.seal(upper)
            print(f"acked {upper}", flush=True)
        return 0
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


def recovery(contender: str, cell: Cell, work: Path, acks: int = 10) -> dict[str, Any]:
    """Kill a writer with SIGKILL after ``acks`` acknowledged appends; reopen and read."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.peers_contenders", "--writer",
                             contender, cell.name, str(work)], stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[1])
    assert proc.stdout is not None
    acked = 0
    for line in proc.stdout:
        acked = int(line.split()[1])
        acks -= 1
        if acks <= 0:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    started = time.perf_counter()
    if contender == "lamina":
        with _open_store(work / "data", "never") as store:
            rel = store.relation(RELATION)
            recovered = rel.upper
            rows = rel.snapshot(recovered - 1).num_rows
    else:
        from deltalake import DeltaTable

        recovered = DeltaTable(work / "table").transaction_version(APP_ID) or 0
        rows = delta_read(work / "table", contender == "delta-merge", None).num_rows
    return {"seconds": round(time.perf_counter() - started, 4), "acked_upper": acked,
            "recovered_upper": recovered, "lost_acked": max(0, acked - recovered),
            "rows": rows}


def run(contender: str, cell: Cell, work: Path, budget: float) -> dict[str, Any]:
    if contender == "lamina":
        out = run_lamina(cell, work, budget)
    else:
        out = run_delta(cell, work, budget, contender)
    out["recovery"] = recovery(contender, cell, work)
    out["process_io"] = {k: v for k, v in proc_io().items()
                         if k in ("read_bytes", "write_bytes")}
    return out


def main(argv: list[str]) -> int:
    if argv[0] == "--writer":
        return writer(argv[1], CELLS[argv[2]], Path(argv[3]))
    contender, cell, work = argv[0], CELLS[argv[1]], Path(argv[2])
    budget = float(argv[3]) if len(argv) > 3 else 1800.0
    work.mkdir(parents=True, exist_ok=True)
    print(json.dumps(run(contender, cell, work, budget)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
