"""lamina.store: the public write API of the README (Store, Relation), its read-back through
snapshots, and its refusals: every bad call raises a typed LaminaError and leaves every
byte of the data directory as it was.

A stateful hypothesis test drives a Store against a plain-Python model (appends, seals,
compaction frontiers, snapshots, reopen) with small segments, so rotation and future
updates are exercised on the way.
"""

from __future__ import annotations

import datetime
import decimal
import errno
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import duckdb
import pandas as pd
import polars as pl
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from lamina import CLOSED, LaminaError, Store
from lamina.errors import (
    AsOfOutOfRangeError,
    ConfigError,
    DiffOverflowError,
    FrontierRegressionError,
    InvalidArgumentError,
    InvalidNameError,
    LockedError,
    RelationExistsError,
    RelationNotFoundError,
    SchemaError,
    StorageError,
    UpdateBeforeUpperError,
    WriterFailedError,
)
from lamina.fs import FileSystem
from lamina.wal.segment import list_segments
from tests.conftest import ORDERS, tree_digest, updates

NAME = "orders"


@pytest.fixture
def store(data_dir: Path) -> Iterator[Store]:
    """A store holding ORDERS with a few updates, sealed at 5, since 2; the writer is open."""
    s = Store.open(data_dir)
    rel = s.create_relation(NAME, ORDERS, key=["id"])
    rel.append(updates([(1, "a", 1, 1), (2, "b", 3, 1), (3, "c", 9, 1)]))
    rel.seal(5)
    rel.allow_compaction(2)
    yield s
    s.close()


def as_rows(table: pa.Table) -> list[tuple[object, ...]]:
    return list(zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True))


# --- the API ------------------------------------------------------------------------------

def test_create_append_snapshot(data_dir: Path) -> None:
    """Updates consolidate per row and time; a snapshot at as_of sums the diffs of updates
    at times <= as_of, drops zero sums and orders by key; rows insert and retract."""
    with Store.open(data_dir) as s:
        rel = s.create_relation(NAME, ORDERS, key=["id"])
        assert s.relations() == [NAME]
        assert s.relation(NAME) is rel
        assert (rel.name, rel.key, rel.schema) == (NAME, ("id",), ORDERS)
        rel.append(updates([(3, "c", 0, 1), (1, "a", 0, 2), (2, "b", 1, 1)]))
        rel.append(pa.RecordBatch.from_pylist(
            [{"id": 1, "item": "a", "_time": 2, "_diff": -2},
             {"id": 2, "item": "b", "_time": 2, "_diff": 4}],
            schema=pa.schema([("id", pa.int64()), ("item", pa.string()),
                              ("_time", pa.uint64()), ("_diff", pa.int64())])))
        rel.seal(3)
        assert (rel.upper, rel.since) == (3, 0)
        snap = rel.snapshot(0)
        assert snap.column_names == ["id", "item", "_diff"]
        assert as_rows(snap) == [(1, "a", 2), (3, "c", 1)]
        assert as_rows(rel.snapshot(1)) == [(1, "a", 2), (2, "b", 1), (3, "c", 1)]
        assert as_rows(rel.snapshot(2)) == [(2, "b", 5), (3, "c", 1)]


def test_reopen_resumes(data_dir: Path) -> None:
    """A reopened store reads everything back, including frontiers, and takes further
    appends; handles of another Store object read the same frontiers without writing."""
    with Store.open(data_dir) as s:
        rel = s.create_relation(NAME, ORDERS, key=["id"])
        rel.append(updates([(1, "a", 0, 1)]))
        rel.seal(4)
        rel.allow_compaction(1)
    with Store.open(data_dir) as s:
        rel = s.relation(NAME)
        assert (rel.upper, rel.since) == (4, 1)
        rel.append(updates([(2, "b", 4, 1)]))
        rel.seal(6)
        assert as_rows(rel.snapshot(5)) == [(1, "a", 1), (2, "b", 1)]
    with Store.open(data_dir) as s:
        assert (s.relation(NAME).upper, s.relation(NAME).since) == (6, 1)


def test_future_updates_are_kept_and_not_applied_early(data_dir: Path) -> None:
    """Updates at times beyond the upper are legal: through seals and segment rotations
    they are invisible at earlier as_of and counted once they are sealed past."""
    with Store.open(data_dir, segment_bytes=4096) as s:
        rel = s.create_relation(NAME, ORDERS, key=["id"])
        rel.append(updates([(1, "future", 100, 1)]))
        for t in range(20):
            rel.append(updates([(1000 + i, "x" * 30, t, 1) for i in range(20)]))
            rel.seal(t + 1)
        assert len(list_segments(data_dir / "wal" / NAME)) > 2
        assert (1, "future", 1) not in as_rows(rel.snapshot(19))
        rel.seal(101)
        rows = as_rows(rel.snapshot(100))
        assert (1, "future", 1) in rows
        assert len(rows) == 21


def test_since_forwards_history(data_dir: Path) -> None:
    """After allow_compaction(s), reads at as_of >= s are unchanged, reads below s are
    refused with AsOfOutOfRangeError."""
    with Store.open(data_dir) as s:
        rel = s.create_relation(NAME, ORDERS, key=["id"])
        rel.append(updates([(1, "a", 0, 1), (1, "a", 2, -1), (2, "b", 3, 1)]))
        rel.seal(5)
        before = rel.snapshot(3)
        rel.allow_compaction(3)
        assert rel.snapshot(3).equals(before)
        with pytest.raises(AsOfOutOfRangeError, match="compacted away"):
            rel.snapshot(2)


def test_drop_and_recreate(data_dir: Path) -> None:
    """A dropped relation disappears with its data; the name can be created again at once
    as a new, empty incarnation with a new relation id."""
    with Store.open(data_dir) as s:
        rel = s.create_relation(NAME, ORDERS, key=["id"])
        rel.append(updates([(1, "a", 0, 1)]))
        rel.seal(1)
        old_id = rel.meta.relation_id
        s.drop_relation(NAME)
        assert s.relations() == []
        with pytest.raises(RelationNotFoundError):
            s.relation(NAME)
        with pytest.raises(RelationNotFoundError, match="dropped"):
            rel.append(updates([(2, "b", 1, 1)]))
        again = s.create_relation(NAME, ORDERS, key=["id"])
        assert again.meta.relation_id != old_id
        assert (again.upper, again.since) == (0, 0)
        again.seal(1)
        assert again.snapshot(0).num_rows == 0


# --- refusals leave the disk unchanged ----------------------------------------------------

Call = Callable[[Store], object]

BAD_CALLS: list[tuple[str, Call, type[LaminaError]]] = [
    ("update below upper", lambda s: s.relation(NAME).append(updates([(9, "z", 4, 1)])),
     UpdateBeforeUpperError),
    ("update mixed with one below upper",
     lambda s: s.relation(NAME).append(updates([(9, "z", 7, 1), (8, "y", 0, 1)])),
     UpdateBeforeUpperError),
    ("seal backwards", lambda s: s.relation(NAME).seal(4), FrontierRegressionError),
    ("since backwards", lambda s: s.relation(NAME).allow_compaction(1),
     FrontierRegressionError),
    ("since beyond upper", lambda s: s.relation(NAME).allow_compaction(6),
     FrontierRegressionError),
    ("seal not an int", lambda s: s.relation(NAME).seal("6"), InvalidArgumentError),  # type: ignore[arg-type]
    ("seal beyond CLOSED", lambda s: s.relation(NAME).seal(CLOSED + 1), InvalidArgumentError),
    ("missing column",
     lambda s: s.relation(NAME).append(updates([(9, "z", 7, 1)]).drop_columns(["item"])),
     SchemaError),
    ("extra column", lambda s: s.relation(NAME).append(
        updates([(9, "z", 7, 1)]).append_column("extra", pa.array([1]))), SchemaError),
    ("wrongly typed column", lambda s: s.relation(NAME).append(
        updates([(9, "z", 7, 1)]).set_column(1, "item", pa.array([1.5]))), SchemaError),
    ("negative time", lambda s: s.relation(NAME).append(
        updates([(9, "z", 7, 1)]).set_column(2, "_time", pa.array([-7]))), SchemaError),
    ("not a table", lambda s: s.relation(NAME).append([{"id": 1}]), SchemaError),
    ("reserved column name",
     lambda s: s.create_relation("r2", pa.schema([("_time", pa.int64())])), SchemaError),
    ("reserved diff name",
     lambda s: s.create_relation("r2", pa.schema([("a", pa.int8()), ("_diff", pa.int64())])),
     SchemaError),
    ("unsupported type",
     lambda s: s.create_relation("r2", pa.schema([("a", pa.uint64())])), SchemaError),
    ("unsupported nested type",
     lambda s: s.create_relation("r2", pa.schema([("a", pa.list_(pa.int64()))])), SchemaError),
    ("bad key", lambda s: s.create_relation("r2", ORDERS, key=["nope"]), SchemaError),
    ("empty name", lambda s: s.create_relation("", ORDERS), InvalidNameError),
    ("65-char name", lambda s: s.create_relation("a" * 65, ORDERS), InvalidNameError),
    ("uppercase name", lambda s: s.create_relation("Orders", ORDERS), InvalidNameError),
    ("parent path name", lambda s: s.create_relation("../x", ORDERS), InvalidNameError),
    ("nested path name", lambda s: s.create_relation("a/b", ORDERS), InvalidNameError),
    ("path name lookup", lambda s: s.relation("../orders"), InvalidNameError),
    ("path name drop", lambda s: s.drop_relation("a/b"), InvalidNameError),
    ("unknown relation", lambda s: s.relation("nope"), RelationNotFoundError),
    ("drop unknown relation", lambda s: s.drop_relation("nope"), RelationNotFoundError),
    ("create existing", lambda s: s.create_relation(NAME, ORDERS), RelationExistsError),
    ("as_of at upper", lambda s: s.relation(NAME).snapshot(5), AsOfOutOfRangeError),
    ("as_of below since", lambda s: s.relation(NAME).snapshot(1), AsOfOutOfRangeError),
    ("as_of far beyond", lambda s: s.relation(NAME).snapshot(CLOSED), AsOfOutOfRangeError),
    ("as_of not an int", lambda s: s.relation(NAME).snapshot(3.0), InvalidArgumentError),  # type: ignore[arg-type]
    ("second writer in process", lambda s: Store.open(s.layout.root).relation(NAME).append(
        updates([(9, "z", 7, 1)])), LockedError),
    ("second writer seals", lambda s: Store.open(s.layout.root).relation(NAME).seal(9),
     LockedError),
    ("read-only append", lambda s: Store.open(s.layout.root, read_only=True).relation(
        NAME).append(updates([(9, "z", 7, 1)])), InvalidArgumentError),
    ("read-only seal", lambda s: Store.open(s.layout.root, read_only=True).relation(
        NAME).seal(9), InvalidArgumentError),
    ("read-only compaction", lambda s: Store.open(s.layout.root, read_only=True).relation(
        NAME).allow_compaction(4), InvalidArgumentError),
    ("read-only create", lambda s: Store.open(s.layout.root, read_only=True)
     .create_relation("r2", ORDERS), InvalidArgumentError),
    ("read-only drop", lambda s: Store.open(s.layout.root, read_only=True).drop_relation(NAME),
     InvalidArgumentError),
    ("read-only trace_url", lambda s: Store.open(s.layout.root, read_only=True,
                                                 trace_url="s3://b/p"), InvalidArgumentError),
    ("polars frame without _diff", lambda s: s.relation(NAME).append(pl.DataFrame(
        {"id": [9], "item": ["z"], "_time": pl.Series([7], dtype=pl.UInt64)})), SchemaError),
    ("pandas frame with float ids", lambda s: s.relation(NAME).append(pd.DataFrame(
        {"id": [9.5], "item": ["z"], "_time": [7], "_diff": [1]})), SchemaError),
    ("pandas frame of mixed objects", lambda s: s.relation(NAME).append(pd.DataFrame(
        {"id": [9, "nine"], "item": ["z", "y"], "_time": [7, 7], "_diff": [1, 1]})),
     SchemaError),
    ("duckdb result with a text time", lambda s: s.relation(NAME).append(duckdb.sql(
        "select 9::BIGINT as id, 'z' as item, 'soon' as _time, 1::BIGINT as _diff")),
     SchemaError),
    ("polars series", lambda s: s.relation(NAME).append(pl.Series([1, 2])), SchemaError),
    ("bad fsync policy", lambda s: Store.open(s.layout.root, fsync="later"),  # type: ignore[arg-type]
     InvalidArgumentError),
    ("tiny segments", lambda s: Store.open(s.layout.root, segment_bytes=100),
     InvalidArgumentError),
]


@pytest.mark.parametrize(("what", "call", "exc"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_calls_change_nothing(store: Store, what: str, call: Call,
                                  exc: type[LaminaError]) -> None:
    """Each bad call raises its typed error (under LaminaError), with a message, and every
    file and directory of the data dir is byte-identical afterwards; the store goes on
    working."""
    root = store.layout.root
    before = tree_digest(root)
    with pytest.raises(exc) as info:
        call(store)
    assert isinstance(info.value, LaminaError)
    assert len(str(info.value)) > 20
    assert tree_digest(root) == before, what
    rel = store.relation(NAME)
    rel.seal(6)
    assert as_rows(rel.snapshot(5)) == [(1, "a", 1), (2, "b", 1)]


def test_bad_store_path(tmp_path: Path) -> None:
    """Opening a store on a regular file is an InvalidArgumentError."""
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(InvalidArgumentError, match="not a directory"):
        Store.open(f)


def test_diff_overflow_in_snapshot(store: Store) -> None:
    """Two updates of 2**62 to one row at one time sum to 2**63, past int64: the snapshot
    raises DiffOverflowError (never a wrapped negative diff) and writes nothing; a
    snapshot before the overflowing time still works."""
    rel = store.relation(NAME)
    rel.append(updates([(7, "big", 6, 2**62)]))
    rel.append(updates([(7, "big", 6, 2**62)]))
    rel.seal(8)
    before = tree_digest(store.layout.root)
    with pytest.raises(DiffOverflowError, match=str(2**63)):
        rel.snapshot(7)
    assert tree_digest(store.layout.root) == before
    assert as_rows(rel.snapshot(5)) == [(1, "a", 1), (2, "b", 1)]
    rel.append(updates([(7, "big", 8, -1)]))
    rel.seal(9)
    assert (7, "big", 2**63 - 1) in as_rows(rel.snapshot(8))


def test_first_call_of_a_fresh_handle_can_be_refused(data_dir: Path) -> None:
    """A handle whose writer is not open yet (a fresh process, a relation never written)
    refuses a since beyond the upper and a seal going backwards without changing any data
    file. (Taking the writer lock may create the LOCK file: lock state, not data.)"""
    with Store.open(data_dir) as s:
        s.create_relation(NAME, ORDERS)
        s.create_relation("sealed", ORDERS).seal(5)
    before = tree_digest(data_dir)
    with Store.open(data_dir) as s:
        with pytest.raises(FrontierRegressionError):
            s.relation(NAME).allow_compaction(1)
        with pytest.raises(FrontierRegressionError):
            s.relation("sealed").seal(3)
    after = tree_digest(data_dir)
    assert {k: v for k, v in after.items() if not k.endswith("/LOCK")} == \
        {k: v for k, v in before.items() if not k.endswith("/LOCK")}


def test_handles_refuse_writes_after_the_store_is_closed(data_dir: Path) -> None:
    """After Store.close, a write through an old handle must be refused instead of
    silently taking the writer lock again (which would then never be released)."""
    s = Store.open(data_dir)
    rel = s.create_relation(NAME, ORDERS)
    s.close()
    try:
        with pytest.raises(InvalidArgumentError, match="closed"):
            rel.seal(3)
    finally:
        rel._close()


_HOLDER = """
import sys
from lamina import Store
store = Store.open(sys.argv[1])
rel = store.relation("orders")
rel.seal(rel.upper)  # takes the writer lock, writes nothing
print("locked", flush=True)
sys.stdin.read()
store.close()
"""


def test_second_writer_in_another_process_is_locked_out(store: Store) -> None:
    """While another process holds a relation's writer lock, appends and seals from this
    process raise LockedError naming that process, and nothing on disk changes; once it
    exits, the lock is free again."""
    root = store.layout.root
    store.close()
    with subprocess.Popen([sys.executable, "-c", _HOLDER, str(root)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as holder:
        assert holder.stdin is not None
        assert holder.stdout is not None
        try:
            assert holder.stdout.readline().strip() == "locked"
            before = tree_digest(root)
            with Store.open(root) as other:
                rel = other.relation(NAME)
                with pytest.raises(LockedError, match=f"pid {holder.pid}"):
                    rel.append(updates([(9, "z", 7, 1)]))
                with pytest.raises(LockedError):
                    rel.seal(9)
                assert rel.upper == 5  # reading needs no lock
            assert tree_digest(root) == before
        finally:
            holder.stdin.close()
            assert holder.wait(timeout=30) == 0
    with Store.open(root) as again:
        again.relation(NAME).seal(9)


class EIOAfter(FileSystem):
    """fdatasync fails with EIO once ``ok`` more syncs were spent (None: never)."""

    def __init__(self) -> None:
        self.ok: int | None = None

    def os_fdatasync(self, fd: int, path: Path) -> None:
        if self.ok is not None:
            if self.ok <= 0:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            self.ok -= 1
        super().os_fdatasync(fd, path)


def test_fsync_failure_through_the_public_api(data_dir: Path) -> None:
    """Store.open(fs=...) with a disk whose fdatasync starts failing: the append that hit
    the failure raises StorageError (EIO), every later write WriterFailedError; a store
    reopened on a healthy FileSystem holds exactly what was acknowledged."""
    fs = EIOAfter()
    s = Store.open(data_dir, fs=fs)
    rel = s.create_relation(NAME, ORDERS, key=["id"])
    rel.append(updates([(1, "a", 0, 1)]))
    rel.seal(2)
    fs.ok = 0
    with pytest.raises(StorageError) as info:
        rel.append(updates([(2, "b", 2, 1)]))
    assert info.value.errno == errno.EIO
    with pytest.raises(WriterFailedError):
        rel.append(updates([(3, "c", 2, 1)]))
    with pytest.raises(WriterFailedError):
        rel.seal(5)
    s.close()
    with Store.open(data_dir) as again:
        rel = again.relation(NAME)
        assert (rel.upper, rel.since) == (2, 0)
        rel.seal(10)
        assert as_rows(rel.snapshot(9)) == [(1, "a", 1)]


@pytest.mark.parametrize("policy", ["always", "interval", "never"])
def test_fsync_policies(data_dir: Path, policy: str) -> None:
    """Each fsync policy stores and reads back the same data across close and reopen."""
    with Store.open(data_dir, fsync=policy, fsync_interval=0.01,  # type: ignore[arg-type]
                    segment_bytes=4096) as s:
        rel = s.create_relation(NAME, ORDERS, key=["id"])
        for t in range(10):
            rel.append(updates([(t * 10 + i, "x" * 40, t, 1) for i in range(10)]))
            rel.seal(t + 1)
        assert rel.snapshot(9).num_rows == 100
    with Store.open(data_dir) as s:
        rel = s.relation(NAME)
        assert rel.upper == 10
        assert rel.snapshot(9).column("id").to_pylist() == list(range(100))


# --- a stateful model test ------------------------------------------------------------------

class StoreMachine(RuleBasedStateMachine):
    """The Store against a model: a list of acknowledged updates plus upper and since."""

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self._tmp = tempfile.TemporaryDirectory()
        self.root = Path(self._tmp.name) / "data"
        self.updates: list[tuple[int, str, int, int]] = []
        self.upper = 0
        self.since = 0
        self.next_id = 0

    @initialize()
    def create(self) -> None:
        self.store = Store.open(self.root, segment_bytes=4096, fsync="never")
        self.store.create_relation(NAME, ORDERS, key=["id"])

    @rule(rows=st.lists(st.tuples(st.integers(0, 4), st.sampled_from(["a", "b"]),
                                  st.integers(0, 6), st.integers(-2, 2)),
                        min_size=1, max_size=30))
    def append(self, rows: list[tuple[int, str, int, int]]) -> None:
        batch = [(k, item * (1 + k), self.upper + dt, d) for k, item, dt, d in rows]
        self.store.relation(NAME).append(updates(batch))
        self.updates.extend(batch)

    @rule(step=st.integers(0, 4))
    def seal(self, step: int) -> None:
        self.store.relation(NAME).seal(self.upper + step)
        self.upper += step

    @precondition(lambda self: self.upper > 0)
    @rule(data=st.data())
    def allow_compaction(self, data: st.DataObject) -> None:
        since = data.draw(st.integers(self.since, self.upper))
        self.store.relation(NAME).allow_compaction(since)
        self.since = since

    @precondition(lambda self: self.upper > 0)
    @rule(time=st.integers(0, 3))
    def refused_update(self, time: int) -> None:
        t = max(0, self.upper - 1 - time)
        with pytest.raises(UpdateBeforeUpperError):
            self.store.relation(NAME).append(updates([(0, "a", t, 1)]))

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = Store.open(self.root, segment_bytes=4096, fsync="never")

    @precondition(lambda self: self.upper > self.since)
    @rule(data=st.data())
    def snapshot(self, data: st.DataObject) -> None:
        as_of = data.draw(st.integers(self.since, self.upper - 1))
        sums: dict[tuple[int, str], int] = defaultdict(int)
        for k, item, t, d in self.updates:
            if t <= as_of:
                sums[(k, item)] += d
        want = sorted((k, item, d) for (k, item), d in sums.items() if d)
        assert as_rows(self.store.relation(NAME).snapshot(as_of)) == want

    @invariant()
    def frontiers(self) -> None:
        if hasattr(self, "store"):
            rel = self.store.relation(NAME)
            assert (rel.upper, rel.since) == (self.upper, self.since)

    def teardown(self) -> None:
        if hasattr(self, "store"):
            self.store.close()
        self._tmp.cleanup()


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=25, stateful_step_count=30, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


def test_no_stray_files(store: Store) -> None:
    """A store holds only the documented files: relation.json, LOCK and segments in the
    relation's WAL dir, and no temp or staging leftovers."""
    names = sorted(os.listdir(store.layout.wal_dir(NAME)))
    assert names == ["0000000000000001.wal.open", "LOCK", "relation.json"]
    assert sorted(os.listdir(store.layout.wal)) == [NAME]


# --- what append takes --------------------------------------------------------------------

TYPED = pa.schema([("id", pa.int64()), ("item", pa.string()), ("at", pa.timestamp("us")),
                   ("price", pa.decimal128(9, 2))])
AT = datetime.datetime(2024, 1, 31, 12, 0, 0, 250)


def test_append_takes_polars_duckdb_pandas_and_readers(data_dir: Path) -> None:
    """Real polars and pandas DataFrames, a DuckDB result and a RecordBatchReader append the
    same updates as a pa.Table: polars' string views, pandas' nanosecond timestamps and
    int64 times, a pandas frame filtered (an index that is not 0..n-1, dropped) or indexed
    by the key (a named index: a column), categorical strings."""
    with Store.open(data_dir, fsync="never") as store:
        rel = store.create_relation(NAME, TYPED, key=["id"])
        price = decimal.Decimal("1.50")
        rel.append(pl.DataFrame({"id": [1], "item": ["polars"], "at": [AT],
                                 "price": [price], "_time": pl.Series([0], dtype=pl.UInt64),
                                 "_diff": [1]}))
        rel.append(duckdb.sql("select 2::BIGINT as id, 'duckdb' as item, TIMESTAMP "
                              "'2024-01-31 12:00:00.00025' as at, 1.50::DECIMAL(9,2) as price,"
                              " 0::UBIGINT as _time, 1::BIGINT as _diff"))
        frame = pd.DataFrame({"id": [0, 3], "item": ["dropped", "pandas"],
                              "at": pd.to_datetime([AT, AT]), "price": [price, price],
                              "_time": [0, 0], "_diff": [1, 1]})
        rel.append(frame[frame.id > 0])  # index [1]: not a column
        rel.append(frame.assign(id=[4, 5], item=pd.Categorical(["indexed", "indexed"]))
                   .set_index("id"))
        reader = pa.RecordBatchReader.from_batches(
            rel.meta.update_schema, pa.Table.from_pylist(
                [{"id": 6, "item": "reader", "at": AT, "price": price, "_time": 0,
                  "_diff": 1}], schema=rel.meta.update_schema).to_batches())
        rel.append(reader)
        rel.seal(1)
        got = rel.snapshot(0).to_pylist()
    assert [(r["id"], r["item"]) for r in got] == [
        (1, "polars"), (2, "duckdb"), (3, "pandas"), (4, "indexed"), (5, "indexed"),
        (6, "reader")]
    assert {(r["at"], r["price"], r["_diff"]) for r in got} == {(AT, price, 1)}


def test_an_append_built_with_pa_table_writes_the_records_of_the_relations_schema(
        tmp_path: Path) -> None:
    """Updates built with ``pa.table`` (every field nullable) are written as they are, under
    the relation's schema: the segment is byte for byte the one that the same updates
    given with the exact update schema make, its records declare the non-nullable
    ``_time`` and ``_diff``; a null in one of those is refused and writes nothing."""
    rows = [(1, "a", 0, 1), (2, None, 1, 2), (3, "c", 1, 1)]
    segments = []
    for given in ("loose", "exact"):
        with Store.open(tmp_path / given) as s:
            rel = s.create_relation(NAME, ORDERS, key=["id"])
            table = updates(rows)
            if given == "exact":
                table = pa.Table.from_arrays(table.columns, schema=rel.meta.update_schema)
            else:
                assert table.schema.equals(rel.meta.loose_update_schema)
            rel.append(table)
            rel.append(table.slice(1))
            (segment,) = list_segments(s.layout.wal_dir(NAME))
            segments.append(segment.path.read_bytes())
            if given == "loose":
                before = tree_digest(tmp_path / given)
                bad = table.set_column(table.num_columns - 2, "_time",
                                       pa.array([0, None, 1], pa.uint64()))
                with pytest.raises(SchemaError, match="'_time' holds 1 nulls"):
                    rel.append(bad)
                assert tree_digest(tmp_path / given) == before
            rel.seal(2)
            assert as_rows(rel.snapshot(1)) == [(1, "a", 1), (2, None, 4), (3, "c", 2)]
    assert segments[0] == segments[1]


def test_append_refuses_a_lossy_conversion_and_writes_nothing(data_dir: Path) -> None:
    with Store.open(data_dir, fsync="never") as store:
        rel = store.create_relation(NAME, TYPED, key=["id"])
        rel.seal(1)
        before = tree_digest(data_dir)
        finer = pd.DataFrame({"id": [1], "item": ["x"],
                              "at": pd.to_datetime(["2024-01-31 12:00:00.000000001"]),
                              "price": [decimal.Decimal("1.50")], "_time": [1], "_diff": [1]})
        with pytest.raises(SchemaError, match="'at' cannot be converted from timestamp"):
            rel.append(finer)
        tz = finer.assign(at=pd.to_datetime([AT]).tz_localize("UTC"))
        with pytest.raises(SchemaError, match="column 'at' has type timestamp"):
            rel.append(tz)
        with pytest.raises(SchemaError, match="updates must be a pyarrow Table"):
            rel.append({"id": [1]})
        assert tree_digest(data_dir) == before


# --- read-only opening and the trace location's probe -------------------------------------

def test_read_only_creates_nothing_and_refuses_what_is_not_a_data_dir(tmp_path: Path) -> None:
    missing, empty = tmp_path / "missing", tmp_path / "empty"
    empty.mkdir()
    for root in (missing, empty):
        with pytest.raises(InvalidArgumentError, match="is not a lamina data directory"):
            Store.open(root, read_only=True)
    assert not missing.exists()
    assert list(empty.iterdir()) == []


def test_read_only_reads_and_writes_nothing(store: Store) -> None:
    root = store.layout.root
    store.close()
    before = tree_digest(root)
    with Store.open(root, read_only=True) as ro:
        rel = ro.relation(NAME)
        assert (rel.upper, rel.since) == (5, 2)
        assert as_rows(rel.snapshot(4)) == [(1, "a", 1), (2, "b", 1)]
        assert list(rel.snapshot_reader(4))
        assert as_rows(rel.lookup({"id": [2]}, 4)) == [(2, "b", 1)]
        assert ro.relations() == [NAME]
        with pytest.raises(InvalidArgumentError, match="opened read-only"):
            rel.seal(9)
    assert tree_digest(root) == before


def test_an_s3_trace_url_is_probed_before_it_is_recorded(tmp_path: Path,
                                                        s3_bucket: str) -> None:
    """A real S3 server: the bucket answers the conditional-put probe and is recorded (the
    probe leaves no object behind); a missing bucket and an endpoint nobody listens on are
    refused with ConfigError, and nothing is created."""
    from lamina.objstore.base import open_store
    from lamina.objstore.s3 import S3Settings
    from tests.objstore.s3server import free_port

    url = f"s3://{s3_bucket}/traces"
    with Store.open(tmp_path / "ok", trace_url=url) as store:
        assert store.layout.trace_url() == url
    assert open_store(f"s3://{s3_bucket}").list() == []

    no_bucket = tmp_path / "no-bucket"
    with pytest.raises(ConfigError, match=r"was not recorded.*does not exist"):
        Store.open(no_bucket, trace_url=f"s3://{s3_bucket}-missing/traces")
    assert not no_bucket.exists()

    unreachable = tmp_path / "unreachable"
    quick = S3Settings(endpoint=f"http://127.0.0.1:{free_port()}", max_retries=0,
                       retry_timeout_s=2, connect_timeout_s=2, timeout_s=5)
    with pytest.raises(ConfigError, match="was not recorded: the store could not be checked"):
        Store.open(unreachable, trace_url=url, s3=quick)
    assert not unreachable.exists()
