"""``as_of`` at the API level (lamina.read.view.resolve_as_of, issue 21 point 13): omitted it
is the latest readable time in every read; nothing readable yet is a clear error; a
relation records its time unit, and one counting epoch milliseconds takes timezone-aware
datetimes wherever it takes a time; and ``Relation.updates(lower, upper)``."""

from __future__ import annotations

import random
from collections import defaultdict
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pytest

from lamina import CLOSED, Progress, Store
from lamina.errors import AsOfOutOfRangeError, InvalidArgumentError
from lamina.read.unsealed import updates
from lamina.trace.trace import Trace
from tests.read.data import relation
from tests.trace.helpers import KEY, NAME, SCHEMA, Oracle, convert, table_of


def test_as_of_omitted_is_the_latest_readable_time(tmp_path: Path) -> None:
    """Batches, pending parts and a WAL tail: every read without ``as_of`` equals the same
    read at ``upper - 1``."""
    with relation(tmp_path, 31) as (rel, oracle):
        last = oracle.upper - 1
        want = rel.snapshot(last)
        assert want.to_pylist() == oracle.snapshot(last)
        assert rel.snapshot().equals(want)
        assert rel.snapshot_reader().read_all().to_pylist() == want.to_pylist()
        keys = {"id": [r["id"] for r in want.to_pylist()[::2]]}
        assert rel.lookup(keys).equals(rel.lookup(keys, last))
        items = rel.subscribe(stop=_stopped())
        first = list(items)
        assert first[-1] == Progress(oracle.upper)
        got = pa.concat_tables([t for t in first if isinstance(t, pa.Table)])
        assert got.drop_columns(["_time"]).to_pylist() == want.to_pylist()
        assert set(got.column("_time").to_pylist()) == {last}
        resumed = list(rel.subscribe(snapshot=False, stop=_stopped()))
        assert resumed == [Progress(oracle.upper)]  # from now on: nothing sealed yet


def _stopped() -> object:
    import threading

    stop = threading.Event()
    stop.set()  # end at the first wait
    return stop


def test_nothing_readable_yet_is_a_clear_error(tmp_path: Path) -> None:
    """Nothing sealed (upper 0), and since caught up with the upper: every read without
    ``as_of`` says why nothing is readable, and changes nothing."""
    with Store.open(tmp_path, fsync="never") as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        rel.append(table_of([(1, "a", 0, 1)]))
        reads = [rel.snapshot, rel.snapshot_reader, lambda: rel.lookup({"id": [1]}),
                 rel.subscribe]
        for read in reads:
            with pytest.raises(AsOfOutOfRangeError, match=r"nothing readable yet.*seal a time"):
                read()
        rel.seal(3)
        rel.allow_compaction(3)
        for read in reads:
            with pytest.raises(AsOfOutOfRangeError, match="compacted away: seal further"):
                read()
        rel.seal(4)
        assert rel.snapshot().to_pylist() == [{"id": 1, "item": "a", "_diff": 1}]


MS = pa.schema([("id", pa.int64()), ("item", pa.string())])
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def _ms(dt: datetime) -> int:
    return (dt - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)


def test_a_relation_in_milliseconds_takes_datetimes(tmp_path: Path) -> None:
    """``time_unit="ms"`` is recorded (a new handle reads it back); every time argument
    then takes a timezone-aware datetime: a time (``as_of``) is the millisecond the instant
    falls in, a frontier (``seal``, ``allow_compaction``, the bounds of ``updates``) the
    first millisecond not before it; any timezone names the same instant."""
    t0 = _ms(T0)
    with Store.open(tmp_path, fsync="never") as store:
        rel = store.create_relation("clicks", MS, key=["id"], time_unit="ms")
        rel.append(table_of([(1, "a", t0, 1), (2, "b", t0 + 1, 1), (1, "a", t0 + 5, -1)]))
        rel.seal(T0 + timedelta(microseconds=5500))  # rounds up: no update before t0 + 6
        assert rel.upper == t0 + 6
    with Store.open(tmp_path) as store:
        rel = store.relation("clicks")
        assert rel.meta.time_unit == "ms"
        half = T0 + timedelta(microseconds=1500)  # inside millisecond t0 + 1
        assert rel.snapshot(half).equals(rel.snapshot(t0 + 1))
        assert [r["id"] for r in rel.snapshot(half).to_pylist()] == [1, 2]
        tokyo = T0.astimezone(timezone(timedelta(hours=9)))
        assert rel.snapshot(tokyo).equals(rel.snapshot(t0))
        assert rel.lookup({"id": [2]}, half).to_pylist() == [{"id": 2, "item": "b", "_diff": 1}]
        assert rel.snapshot_reader(half).read_all().equals(rel.snapshot(half))
        got = rel.updates(T0 + timedelta(microseconds=1), T0 + timedelta(milliseconds=5))
        assert got.to_pylist() == [{"id": 2, "item": "b", "_time": t0 + 1, "_diff": 1}]
        rel.allow_compaction(T0)
        assert rel.since == t0
        with pytest.raises(InvalidArgumentError, match="naive datetime"):
            rel.snapshot(datetime(2026, 3, 1, 12, 0))
        with pytest.raises(InvalidArgumentError, match="naive datetime"):
            rel.seal(datetime(2026, 3, 2))
        with pytest.raises(InvalidArgumentError, match="before the Unix epoch"):
            rel.snapshot(datetime(1969, 12, 31, tzinfo=UTC))
        with pytest.raises(AsOfOutOfRangeError, match="outside"):
            rel.snapshot(T0 + timedelta(seconds=1))
        with pytest.raises(InvalidArgumentError, match="int or a timezone-aware datetime"):
            rel.snapshot("2026-03-01")
        assert rel.upper == t0 + 6  # nothing the refused calls did changed the relation


def test_a_relation_without_a_unit_refuses_datetimes(tmp_path: Path) -> None:
    with Store.open(tmp_path, fsync="never") as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        rel.append(table_of([(1, "a", 0, 1)]))
        rel.seal(1)
        assert rel.meta.time_unit is None
        for call in (lambda: rel.snapshot(T0), lambda: rel.seal(T0),
                     lambda: rel.updates(0, T0)):
            with pytest.raises(InvalidArgumentError, match="no unit"):
                call()
        with pytest.raises(InvalidArgumentError, match="time_unit"):
            store.create_relation("other", SCHEMA, time_unit="seconds")
        assert store.relations() == [NAME]
        assert rel.upper == 1


def test_updates_in_an_interval_sealed_or_not(tmp_path: Path) -> None:
    """``updates(lower, upper)``: the oracle's updates in ``[lower, upper)``, consolidated,
    by key and time, from batches, pending parts and the WAL tail; beyond the sealed upper
    it also returns what was appended but not sealed; ``lower`` must be 0 or at least
    since; the default is everything sealed."""
    with relation(tmp_path, 33) as (rel, oracle):
        sums: dict[tuple[int, str, int], int] = defaultdict(int)
        for k, item, t, d in oracle.updates:
            sums[(k, item, max(t, oracle.since))] += d

        def want(lo: int, hi: int) -> list[tuple[int, str, int, int]]:
            return [(k, item, t, d) for (k, item, t), d in sorted(sums.items())
                    if lo <= t < hi and d]

        def got(lo: int, hi: int) -> list[tuple[int, str, int, int]]:
            t = rel.updates(lo, hi)
            return [(r["id"], r["item"], r["_time"], r["_diff"]) for r in t.to_pylist()]

        rng = random.Random(5)
        points = sorted({0, oracle.since, oracle.upper, oracle.upper + 300,
                         *(rng.randrange(oracle.since, oracle.upper) for _ in range(6))})
        assert oracle.since > 0
        for lo in points:
            for hi in points:
                if lo == hi or (hi > oracle.since and (lo == 0 or lo >= oracle.since)
                                and lo < hi):
                    assert got(lo, hi) == want(lo, hi), (lo, hi)
        assert got(oracle.upper, CLOSED) == want(oracle.upper, CLOSED)
        assert want(oracle.upper, CLOSED), "the relation has updates above its upper"
        assert rel.updates().equals(rel.updates(0, oracle.upper))
        for lo, hi in ((oracle.since - 1, oracle.upper), (0, oracle.since)):
            with pytest.raises(AsOfOutOfRangeError, match="not readable at since"):
                rel.updates(lo, hi)
        with pytest.raises(InvalidArgumentError, match="below lower"):
            rel.updates(5, 4)


def test_updates_of_a_trace_compacted_across_lower_are_refused(tmp_path: Path) -> None:
    """A batch whose since moved past ``lower`` after the frontiers were read (its times
    before since can no longer be told apart) is refused, not read at a wrong time."""
    with Store.open(tmp_path, fsync="never", segment_bytes=4096) as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        oracle = Oracle()
        trace = Trace.open(store.layout.trace_store(NAME), rel.meta)
        for t in range(6):
            oracle.append(rel, [(t, "x", t, 1)])
            oracle.seal(rel, t + 1)
            if t == 2:
                rel.close()
                convert(trace, rel.wal_dir, per_plan=64)
        oracle.allow_compaction(rel, 4)
        rel.close()
        convert(trace, rel.wal_dir, per_plan=64)  # the merge forwards to since 4
        assert [(b.lower, b.since) for b in trace.state.batches] == [(0, 4)]
        with pytest.raises(AsOfOutOfRangeError, match="not readable at since 4"):
            rel.updates(2, 6)
        # frontiers read before the compaction (a race): the batch itself says so
        with pytest.raises(AsOfOutOfRangeError, match="forwarded times before 4"):
            updates(rel.files, 2, 6, since=0)
        assert [r["_time"] for r in rel.updates(4, 6).to_pylist()] == [4, 4, 4, 4, 4, 5]
        assert rel.updates(0, 6).equals(rel.updates(4, 6))  # from since: everything
        assert [r["id"] for r in rel.updates(5, 6).to_pylist()] == [5]
