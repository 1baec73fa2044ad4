"""Random workloads for the Spark job suites, and the comparison with the reference executor.

Imported by tests/compacter/test_step.py, test_cluster.py and by the cluster child script
(tests/compacter/cluster.py), so it must not import pytest.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from lamina.objstore.base import open_store
from lamina.schema import RelationMeta
from lamina.store import Relation, Store
from lamina.trace.batch import PartFile, read_part
from lamina.trace.plan import ConversionPlan, MergePlan
from lamina.trace.state import PendingPart
from lamina.trace.trace import Trace
from lamina.wal.reader import SegmentSpan, segment_spans, segment_updates
from lamina.wal.segment import SegmentFile

if TYPE_CHECKING:
    from lamina.compacter.executors import ConversionResult

INT_KEY = pa.schema([("id", pa.int64()), ("item", pa.string()), ("note", pa.string()),
                     ("score", pa.float64())])
STR_KEY = pa.schema([("name", pa.string()), ("qty", pa.int32()), ("tag", pa.binary())])


@dataclass
class Workload:
    """A relation in a data directory with some finished WAL segments."""

    root: Path
    store: Store
    rel: Relation

    @property
    def meta(self) -> RelationMeta:
        return self.rel.meta

    @property
    def wal_dir(self) -> Path:
        return self.store.layout.wal_dir(self.rel.name)

    def trace_dir(self, name: str = "") -> Path:
        base = self.store.layout.trace_dir(self.rel.name)
        return base if not name else base.with_name(f"{base.name}.{name}")

    def trace(self) -> Trace:
        return Trace.open(self.store.layout.trace_store(self.rel.name), self.meta)

    def fork(self, trace: Trace, name: str) -> Trace:
        """A copy of ``trace``'s objects under another name beside it, opened: two
        executors can carry out one plan without writing over each other's files."""
        root = open_store(self.store.layout.trace_url())
        dest = root.child(f"{self.rel.name}.{name}")
        dest.delete_prefix("")
        for obj in trace.store.list(""):
            dest.put(obj.key, trace.store.get(obj.key))
        return Trace.open(dest, self.meta)


def open_workload(root: Path, schema: pa.Schema, key: list[str], *,
                  segment_bytes: int = 4096, name: str = "rel",
                  trace_url: str | None = None) -> Workload:
    store = Store.open(root, segment_bytes=segment_bytes, fsync="never", trace_url=trace_url)
    rel = store.create_relation(name, schema, key=key)
    return Workload(root, store, rel)


def random_rows(rng: random.Random, schema: pa.Schema, n: int, *, keys: int,
                times: tuple[int, int], future: float = 0.0, far: int = 1 << 40
                ) -> list[dict[str, Any]]:
    """``n`` updates over ``keys`` distinct rows: repeated rows, retractions (negative
    diffs), nulls in nullable non-key columns, and a share ``future`` of times beyond
    ``times`` (some very far ahead)."""
    rows = []
    lo, hi = times
    for _ in range(n):
        k = rng.randrange(keys)
        row: dict[str, Any] = {}
        for field in schema:
            row[field.name] = _value(rng, field, k)
        if rng.random() < future:
            t = hi + rng.choice([0, 1, 2, 3, rng.randrange(1, 1000), rng.randrange(1, far)])
        else:
            t = rng.randrange(lo, hi)
        row["_time"] = t
        row["_diff"] = rng.choice([1, 1, 1, 2, -1, -1, 3, -2])
        rows.append(row)
    return rows


def _value(rng: random.Random, field: pa.Field, k: int) -> Any:
    """Column values of row ``k``: a key column follows ``k``; others vary a little and
    are null now and then (so equal rows repeat and nulls sort and group)."""
    t = field.type
    variant = rng.randrange(3)
    if field.name in ("id",):
        return k
    if field.name == "name":
        return f"n{k % 97:02d}-{'é' if k % 5 == 0 else ''}{k}"
    if field.nullable and field.name in ("note", "qty", "tag", "score") and rng.random() < 0.2:
        return None
    if t == pa.string():
        return f"v{k % 7}-{variant}"
    if t == pa.binary():
        return bytes([k % 256, variant])
    if pa.types.is_integer(t):
        return (k * 7 + variant) % 1000 - 500
    if pa.types.is_floating(t):
        return [0.5, -1.25, float(k % 11), float("nan")][variant if rng.random() < 0.9 else 3]
    raise TypeError(t)


def table_of(schema: pa.Schema, rows: list[dict[str, Any]]) -> pa.Table:
    full = schema.append(pa.field("_time", pa.uint64(), False)).append(
        pa.field("_diff", pa.int64(), False))
    return pa.Table.from_pylist(rows, schema=full)


def drive(w: Workload, rng: random.Random, *, steps: int, rows_per_step: int, keys: int,
          future: float, since_lag: int | None = 5, time_step: int = 10) -> None:
    """Append, seal and advance ``since`` for ``steps`` rounds; small segments rotate
    often, so this leaves several finished segments."""
    upper = w.rel.upper
    for _ in range(steps):
        nxt = upper + rng.randrange(1, time_step + 1)
        rows = random_rows(rng, w.meta.schema, rows_per_step, keys=keys, times=(upper, nxt),
                           future=future)
        w.rel.append(table_of(w.meta.schema, rows))
        if rng.random() < 0.3:  # a second, smaller append in the same interval
            w.rel.append(table_of(w.meta.schema, random_rows(
                rng, w.meta.schema, max(1, rows_per_step // 4), keys=keys,
                times=(upper, nxt), future=future)))
        w.rel.seal(nxt)
        upper = nxt
        if since_lag is not None and upper > since_lag and rng.random() < 0.5:
            w.rel.allow_compaction(max(w.rel.since, upper - since_lag))


def spans(trace: Trace, wal_dir: Path) -> list[SegmentSpan]:
    """Finished segments not yet converted by ``trace``, as the compacter describes them."""
    return list(segment_spans(wal_dir, trace.meta.name, after=trace.state.converted_through))


# --- comparing outputs ------------------------------------------------------------------------

def batch_table(trace: Trace, parts: list[PartFile]) -> pa.Table:
    """The batch's rows: its parts read (checksums checked) and concatenated in order."""
    schema = trace.meta.update_schema
    tables = [read_part(trace.store, p) for p in parts]
    return pa.concat_tables(tables) if tables else schema.empty_table()


def pending_tables(trace: Trace, pending: list[PendingPart]) -> dict[tuple[int, int], pa.Table]:
    out: dict[tuple[int, int], list[pa.Table]] = {}
    for p in pending:
        out.setdefault((p.lower, p.upper), []).append(read_part(trace.store, p.part))
    return {k: pa.concat_tables(v) for k, v in sorted(out.items())}


def assert_same_tables(got: pa.Table, want: pa.Table, what: str) -> None:
    assert got.schema.equals(want.schema), f"{what}: schema {got.schema} != {want.schema}"
    if got.equals(want):
        return
    g, w = got.to_pylist(), want.to_pylist()  # NaN != NaN in Table.equals: compare rows
    first = next((i for i, (a, b) in enumerate(zip(g, w, strict=False))
                  if not _same_row(a, b)), min(len(g), len(w)))
    if len(g) != len(w) or first < len(g):
        raise AssertionError(f"{what}: {len(g)} rows vs reference {len(w)}; first difference "
                             f"at row {first}: {g[first:first + 3]} vs {w[first:first + 3]}")


def _same_row(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x)
                          and math.isnan(y))
               for x, y in zip(a.values(), b.values(), strict=True))


def input_updates(trace: Trace, plan: ConversionPlan) -> int:
    """The updates a conversion reads, counted without the Spark jobs' code: every update
    of the plan's segments (the WAL reader's decoding) plus the rows of the pending parts
    it consumes (their descriptions). Call it before the segments are deleted."""
    n = sum(p.part.rows for p in plan.consume)
    for s in plan.segments:
        seg = SegmentFile(Path(s.path), s.seq, finished=True)
        n += sum(t.num_rows for t in segment_updates(seg, trace.meta.name,
                                                     trace.meta.update_schema))
    return n


def assert_same_conversion(spark_trace: Trace, got: ConversionResult, ref_trace: Trace,
                           want: tuple[list[PartFile], list[PendingPart]], *,
                           plan: ConversionPlan) -> None:
    """The Spark conversion wrote what the reference wrote, and counted every update it
    read (``plan``'s segments must still exist)."""
    assert_same_tables(batch_table(spark_trace, got.parts), batch_table(ref_trace, want[0]),
                       "batch")
    gp, wp = pending_tables(spark_trace, got.pending), pending_tables(ref_trace, want[1])
    assert list(gp) == list(wp), f"pending buckets {list(gp)} != reference {list(wp)}"
    assert len(got.pending) == len(gp), "more than one pending part for a bucket"
    for rng_, table in gp.items():
        assert_same_tables(table, wp[rng_], f"pending bucket {rng_}")
    for p in got.parts:
        assert p.rows > 0, f"empty part {p.path} written"
    expected = input_updates(spark_trace, plan)
    assert got.input_rows == expected, f"input rows {got.input_rows} != {expected} read"


# --- plans as JSON (for the cluster child process) ----------------------------------------------

def plan_to_json(plan: ConversionPlan) -> dict[str, Any]:
    return {
        "segments": [vars(s) for s in plan.segments], "lower": plan.lower,
        "upper": plan.upper, "since": plan.since,
        "consume": [p.to_dict() for p in plan.consume],
        "keep": [p.to_dict() for p in plan.keep], "batch_id": plan.batch_id,
    }


def plan_from_json(doc: dict[str, Any]) -> ConversionPlan:
    return ConversionPlan(
        segments=tuple(SegmentSpan(**s) for s in doc["segments"]), lower=doc["lower"],
        upper=doc["upper"], since=doc["since"],
        consume=tuple(PendingPart.from_dict(p) for p in doc["consume"]),
        keep=tuple(PendingPart.from_dict(p) for p in doc["keep"]), batch_id=doc["batch_id"])


def merge_plan_ok(plan: MergePlan | None) -> MergePlan:
    assert plan is not None, "expected two batches at one level"
    return plan
