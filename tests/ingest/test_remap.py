"""Bindings: lamina times of a source, the remap relation, adoption after a kill, and
reclocking of transactions at their binding times (exactly once with an unsealed tail)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lamina import Store
from lamina.errors import SourceStalledError
from lamina.ingest.changes import gather
from lamina.ingest.reclock import Output, Reclocker, open_output
from lamina.ingest.remap import REMAP_SCHEMA, Remap, next_binding_time
from lamina.ingest.retention import Retention
from lamina.ingest.settings import OutputSettings
from lamina.ingest.source import TableSpec, Transaction

SCHEMA = pa.schema([pa.field("id", pa.int64(), False), pa.field("v", pa.string())])
SPEC = TableSpec("t", SCHEMA, ("id",))
KEEP = Retention(float("inf"))


def output(store: Store, *, retain: float = float("inf"), on_truncate: str = "retract",
           spec: TableSpec = SPEC) -> Output:
    how = OutputSettings("s.t", Retention(retain), on_truncate)  # type: ignore[arg-type]
    return open_output(store, "s", "t", how, spec)


def write(rc: Reclocker, time: int, txns: list[Transaction]) -> dict[str, int]:
    return rc.write(time, gather(txns))


@given(st.lists(st.integers(0, 10**13), min_size=1, max_size=30),
       st.integers(1, 5000), st.one_of(st.none(), st.integers(0, 10**13)))
def test_binding_times_round_up_and_strictly_increase(clock: list[int], interval: int,
                                                      start: int | None) -> None:
    """Whatever the clock does (steps backwards included), times are multiples of the
    interval, not below the clock, and strictly increasing across 'restarts'."""
    last = None if start is None else start - start % interval
    for now in clock:
        t = next_binding_time(now, interval, last)
        assert t % interval == 0
        assert t >= now
        if last is not None:
            assert t > last
        last = t


def test_remap_mints_retracts_and_adopts_an_unsealed_binding(tmp_path: Path) -> None:
    with Store.open(tmp_path / "d") as store:
        remap = Remap(store, "s.remap", decode=int, retention=KEEP)
        assert remap.load() == []
        remap.mint(1000, 10, "10", retire_below=None)
        remap.mint(2000, 20, "20", retire_below=None)
        remap.mint(3000, 20, "20", retire_below=2000)      # retires 1000
        assert [b.time for b in remap.load()] == [2000, 3000]
        # a kill between append and seal: the binding is appended, not sealed
        store.relation("s.remap").append(pa.table({
            "binding_time": pa.array([4000], pa.int64()), "upper": ["35"],
            "_time": pa.array([4000], pa.uint64()), "_diff": pa.array([1], pa.int64())}))
    with Store.open(tmp_path / "d") as store:
        remap = Remap(store, "s.remap", decode=int, retention=KEEP)
        got = remap.load()
        assert [(b.time, b.upper) for b in got] == [(2000, 20), (3000, 20), (4000, 35)]
        assert store.relation("s.remap").upper == 4001
        assert remap.last_time == 4000


def test_a_foreign_relation_under_the_remap_name_is_refused(tmp_path: Path) -> None:
    with Store.open(tmp_path / "d") as store:
        store.create_relation("s.remap", SCHEMA, ["id"])
        with pytest.raises(SourceStalledError, match="not a remap relation"):
            Remap(store, "s.remap", decode=int, retention=KEEP)
        assert store.relation("s.remap").schema != REMAP_SCHEMA


def changes(ids: list[int]) -> pa.Table:
    return pa.table({"id": pa.array(ids, pa.int64()), "v": [f"v{i}" for i in ids],
                     "_diff": pa.array([1] * len(ids), pa.int64())})


def test_reclocker_writes_each_binding_once_even_over_a_partial_unsealed_write(
        tmp_path: Path) -> None:
    with Store.open(tmp_path / "d") as store:
        out = output(store)
        rc = Reclocker({"t": out}, "s")
        write(rc, 100, [Transaction(1, {"t": changes([1, 2])})])
        assert out.upper == 101
        # killed after appending part of time 200 (say a first slice), before the seal
        store.relation("s.t").append(changes([3]).append_column(
            "_time", pa.array([200], pa.uint64())))
    with Store.open(tmp_path / "d") as store:
        out = output(store)
        assert out.upper == 101
        assert list(out.unsealed) == [200]
        rc = Reclocker({"t": out}, "s")
        # the replay writes time 100 again: skipped, the output is past it
        assert write(rc, 100, [Transaction(1, {"t": changes([1, 2])})]) == {}
        write(rc, 200, [Transaction(5, {"t": changes([3, 4])}),
                        Transaction(6, {"t": changes([5])})])
        rel = store.relation("s.t")
        assert rel.upper == 201
        snap = rel.snapshot(200).to_pylist()
        assert [(r["id"], r["_diff"]) for r in snap] == [(i, 1) for i in range(1, 6)]
        assert [r["id"] for r in rel.snapshot(100).to_pylist()] == [1, 2]


def test_an_output_whose_columns_changed_is_stalled_not_rewritten(tmp_path: Path) -> None:
    with Store.open(tmp_path / "d") as store:
        store.create_relation("s.t", pa.schema([("id", pa.int64())]), ["id"])
        out = output(store)
        assert out.stalled is not None
        assert "lamina ingest resync --config FILE s t" in out.stalled[1]
        write(Reclocker({"t": out}, "s"), 100, [Transaction(1, {"t": changes([1])})])
        assert store.relation("s.t").upper == 0


def snap(store: Store, at: int) -> list[tuple[int, int]]:
    return [(r["id"], r["_diff"]) for r in store.relation("s.t").snapshot(at).to_pylist()]


def test_truncate_retracts_what_the_output_holds_exactly_once(tmp_path: Path) -> None:
    with Store.open(tmp_path / "d") as store:
        rc = Reclocker({"t": output(store)}, "s")
        write(rc, 100, [Transaction(1, {"t": changes([1, 2, 3])})])
        # one binding: an insert, a transaction truncating then inserting, another insert
        write(rc, 200, [Transaction(2, {"t": changes([4])}),
                        Transaction(3, {"t": changes([5])}, truncated=frozenset({"t"})),
                        Transaction(4, {"t": changes([6])})])
        assert snap(store, 100) == [(1, 1), (2, 1), (3, 1)]
        assert snap(store, 200) == [(5, 1), (6, 1)]
        # killed while writing a later truncate: part of the retraction appended only
        retract = changes([5]).set_column(2, "_diff", pa.array([-1], pa.int64()))
        store.relation("s.t").append(retract.append_column("_time", pa.array([300],
                                                                              pa.uint64())))
    with Store.open(tmp_path / "d") as store:
        rc = Reclocker({"t": output(store)}, "s")
        write(rc, 300, [Transaction(5, {"t": changes([7])}, truncated=frozenset({"t"}))])
        assert snap(store, 300) == [(7, 1)]
        assert snap(store, 200) == [(5, 1), (6, 1)]


def test_truncate_under_stall_stops_the_output_before_the_binding(tmp_path: Path) -> None:
    with Store.open(tmp_path / "d") as store:
        out = output(store, on_truncate="stall")
        rc = Reclocker({"t": out}, "s")
        write(rc, 100, [Transaction(1, {"t": changes([1])})])
        write(rc, 200, [Transaction(2, {"t": changes([2])}),
                        Transaction(3, {}, truncated=frozenset({"t"}))])
        assert out.stalled is not None
        assert "TRUNCATE" in out.stalled[0]
        assert "lamina ingest resync --config FILE s t" in out.stalled[1]
        assert store.relation("s.t").upper == 101        # nothing of time 200
        assert snap(store, 100) == [(1, 1)]


def test_since_follows_the_bindings_by_the_retention(tmp_path: Path) -> None:
    with Store.open(tmp_path / "d") as store:
        out = output(store, retain=1.0)                  # a 1 s window, 100 ms steps
        rc = Reclocker({"t": out}, "s")
        remap = Remap(store, "s.remap", decode=int, retention=Retention(0))
        for i, t in enumerate(range(1000, 20001, 250)):
            remap.mint(t, i, str(i), retire_below=None)
            write(rc, t, [Transaction(i, {"t": changes([i])})])
            rel = store.relation("s.t")
            assert t - 1000 - 100 < rel.since <= max(0, t - 1000) or t < 1100
            assert store.relation("s.remap").since == t    # 0: only the newest read
        assert snap(store, 19000)[-1] == (72, 1)           # within the window: readable
        kept = output(store, retain=float("inf"))
        assert kept.retention.since_at(10**9, 0) is None   # inf: since never moves
