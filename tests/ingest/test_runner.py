"""The source runner with a scripted source of two tables (a real Source implementation,
integer offsets): a stall of one table leaves the other running, transient errors are
retried, offsets are committed only once every output holds them, and a second runner on
the same store resumes exactly where the outputs are."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa

from lamina import Store
from lamina.errors import SourceTransientError
from lamina.ingest.runner import SourceRunner
from lamina.ingest.settings import PostgresSourceSettings
from lamina.ingest.source import Event, Offset, Stall, TableSpec, Transaction, Upper
from tests.ingest import running

SCHEMA = pa.schema([pa.field("id", pa.int64(), False)])


class ScriptSource:
    """Offsets are ints; transaction i (i = 0, 1, ...) inserts id i into table "public.a"
    (even i) or "public.b" (odd i). ``stall_b_at``: a Stall for b once offset reaches it
    (``positional``: a Stall about that offset, as PostgreSQL reports stream problems)."""

    replays_from_start = False

    def __init__(self, total: int, *, fail_opens: int = 0, stall_b_at: int | None = None,
                 positional: bool = False) -> None:
        self.name = "pg"
        self.total = total
        self.fail_opens = fail_opens
        self.stall_b_at = stall_b_at
        self.positional = positional
        self.pos = 0
        self.opened: list[Offset | None] = []
        self.commits: list[int] = []
        self.stalled = False

    def open(self, resume: Offset | None) -> dict[str, TableSpec]:
        self.opened.append(resume)
        if self.fail_opens:
            self.fail_opens -= 1
            raise SourceTransientError("connection refused")
        self.pos = 0 if resume is None else int(resume)
        self.stalled = False
        return {t: TableSpec(t, SCHEMA, ("id",)) for t in ("public.a", "public.b")}

    def poll(self, timeout: float) -> list[Event]:
        time.sleep(min(timeout, 0.005))
        out: list[Event] = []
        for _ in range(3):
            if self.pos >= self.total:
                break
            i = self.pos
            if self.stall_b_at is not None and i >= self.stall_b_at and not self.stalled:
                self.stalled = True
                out.append(Stall("public.b", "TRUNCATE of public.b", "re-create the output",
                                 offset=self.stall_b_at if self.positional else None))
            table = "public.a" if i % 2 == 0 else "public.b"
            out.append(Transaction(i, {table: pa.table({
                "id": pa.array([i], pa.int64()), "_diff": pa.array([1], pa.int64())})}))
            self.pos += 1
        out.append(Upper(self.pos))
        return out

    def commit(self, offset: Offset) -> None:
        self.commits.append(int(offset))

    def set_barriers(self, offsets: list[Offset]) -> None:
        pass

    def lag_offsets(self) -> int | None:
        return self.total - self.pos

    def clock(self) -> float:
        return time.time()

    def encode_offset(self, offset: Offset) -> str:
        return str(int(offset))

    def decode_offset(self, text: str) -> Offset:
        return int(text)

    def close(self) -> None:
        pass


SETTINGS = PostgresSourceSettings.model_validate({
    "name": "pg", "kind": "postgres", "dsn": "host=/nowhere",
    "tables": ["public.a", "public.b"], "timestamp_interval_seconds": 0.01})


def run_until(store: Store, source: ScriptSource,
              cond: Callable[[SourceRunner], bool]) -> tuple[SourceRunner, dict[str, Any]]:
    return running.run_until(store, SETTINGS, source, cond, retry_max_seconds=0.05)


def ids(store: Store, rel: str) -> list[Any]:
    r = store.relation(rel)
    return [(x["id"], x["_diff"]) for x in r.snapshot(r.upper - 1).to_pylist()]


def outputs(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The outputs of a runner's status, by relation."""
    return {o["relation"]: o for o in status["outputs"]}


def test_retries_then_writes_each_table_and_commits_what_all_outputs_hold(
        tmp_path: Path) -> None:
    with Store.open(tmp_path / "d") as store:
        src = ScriptSource(40, fail_opens=2)
        r, _ = run_until(store, src, lambda r: r.binding is not None and r.binding.upper == 40
                         and r.committed == 40)
        assert src.opened == [None, None, None]            # two retried opens
        assert r.metrics.retries.labels(source="pg")._value.get() == 2
        assert ids(store, "pg.a") == [(i, 1) for i in range(0, 40, 2)]
        assert ids(store, "pg.b") == [(i, 1) for i in range(1, 40, 2)]
        assert store.relation("pg.a").upper == store.relation("pg.b").upper
        assert src.commits == sorted(src.commits)
        assert src.commits[-1] == 40
        assert r.status()["state"] == "ceased"


def test_a_stalled_table_stops_only_its_output_and_holds_back_the_commit(
        tmp_path: Path) -> None:
    with Store.open(tmp_path / "d") as store:
        src = ScriptSource(60, stall_b_at=21)
        _, status = run_until(store, src,
                              lambda r: r.binding is not None and r.binding.upper == 60)
        outs = outputs(status)
        assert outs["pg.b"]["state"] == "stalled"
        assert "TRUNCATE" in outs["pg.b"]["error"]
        assert outs["pg.a"]["state"] == "running"
        assert ids(store, "pg.a") == [(i, 1) for i in range(0, 60, 2)]   # a went on
        b = [i for i, _ in ids(store, "pg.b")]
        assert b == list(range(1, b[-1] + 1, 2))
        assert b[-1] < 21
        assert max(src.commits) <= 21       # upstream keeps what b still needs
        a_upper = store.relation("pg.a").upper
        assert store.relation("pg.b").upper < a_upper
        # restart without the stall: b resumes at its own upper, a takes nothing twice
        src2 = ScriptSource(60)
        r2, _ = run_until(store, src2, lambda r: r.binding is not None
                          and r.binding.upper == 60 and r.committed == 60)
        assert src2.opened[0] is not None
        assert src2.opened[0] <= 21
        assert ids(store, "pg.a") == [(i, 1) for i in range(0, 60, 2)]
        assert ids(store, "pg.b") == [(i, 1) for i in range(1, 60, 2)]
        assert r2.status()["resume_frontier"] == store.relation("pg.a").upper


def test_a_positional_stall_takes_the_bindings_below_it_and_a_passed_one_is_ignored(
        tmp_path: Path) -> None:
    with Store.open(tmp_path / "d") as store:
        src = ScriptSource(60, stall_b_at=31, positional=True)
        _, status = run_until(store, src, lambda r: r.binding is not None
                              and r.binding.upper == 60)
        assert outputs(status)["pg.b"]["state"] == "stalled"
        b = [i for i, _ in ids(store, "pg.b")]
        assert b == list(range(1, b[-1] + 1, 2))       # every change up to the stall
        assert b[-1] < 31
        remap = store.relation("pg.remap")             # b is sealed past no binding above it
        bindings = {r["binding_time"]: int(r["upper"]) for r in
                    remap.snapshot(remap.upper - 1).to_pylist()}
        assert all(f <= 31 for t, f in bindings.items() if t < store.relation("pg.b").upper)
        # a replay meeting a stall at a position the output is past (after a resync, say)
        # ignores it
        store.relation("pg.b").seal(store.relation("pg.a").upper)  # as a resync would
        src2 = ScriptSource(80, stall_b_at=1, positional=True)
        _, status2 = run_until(store, src2, lambda r: r.binding is not None
                               and r.binding.upper == 80 and r.committed == 80)
        assert outputs(status2)["pg.b"]["state"] == "running"
        assert [i for i, _ in ids(store, "pg.b")][-1] == 79


def test_outputs_without_bindings_stall_instead_of_counting_twice(tmp_path: Path) -> None:
    with Store.open(tmp_path / "d") as store:
        run_until(store, ScriptSource(10), lambda r: r.binding is not None
                  and r.binding.upper == 10)
        store.drop_relation("pg.remap")
        src = ScriptSource(10)
        r, _ = run_until(store, src, lambda r: r.health.state == "stalled")
        assert "no bindings" in str(r.health.error)
        assert "pg.remap" in str(r.health.hint)
        assert src.opened == []                 # never re-read into full outputs
        assert ids(store, "pg.a") == [(i, 1) for i in range(0, 10, 2)]
