"""Where a conversion or merge spends its time: the profiles behind docs/performance.md.

    .venv/bin/python -m bench.profile tasks [--step convert|merge] [--scale 1.0] [--top 25]
    .venv/bin/python -m bench.profile jvm [--step convert|merge] [--scale 1.0] [--runs 2]
    .venv/bin/python -m bench.profile sums [--scale 1.0]
    .venv/bin/python -m bench.profile sorts [--runs 7]
    .venv/bin/python -m bench.profile encodings [--runs 3]
    .venv/bin/python -m bench.profile wal [--runs 300]
    .venv/bin/python -m bench.profile syncs [--runs 5]
    .venv/bin/python -m bench.profile timeline [--step convert|merge] [--scale 1.0] [--runs 2]
    .venv/bin/python -m bench.profile pertask [--runs 5] [--conf K=V ...]
    .venv/bin/python -m bench.profile reads --store DIR [--relation peers] [--cell CELL]
                                            [--read snapshot|snapshot_reader|updates]
                                            [--runs 3]

``tasks`` runs the step's Spark tasks in this process, one after the other, with no Spark
at all (``lamina.compacter.step.driver`` hands the task functions to ``_run_tasks``, which this
replaces), and prints each job's CPU and wall seconds and cProfile's heaviest functions:
the Python work of the step, without scheduling or parallelism.

``jvm`` runs the step ``--runs`` times with Spark (``local[*]``) under Java Flight
Recorder and prints the JVM's hottest methods (self and inclusive samples) and threads;
with the code of an earlier commit on ``PYTHONPATH`` it profiles that code (this is how
the former design's profile was taken).

``sums`` times pyarrow's hash group-by of the merge input's 10M rows by row, summing the
diffs as int64 and as decimal128(38, 0) (what ``lamina.consolidate`` chooses between).

``sorts`` times the orders of 650,000 integers (a decode task's prefixes; random, and in
15 presorted runs as a write task's pieces come, over ranges of 2^20, 2^40 and all of
int64): numpy's introsort, its timsort and :func:`lamina.trace.order.argsort_ints`, the
best of ``--runs`` CPU times each: the table of docs/performance.md, "Radix-sorted
prefixes".

``encodings`` writes 2M rows of an int64 key and one 12-character string column (in runs
of about ten, as a function of the sorted key; and 200,000 to 5 values in random order) as
parts are written, with the string column dictionary-encoded and plain, and prints the
best of ``--runs`` CPU seconds to write and to read the column back, the bytes, and what
``lamina.trace.batch.wants_dictionary`` chooses: the table of docs/performance.md,
"Dictionaries only where values recur apart".

``timeline`` runs the step with Spark ``--runs`` times and prints, per job, when its
first task started and its last ended, the tasks' wall and CPU seconds and the slot-seconds
no task ran. ``pertask`` measures what a task costs beyond its work (jobs of 32 tasks
that only read their input: job wall, input wait, gap between tasks, worker CPU), as
PySpark's ``mapInArrow`` runs tasks, after ``gc.freeze()``, and as the driver runs a step's
jobs (``_run_tasks``); ``--conf K=V`` overrides the session's
configuration.

``reads`` starts ``--runs`` fresh processes that each read the latest snapshot of
``--store``'s relation twice and prints the first call's wall, system CPU and page
faults, the second call's wall, the peak RSS and whether pandas was imported (``--read``:
the streamed snapshot, ``snapshot_reader().read_all()``, or the whole history,
``updates()``, instead). With ``--cell`` each process first lives
as a bench.peers writer would: it appends that cell's stream (fsync "never") into a
scratch store and drops it, which leaves its memory as fragmented as the peers benchmark's
process is when it reads. ``python -m bench.peers_contenders lamina CELL DIR`` leaves a
store of that cell in ``DIR/data``.

``wal`` times the pieces of an append of bench/wal_append.py's 10,000-row batches (eight
distinct ones, so caches do not flatter it) in the loop, ``--runs`` appends a round: the
input checks (``checked_updates``, ``check_diffs``), the encoding
(``UpdatesEncoder.encode``: the record's pieces, no copy, CRC32C included), the time check
(``least_time``), ``os.writev`` and ``os.fdatasync`` of the record; then
``Relation.append`` (fsync "always") whole, for comparison. Then the same work at the
append's cadence: raw ``write`` + ``fdatasync`` of each record, alone and with one more
piece of an append's work before it (the CRC32C pass over the table's buffers; the input
and time checks; checks and encoding written inline, the least an append can do in Python
with this record format; ``Relation.append`` itself), each in blocks of 20 appends taking
turns, ``--runs`` blocks: what each piece costs where it runs, between two syncs.

``syncs`` asks the disk under bench/.cache how it takes a durable append of 4 KiB, 64 KiB
and 520 KB (the WAL benchmark's record), four ways taking turns, ``--runs`` rounds of 400
appends (at most 64 MiB) each: ``pwrite`` at the end of a fresh file + ``fdatasync`` (what
raw and the WAL do); ``pwritev`` with ``RWF_DSYNC`` (the write and the sync in one call);
``pwrite`` + ``fdatasync`` over a file zeroed beforehand (untimed; PostgreSQL's
``wal_init_zero``: no size change for the journal to commit); and the same with another
file of that size zeroed on a second thread meanwhile (the cost of having the next segment
ready). It prints the median milliseconds per append and each way's ratio to the first.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import itertools
import json
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from bench.dataset import CACHE, Input, conversion_input, merge_input
from lamina.objstore.local import LocalObjectStore


def _step(step: str, scale: float, work: Path) -> tuple[Any, Callable[[Any], Any]]:
    """A fresh trace for the step, and a function running it with a given session."""
    from lamina.compacter.step.driver import spark_convert, spark_merge
    from lamina.trace.plan import plan_conversion, plan_merge
    from lamina.trace.trace import Trace

    inp: Input
    if step == "convert":
        inp = conversion_input(scale)
        spans = inp.spans()

        def convert(spark: Any) -> Any:
            trace = Trace.open(LocalObjectStore(work / f"t{time.monotonic_ns()}"), inp.meta)
            return spark_convert(spark, trace, plan_conversion(trace.state, spans))
        return inp, convert
    inp = merge_input(scale)

    def merge(spark: Any) -> Any:
        trace_dir = work / f"t{time.monotonic_ns()}"
        shutil.copytree(inp.trace_dir, trace_dir)
        trace = Trace.open(LocalObjectStore(trace_dir), inp.meta)
        plan = plan_merge(trace.state)
        assert plan is not None
        return spark_merge(spark, trace, plan)
    return inp, merge


def tasks(step: str, scale: float, top: int) -> None:
    from lamina.compacter.step import driver

    class _Context:
        defaultParallelism = 2  # as SparkContext names it

    class _Session:
        sparkContext = _Context()

    def run_tasks(spark: Any, n: int, fn: Callable[[Iterator[pa.RecordBatch]],
                                                   Iterator[pa.RecordBatch]],
                  fields: Any, check: Callable[[], None]) -> list[Any]:
        out: list[Any] = []
        cpu, wall = time.process_time(), time.monotonic()
        profile = cProfile.Profile()
        profile.enable()
        for i in range(n):
            ids = pa.record_batch([pa.array([i], pa.int64())], names=["id"])
            for rb in fn(iter([ids])):
                out.extend(rb.to_pylist())
        profile.disable()
        kind = "decode" if fields[0][0] == "group" else "write"
        print(f"== {kind} job: {n} tasks, {time.process_time() - cpu:.2f} s CPU, "
              f"{time.monotonic() - wall:.2f} s wall")
        pstats.Stats(profile).sort_stats("tottime").print_stats(top)
        return out

    driver._run_tasks = run_tasks
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        _, fn = _step(step, scale, Path(tmp))
        started = time.monotonic()
        fn(_Session())
        print(f"== total {time.monotonic() - started:.2f} s wall")


def _jfr_top(recording: Path, top: int) -> None:
    doc = json.loads(subprocess.run(["jfr", "print", "--json", "--events",
                                     "jdk.ExecutionSample", str(recording)],
                                    capture_output=True, text=True, check=True).stdout)
    events = doc["recording"]["events"]
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    for e in events:
        frames = e["values"]["stackTrace"]["frames"]
        thread = e["values"]["sampledThread"].get("javaName") or "?"
        threads[thread.split(" ")[0][:40]] += 1
        names = [f"{f['method']['type']['name']}.{f['method']['name']}" for f in frames]
        if names:
            own[names[0]] += 1
        for name in set(names):
            total[name] += 1
    n = max(len(events), 1)
    print(f"{len(events)} samples")
    for title, counter, k in (("threads", threads, 8), ("self", own, top),
                              ("inclusive", total, top)):
        print(f"== {title}")
        for name, count in counter.most_common(k):
            print(f"{count / n:6.1%}  {name}")


def jvm(step: str, scale: float, runs: int, top: int) -> None:
    from lamina.compacter.spark import build_session

    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        recording = Path(tmp) / "step.jfr"
        spark = build_session("local[*]", app_name="bench-profile", conf={
            "spark.driver.extraJavaOptions":
                f"-XX:StartFlightRecording=filename={recording},settings=profile"})
        _, fn = _step(step, scale, Path(tmp))
        for i in range(runs):
            started = time.monotonic()
            fn(spark)
            print(f"run {i + 1}: {time.monotonic() - started:.2f} s", flush=True)
        spark.stop()  # the JVM writes the recording when it exits
        deadline = time.monotonic() + 60
        while not recording.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        _jfr_top(recording, top)


def timeline(step: str, scale: float, runs: int) -> None:
    """The step with Spark (``local[*]``), ``runs`` times, each task's start, end and CPU
    logged by wrappers of the driver's task functions: per job, when its first task
    started and its last ended (from the step's start), the tasks' wall and CPU seconds,
    and the slot-seconds no task ran (the job's span times the slots, less the tasks'
    wall)."""
    import os

    from lamina.compacter.spark import build_session
    from lamina.compacter.step import driver

    def logged(factory: Callable[..., Any], job: str, log: str) -> Callable[..., Any]:
        def make(*args: Any, **kwargs: Any) -> Any:
            fn = factory(*args, **kwargs)

            def task(batches: Any) -> Iterator[pa.RecordBatch]:
                start, cpu = time.time(), time.process_time()
                ids = list(batches)
                out = list(fn(iter(ids)))
                with open(log, "a") as f:
                    f.write(json.dumps({"job": job, "start": start, "end": time.time(),
                                        "cpu": time.process_time() - cpu,
                                        "pid": os.getpid(),
                                        "task": ids[0].column(0)[0].as_py()}) + "\n")
                yield from out
            return task
        return make

    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        log = str(Path(tmp) / "tasks.jsonl")
        driver.decoder = logged(driver.decoder, "decode", log)  # type: ignore[attr-defined]
        driver.writer = logged(driver.writer, "write", log)  # type: ignore[attr-defined]
        driver.merger = logged(driver.merger, "merge", log)  # type: ignore[attr-defined]
        spark = build_session("local[*]", app_name="bench-profile")
        slots = int(spark.sparkContext.defaultParallelism)
        _, fn = _step(step, scale, Path(tmp))
        for i in range(runs):
            Path(log).unlink(missing_ok=True)
            started = time.time()
            fn(spark)
            ended = time.time()
            events = [json.loads(line) for line in Path(log).read_text().splitlines()]
            print(f"run {i + 1}: {ended - started:.2f} s, {slots} slots")
            for job in ("decode", "write", "merge"):
                tasks = [e for e in events if e["job"] == job]
                if not tasks:
                    continue
                first = min(e["start"] for e in tasks) - started
                last = max(e["end"] for e in tasks) - started
                wall = sum(e["end"] - e["start"] for e in tasks)
                cpu = sum(e["cpu"] for e in tasks)
                print(f"  {job:6s} {len(tasks):3d} tasks  first start {first:5.2f} s  last end "
                      f"{last:5.2f} s  task wall {wall:5.2f} s  CPU {cpu:5.2f} s  idle "
                      f"{slots * (last - first) - wall:5.2f} slot-s")
                print("         task:seconds in start order " + " ".join(
                    f"{e['task']}:{e['end'] - e['start']:.2f}"
                    for e in sorted(tasks, key=lambda e: e["start"])))
        spark.stop()


def _trivial_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """A task that only reads its input: when it started, when its input had come, when
    it ended, its worker's pid and CPU seconds so far."""
    import os

    start = time.time()
    rows = sum(b.num_rows for b in batches)
    got = time.time()
    yield pa.RecordBatch.from_pydict({
        "pid": [os.getpid()], "start": [start], "got": [got], "end": [time.time()],
        "cpu": [time.process_time()], "rows": [rows]})


def pertask(confs: list[str], jobs: int) -> None:
    """What a Spark task of lamina's kind costs beyond its work: ``jobs`` jobs of 32 tasks
    that only read their one-row input (``spark.range(32, numPartitions=32)``), first
    through ``mapInArrow`` as PySpark runs any task, then after the driver's
    ``_gc_frozen``, then as a step's jobs run (the driver's ``_run_tasks``: an RDD of 32
    partitions, each task frozen); per phase the median job wall, the median time a task
    waited for its input, the median gap between two tasks of one worker and the worker CPU
    per task.
    ``--conf K=V`` overrides the session's configuration (e.g.
    ``spark.python.unix.domain.socket.enabled=false``, TCP)."""
    import statistics

    from pyspark.sql.pandas.types import from_arrow_schema

    from lamina.compacter.spark import build_session
    from lamina.compacter.step.driver import _gc_frozen, _run_tasks

    conf = dict(c.split("=", 1) for c in confs)
    spark = build_session("local[*]", app_name="bench-profile", conf=conf)
    fields = [("pid", pa.int64()), ("start", pa.float64()), ("got", pa.float64()),
              ("end", pa.float64()), ("cpu", pa.float64()), ("rows", pa.int64())]
    ddl = from_arrow_schema(pa.schema(fields))
    spark.range(0, 4, 1, 4).mapInArrow(_trivial_task, ddl).collect()  # start the workers

    def arrow(fn: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]
              ) -> Callable[[], list[Any]]:
        return lambda: spark.range(0, 32, 1, 32).mapInArrow(fn, ddl).collect()

    print(f"{jobs} jobs of 32 trivial tasks per phase; conf overrides {conf or 'none'}")
    for phase, job in (("mapInArrow, as PySpark runs it", arrow(_trivial_task)),
                       ("mapInArrow after gc.freeze()", arrow(_gc_frozen(_trivial_task))),
                       ("the driver's _run_tasks (RDD)",
                        lambda: _run_tasks(spark, 32, _trivial_task, fields, lambda: None))):
        walls: list[float] = []
        waits: list[float] = []
        gaps: list[float] = []
        cpus: list[float] = []
        for _ in range(jobs):
            started = time.perf_counter()
            rows = job()
            walls.append(time.perf_counter() - started)
            waits += [r.got - r.start for r in rows]
            by_worker: dict[int, list[Any]] = collections.defaultdict(list)
            for r in rows:
                by_worker[r.pid].append(r)
            for tasks in by_worker.values():
                tasks.sort(key=lambda r: r.start)
                gaps += [b.start - a.end for a, b in itertools.pairwise(tasks)]
                cpus += [b.cpu - a.cpu for a, b in itertools.pairwise(tasks)]
        print(f"  {phase:32s} job {statistics.median(walls) * 1e3:6.0f} ms  input wait "
              f"{statistics.median(waits) * 1e3:5.1f} ms  gap {statistics.median(gaps) * 1e3:5.1f}"
              f" ms  worker CPU {statistics.median(cpus) * 1e3:5.1f} ms per task")
    spark.stop()


def _best(fn: Callable[[], object], n: int = 3,
          clock: Callable[[], float] = time.perf_counter) -> float:
    """The least seconds of ``n`` calls of ``fn`` by ``clock`` (wall time unless told)."""
    times = []
    for _ in range(n):
        started = clock()
        fn()
        times.append(clock() - started)
    return min(times)


def encodings(runs: int) -> None:
    import io

    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from lamina.trace.batch import ROW_GROUP_ROWS, parquet_options, wants_dictionary

    rng = np.random.default_rng(1)
    n = 2_000_000
    ids = np.sort(rng.integers(0, n // 10, n))

    def strings(values: Any, prefix: str) -> pa.Array:
        return pc.binary_join_element_wise(prefix, pc.cast(pa.array(values), pa.string()), "")

    columns = {"a function of the sorted key (runs of about ten)":
               strings(ids + 1_000_000, "item-")}
    for card in (200_000, 2_000, 1_000, 20, 5):
        columns[f"{card:,} values in random order"] = strings(
            rng.integers(0, card, n) + 1_000_000, "city-")

    def measure(column: pa.Array, dictionary: bool) -> tuple[float, float, int]:
        table = pa.table({"id": ids, "c": column})
        options = parquet_options(table.schema)  # as parts are written, the choice forced
        options["use_dictionary"] = ["c"] if dictionary else False
        write, read, size = [], [], 0
        for _ in range(runs):
            sink = io.BytesIO()
            started = time.process_time()
            with pq.ParquetWriter(sink, table.schema, **options) as writer:
                writer.write(table, row_group_size=ROW_GROUP_ROWS)
            write.append(time.process_time() - started)
            data = sink.getvalue()
            size = len(data)
            started = time.process_time()
            pq.read_table(pa.BufferReader(data), columns=["c"])
            read.append(time.process_time() - started)
        return min(write), min(read), size

    print("| the string column | dictionary: write / read / bytes | plain: write / read / "
          "bytes | wants_dictionary |")
    print("|---|---|---|---|")
    for name, column in columns.items():
        cells = []
        for dictionary in (True, False):
            w, r, b = measure(column, dictionary)
            cells.append(f"{w:.3f} / {r:.3f} s / {b / 1e6:.2f} MB")
        print(f"| {name} | {cells[0]} | {cells[1]} | "
              f"{wants_dictionary(column.slice(0, ROW_GROUP_ROWS))} |")


def sums(scale: float) -> None:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    inp = merge_input(scale)
    files = sorted(str(p) for p in inp.trace_dir.glob("batches/*/*.parquet"))
    table = pq.read_table(files).drop_columns(["_time"])
    keys = inp.meta.row_columns
    wide = table.append_column("w", pc.cast(table.column("_diff"), pa.decimal128(38, 0)))
    print(f"{table.num_rows:,} rows, group by {keys}, best of 3 (wall seconds):")
    print(f"  int64 sum:   {_best(lambda: table.group_by(keys).aggregate([('_diff', 'sum')])):.3f}")
    print(f"  decimal cast + sum: "
          f"{_best(lambda: wide.group_by(keys).aggregate([('w', 'sum')])):.3f} "
          f"(+ cast {_best(lambda: pc.cast(table.column('_diff'), pa.decimal128(38, 0))):.3f})")


def sorts(runs: int) -> None:
    import numpy as np

    from lamina.consolidate import INT64_MAX, INT64_MIN
    from lamina.trace.order import argsort_ints

    def best(fn: Callable[[], object]) -> float:
        return _best(fn, runs, time.process_time) * 1e3

    n, pieces = 650_000, 15
    rng = np.random.default_rng(7)
    print(f"{n:,} int64, best of {runs} (CPU ms): introsort / timsort / argsort_ints")
    for label, high in (("2^20", 1 << 20), ("2^40", 1 << 40), ("int64", None)):
        def draw(size: int, high: int | None = high) -> np.ndarray:
            if high is None:
                return rng.integers(INT64_MIN, INT64_MAX, size, endpoint=True)
            return rng.integers(0, high, size)
        shuffled = draw(n)
        presorted = np.concatenate([np.sort(draw(n // pieces)) for _ in range(pieces)])
        for kind, values in (("random", shuffled), (f"{pieces} presorted runs", presorted)):
            assert np.array_equal(argsort_ints(values), np.argsort(values, kind="stable"))
            intro = best(functools.partial(np.argsort, values))
            tim = best(functools.partial(np.argsort, values, kind="stable"))
            radix = best(functools.partial(argsort_ints, values))
            print(f"  {kind}, range {label}: {intro:.1f} / {tim:.1f} / {radix:.1f}")


def wal(runs: int) -> None:
    import os

    from bench.wal_append import SCHEMA, make_batches
    from lamina import Store
    from lamina.schema import check_diffs, checked_updates
    from lamina.wal.log import least_time
    from lamina.wal.record import UpdatesEncoder

    batches = make_batches(10_000)
    names = ("checked_updates + check_diffs", "UpdatesEncoder.encode", "time check (least_time)",
             "os.writev", "os.fdatasync")
    steps: dict[str, list[float]] = {k: [] for k in names}
    appends: list[float] = []
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp, \
            Store.open(Path(tmp) / "data", fsync="always") as store:
        rel = store.create_relation("bench", SCHEMA, key=["id"])
        meta = rel.meta
        fd = os.open(Path(tmp) / "raw.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        # the batches are built with pa.table(): written as they are (Relation.append)
        encoder = UpdatesEncoder(meta.update_schema, batches=meta.loose_update_schema)
        size = 0
        for _ in range(5):  # rounds: the pieces one by one, then Relation.append whole
            acc = [0.0] * len(names)
            for i in range(runs):
                t0 = time.perf_counter()
                table = check_diffs(meta, checked_updates(meta, batches[i % 8]))
                t1 = time.perf_counter()
                record, size = encoder.encode(table)
                t2 = time.perf_counter()
                least_time(table.column(table.num_columns - 2))
                t3 = time.perf_counter()
                os.writev(fd, record)
                t4 = time.perf_counter()
                os.fdatasync(fd)
                t5 = time.perf_counter()
                for k, (a, b) in enumerate(((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5))):
                    acc[k] += b - a
            for name, total in zip(names, acc, strict=True):
                steps[name].append(total / runs * 1e3)
            started = time.perf_counter()
            for i in range(runs):
                rel.append(batches[i % 8])
            appends.append((time.perf_counter() - started) / runs * 1e3)
        cadence = _wal_cadence(rel, fd, encoder, batches, runs)
        os.close(fd)
    print(f"ms per append of 10,000 updates ({size:,} record bytes), the pieces of an append "
          f"timed in the loop, 5 rounds of {runs}:")
    for name, ms in [*steps.items(), ("Relation.append (all of it)", appends)]:
        print(f"  {name:30s} median {sorted(ms)[2]:.3f}  ({' '.join(f'{m:.3f}' for m in ms)})")
    print(f"at the append's cadence ({runs} blocks of 20 appends per side, taking turns): "
          "ms per append, wall and thread CPU, and raw's wall over it")
    raw = cadence["raw write + fdatasync"][0]
    for name, (wall, cpu) in cadence.items():
        print(f"  {name:32s} {wall:.3f}  CPU {cpu:.3f}  ratio {raw / wall:.3f}")


def _wal_cadence(rel: Any, fd: int, encoder: Any, batches: list[pa.Table], blocks: int
                 ) -> dict[str, tuple[float, float]]:
    """Raw write + fdatasync of each record to ``fd``, alone and after one more piece of an
    append's work, and ``rel.append``, in blocks of 20 taking turns (see the module
    docstring): per side, milliseconds of wall and of thread CPU per append."""
    import os

    import crc32c

    from lamina.schema import check_diffs, checked_updates, conform_updates
    from lamina.wal.log import least_time
    from lamina.wal.record import RecordType, encode_updates, frame

    meta = rel.meta
    conformed = [conform_updates(meta, b) for b in batches]  # the records' bytes
    records = [frame(RecordType.UPDATES, encode_updates(t)) for t in conformed]
    pieces = [encoder.encode(checked_updates(meta, b))[0]  # over the tables' own buffers
              for b in batches]

    def crc(i: int) -> list[Any]:
        value = 0
        for piece in pieces[i]:
            value = crc32c.crc32c(piece, value)
        return [records[i]]

    def checks(i: int) -> list[Any]:
        table = check_diffs(meta, checked_updates(meta, batches[i]))
        least_time(table.column(table.num_columns - 2))
        return [records[i]]

    def inline(i: int) -> list[Any]:
        table = check_diffs(meta, checked_updates(meta, batches[i]))
        least_time(table.column(table.num_columns - 2))
        pieces: list[Any] = encoder.encode(table)[0]
        return pieces

    sides: dict[str, Callable[[int], list[Any]] | None] = {
        "raw write + fdatasync": lambda i: [records[i]],
        "+ CRC32C of the table's buffers": crc,
        "+ input and time checks": checks,
        "checks + encoding, inline": inline,
        "Relation.append": None}
    wall = dict.fromkeys(sides, 0)
    cpu = dict.fromkeys(sides, 0)
    for _ in range(blocks):
        for name, work in sides.items():
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            for i in range(20):
                if work is None:
                    rel.append(batches[i % 8])
                    continue
                os.writev(fd, work(i % 8))
                os.fdatasync(fd)
            wall[name] += time.perf_counter_ns() - t0
            cpu[name] += time.thread_time_ns() - c0
    n = blocks * 20
    return {name: (wall[name] / n / 1e6, cpu[name] / n / 1e6) for name in sides}


def _zeroed(path: Path, size: int) -> None:
    """``path`` as ``size`` zero bytes, synced."""
    import os

    zeros = bytes(1 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, size, len(zeros)):
            os.write(fd, zeros[:min(len(zeros), size - off)])
        os.fdatasync(fd)
    finally:
        os.close(fd)


def syncs(runs: int) -> None:
    """The durable-append probe of the module docstring."""
    import os
    import threading

    ways = ("append + fdatasync", "pwritev RWF_DSYNC", "pre-zeroed + fdatasync",
            "pre-zeroed, next zeroed alongside")
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        for size in (4096, 65536, 520_000):
            record = os.urandom(size)
            n = min(400, (64 << 20) // size)
            ms: dict[str, list[float]] = {w: [] for w in ways}
            for r in range(runs):
                for way in ways[r % 2:] + ways[:r % 2]:  # another order each round
                    path, spare = Path(tmp) / "file", Path(tmp) / "spare"
                    zeroing = None
                    if way.startswith("pre-zeroed"):
                        _zeroed(path, n * size)
                    if way == "pre-zeroed, next zeroed alongside":
                        zeroing = threading.Thread(target=_zeroed, args=(spare, n * size))
                    flags = os.O_WRONLY | (0 if way.startswith("pre") else os.O_CREAT | os.O_TRUNC)
                    fd = os.open(path, flags, 0o644)
                    started = time.perf_counter()
                    if zeroing is not None:
                        zeroing.start()
                    for i in range(n):
                        if way == "pwritev RWF_DSYNC":
                            os.pwritev(fd, [record], i * size, os.RWF_DSYNC)
                        else:
                            os.pwrite(fd, record, i * size)
                            os.fdatasync(fd)
                    if zeroing is not None:
                        zeroing.join()
                    ms[way].append((time.perf_counter() - started) / n * 1e3)
                    os.close(fd)
                    path.unlink()
                    spare.unlink(missing_ok=True)
            base = sorted(ms[ways[0]])[runs // 2]
            print(f"{size:,}-byte appends, {n} per round, {runs} rounds: median ms per append "
                  "(ratio to the first way)")
            for way in ways:
                median = sorted(ms[way])[runs // 2]
                print(f"  {way:36s} {median:.3f}  ({base / median:.2f}x)")


READS = {"snapshot": lambda rel: rel.snapshot().num_rows,
         "snapshot_reader": lambda rel: rel.snapshot_reader().read_all().num_rows,
         "updates": lambda rel: rel.updates().num_rows}
"""What ``reads --read`` calls, returning the rows read."""


def _read_child(store: str, relation: str, cell: str | None, read: str) -> None:
    """One fresh process's reads (see ``reads``), as one JSON line on stdout."""
    import resource

    from lamina import Store

    if cell is not None:  # a writer's life first: the cell's stream appended, then dropped
        from bench.peers_stream import CELLS, KEY, SCHEMA, appends

        with tempfile.TemporaryDirectory(dir=CACHE) as tmp, \
                Store.open(Path(tmp) / "data", fsync="never") as scratch:
            rel = scratch.create_relation("r", SCHEMA, key=KEY)
            for i, table in enumerate(appends(CELLS[cell])):
                rel.append(table)
                rel.seal(i + 1)
    with Store.open(store, fsync="never") as opened:
        rel = opened.relation(relation)
        before = resource.getrusage(resource.RUSAGE_SELF)
        started = time.perf_counter()
        rows = READS[read](rel)
        first = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_SELF)
        started = time.perf_counter()
        READS[read](rel)
        second = time.perf_counter() - started
    print(json.dumps({"rows": rows, "first": first, "second": second,
                      "first_system": after.ru_stime - before.ru_stime,
                      "first_faults": after.ru_minflt - before.ru_minflt,
                      "max_rss_mib": after.ru_maxrss / 1024,
                      "pandas": "pandas" in sys.modules}))


def reads(store: str, relation: str, cell: str | None, runs: int, read: str) -> None:
    """Fresh processes reading ``store``'s latest snapshot (or ``read``: :data:`READS`)
    twice, each after a writer's life of ``cell``'s stream if given: the first call's
    wall, system CPU and page faults, the second call's wall, peak RSS; per run, then
    medians."""
    import statistics

    out = []
    for i in range(runs):
        cmd = [sys.executable, "-m", "bench.profile", "_read_child", "--store", store,
               "--relation", relation, "--read", read] + (["--cell", cell] if cell else [])
        done = subprocess.run(cmd, check=True, capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1])
        r = json.loads(done.stdout.strip().splitlines()[-1])
        out.append(r)
        print(f"  run {i + 1}: {r['rows']:,} rows; first {r['first']:.3f} s (system "
              f"{r['first_system']:.3f} s, {r['first_faults']:,} faults), second "
              f"{r['second']:.3f} s, peak RSS {r['max_rss_mib']:.0f} MiB"
              + ("; pandas imported" if r["pandas"] else ""))
    print(f"median: first {statistics.median(r['first'] for r in out):.3f} s (system "
          f"{statistics.median(r['first_system'] for r in out):.3f} s), second "
          f"{statistics.median(r['second'] for r in out):.3f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("mode", choices=("tasks", "jvm", "sums", "sorts", "encodings", "wal",
                                         "syncs", "timeline", "pertask", "reads",
                                         "_read_child"))
    parser.add_argument("--step", choices=("convert", "merge"), default="convert")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--conf", action="append", default=[], metavar="K=V",
                        help="pertask: a Spark configuration override (repeatable)")
    parser.add_argument("--store", help="reads: a data directory")
    parser.add_argument("--relation", default="peers", help="reads: the relation to read")
    parser.add_argument("--cell", help="reads: append this bench.peers cell's stream first")
    parser.add_argument("--read", choices=sorted(READS), default="snapshot",
                        help="reads: what each process reads")
    args = parser.parse_args(argv)
    CACHE.mkdir(parents=True, exist_ok=True)
    if args.mode in ("reads", "_read_child") and not args.store:
        parser.error(f"{args.mode} needs --store")
    if args.mode == "reads":
        reads(args.store, args.relation, args.cell, max(args.runs, 1), args.read)
        return 0
    if args.mode == "_read_child":
        _read_child(args.store, args.relation, args.cell, args.read)
        return 0
    if args.mode == "tasks":
        tasks(args.step, args.scale, args.top)
    elif args.mode == "jvm":
        jvm(args.step, args.scale, args.runs, args.top)
    elif args.mode == "sums":
        sums(args.scale)
    elif args.mode == "sorts":
        sorts(max(args.runs, 3))
    elif args.mode == "encodings":
        encodings(max(args.runs, 1))
    elif args.mode == "timeline":
        timeline(args.step, args.scale, args.runs)
    elif args.mode == "pertask":
        pertask(args.conf, max(args.runs, 3))
    elif args.mode == "syncs":
        syncs(max(args.runs, 1))
    else:
        wal(max(args.runs, 10))
    return 0


if __name__ == "__main__":
    sys.exit(main())
