"""Relation.subscribe (lamina.read.subscribe) against the oracle, with conversions, merges,
segment deletion and garbage collection running underneath."""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from lamina import CLOSED, Progress, Store
from lamina.errors import AsOfOutOfRangeError, InvalidArgumentError, SubscriptionBehindError
from lamina.trace.trace import Trace
from tests.read.data import random_rows
from tests.trace.helpers import KEY, NAME, SCHEMA, Oracle, collect_all, convert, merge_all

Acc = dict[tuple[int, str, int], int]


def accumulate(acc: Acc, table: pa.Table) -> None:
    for r in table.to_pylist():
        acc[(r["id"], r["item"], r["_time"])] += r["_diff"]


def state_at(acc: Acc, t: int) -> list[dict[str, Any]]:
    sums: dict[tuple[int, str], int] = defaultdict(int)
    for (k, item, time_), d in acc.items():
        if time_ <= t:
            sums[(k, item)] += d
    return [{"id": k, "item": i, "_diff": d} for (k, i), d in sorted(sums.items()) if d]


def check_consolidated(table: pa.Table, lower: int, upper: int) -> None:
    rows = table.to_pylist()
    keys = [(r["id"], r["item"], r["_time"]) for r in rows]
    assert keys == sorted(keys)
    assert len(set(keys)) == len(keys)
    assert all(r["_diff"] != 0 and lower <= r["_time"] < upper for r in rows)


class Compacter(threading.Thread):
    """The reference executor driven like the daemon: convert, delete segments, merge,
    collect garbage with no grace period, in a loop."""

    def __init__(self, store: Store, rel_meta: Any, wal_dir: Path) -> None:
        super().__init__(daemon=True)
        self.trace = Trace.open(store.layout.trace_store(NAME), rel_meta)
        self.wal_dir = wal_dir
        self.halt = threading.Event()
        self.steps = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.halt.is_set():
                if convert(self.trace, self.wal_dir, per_plan=2, merge=False):
                    self.trace.delete_converted_segments(self.wal_dir)
                    self.steps += 1
                self.steps += merge_all(self.trace)
                collect_all(self.trace)
                time.sleep(0.005)
        except BaseException as exc:  # surfaced by the test
            self.error = exc


def test_subscription_matches_the_oracle_while_compaction_runs(tmp_path: Path) -> None:
    rng = random.Random(5)
    with Store.open(tmp_path, segment_bytes=4096, fsync="never") as store:
        rel = store.create_relation(NAME, SCHEMA, KEY)
        oracle = Oracle()
        for _ in range(5):
            oracle.append(rel, random_rows(rng, oracle.upper, 8, 30))
            oracle.seal(rel, oracle.upper + 2)
        compacter = Compacter(store, rel.meta, rel.wal_dir)
        compacter.start()
        items: list[pa.Table | Progress] = []
        reader_rel = Store.open(tmp_path).relation(NAME)  # a reader of its own
        start = 3
        sub = reader_rel.subscribe(start, max_wait=0.02)

        def consume() -> None:
            items.extend(sub)

        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()
        for i in range(60):
            oracle.append(rel, random_rows(rng, oracle.upper, rng.randrange(1, 10), 30))
            oracle.seal(rel, oracle.upper + rng.randrange(1, 4))
            if i % 5 == 4:  # since lags the upper: the subscription stays ahead of it
                oracle.allow_compaction(rel, max(oracle.since, oracle.upper - 8))
            time.sleep(0.004)
        last = oracle.upper
        oracle.seal(rel, CLOSED)
        consumer.join(60)
        compacter.halt.set()
        compacter.join(30)
        assert not consumer.is_alive()
        assert compacter.error is None
        assert compacter.steps > 3  # compaction really ran underneath

    acc: Acc = defaultdict(int)
    progress = [start + 1]
    assert items[0] != Progress(start + 1) or oracle.snapshot(start) == []
    for item in items:
        if isinstance(item, Progress):
            assert item.upper > progress[-1] or item.upper == start + 1
            if item.upper != CLOSED and item.upper > start + 1:
                assert state_at(acc, item.upper - 1) == oracle.snapshot(item.upper - 1)
            progress.append(item.upper)
        else:
            if len(progress) > 1:
                check_consolidated(item, progress[-1], CLOSED)
            accumulate(acc, item)
    assert progress[-1] == CLOSED
    assert len(progress) > 5  # many intervals were delivered
    for t in range(oracle.since, last):
        assert state_at(acc, t) == oracle.snapshot(t), t


def test_resume_after_progress_gives_the_same_updates(tmp_path: Path) -> None:
    """Stopping after any Progress(u) and resuming with subscribe(u - 1, snapshot=False)
    delivers exactly what the first subscription delivered after u."""
    rng = random.Random(9)
    with Store.open(tmp_path, segment_bytes=4096, fsync="never") as store:
        rel = store.create_relation(NAME, SCHEMA, KEY)
        oracle = Oracle()
        for _ in range(12):
            oracle.append(rel, random_rows(rng, oracle.upper, 6, 20))
            oracle.seal(rel, oracle.upper + 3)
        rel.seal(CLOSED)
        full = list(rel.subscribe(0))
        for i, item in enumerate(full):
            if isinstance(item, Progress) and item.upper != CLOSED:
                rest = list(rel.subscribe(item.upper - 1, snapshot=False))
                assert [x if isinstance(x, Progress) else x.to_pylist() for x in rest[1:]] \
                    == [x if isinstance(x, Progress) else x.to_pylist() for x in full[i + 1:]]
                assert rest[0] == item


def test_falling_behind_since_is_an_error(tmp_path: Path) -> None:
    with Store.open(tmp_path, segment_bytes=4096, fsync="never") as store:
        rel = store.create_relation(NAME, SCHEMA, KEY)
        oracle = Oracle()
        for _ in range(6):
            oracle.append(rel, random_rows(random.Random(1), oracle.upper, 5, 10))
            oracle.seal(rel, oracle.upper + 2)
        trace = Trace.open(store.layout.trace_store(NAME), rel.meta)
        sub = rel.subscribe(2, snapshot=False, max_wait=0.01)
        assert next(sub) == Progress(3)
        # compaction forwards times below 8 into one merged batch straddling the frontier
        rel.allow_compaction(8)
        rel.seal(CLOSED)  # finishes the last segment: every frontier gets converted
        convert(trace, rel.wal_dir, per_plan=64)
        trace.delete_converted_segments(rel.wal_dir)
        merge_all(trace)
        [batch] = trace.state.batches
        assert batch.lower < 3 <= batch.since
        with pytest.raises(SubscriptionBehindError, match="fell behind since"):
            next(sub)
        with pytest.raises(AsOfOutOfRangeError):
            rel.subscribe(2)  # a snapshot below since
        with pytest.raises(InvalidArgumentError):
            rel.subscribe(CLOSED, snapshot=False)  # at the upper: nothing can follow
        # a subscription at or above since still reads exactly
        got = [x for x in rel.subscribe(8) if not isinstance(x, Progress)]
        assert state_at_rows(got, 8) == oracle.snapshot(8)


def state_at_rows(tables: list[pa.Table], t: int) -> list[dict[str, Any]]:
    acc: Acc = defaultdict(int)
    for table in tables:
        accumulate(acc, table)
    return state_at(acc, t)


def test_an_idle_subscription_waits_and_stops(tmp_path: Path) -> None:
    """No busy polling: an idle subscription stats the WAL a handful of times a second;
    stop ends it promptly."""
    with Store.open(tmp_path, fsync="never") as store:
        rel = store.create_relation(NAME, SCHEMA, KEY)
        rel.seal(1)
        stop = threading.Event()
        sub = rel.subscribe(0, stop=stop, max_wait=0.1)
        assert next(sub) == Progress(1)
        from lamina.read import subscribe as mod

        calls = 0
        real = mod._signature

        def counting(*a: Any) -> Any:
            nonlocal calls
            calls += 1
            return real(*a)

        mod._signature = counting  # type: ignore[assignment]
        try:
            t0 = time.monotonic()
            threading.Timer(1.0, stop.set).start()
            assert list(sub) == []
            elapsed = time.monotonic() - t0
        finally:
            mod._signature = real  # type: ignore[assignment]
        assert 1.0 <= elapsed < 3.0
        assert calls < 25, calls


def test_a_dropped_relation_ends_the_subscription_with_an_error(tmp_path: Path) -> None:
    from lamina.errors import RelationNotFoundError

    with Store.open(tmp_path, fsync="never") as store:
        rel = store.create_relation(NAME, SCHEMA, KEY)
        rel.seal(1)
        sub = Store.open(tmp_path).relation(NAME).subscribe(0, max_wait=0.01)
        assert next(sub) == Progress(1)
        store.drop_relation(NAME)
        with pytest.raises(RelationNotFoundError, match="dropped while subscribed"):
            next(sub)
