"""The Spark jobs against the reference executor: same plan, same output.

Spark runs are slow, so the Spark cases are a handful of seeded random workloads that each
cover a lot at once: several segments per plan, future times (near, far, the last time
2**64-1), retractions, repeated rows, since forwarding, consumed pending parts, nulls,
NaN, string and int keys, the single-task path and the partitioned path. The pure helpers
(time shift, buckets, segment cutting) are checked without Spark, with hypothesis.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lamina.compacter.executors import reference
from lamina.compacter.spark import JobCancelledError, JobTags, check_cancelled
from lamina.compacter.step.context import StepContext
from lamina.compacter.step.decode import prepared, split, summed_repeats
from lamina.compacter.step.driver import (
    _rdd_task,
    conversion_spec,
    single_context,
    spark_convert,
    spark_merge,
)
from lamina.compacter.step.runs import (
    AUTO_ROOM,
    RunCompression,
    read_run,
    run_codec,
    write_run,
)
from lamina.compacter.step.work import JobTuning, WalRange, pack
from lamina.consolidate import INT64_MAX, consolidate, sort
from lamina.errors import CorruptionError, JobError
from lamina.objstore.local import LocalObjectStore
from lamina.store import Store
from lamina.trace.batch import read_part
from lamina.trace.order import order_prefix
from lamina.trace.pending import bucket_lows, bucket_of
from lamina.trace.plan import plan_conversion, plan_merge
from lamina.wal.ranges import segment_ranges
from lamina.wal.record import HEADER_SIZE, RecordType, read_frame
from lamina.wal.segment import scan_file
from tests.compacter.workload import (
    INT_KEY,
    STR_KEY,
    Workload,
    assert_same_conversion,
    assert_same_tables,
    batch_table,
    drive,
    input_updates,
    merge_plan_ok,
    open_workload,
    spans,
    table_of,
)
from tests.wal.codecs import codec_of

# small shares so that a test-sized input takes the partitioned path with several parts
SPLIT = JobTuning(single_task_bytes=2048, split_bytes=32 << 10, min_split_bytes=8 << 10,
                  part_bytes=24 << 10, chunk_rows=64)
MAX_TIME = 2**64 - 1


# --- pure helpers ---------------------------------------------------------------------------

times = st.integers(0, MAX_TIME)


@settings(max_examples=300, deadline=None)
@given(st.lists(times, min_size=1, max_size=20), times)
def test_bucket_lows_match_bucket_of(ts: list[int], upper: int) -> None:
    ts = [max(t, upper) for t in ts]
    got = bucket_lows(pa.array(ts, pa.uint64()), upper).to_pylist()
    assert got == [bucket_of(t, upper)[0] for t in ts]
    for t, lo in zip(ts, got, strict=True):  # the driver rebuilds a bucket from its low end
        assert bucket_of(lo, upper) == bucket_of(t, upper)


_PREFIX_CASES = [
    (pa.int64(), st.integers(-(2**63), 2**63 - 1)),
    (pa.int8(), st.integers(-128, 127)),
    (pa.float64(), st.floats(allow_nan=True, allow_infinity=True)),
    (pa.float32(), st.floats(width=32, allow_nan=True, allow_infinity=True)),
    (pa.string(), st.text(max_size=12)),
    (pa.binary(), st.binary(max_size=12)),
    (pa.bool_(), st.booleans()),
    (pa.date32(), st.dates()),
    (pa.timestamp("us"), st.datetimes()),
    (pa.decimal128(20, 3), st.decimals(min_value=-(10**16), max_value=10**16, places=3,
                                       allow_nan=False)),
]


@settings(max_examples=60, deadline=None)
@given(st.data())
@pytest.mark.parametrize(("type_", "values"), _PREFIX_CASES,
                         ids=[str(t) for t, _ in _PREFIX_CASES])
def test_order_prefix_is_monotone_in_batch_order(type_: pa.DataType, values: Any,
                                                 data: Any) -> None:
    """Sorted the way batches are (lamina.consolidate.sort), prefixes never decrease."""
    items = data.draw(st.lists(st.one_of(st.none(), values), max_size=40))
    table = pa.table({"c": pa.array(items, type_)})
    table = sort(table, ["c"])
    prefix = order_prefix(table.column("c").slice(0)).to_pylist()
    assert prefix == sorted(prefix)
    assert all(p == -(2**63) for p, v in zip(prefix, table.column("c").to_pylist(),
                                              strict=True) if v is None)


def _split_context(first: pa.DataType, since: int, upper: int | None) -> StepContext:
    schema = pa.schema([("a", first), ("b", pa.string()), ("_time", pa.uint64()),
                        ("_diff", pa.int64())])
    return StepContext(store=LocalObjectStore(Path("/nonexistent")), relation="t",
                       update_schema=schema, row_columns=("a", "b"), sort_columns=("a", "b"),
                       prefix="__p", bucket="__b", since=since, upper=upper, batch_id="x",
                       context="test", scratch="s", sample_every=1, min_samples=1, parts=1,
                       groups=())


@settings(max_examples=150, deadline=None)
@given(st.data())
@pytest.mark.parametrize("first", [pa.int64(), pa.string()], ids=["int64", "string"])
def test_split_matches_filter_forward_and_stable_sort(first: pa.DataType, data: Any) -> None:
    """decode.split gathers each side once; it must give what filtering, forwarding and a
    stable sort by prefix (future rows: by bucket) give (the radix sort itself, on inputs
    long enough for it: tests/trace/test_order.py)."""
    values = st.integers(-5, 5) if first == pa.int64() else st.text("ab", max_size=9)
    row = st.tuples(st.one_of(st.none(), values), st.text("xy", max_size=2),
                    st.integers(0, 40), st.integers(-2, 2))
    chunks = data.draw(st.lists(st.lists(row, max_size=12), max_size=4))
    since = data.draw(st.integers(0, 45))
    upper = data.draw(st.one_of(st.none(), st.integers(0, 45)))
    ctx = _split_context(first, since, upper)
    tables = [pa.Table.from_pylist([dict(zip(ctx.update_schema.names, r, strict=True))
                                    for r in rows], ctx.update_schema) for rows in chunks]
    table = pa.concat_tables(tables) if tables else ctx.update_schema.empty_table()
    rows = table.to_pylist()
    is_future = [upper is not None and r["_time"] >= upper for r in rows]
    prefixes = order_prefix(table.column("a")).to_pylist()
    want_past = sorted(({**r, "_time": max(r["_time"], since), "__p": p}
                        for r, p, f in zip(rows, prefixes, is_future, strict=True) if not f),
                       key=lambda r: r["__p"])
    want_future = sorted(({**r, "__p": p, "__b": bucket_of(r["_time"], upper)[0]}
                          for r, p, f in zip(rows, prefixes, is_future, strict=True)
                          if f and upper is not None), key=lambda r: r["__b"])
    past, future = split(table, ctx)
    assert past.column_names == [*ctx.update_schema.names, "__p"]
    assert future.column_names == [*ctx.update_schema.names, "__p", "__b"]
    assert past.to_pylist() == want_past
    assert future.to_pylist() == want_future


def _live(table: pa.Table) -> list[tuple[Any, ...]]:
    """Rows with their summed diffs, zero sums dropped, in row order: what a batch holds."""
    cols = [c for c in table.column_names if c != "_diff" and not c.startswith("__")]
    out = consolidate(table, [*cols], [*cols])
    return sorted(zip(*(out.column(c).to_pylist() for c in [*cols, "_diff"]), strict=True),
                  key=repr)


def test_summed_repeats_sums_what_forwarding_made_equal() -> None:
    """A decode task's rows, forwarded to ``since``, repeat: summed before the run is
    written, they are fewer, still ordered by prefix, with the run's schema, and hold the
    same live rows. Each key churns through ten values, so a row's repeats seldom sit
    next to each other in prefix order (a probe of neighbouring whole rows misses them)."""
    ctx = _split_context(pa.int64(), since=90, upper=100)
    rng = random.Random(3)
    n = 20_000
    table = pa.table({
        "a": pa.array([None if i % 97 == 0 else rng.randrange(300) for i in range(n)],
                      pa.int64()),
        "b": pa.array([None if i % 11 == 0 else f"v{rng.randrange(10)}" for i in range(n)]),
        "_time": pa.array([rng.randrange(95) for _ in range(n)], pa.uint64()),
        "_diff": pa.array([rng.choice((1, 1, -1, 2)) for _ in range(n)], pa.int64()),
    }, schema=ctx.update_schema)
    past, _ = split(table, ctx)
    summed = summed_repeats(past, ctx)
    assert summed.num_rows < past.num_rows // 4
    assert summed.schema.equals(past.schema)
    prefix = summed.column("__p").to_pylist()
    assert prefix == sorted(prefix)
    assert _live(summed) == _live(past)


def test_summed_repeats_leaves_distinct_rows_and_floats_alone() -> None:
    ctx = _split_context(pa.int64(), since=0, upper=None)
    n = 5_000
    table = pa.table({"a": pa.array(range(n), pa.int64()), "b": pa.array(["x"] * n),
                      "_time": pa.array([7] * n, pa.uint64()),
                      "_diff": pa.array([1] * n, pa.int64())}, schema=ctx.update_schema)
    past, _ = split(table, ctx)
    assert summed_repeats(past, ctx) is past  # every sampled pair differs: not even sorted
    floats = dataclasses.replace(ctx, update_schema=ctx.update_schema.set(
        1, pa.field("b", pa.float64())))
    rows = pa.table({"a": pa.array([1] * n, pa.int64()), "b": pa.array([0.5] * n),
                     "_time": pa.array([7] * n, pa.uint64()),
                     "_diff": pa.array([1] * n, pa.int64())}, schema=floats.update_schema)
    past, _ = split(rows, floats)
    assert summed_repeats(past, floats) is past  # left to the write tasks' consolidation
    # distinct rows that share a prefix (a string's first 7 bytes) and a forwarded time:
    # the probe compares the whole rows, so no sort is paid for nothing (review finding)
    strings = _split_context(pa.string(), since=100, upper=None)
    rows = pa.table({"a": pa.array([f"user_{i:07d}" for i in range(n)]),
                     "b": pa.array(["x"] * n), "_time": pa.array([i % 90 for i in range(n)],
                                                                  pa.uint64()),
                     "_diff": pa.array([1] * n, pa.int64())}, schema=strings.update_schema)
    past, _ = split(rows, strings)
    assert summed_repeats(past, strings) is past


@pytest.mark.parametrize("codec", ["lz4", "zstd", "none"])
def test_runs_are_written_with_the_tuned_codec(tmp_path: Path, codec: RunCompression) -> None:
    """A scratch run's record batches are compressed with the codec asked for, or not at
    all (read from the bytes: each compressed batch body starts with a buffer's length,
    then that codec's frame) and read back as written, batch spans included."""
    store = LocalObjectStore(tmp_path)
    rng = random.Random(3)
    ids = sorted(rng.randrange(5_000) for _ in range(20_000))
    rows = pa.table({"id": pa.array(ids, pa.int64()),
                     "qty": pa.array([rng.randrange(100) for _ in ids], pa.int64()),
                     "_time": pa.array([i % 50 for i in range(len(ids))], pa.uint64()),
                     "_diff": pa.array([1] * len(ids), pa.int64())})
    run = write_run(store, "s/run-00000.arrow", rows, "id", 4096, compression=codec)
    assert run.spans[0] == (ids[0], ids[4095])
    assert len(run.spans) == 5
    data = store.get(run.path)  # an IPC file is "ARROW1", two bytes of padding, a stream
    assert data[:6] == b"ARROW1"
    assert codec_of(data[8:]) == codec
    assert read_run(store, run, 0, len(run.spans) - 1).equals(rows)
    assert read_run(store, run, 1, 2).equals(rows.slice(4096, 8192))


def test_segment_ranges_cut_at_record_boundaries(tmp_path: Path) -> None:
    """Ranges start and end at records, chain, cover the segment, and leave no last range
    shorter than a quarter of the target."""
    w = open_workload(tmp_path / "d", INT_KEY, ["id"], segment_bytes=16 << 10)
    drive(w, random.Random(3), steps=40, rows_per_step=20, keys=50, future=0.1)
    trace = w.trace()
    span = spans(trace, w.wal_dir)[0]
    scan, _ = scan_file(next(s for s in _segments(w) if s.seq == span.seq), w.meta.name)
    starts = {r.offset for r in scan.records} | {scan.valid_end}
    for target in (1, 1000, 10_000, 1 << 30):
        ranges = segment_ranges(span, w.meta.name, target)
        assert ranges[0].start == scan.records[0].offset
        assert ranges[-1].end == span.bytes
        assert [r.first for r in ranges] == [True] + [False] * (len(ranges) - 1)
        assert [r.last for r in ranges] == [False] * (len(ranges) - 1) + [True]
        for a, b in itertools.pairwise(ranges):
            assert a.end == b.start
            assert a.end in starts
        if target == 1:
            assert len(ranges) == len(scan.records)
        if len(ranges) > 1:  # no sliver of a last range: a task that would decode nothing
            assert ranges[-1].end - ranges[-1].start >= target // 4
    groups = pack([WalRange(r) for r in segment_ranges(span, w.meta.name, 1000)], 3000)
    assert all(sum(i.weight for i in g) <= 3000 or len(g) == 1 for g in groups)


def _segments(w: Workload) -> list[Any]:
    from lamina.wal.segment import list_segments

    return list_segments(w.wal_dir)


# --- Spark against the reference -----------------------------------------------------------

def _extreme_times(w: Workload) -> None:
    """Future updates at the far end of time: the shift boundary 2**63 and the last time."""
    row = {f.name: None for f in w.meta.schema}
    row[w.meta.key[0]] = 7 if w.meta.schema.field(w.meta.key[0]).type == pa.int64() else "k7"
    rows = [dict(row, _time=t, _diff=d) for t, d in
            ((2**63, 1), (2**63 - 1, 2), (MAX_TIME, 1), (MAX_TIME, 4), (2**63, -1))]
    w.rel.append(table_of(w.meta.schema, rows))


def _convert_both(spark: Any, w: Workload, trace: Any, chunk: Any, *, name: str,
                  tuning: JobTuning, stage: bool = False) -> tuple[Any, Any]:
    plan = plan_conversion(trace.state, chunk)
    ref = w.fork(trace, name)
    want = reference.run_conversion(ref, plan)
    got = spark_convert(spark, trace, plan, tuning=tuning, stage_segments=stage)
    assert_same_conversion(trace, got, ref, want, plan=plan)
    return plan, got


@pytest.fixture
def sp(spark: Any) -> Any:
    """The session-wide SparkSession (typed for these tests)."""
    return spark


@pytest.mark.spark
@pytest.mark.parametrize("case", [
    (INT_KEY, ["id"], 11, JobTuning()),
    (STR_KEY, ["name"], 12, SPLIT),
    (INT_KEY, ["id", "item"], 13, SPLIT),
], ids=["int-key-single-task", "str-key-partitioned", "two-keys-partitioned"])
def test_conversions_and_merge_match_reference(
        sp: Any, tmp_path: Path, case: tuple[pa.Schema, list[str], int, JobTuning]) -> None:
    """Two conversions (the second consumes pending parts of the first) and the merge of
    their batches give exactly the reference's rows, order and pending buckets."""
    schema, key, seed, tuning = case
    rng = random.Random(seed)
    w = open_workload(tmp_path / "d", schema, key)
    drive(w, rng, steps=14, rows_per_step=40, keys=25, future=0.25)
    _extreme_times(w)
    drive(w, rng, steps=14, rows_per_step=40, keys=25, future=0.25)
    trace = w.trace()
    segs = spans(trace, w.wal_dir)
    assert len(segs) >= 6
    half = len(segs) // 2
    plan1, got1 = _convert_both(sp, w, trace, segs[:half], name="ref1", tuning=tuning)
    assert got1.pending, "the workload should leave future updates pending"
    trace.commit_conversion(plan1, got1.parts, got1.pending)
    plan2, got2 = _convert_both(sp, w, trace, segs[half:], name="ref2", tuning=tuning)
    assert plan2.consume, "the second conversion should consume pending parts"
    assert plan2.since > 0, "since should have advanced (forwarding)"
    trace.commit_conversion(plan2, got2.parts, got2.pending)
    if tuning is SPLIT:
        assert len(got1.parts) > 1
        assert len(got2.parts) > 1

    mplan = merge_plan_ok(plan_merge(trace.state))
    ref = w.fork(trace, "refm")
    want = reference.run_merge(ref, mplan)
    got = spark_merge(sp, trace, mplan, tuning=tuning)
    assert_same_tables(batch_table(trace, got), batch_table(ref, want), "merged batch")
    trace.commit_merge(mplan, got)


def test_auto_scratch_codec_compresses_only_where_room_is_short() -> None:
    """``auto`` writes a step's runs uncompressed only where the store has AUTO_ROOM times
    the step's decoded input free, LZ4 where it has less or cannot tell (S3); a chosen
    codec is taken as it is."""
    gib = 1 << 30
    assert run_codec("auto", gib, AUTO_ROOM * gib) == "none"
    assert run_codec("auto", gib, AUTO_ROOM * gib - 1) == "lz4"
    assert run_codec("auto", gib, None) == "lz4"
    assert run_codec("auto", 0, 0) == "none"
    for codec in ("lz4", "zstd", "none"):
        assert run_codec(codec, gib, None) == codec
        assert run_codec(codec, 1, 100 * gib) == codec


@pytest.mark.spark
def test_a_large_step_on_a_roomy_disk_writes_its_runs_uncompressed(sp: Any, tmp_path: Path
                                                                   ) -> None:
    """Under the default ``auto`` a two-job conversion on a local trace (this machine's disk
    has far more than AUTO_ROOM times the input free) writes its runs uncompressed, says
    so in a ``step.scratch`` event, and converts to exactly the reference's rows."""
    from structlog.testing import capture_logs

    w = open_workload(tmp_path / "d", INT_KEY, ["id"])
    drive(w, random.Random(29), steps=12, rows_per_step=40, keys=25, future=0.25)
    trace = w.trace()
    assert SPLIT.run_compression == "auto"
    with capture_logs() as logs:
        _convert_both(sp, w, trace, spans(trace, w.wal_dir), name="ref", tuning=SPLIT)
    chosen = [e for e in logs if e["event"] == "step.scratch"]
    assert len(chosen) == 1, logs
    assert chosen[0]["scratch_compression"] == "none"
    assert chosen[0]["free_bytes"] >= AUTO_ROOM * chosen[0]["input_bytes"] > 0
    with capture_logs() as logs:  # a chosen codec is not a choice to log
        _convert_both(sp, w, trace, spans(trace, w.wal_dir), name="ref-lz4",
                      tuning=dataclasses.replace(SPLIT, run_compression="lz4"))
    assert not [e for e in logs if e["event"] == "step.scratch"]


@pytest.mark.spark
def test_compressed_segments_match_reference(sp: Any, tmp_path: Path) -> None:
    """Segments of LZ4- and ZSTD-compressed update records, and uncompressed ones, in one
    step (stores of each setting in turn) convert through the partitioned path, with its
    scratch runs in ZSTD (the daemon's ``scratch_compression`` for a disk short of room),
    to exactly the reference's rows (tests/wal/test_ranges.py: settings mixed within a
    segment)."""
    root = tmp_path / "d"
    open_workload(root, INT_KEY, ["id"]).store.close()
    rng = random.Random(23)
    for compression in ("lz4", "zstd", "none", "lz4"):
        store = Store.open(root, segment_bytes=8192, fsync="never", wal_compression=compression)
        w = Workload(root, store, store.relation("rel"))
        drive(w, rng, steps=6, rows_per_step=40, keys=25, future=0.25)
        store.close()
    codecs = {codec_of(r.payload) for seg in _segments(w)
              for r in scan_file(seg, w.meta.name)[0].updates()}
    assert codecs == {"lz4", "zstd", "none"}
    trace = w.trace()
    _convert_both(sp, w, trace, spans(trace, w.wal_dir), name="ref",
                  tuning=dataclasses.replace(SPLIT, run_compression="zstd"))


@pytest.mark.spark
@pytest.mark.parametrize("tuning", [JobTuning(), SPLIT], ids=["single-task", "partitioned"])
def test_an_s3_trace_with_staged_segments_matches_reference(
        sp: Any, tmp_path: Path, s3_bucket: str, spark_s3_env: None, tuning: JobTuning
        ) -> None:
    """The trace on S3 and the WAL read from staged copies (a cluster with no shared
    directory): the tasks write parts, runs and pending parts as objects, and the result
    is exactly the reference's (the runs LZ4: a bucket has no free bytes to tell); the
    staged copies go when the converted segments do."""
    from structlog.testing import capture_logs

    rng = random.Random(17)
    w = open_workload(tmp_path / "d", STR_KEY, ["name"], trace_url=f"s3://{s3_bucket}/t")
    drive(w, rng, steps=20, rows_per_step=40, keys=25, future=0.25)
    trace = w.trace()
    assert trace.store.url == f"s3://{s3_bucket}/t/rel"
    segs = spans(trace, w.wal_dir)
    with capture_logs() as logs:
        plan, got = _convert_both(sp, w, trace, segs, name="ref", tuning=tuning, stage=True)
    chosen = [e["scratch_compression"] for e in logs if e["event"] == "step.scratch"]
    assert chosen == (["lz4"] if tuning is SPLIT else []), "auto on S3: LZ4 runs"
    staged = {o.key for o in trace.store.list("staging")}
    assert staged == {f"staging/{s.seq:020d}.wal" for s in segs}
    assert not trace.store.list(f"batches/{plan.batch_id}.scratch"), "scratch runs left"
    trace.commit_conversion(plan, got.parts, got.pending)
    trace.delete_converted_segments(w.wal_dir)
    assert not trace.store.list("staging")
    if tuning is SPLIT:
        assert len(got.parts) > 1
    drive(w, rng, steps=6, rows_per_step=40, keys=25, future=0.25)
    plan2, got2 = _convert_both(sp, w, trace, spans(trace, w.wal_dir), name="ref2",
                                tuning=tuning, stage=True)
    trace.commit_conversion(plan2, got2.parts, got2.pending)
    mplan = merge_plan_ok(plan_merge(trace.state))
    ref = w.fork(trace, "refm")
    want = reference.run_merge(ref, mplan)
    merged = spark_merge(sp, trace, mplan, tuning=tuning)
    assert_same_tables(batch_table(trace, merged), batch_table(ref, want), "merged batch")


@pytest.mark.spark
def test_decode_tasks_sum_what_forwarding_repeats(sp: Any, tmp_path: Path) -> None:
    """A backlog converted with ``since`` close behind its upper: the decode tasks sum the
    updates forwarding made equal (checked on the step's own decoded rows), and the batch
    and pending parts still equal the reference's."""
    schema = pa.schema([("id", pa.int64()), ("item", pa.string())])
    w = open_workload(tmp_path / "d", schema, ["id"], segment_bytes=64 << 10)
    rng = random.Random(11)
    for step in range(6):
        n = 4_000
        ids = [rng.randrange(300) for _ in range(n)]
        w.rel.append(pa.table({
            "id": pa.array(ids, pa.int64()),
            "item": pa.array([None if i % 50 == 0 else f"item-{i % 7}" for i in ids]),
            "_time": pa.array([step * 10 + rng.randrange(14) for _ in range(n)], pa.uint64()),
            "_diff": pa.array([rng.choice((1, 1, -1)) for _ in range(n)], pa.int64()),
        }))
        if step == 5:  # before the last seal: in a segment the conversion reads
            w.rel.allow_compaction(48)
        w.rel.seal(step * 10 + 10)
    trace = w.trace()
    plan = plan_conversion(trace.state, spans(trace, w.wal_dir))
    assert (plan.since, plan.upper) == (48, 60)
    ctx = single_context(trace, conversion_spec(trace, plan))
    past, _, decoded = prepared(0, ctx)
    assert summed_repeats(past, ctx).num_rows < past.num_rows // 4 < decoded
    ref = w.fork(trace, "ref")
    want = reference.run_conversion(ref, plan)
    got = spark_convert(sp, trace, plan, tuning=SPLIT)
    assert len(got.parts) > 1, "expected the partitioned path"
    assert got.pending, "expected future rows"
    assert_same_conversion(trace, got, ref, want, plan=plan)


@pytest.mark.spark
def test_several_tasks_write_parts_of_a_big_input(sp: Any, tmp_path: Path) -> None:
    """With default tuning, an input a few times ``part_bytes`` is range-partitioned: parts
    from several tasks, globally sorted in index order, equal to the reference's one part."""
    w = open_workload(tmp_path / "d", INT_KEY, ["id"], segment_bytes=1 << 20)
    rng = random.Random(5)
    for step in range(6):
        n = 20_000
        w.rel.append(pa.table({
            "id": pa.array([rng.randrange(50_000) for _ in range(n)], pa.int64()),
            "item": pa.array([f"item-{i % 97}" for i in range(n)]),
            "note": pa.array([None if i % 5 == 0 else "x" * (i % 40) for i in range(n)]),
            "score": pa.array([float(i % 13) for i in range(n)]),
            "_time": pa.array([step * 10 + i % 12 for i in range(n)], pa.uint64()),
            "_diff": pa.array([1 if i % 3 else -1 for i in range(n)], pa.int64()),
        }))
        w.rel.seal(step * 10 + 10)
    w.rel.seal(100)
    trace = w.trace()
    tuning = JobTuning(part_bytes=1 << 20, single_task_bytes=1 << 20)
    plan = plan_conversion(trace.state, spans(trace, w.wal_dir))
    ref = w.fork(trace, "ref")
    want = reference.run_conversion(ref, plan)
    got = spark_convert(sp, trace, plan, tuning=tuning)
    assert len(got.parts) > 1, "expected parts from more than one task"
    assert len({p.path for p in got.parts}) == len(got.parts)
    assert_same_conversion(trace, got, ref, want, plan=plan)


@pytest.mark.spark
def test_all_cancelled_writes_nothing(sp: Any, tmp_path: Path) -> None:
    """Updates that cancel out leave an empty batch: no part file at all."""
    w = open_workload(tmp_path / "d", INT_KEY, ["id"])
    rows = [{"id": 1, "item": "a", "note": None, "score": 1.0, "_time": 3, "_diff": d}
            for d in (2, -1, -1)]
    w.rel.append(table_of(INT_KEY, rows))
    w.rel.seal(10)
    segs = _finish(w)
    trace = w.trace()
    plan = plan_conversion(trace.state, segs)
    got = spark_convert(sp, trace, plan)
    assert (got.parts, got.pending) == ([], []) == reference.run_conversion(
        w.fork(trace, "ref"), plan)
    assert got.input_rows == input_updates(trace, plan) > 3, "every update read is counted"
    assert not trace.store.list("batches"), "a cancelled step left files"


def _finish(w: Workload) -> Any:
    """Seal and append cancelling pairs until the open segment rotates, so everything
    appended so far is in finished segments (the pairs consolidate away); their spans."""
    key = w.meta.key[0]
    pad: dict[str, Any] = {f.name: None for f in w.meta.schema}
    pad[key] = 0 if pa.types.is_integer(w.meta.schema.field(key).type) else "k0"
    while not any(s.finished for s in _segments(w)):
        t = w.rel.upper
        row = dict(pad, _time=t, _diff=1)
        w.rel.append(table_of(w.meta.schema, [row, dict(row, _diff=-1)]))
        w.rel.seal(t + 1)
    return spans(w.trace(), w.wal_dir)


# --- errors ------------------------------------------------------------------------------------

@pytest.mark.spark
@pytest.mark.parametrize("tuning", [JobTuning(), SPLIT], ids=["whole", "split"])
def test_diff_overflow_is_carried(sp: Any, tmp_path: Path, tuning: JobTuning) -> None:
    """A (row, time) whose exact sum leaves int64 is stored as a carry (lamina.consolidate)
    by the Spark write tasks exactly as by the reference, row for row; a sum whose partial
    sums leave int64 but whose total fits is one row; nothing raises, nothing wraps."""
    w = open_workload(tmp_path / "d", INT_KEY, ["id"])
    row = {"id": 1, "item": "a", "note": "n", "score": 0.5, "_time": 2}
    w.rel.append(table_of(INT_KEY, [dict(row, _diff=2**62), dict(row, _diff=2**62),
                                    dict(row, _diff=-(2**62)), dict(row, id=2, _diff=2**62),
                                    dict(row, id=2, _diff=2**62), dict(row, id=3, _diff=-5),
                                    dict(row, id=2, _time=10**6, _diff=2**62),
                                    dict(row, id=2, _time=10**6, _diff=2**62)]))
    w.rel.seal(5)
    segs = _finish(w)
    trace = w.trace()
    plan = plan_conversion(trace.state, segs)
    ref = w.fork(trace, "ref")
    want = reference.run_conversion(ref, plan)
    got = spark_convert(sp, trace, plan, tuning=tuning)
    assert_same_conversion(trace, got, ref, want, plan=plan)
    rows = [(r["id"], r["_time"], r["_diff"])
            for r in pa.concat_tables(read_part(ref.store, p) for p in want[0]).to_pylist()
            if r["id"] != 0]
    assert rows == [(1, 2, 2**62), (2, 2, INT64_MAX), (2, 2, 1), (3, 2, -5)]
    pending = pa.concat_tables(read_part(ref.store, p.part) for p in want[1])
    assert pending.column("_diff").to_pylist() == [INT64_MAX, 1]  # carried in pending too


@pytest.mark.spark
@pytest.mark.parametrize("tuning", [JobTuning(), SPLIT], ids=["whole", "split"])
@pytest.mark.parametrize("where", ["payload", "length"])
def test_corrupt_segment_raises_corruption(sp: Any, tmp_path: Path, tuning: JobTuning,
                                           where: str) -> None:
    """A flipped byte in a finished segment (an update's payload, or a frame's length
    field that the driver's walk reads) is CorruptionError naming the file, never a skip."""
    w = open_workload(tmp_path / "d", STR_KEY, ["name"])
    drive(w, random.Random(21), steps=12, rows_per_step=30, keys=20, future=0.1)
    trace = w.trace()
    segs = spans(trace, w.wal_dir)
    victim = segs[len(segs) // 2]
    scan, data = scan_file(next(s for s in _segments(w) if s.seq == victim.seq), w.meta.name)
    rec = next(r for r in scan.records[1:] if r.rtype is RecordType.UPDATES)
    offset = rec.offset + HEADER_SIZE + len(rec.payload) // 2 if where == "payload" \
        else rec.offset + 1
    damaged = bytearray(data)
    damaged[offset] ^= 0x40
    assert not isinstance(read_frame(memoryview(bytes(damaged)), rec.offset), type(rec))
    Path(victim.path).write_bytes(bytes(damaged))
    plan = plan_conversion(trace.state, segs)
    with pytest.raises(CorruptionError) as err:
        spark_convert(sp, trace, plan, tuning=tuning)
    assert err.value.path == Path(victim.path)
    assert "write-ahead log damaged" in str(err.value)


@pytest.mark.spark
def test_corrupt_pending_part_raises_corruption(sp: Any, tmp_path: Path) -> None:
    w = open_workload(tmp_path / "d", INT_KEY, ["id"])
    drive(w, random.Random(8), steps=16, rows_per_step=30, keys=20, future=0.4)
    trace = w.trace()
    segs = spans(trace, w.wal_dir)
    reference.convert(trace, plan_conversion(trace.state, segs[:2]))
    plan = plan_conversion(trace.state, segs[2:])
    assert plan.consume
    path = trace.store.root / plan.consume[0].part.path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="checksum") as err:
        spark_convert(sp, trace, plan)
    assert err.value.path == path


@pytest.mark.spark
def test_task_failure_is_job_error(sp: Any, tmp_path: Path) -> None:
    """Anything else failing in a task (here a consumed pending part that vanished) is
    JobError naming the relation and the step, with the root cause."""
    w = open_workload(tmp_path / "d", INT_KEY, ["id"])
    drive(w, random.Random(9), steps=16, rows_per_step=30, keys=20, future=0.4)
    trace = w.trace()
    segs = spans(trace, w.wal_dir)
    reference.convert(trace, plan_conversion(trace.state, segs[:2]))
    plan = plan_conversion(trace.state, segs[2:])
    (trace.store.root / plan.consume[0].part.path).unlink()
    with pytest.raises(JobError) as err:
        spark_convert(sp, trace, plan)
    assert "conversion of 'rel'" in str(err.value)
    assert "ObjectNotFoundError" in str(err.value)  # a FileNotFoundError


# --- cancellation ----------------------------------------------------------------------------

def _sleepy(batches: Any) -> Any:
    for b in batches:
        time.sleep(60)
        yield b


def _heap_report(batches: Any) -> Any:
    """A task that reports its worker's frozen objects and whether a cycle it made is
    still reachable by the collector (gc.is_tracked, and collected by gc.collect)."""
    import gc
    import os
    import weakref

    class Node:
        other: Any = None

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle only the collector frees
    ref = weakref.ref(a)
    del a, b
    gc.collect()
    for batch in batches:
        yield pa.RecordBatch.from_pydict(
            {"frozen": [gc.get_freeze_count()] * batch.num_rows,
             "cycle_freed": [ref() is None] * batch.num_rows,
             "unix_socket": [os.environ.get("PYTHON_UNIX_DOMAIN_ENABLED")] * batch.num_rows})


def test_rdd_tasks_get_their_ids_as_a_batch_and_return_the_jobs_columns() -> None:
    """A step's task function runs as an RDD partition function (the driver's
    ``_rdd_task``): it receives its ids as a one-column int64 batch, as ``spark.range``
    gave them, its rows reach the driver as pyspark Rows (by name and as attributes), and
    a task that returns other columns (or types) than the job's fails, naming both."""
    def echo(batches: Any) -> Any:
        for b in batches:
            assert b.schema == pa.schema([("id", pa.int64())])
            ids = b.column(0).to_pylist()
            yield pa.RecordBatch.from_pydict({"id": ids, "twice": [2 * i for i in ids]})

    both = pa.schema([("id", pa.int64()), ("twice", pa.int64())])
    rows = list(_rdd_task(echo, both)(iter([3, 4])))
    assert [(r.id, r["twice"]) for r in rows] == [(3, 6), (4, 8)]
    with pytest.raises(ValueError, match=r"returned columns \(id int64, twice int64\), the "
                                         r"job expects \(id int64\)"):
        list(_rdd_task(echo, pa.schema([("id", pa.int64())]))(iter([1])))
    with pytest.raises(ValueError, match=r"the job expects \(id int64, twice int32\)"):
        list(_rdd_task(echo, pa.schema([("id", pa.int64()), ("twice", pa.int32())]))(iter([1])))


@pytest.mark.spark
def test_step_tasks_run_over_unix_sockets_with_the_worker_heap_frozen(sp: Any) -> None:
    """The two per-task costs docs/performance.md measured ("Forty milliseconds a task")
    stay removed: the session of build_session has the JVM talk to its Python workers over
    Unix sockets (PySpark's daemon learns it from PYTHON_UNIX_DOMAIN_ENABLED), and every
    task of a step's job runs after gc.freeze() (the driver's _gc_frozen), so the full
    collection the daemon runs after each task walks only what the task made; a cycle a
    task makes is still collected."""
    from lamina.compacter.step.driver import _run_tasks

    rows = _run_tasks(sp, 4, _heap_report, [("frozen", pa.int64()), ("cycle_freed", pa.bool_()),
                                            ("unix_socket", pa.string())], lambda: None)
    assert len(rows) == 4
    assert all(r.frozen > 0 for r in rows), rows
    assert all(r.cycle_freed for r in rows), rows
    assert all(str(r.unix_socket).lower() == "true" for r in rows), rows


@pytest.mark.spark
def test_cancel_a_tagged_step_from_another_thread(sp: Any) -> None:
    tags = JobTags(sp)
    outcome: list[BaseException | None] = []

    def step() -> None:
        def work() -> Any:
            check_cancelled()
            df = sp.range(0, 2, 1, 2).mapInArrow(_sleepy, "id bigint")
            return df.collect()
        try:
            tags.run("lamina-rel-test", work, "a step that sleeps")
            outcome.append(None)
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)

    t = threading.Thread(target=step)
    started = time.monotonic()
    t.start()
    deadline = time.monotonic() + 30
    while "lamina-rel-test" not in tags.running() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # let the job start its tasks
    assert tags.cancel("lamina-rel-test")
    t.join(30)
    assert not t.is_alive()
    assert time.monotonic() - started < 30
    assert isinstance(outcome[0], JobCancelledError)
    assert tags.running() == []
    assert not tags.cancel("lamina-rel-test")  # nothing runs under it any more
    assert tags.run("lamina-rel-test", lambda: 42) == 42  # a new step starts afresh


@pytest.mark.spark
def test_a_cancel_before_the_job_reaches_spark_still_cancels_it(sp: Any) -> None:
    """The step passed its last check and has not submitted its job yet when the cancel
    comes: Spark has nothing to cancel then, so the cancel is repeated until the job that
    follows is gone too."""
    tags = JobTags(sp)
    passed_check = threading.Event()
    outcome: list[BaseException | None] = []

    def work() -> Any:
        check_cancelled()
        passed_check.set()
        time.sleep(1.0)  # the cancel lands here, before the job exists
        return sp.range(0, 2, 1, 2).mapInArrow(_sleepy, "id bigint").collect()

    def step() -> None:
        try:
            tags.run("lamina-rel-late", work, "a step cancelled before its job")
            outcome.append(None)
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)

    t = threading.Thread(target=step)
    t.start()
    assert passed_check.wait(30)
    assert tags.cancel("lamina-rel-late")
    t.join(40)  # the job sleeps 60 s per task when not cancelled
    assert not t.is_alive()
    assert isinstance(outcome[0], JobCancelledError)


WIDE = pa.schema([
    ("k32", pa.int32()), ("ks", pa.string()), ("i8", pa.int8()), ("i16", pa.int16()),
    ("f32", pa.float32()), ("flag", pa.bool_()), ("day", pa.date32()),
    ("ts", pa.timestamp("us")), ("tz", pa.timestamp("us", tz="Europe/Berlin")),
    ("dec", pa.decimal128(20, 3)), ("blob", pa.binary()),
    # names that must not clash with the jobs' own Spark columns, nor with each other
    ("__lamina_bucket", pa.int16()), ("KS", pa.string()),
])


def _wide_rows(rng: random.Random, n: int, upper: int) -> list[dict[str, Any]]:
    import datetime as dt
    from decimal import Decimal

    def maybe(v: Any) -> Any:
        return None if rng.random() < 0.15 else v

    out = []
    for _ in range(n):
        k = rng.randrange(12)
        out.append({
            "k32": maybe(k - 6), "ks": maybe(["", "a", "ä", "b"][k % 4]),
            "i8": maybe(rng.choice([-128, 0, 127])), "i16": maybe(k * 100 - 600),
            "f32": maybe(rng.choice([1.5, -2.0, float("nan"), float("inf")])),
            "flag": maybe(k % 2 == 0), "day": maybe(dt.date(1969 + k, 12, 31)),
            "ts": maybe(dt.datetime(2000, 1, 1) + dt.timedelta(microseconds=k * 7)),
            "tz": maybe(dt.datetime(2000, 1, 1, tzinfo=dt.UTC) + dt.timedelta(hours=k)),
            "dec": maybe(Decimal(k * 1000 - 5000) / 1000), "blob": maybe(bytes([k, 0, 255])),
            "__lamina_bucket": maybe(k % 3), "KS": maybe(["x", "y"][k % 2]),
            "_time": upper + rng.choice([0, 0, 1, 2, 9, 1 << 20]),
            "_diff": rng.choice([1, 1, -1, 2]),
        })
    return out


@pytest.mark.spark
def test_every_supported_column_type(sp: Any, tmp_path: Path) -> None:
    """Signed ints of each width, float32 with NaN and inf, bool, date, timestamps with and
    without a time zone, decimal, binary, and nulls everywhere (also in key columns) are
    mapped to Spark and back, ordered and consolidated like the reference; columns named
    like the jobs' own or differing only in case are kept apart."""
    w = open_workload(tmp_path / "d", WIDE, ["k32", "ks"])
    rng = random.Random(41)
    for _ in range(10):
        upper = w.rel.upper
        w.rel.append(table_of(WIDE, _wide_rows(rng, 60, upper)))
        w.rel.seal(upper + 3)
        w.rel.allow_compaction(max(0, upper - 2))
    trace = w.trace()
    segs = _finish(w)
    plan = plan_conversion(trace.state, segs)
    ref = w.fork(trace, "ref")
    want = reference.run_conversion(ref, plan)
    got = spark_convert(sp, trace, plan, tuning=SPLIT)
    assert_same_conversion(trace, got, ref, want, plan=plan)
    assert len(got.parts) > 1
