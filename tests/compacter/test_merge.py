"""One-pass merges (lamina.compacter.step.merge) against the reference executor.

The cut of the prefix space is checked without Spark (hypothesis, and a written part's
footer against its rows), and so are forwarded runs (summed first where rows repeat)
followed by a task's sort and consolidation; the Spark cases merge two batches of several
row groups each, built by the reference executor, through ``run_step`` and compare every row
and its order with the reference's merge: int, string, nullable int32 and timestamp first
columns, since forwarding, several write tasks and chunks. They also show when the two-job
step runs instead (a float first column, one key holding most rows) and that a damaged page
of an input fails the merge as corruption.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import random
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lamina.compacter.executors import reference
from lamina.compacter.step.context import StepContext
from lamina.compacter.step.driver import StepOutput, _context, merge_spec, run_step
from lamina.compacter.step.merge import (
    GroupIndex,
    GroupRange,
    cut_values,
    forwarded_run,
    sampled_ranges,
)
from lamina.compacter.step.work import JobTuning
from lamina.compacter.step.write import consolidated_rows
from lamina.consolidate import INT64_MIN, consolidate_updates, forward
from lamina.errors import CorruptionError
from lamina.trace.batch import ROW_GROUP_ROWS, OpenPart, read_part, write_part
from lamina.trace.order import order_prefix
from lamina.trace.plan import plan_conversion, plan_merge
from lamina.trace.trace import Trace
from tests.compacter.workload import (
    Workload,
    assert_same_tables,
    batch_table,
    merge_plan_ok,
    open_workload,
    spans,
)

# several write tasks and several chunks per task on inputs of a few row groups per part
TUNING = JobTuning(single_task_bytes=4096, part_bytes=64 << 10, chunk_rows=3000)


# --- the cut, without Spark ---------------------------------------------------------------

group = st.tuples(st.integers(-50, 50), st.integers(0, 40), st.integers(1, 5000)).map(
    lambda g: (g[0], g[0] + g[1], g[2]))


@settings(max_examples=300, deadline=None)
@given(st.lists(group, max_size=30), st.integers(1, 20))
def test_cut_values_increase_and_leave_rows_above_the_last(
        samples: list[GroupRange], chunks: int) -> None:
    cuts = cut_values(samples, chunks)
    assert len(cuts) <= max(0, chunks - 1)
    assert cuts == sorted(set(cuts))
    highs = [hi for _, hi, _ in samples]
    if cuts:
        assert cuts[-1] < max(highs)
        assert all(c in highs for c in cuts)


def test_cut_values_share_rows_evenly_over_many_groups() -> None:
    samples = [(i * 10, i * 10 + 9, 100) for i in range(200)]
    cuts = cut_values(samples, 4)
    assert len(cuts) == 3
    for c, want in zip(cuts, (500, 1000, 1500), strict=True):
        assert abs(c - want) <= 10


def _sorted_part(tmp_path: Path, values: list[Any], type_: pa.DataType) -> tuple[Any, Any]:
    w = open_workload(tmp_path / "d", pa.schema([("s", type_)]), ["s"])
    trace = w.trace()
    n = len(values)
    table = pa.table({"s": pa.array(values, type_), "_time": pa.array([1] * n, pa.uint64()),
                      "_diff": pa.array([1] * n, pa.int64())})
    part = write_part(trace.store, "batches/b/part-00000.parquet", trace.meta.update_schema,
                      [table])
    return trace, part


def test_group_index_bounds_every_row_and_finds_the_groups_of_a_range(
        tmp_path: Path) -> None:
    """Each row group's range from the footer holds the prefix of each of its rows (nulls
    and empty strings included), and the groups found for a range hold every row whose
    prefix is in it."""
    rng = random.Random(3)
    n = 5 * ROW_GROUP_ROWS + 17
    values = sorted((rng.choice([None, "", "a", "ab", "b" * 20, "é", f"k{rng.random()}"])
                     for _ in range(n)), key=lambda v: (v is not None, v or ""))
    trace, part = _sorted_part(tmp_path, values, pa.string())
    opened = OpenPart(trace.store, part, verify=True)
    index = GroupIndex(opened.file.metadata, "s", pa.string())
    assert index.groups == 6
    prefix = order_prefix(pa.array(values, pa.string())).to_pylist()
    for g in range(index.groups):
        found = index.range(g)
        assert found is not None
        lo, hi, rows = found
        mine = prefix[g * ROW_GROUP_ROWS:(g + 1) * ROW_GROUP_ROWS]
        assert rows == len(mine)
        assert lo <= min(mine)
        assert max(mine) <= hi
    assert index.range(0)[0] == INT64_MIN  # type: ignore[index]  # the nulls' prefix
    cuts = sorted(set(rng.sample(prefix, 8)))
    for lower, upper in zip([None, *cuts], [*cuts, None], strict=True):
        groups = index.wanted(lower, upper)
        inside = [i // ROW_GROUP_ROWS for i, p in enumerate(prefix)
                  if (lower is None or p > lower) and (upper is None or p <= upper)]
        assert set(inside) <= set(groups)
        assert groups == list(range(groups[0], groups[-1] + 1)) if groups else not inside
    opened.close()


def test_sampled_ranges_weigh_every_row(tmp_path: Path) -> None:
    values = list(range(40 * ROW_GROUP_ROWS))
    trace, part = _sorted_part(tmp_path, values, pa.int64())
    samples = sampled_ranges(trace.store, [part], "s", pa.int64(), per_part=7)
    assert samples is not None
    assert len(samples) == 7
    assert abs(sum(r for _, _, r in samples) - part.rows) < 7
    assert [lo for lo, _, _ in samples] == sorted(lo for lo, _, _ in samples)


# --- Spark against the reference ---------------------------------------------------------

def _two_batches(tmp_path: Path, schema: pa.Schema, key: list[str],
                 rows: Any, *, since: int = 0) -> tuple[Workload, Trace]:
    """Two batches of one level, converted by the reference executor from ``rows(t)``
    appended over three sealed intervals each (what reached finished segments);
    ``since`` allowed before the second conversion (before the last seal, so that the
    SINCE record is in a segment it converts and the merge forwards)."""
    w = open_workload(tmp_path / "d", schema, key, segment_bytes=64 << 10)
    trace = w.trace()
    for half in range(2):
        for step in range(3):
            t = (half * 3 + step) * 10
            w.rel.append(rows(t))
            if half and step == 2 and since:  # in a segment the conversion reads
                w.rel.allow_compaction(since)
            w.rel.seal(t + 10)
        plan = plan_conversion(trace.state, spans(trace, w.wal_dir))
        trace.commit_conversion(plan, *reference.run_conversion(trace, plan))
    return w, trace


def _merge(spark: Any, w: Workload, trace: Trace, tuning: JobTuning = TUNING
           ) -> StepOutput:
    """The Spark merge of the trace's two batches, checked against the reference's."""
    plan = merge_plan_ok(plan_merge(trace.state))
    ref = w.fork(trace, "ref")
    want = reference.run_merge(ref, plan)
    out = run_step(spark, trace, merge_spec(trace, plan), tuning=tuning)
    assert_same_tables(batch_table(trace, out.parts), batch_table(ref, want), "merged batch")
    assert out.input_rows == sum(p.rows for b in (plan.left, plan.right) for p in b.parts)
    assert all(p.rows > 0 for p in out.parts)
    return out


def _int_rows(rng: random.Random, keys: int, n: int = 5000) -> Any:
    def rows(t: int) -> pa.Table:
        return pa.table({
            "id": pa.array([rng.randrange(keys) for _ in range(n)], pa.int64()),
            "item": pa.array([f"i{rng.randrange(3)}" for _ in range(n)]),
            "note": pa.array([None if i % 7 == 0 else "x" for i in range(n)]),
            "score": pa.array([float(i % 3) for i in range(n)]),
            "_time": pa.array([t + rng.randrange(10) for _ in range(n)], pa.uint64()),
            "_diff": pa.array([rng.choice([1, 1, -1, 2]) for _ in range(n)], pa.int64()),
        })
    return rows


INT_KEY = pa.schema([("id", pa.int64()), ("item", pa.string()), ("note", pa.string()),
                     ("score", pa.float64())])


@pytest.mark.spark
def test_an_int_key_merge_is_one_job_of_several_tasks(spark: Any, tmp_path: Path) -> None:
    """Times below since forwarded, rows that cancel dropped, several parts from one job."""
    w, trace = _two_batches(tmp_path, INT_KEY, ["id"], _int_rows(random.Random(1), 4000),
                            since=35)
    out = _merge(spark, w, trace)
    assert out.spark_jobs == 1
    assert len(out.parts) > 2


@pytest.mark.spark
def test_a_string_key_merge_is_one_job(spark: Any, tmp_path: Path) -> None:
    """Strings sharing their first seven bytes (one prefix) stay in one chunk and still
    come out in full-key order."""
    rng = random.Random(2)
    schema = pa.schema([("name", pa.string()), ("qty", pa.int32()), ("tag", pa.binary())])

    def rows(t: int) -> pa.Table:
        n = 5000
        return pa.table({
            "name": pa.array([f"{'same-pre' if rng.random() < 0.2 else 'k'}"
                              f"{rng.randrange(3000)}" for _ in range(n)]),
            "qty": pa.array([rng.randrange(3) for _ in range(n)], pa.int32()),
            "tag": pa.array([None if rng.random() < 0.1 else b"t" for _ in range(n)]),
            "_time": pa.array([t + rng.randrange(10) for _ in range(n)], pa.uint64()),
            "_diff": pa.array([rng.choice([1, -1, 3]) for _ in range(n)], pa.int64()),
        })
    w, trace = _two_batches(tmp_path, schema, ["name"], rows)
    out = _merge(spark, w, trace)
    assert out.spark_jobs == 1
    assert len(out.parts) > 1


@pytest.mark.spark
def test_null_keys_and_timestamp_keys_merge_in_one_job(spark: Any, tmp_path: Path) -> None:
    """A nullable int32 first column (nulls sort first) and a timestamp second key."""
    rng = random.Random(3)
    schema = pa.schema([("k", pa.int32()), ("at", pa.timestamp("us")), ("v", pa.int64())])
    base = dt.datetime(2026, 1, 1)

    def rows(t: int) -> pa.Table:
        n = 5000
        return pa.table({
            "k": pa.array([None if rng.random() < 0.05 else rng.randrange(-500, 500)
                           for _ in range(n)], pa.int32()),
            "at": pa.array([base + dt.timedelta(seconds=rng.randrange(5)) for _ in range(n)],
                           pa.timestamp("us")),
            "v": pa.array([rng.randrange(2) for _ in range(n)], pa.int64()),
            "_time": pa.array([t + rng.randrange(10) for _ in range(n)], pa.uint64()),
            "_diff": pa.array([rng.choice([1, -1, 1]) for _ in range(n)], pa.int64()),
        })
    w, trace = _two_batches(tmp_path, schema, ["k", "at"], rows, since=20)
    assert _merge(spark, w, trace).spark_jobs == 1


BENCH_LIKE = pa.schema([("id", pa.int64()), ("item", pa.string()), ("qty", pa.int64())])


def _repeating_rows(rng: random.Random, keys: int, n: int = 4000) -> Any:
    """Rows as bench.merge has them (item and qty functions of id), many updates each."""
    def rows(t: int) -> pa.Table:
        ids = [rng.randrange(keys) for _ in range(n)]
        return pa.table({
            "id": pa.array(ids, pa.int64()), "item": pa.array([f"item-{i % 7}" for i in ids]),
            "qty": pa.array([i * 3 for i in ids], pa.int64()),
            "_time": pa.array([t + rng.randrange(10) for _ in range(n)], pa.uint64()),
            "_diff": pa.array([rng.choice([1, 1, -1, 2]) for _ in range(n)], pa.int64()),
        })
    return rows


def test_a_forwarded_run_is_summed_first_only_where_rows_repeat(tmp_path: Path) -> None:
    """The left batch below ``since``: its runs come back forwarded and consolidated (what
    the reference makes of them, with the inputs' fields), a fraction of their rows; a run
    of times at or above ``since`` comes back as it is; one whose forwarded rows stay
    mostly distinct comes back forwarded but not summed, and so does a single row; one
    whose rows cancel comes back empty."""
    _, trace = _two_batches(tmp_path, BENCH_LIKE, ["id"], _repeating_rows(random.Random(8), 300),
                            since=30)
    plan = merge_plan_ok(plan_merge(trace.state))
    ctx = _context(trace, merge_spec(trace, plan), share=1 << 20, n_write=1, tuning=TUNING,
                   stage_segments=False)
    left, right = (pa.concat_tables([read_part(trace.store, p) for p in b.parts])
                   for b in (plan.left, plan.right))
    left, right = (t.append_column(ctx.prefix, order_prefix(t.column("id")))
                   for t in (left, right))
    assert plan.since == 30
    assert pc.max(left.column("_time")).as_py() < 30 <= pc.min(right.column("_time")).as_py()
    summed = forwarded_run(left, ctx)
    assert summed.schema.equals(left.schema)
    assert summed.num_rows < left.num_rows // 4
    want = consolidate_updates(forward(left, 30).drop_columns([ctx.prefix]), ["id", "item",
                               "qty"], ["id", "item", "qty"], context="test")
    assert_same_tables(summed.drop_columns([ctx.prefix]).cast(want.schema), want, "summed run")
    assert forwarded_run(right, ctx) is right
    ids = left.column("id").to_numpy()  # one row per id: forwarding makes no two equal
    distinct = left.take(np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]]))
    cancelled = left.take([0, 0]).set_column(  # a row and its retraction: nothing left
        left.schema.get_field_index("_diff"), left.schema.field("_diff"),
        pa.array([1, -1], pa.int64()))
    assert forwarded_run(cancelled, ctx).num_rows == 0
    unsummed = forwarded_run(distinct, ctx)
    assert unsummed.num_rows == distinct.num_rows
    assert set(unsummed.column("_time").to_pylist()) == {30}
    for one in (left.slice(0, 1), left.slice(left.num_rows - 1)):  # a chunk's lone row
        assert forwarded_run(one, ctx).column("_time").to_pylist() == [30]


MIXED = pa.schema([("k", pa.int32()), ("s", pa.string()), ("f", pa.float64())])


@pytest.fixture(scope="module")
def mixed_ctx(tmp_path_factory: pytest.TempPathFactory) -> StepContext:
    """A merge's step context for ``MIXED`` (key ``k``, nullable; a float row column)."""
    rng = random.Random(12)

    def rows(t: int) -> pa.Table:
        n = 3000  # enough to finish a segment of 64 KiB
        return pa.table({"k": pa.array([rng.randrange(500) for _ in range(n)], pa.int32()),
                         "s": ["a"] * n, "f": [0.5] * n,
                         "_time": pa.array([t] * n, pa.uint64()),
                         "_diff": pa.array([1] * n, pa.int64())})
    _, trace = _two_batches(tmp_path_factory.mktemp("mixed"), MIXED, ["k"], rows)
    plan = merge_plan_ok(plan_merge(trace.state))
    return _context(trace, merge_spec(trace, plan), share=1 << 20, n_write=1, tuning=TUNING,
                    stage_segments=False)


_mixed_row = st.tuples(st.one_of(st.none(), st.integers(-3, 3)),
                       st.one_of(st.none(), st.sampled_from(["a", "ab", "b"])),
                       st.sampled_from([0.0, 1.5, float("nan")]),
                       st.integers(0, 19), st.sampled_from([1, 1, -1, 2, -3]))


@settings(max_examples=200, deadline=None)
@given(st.lists(_mixed_row, max_size=60), st.lists(_mixed_row, max_size=60),
       st.integers(0, 45), st.booleans())
def test_forwarded_runs_then_the_chunk_sort_give_the_reference_consolidation(
        mixed_ctx: StepContext, left: list[Any], right: list[Any], since: int,
        integral: bool) -> None:
    """Two consolidated parents (times 0..19 and 20..39), forwarded run by run (summed
    where rows repeat), concatenated, sorted and consolidated as a merge task does: the
    rows the reference makes of the forwarded parents, whatever ``since`` is; with and
    without the float column (where summing a run declines). No -0.0: it sorts equal to
    0.0 but is kept apart by consolidation, so the order of the two rows follows the
    input's, in the old merge path as in this one, and a row-by-row comparison with the
    reference cannot hold."""
    ctx = dataclasses.replace(mixed_ctx, since=since)
    if integral:
        ctx = dataclasses.replace(ctx, update_schema=pa.schema(
            [f for f in ctx.update_schema if f.name != "f"]),
            row_columns=("k", "s"), sort_columns=("k", "s"))
    cols = list(ctx.row_columns)

    def parent(rows: list[Any], base: int) -> pa.Table:
        table = pa.table({"k": pa.array([r[0] for r in rows], pa.int32()),
                          "s": pa.array([r[1] for r in rows], pa.string()),
                          "f": pa.array([r[2] for r in rows], pa.float64()),
                          "_time": pa.array([base + r[3] for r in rows], pa.uint64()),
                          "_diff": pa.array([r[4] for r in rows], pa.int64())})
        table = consolidate_updates(table.select([*cols, "_time", "_diff"]), cols, cols,
                                    context="test").cast(ctx.update_schema)
        return table.append_column(ctx.prefix, order_prefix(table.column("k")))

    parents = [parent(left, 0), parent(right, 20)]
    pieces = [forwarded_run(p, ctx) for p in parents if p.num_rows]
    for p, q in zip([p for p in parents if p.num_rows], pieces, strict=True):
        assert q.schema.equals(p.schema)
    rows = pa.concat_tables(pieces) if pieces else parents[0]
    got = consolidated_rows(rows.take(pc.sort_indices(rows, sort_keys=ctx.sort_keys)), ctx)
    history = pa.concat_tables(parents).drop_columns([ctx.prefix])
    want = consolidate_updates(forward(history, since), cols, cols, context="test")
    assert_same_tables(got.cast(want.schema), want, "merged chunk")


@pytest.mark.spark
def test_a_merge_whose_left_batch_is_all_history_sums_it_first(
        spark: Any, tmp_path: Path) -> None:
    """bench.merge's shape: every time of the left batch below ``since``, a few hundred
    rows updated many times; cancelling updates drop out; the same batch as the
    reference's."""
    w, trace = _two_batches(tmp_path, BENCH_LIKE, ["id"], _repeating_rows(random.Random(9), 300),
                            since=30)
    _merge(spark, w, trace)


@pytest.mark.spark
def test_a_float_first_column_or_one_huge_key_takes_the_two_job_step(
        spark: Any, tmp_path: Path) -> None:
    """Statistics cannot cut floats (NaN, -0.0), nor a single key holding most rows: the
    general step runs, with the same output."""
    rng = random.Random(4)
    schema = pa.schema([("x", pa.float64()), ("v", pa.int64())])

    def rows(t: int) -> pa.Table:
        n = 5000
        return pa.table({
            "x": pa.array([rng.choice([float("nan"), -0.0, 0.0, 1.5, -2.25, float(i % 50)])
                           for i in range(n)]),
            "v": pa.array([rng.randrange(1000) for _ in range(n)], pa.int64()),
            "_time": pa.array([t + rng.randrange(10) for _ in range(n)], pa.uint64()),
            "_diff": pa.array([1] * n, pa.int64()),
        })
    w, trace = _two_batches(tmp_path / "floats", schema, ["x"], rows)
    assert _merge(spark, w, trace).spark_jobs == 2

    def one_key(t: int) -> pa.Table:  # 15,000 distinct rows of key 7 per batch
        n = 5000
        return pa.table({"id": pa.array([7] * n, pa.int64()),
                         "item": pa.array([f"i{t}-{i}" for i in range(n)]),
                         "note": pa.array(["x"] * n), "score": pa.array([1.0] * n),
                         "_time": pa.array([t] * n, pa.uint64()),
                         "_diff": pa.array([1] * n, pa.int64())})
    w, trace = _two_batches(tmp_path / "tie", INT_KEY, ["id"], one_key)
    assert _merge(spark, w, trace).spark_jobs == 2


@pytest.mark.spark
def test_a_damaged_page_of_an_input_fails_the_merge_as_corruption(
        spark: Any, tmp_path: Path) -> None:
    _, trace = _two_batches(tmp_path, INT_KEY, ["id"], _int_rows(random.Random(5), 4000))
    plan = merge_plan_ok(plan_merge(trace.state))
    part = plan.left.parts[0]
    path = Path(trace.store.location(part.path))
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0xFF  # inside a data page, far from the footer
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="not readable Parquet"):
        run_step(spark, trace, merge_spec(trace, plan), tuning=TUNING)


@pytest.mark.spark
def test_a_damaged_statistic_that_would_skip_rows_fails_the_merge(
        spark: Any, tmp_path: Path) -> None:
    """The footers' statistics choose what a task reads and no checksum covers them: a max
    value rewritten in a footer (so that its row group seems to end below the last cut)
    fails the merge as corruption, by the row count, instead of dropping the group."""
    big = 0x0102030405060708  # the largest key: the max of the last row group of its part
    inner = _int_rows(random.Random(6), 4000)

    def rows(t: int) -> pa.Table:
        table = inner(t)
        if t == 0:
            ids = table.column("id").to_pylist()
            ids[0] = big
            table = table.set_column(0, "id", pa.array(ids, pa.int64()))
        return table
    _, trace = _two_batches(tmp_path, INT_KEY, ["id"], rows)
    plan = merge_plan_ok(plan_merge(trace.state))
    part = plan.left.parts[-1]
    path = Path(trace.store.location(part.path))
    data = bytearray(path.read_bytes())
    footer_len = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - footer_len
    needle = big.to_bytes(8, "little")
    footer = bytes(data[start:-8])
    assert needle in footer, "the key should be a statistic of the footer"
    data[start:-8] = footer.replace(needle, (1).to_bytes(8, "little"))
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptionError, match="footer statistics are damaged"):
        run_step(spark, trace, merge_spec(trace, plan), tuning=TUNING)
