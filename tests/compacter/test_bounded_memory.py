"""Bounded memory (docs/operations.md, issue 4 point 7): the daemon converts a WAL backlog several
times larger than its driver memory setting, and no process of it ever holds the relation.

A coordinator (this test, through ``lamina.Store``) first writes about 1.9 GB of updates
(6.8M rows of 284 bytes: an int64 key over 3M distinct values, a 256-byte payload, time
and diff; 52 appends of 37 MB, each sealed) into 26 finished segments of about 74 MB.
Then ``lamina serve`` starts with ``spark_driver_memory`` at its minimum (450m: the driver
JVM's ``-Xmx``; in local mode the executors live in that JVM too) and ``max_bytes_per_job``
above the backlog, so the whole backlog is one conversion job, four times the size of the
driver's heap.

Shown:

- the conversion completes: the trace state's ``converted_through`` is the last segment,
  the WAL holds no finished segment any more, exactly one conversion succeeded;
- the JVM really ran with ``-Xmx450m`` (its command line);
- peak RSS (``VmHWM`` from /proc, sampled over the run for every process of the daemon's
  tree): the daemon's Python process stays under a sixth of the backlog (it is mostly
  its imports: about 180 MB), the JVM under half of it (the 450m heap plus the JVM's own
  code and metaspace: about 500 MB) and every Python worker under half (a worker holds one
  task's share: a decode task's 32 MB input range, or a write task's part of about 32 MB
  of input and the copies sorting it makes: about 600 MB with the interpreter; before run
  batches were sized by the part, a write task decompressed a batch of every run and a
  worker peaked at 2.4 GB, more than the backlog);
- ``snapshot(as_of)`` at two times equals an expectation computed here with numpy from the
  arrays the coordinator wrote (per key, the sum of its diffs up to ``as_of``; the payload
  is a function of the key), without lamina's consolidation code;
- ``lamina_job_input_rows_total{kind="conversion"}`` equals the number of updates written.

Measured on 2 busy cores: about 55 s (writing the backlog 9 s, the conversion 19 s,
Spark's start, two snapshots of 3M rows and the expectation the rest).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from lamina.compacter.settings import MIN_DRIVER_MEMORY_MIB
from lamina.datadir import DataDir
from lamina.drill.procs import DaemonProcess
from lamina.store import Store
from lamina.trace.trace import Trace
from lamina.wal.segment import list_segments
from tests import spark_jvm
from tests.compacter.scrape import metric, scrape_after_jobs

pytestmark = [pytest.mark.slow, pytest.mark.spark]

DRIVER_MEMORY = f"{MIN_DRIVER_MEMORY_MIB}m"
DRIVER_BYTES = MIN_DRIVER_MEMORY_MIB << 20
PAYLOAD_BYTES = 256
SCHEMA = pa.schema([("id", pa.int64()), ("payload", pa.binary())])
KEYS = 3_000_000
ROWS_PER_APPEND = 1 << 17  # about 37 MB per WAL record
SEGMENT_BYTES = 64 << 20  # two appends per finished segment
TARGET_BYTES = 4 * DRIVER_BYTES  # the backlog: four times the driver's heap
TIME_STEP = 10
FILLER = np.random.default_rng(0).integers(0, 256, PAYLOAD_BYTES, dtype=np.uint8)


def payloads(ids: np.ndarray) -> pa.Array:
    """The payload of each key: its 8 bytes (little-endian), then fixed filler."""
    n = len(ids)
    data = np.tile(FILLER, (n, 1))
    data[:, :8] = ids.astype("<i8").view(np.uint8).reshape(n, 8)
    offsets = np.arange(n + 1, dtype=np.int32) * PAYLOAD_BYTES
    return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets),
                                                  pa.py_buffer(data)])


@dataclass
class Written:
    """What the coordinator wrote, kept as plain arrays for the expectation."""

    ids: list[np.ndarray] = field(default_factory=list)
    times: list[np.ndarray] = field(default_factory=list)
    diffs: list[np.ndarray] = field(default_factory=list)
    upper: int = 0
    wal_bytes: int = 0
    last_seq: int = 0

    @property
    def updates(self) -> int:
        return sum(len(a) for a in self.ids)

    def expected(self, as_of: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys whose diffs up to ``as_of`` sum to non-zero, ascending, and those sums."""
        ids, times, diffs = (np.concatenate(a) for a in (self.ids, self.times, self.diffs))
        mask = times <= as_of
        sums = np.zeros(KEYS, dtype=np.int64)
        np.add.at(sums, ids[mask], diffs[mask])
        keys = np.flatnonzero(sums)
        return keys, sums[keys]


def write_backlog(data: Path) -> Written:
    """Append and seal until the finished segments hold TARGET_BYTES and the last seal
    finished its segment (so every update is in a finished segment)."""
    rng = np.random.default_rng(7)
    out = Written()
    with Store.open(data, segment_bytes=SEGMENT_BYTES, fsync="never") as store:
        rel = store.create_relation("big", SCHEMA, key=["id"])
        wal = store.layout.wal_dir("big")
        while True:
            ids = rng.integers(0, KEYS, ROWS_PER_APPEND, dtype=np.int64)
            times = (out.upper + rng.integers(0, TIME_STEP, ROWS_PER_APPEND)).astype(np.uint64)
            diffs = rng.choice(np.array([1, 1, 2, -1], dtype=np.int64), ROWS_PER_APPEND)
            rel.append(pa.table({"id": ids, "payload": payloads(ids),
                                 "_time": pa.array(times, pa.uint64()),
                                 "_diff": pa.array(diffs, pa.int64())}))
            out.upper += TIME_STEP
            rel.seal(out.upper)
            out.ids.append(ids)
            out.times.append(times)
            out.diffs.append(diffs)
            segments = list_segments(wal)
            finished = [s for s in segments if s.finished]
            out.wal_bytes = sum(s.path.stat().st_size for s in finished)
            open_ = [s for s in segments if not s.finished]
            rotated = all(s.path.stat().st_size < 4096 for s in open_)
            if out.wal_bytes >= TARGET_BYTES and rotated:
                out.last_seq = finished[-1].seq
                return out


# --- peak RSS of the daemon's process tree ------------------------------------------------------

def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _status_bytes(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _kind(pid: int, root: int) -> tuple[str, list[bytes]]:
    """What the process is, and its command line."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone", []
    if pid == root:
        return "daemon", argv
    if argv[0].endswith(b"java"):  # spark-class runs the launcher, then execs the driver JVM
        return ("launcher" if b"org.apache.spark.launcher.Main" in argv else "jvm"), argv
    return ("python worker" if b"pyspark" in b" ".join(argv) else "other"), argv


class PeakSampler(threading.Thread):
    """Every 0.2 s, the peak RSS (VmHWM) of every process under ``root``, by pid."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.peaks: dict[int, tuple[str, int]] = {}
        self.jvm_argv: list[bytes] = []
        self.done = threading.Event()

    def sample(self) -> None:
        tree = _children()
        todo, pids = [self.root], []
        while todo:
            pid = todo.pop()
            pids.append(pid)
            todo.extend(tree.get(pid, []))
        for pid in pids:
            hwm = _status_bytes(pid, "VmHWM")
            if hwm is None:
                continue
            kind, argv = _kind(pid, self.root)  # each time: a process may exec another
            self.peaks[pid] = (kind, max(self.peaks.get(pid, (kind, 0))[1], hwm))
            if kind == "jvm":
                self.jvm_argv = argv

    def run(self) -> None:
        while not self.done.wait(0.2):
            self.sample()

    def stop(self) -> None:
        self.sample()
        self.done.set()
        self.join()

    def peak(self, kind: str) -> int:
        return max((b for k, b in self.peaks.values() if k == kind), default=0)


def test_backlog_four_times_the_driver_memory_converts(tmp_path: Path) -> None:
    data = tmp_path / "data"
    started = time.monotonic()
    written = write_backlog(data)
    wrote_s = time.monotonic() - started
    assert written.wal_bytes >= 3.5 * DRIVER_BYTES, written.wal_bytes

    # the suite's JVM options, but G1, the JVM's own default: the suite's serial collector
    # reports a heap below Spark's minimum at -Xmx450m (tests/spark_jvm.py)
    properties = tmp_path / "spark-defaults.conf"
    properties.write_text(spark_jvm.properties_text(spark_jvm.current_archive(),
                                                    gc=spark_jvm.G1))
    env = {"LAMINA_SPARK_DRIVER_MEMORY": DRIVER_MEMORY,
           "LAMINA_MAX_BYTES_PER_JOB": str(4 * written.wal_bytes),
           "LAMINA_GC_INTERVAL_SECONDS": "30",
           "PYSPARK_SUBMIT_ARGS": spark_jvm.submit_args(properties)}
    with DaemonProcess(data, tmp_path / "daemon.log", extra_env=env) as daemon:
        sampler = PeakSampler(daemon.proc.pid)
        sampler.start()
        try:
            daemon.wait_ready()
            convert_started = time.monotonic()
            daemon.wait_caught_up("big", written.upper, timeout=400)
            converted_s = time.monotonic() - convert_started
            metrics = scrape_after_jobs(daemon, 1)
        finally:
            sampler.stop()
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0

    # the whole backlog was one conversion, and every update it read was counted
    assert metric(metrics, "lamina_jobs_total", kind="conversion", outcome="success") == 1
    assert metric(metrics, "lamina_jobs_total", kind="conversion", outcome="failure") == 0
    assert metric(metrics, "lamina_job_input_rows_total",
                   kind="conversion") == written.updates
    layout = DataDir(data)
    with Store.open(data) as store:
        meta = store.relation("big").meta
    state = Trace.open(layout.trace_store("big"), meta).state
    assert state.converted_through == written.last_seq
    assert state.upper == written.upper
    assert not [s for s in list_segments(layout.wal_dir("big")) if s.finished]

    # memory: the driver JVM had the minimum heap; no process held the relation
    assert f"-Xmx{DRIVER_MEMORY}".encode() in sampler.jvm_argv, sampler.jvm_argv
    # the suite's JVM options and class-data archive (tests/spark_jvm.py) reached a daemon's
    # driver
    archive = spark_jvm.current_archive()
    cds = () if archive is None else (f"-XX:SharedArchiveFile={archive}",)
    for flag in (*spark_jvm.FLAGS, spark_jvm.G1, *cds):
        assert flag.encode() in sampler.jvm_argv, sampler.jvm_argv
    assert spark_jvm.SERIAL.encode() not in sampler.jvm_argv, sampler.jvm_argv
    daemon_peak, jvm_peak = sampler.peak("daemon"), sampler.peak("jvm")
    worker_peak = sampler.peak("python worker")
    summary = (f"backlog {written.wal_bytes / 1e9:.2f} GB ({written.updates} updates, "
               f"{written.wal_bytes / DRIVER_BYTES:.1f}x the {DRIVER_MEMORY} driver memory) "
               f"written in {wrote_s:.1f} s, converted in {converted_s:.1f} s; peak RSS: "
               f"daemon {daemon_peak / 1e6:.0f} MB, JVM {jvm_peak / 1e6:.0f} MB, largest "
               f"Python worker {worker_peak / 1e6:.0f} MB")
    print(summary)
    assert jvm_peak > 0, sampler.peaks
    assert worker_peak > 0, sampler.peaks
    assert daemon_peak < written.wal_bytes / 6, summary
    assert jvm_peak < written.wal_bytes / 2, summary
    assert worker_peak < written.wal_bytes / 2, summary

    # the data: snapshots equal the expectation computed from what was written
    with Store.open(data) as store:
        rel = store.relation("big")
        for as_of in (written.upper // 2 - 1, written.upper - 1):
            keys, sums = written.expected(as_of)
            snap = rel.snapshot(as_of)
            assert snap.column_names == ["id", "payload", "_diff"]
            assert snap.num_rows == len(keys), f"as_of {as_of}"
            assert np.array_equal(snap.column("id").to_numpy(), keys), f"as_of {as_of}"
            assert np.array_equal(snap.column("_diff").to_numpy(), sums), f"as_of {as_of}"
            step = 1 << 18
            for start in range(0, len(keys), step):
                got = snap.column("payload").slice(start, step)
                assert got.equals(pa.chunked_array([payloads(keys[start:start + step])])), \
                    f"payloads at rows {start}.. of as_of {as_of}"
            del snap
    print(f"total {time.monotonic() - started:.1f} s")
