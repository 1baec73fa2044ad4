"""lamina.trace.invariants: each invariant of the module, broken by hand, is caught as
CorruptionError (state invariants 1-6 by check_state; row invariants 7-8 by check_rows
and check_data), and sound states and batches pass."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lamina.errors import CorruptionError
from lamina.fs import FileSystem
from lamina.objstore.local import LocalObjectStore
from lamina.schema import RelationMeta
from lamina.trace.batch import BatchDesc, PartFile, write_part
from lamina.trace.invariants import check_data, check_rows, check_state
from lamina.trace.state import PendingPart, TraceState
from tests.trace.helpers import KEY, SCHEMA, table_of

META = RelationMeta.new("r", SCHEMA, KEY)


def batch(i: int, lower: int, upper: int, level: int = 0, since: int = 0) -> BatchDesc:
    return BatchDesc(f"b{i}", lower, upper, since, level,
                     (PartFile(f"batches/b{i}/part-00000.parquet", 1, 10, 0),))


def ppart(name: str, lower: int, upper: int) -> PendingPart:
    return PendingPart(lower, upper, PartFile(f"pending/{name}.parquet", 1, 10, 0))


GOOD = TraceState(version=4, relation="r", relation_id="x", upper=20, since=6,
                  converted_through=3,
                  batches=(batch(0, 0, 10, 2, since=5), batch(1, 10, 15, 1, since=6),
                           batch(2, 15, 20, 1)),
                  pending=(ppart("p1", 20, 21), ppart("p2", 24, 32)))


def test_sound_states_pass() -> None:
    check_state(GOOD)
    check_state(TraceState.empty("r", "x"))
    check_state(replace(GOOD, since=20))  # since may reach the upper


BROKEN = {
    "since beyond upper": replace(GOOD, since=21),
    "first batch not at 0": replace(GOOD, batches=(batch(0, 1, 10, 2), *GOOD.batches[1:])),
    "gap": replace(GOOD, batches=(GOOD.batches[0], batch(1, 11, 15, 1), GOOD.batches[2])),
    "overlap": replace(GOOD, batches=(GOOD.batches[0], batch(1, 9, 15, 1), GOOD.batches[2])),
    "empty in time": replace(GOOD, batches=(*GOOD.batches, batch(3, 20, 20, 0))),
    "backwards interval": replace(GOOD, batches=(GOOD.batches[0], batch(1, 10, 9, 1),
                                                 batch(2, 9, 20, 1))),
    "levels increase": replace(GOOD, batches=(GOOD.batches[0], GOOD.batches[1],
                                              batch(2, 15, 20, 2))),
    "negative level": replace(GOOD, batches=(*GOOD.batches[:2], batch(2, 15, 20, -1))),
    "batch since beyond trace since": replace(
        GOOD, batches=(*GOOD.batches[:2], batch(2, 15, 20, 1, since=7))),
    "batches end below upper": replace(GOOD, upper=25, pending=()),
    "batches end beyond upper": replace(GOOD, upper=18, since=6, pending=()),
    "no batches but an upper": replace(GOOD, batches=(), pending=()),
    "pending below upper": replace(GOOD, pending=(ppart("p1", 19, 21),)),
    "pending empty range": replace(GOOD, pending=(ppart("p1", 22, 22),)),
    "duplicate batch id": replace(GOOD, batches=(
        GOOD.batches[0], GOOD.batches[1],
        replace(GOOD.batches[2], id="b1",
                parts=(PartFile("batches/b9/part-00000.parquet", 1, 10, 0),)))),
    "duplicate file": replace(GOOD, pending=(ppart("p1", 20, 21), ppart("p1", 24, 32))),
    "pending names a batch file": replace(GOOD, pending=(PendingPart(
        20, 21, PartFile("batches/b0/part-00000.parquet", 1, 10, 0)),)),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_each_broken_state_invariant_is_caught(name: str) -> None:
    with pytest.raises(CorruptionError, match="version 4") as info:
        check_state(BROKEN[name], Path("/trace/state"))
    assert info.value.path == Path("/trace/state")


SORTED = table_of([(1, "a", 5, 1), (1, "a", 7, -1), (1, "b", 5, 2), (2, "a", 9, 3)])


def test_sound_rows_pass() -> None:
    check_rows(SORTED, META, lower=5, upper=10, since=None, what="batch")
    check_rows(SORTED.slice(0, 0), META, lower=5, upper=10, since=None, what="batch")
    # A time below lower is fine when it is the batch's since (forwarded).
    forwarded = table_of([(1, "a", 3, 1), (1, "a", 7, -1)])
    check_rows(forwarded, META, lower=5, upper=10, since=3, what="batch")
    # An upper at the end of time.
    check_rows(table_of([(1, "a", 2**64 - 1, 1)]), META, lower=0, upper=2**64, since=None,
               what="pending")


@pytest.mark.parametrize(("rows", "lower", "upper", "since", "error"), [
    ([(1, "b", 5, 2), (1, "a", 5, 1)], 0, 10, None, "not ordered"),        # row order
    ([(2, "a", 5, 1), (1, "z", 5, 1)], 0, 10, None, "not ordered"),        # key first
    ([(1, "a", 7, 1), (1, "a", 5, 1)], 0, 10, None, "not ordered"),        # then time
    ([(1, "a", 5, 1), (1, "a", 5, 2)], 0, 10, None, "not consolidated"),
    ([(1, "a", 5, 0)], 0, 10, None, "zero diff"),
    ([(1, "a", 4, 1)], 5, 10, None, "time 4 outside"),                     # below lower
    ([(1, "a", 10, 1)], 5, 10, None, "time 10 outside"),                   # at upper
    ([(1, "a", 4, 1)], 5, 10, 3, "not the since 3"),                       # not forwarded
    ([(1, "a", 2, 1)], 5, 10, 3, "time 2 outside"),
], ids=["row-order", "key-order", "time-order", "duplicate", "zero", "below-lower",
        "at-upper", "not-since", "below-since"])
def test_each_broken_row_invariant_is_caught(rows: list[tuple[int, str, int, int]],
                                             lower: int, upper: int, since: int | None,
                                             error: str) -> None:
    with pytest.raises(CorruptionError, match=error):
        check_rows(table_of(rows), META, lower=lower, upper=upper, since=since, what="b")


def _trace_with(tmp_path: Path, batch_rows: list[tuple[int, str, int, int]],
                pending_rows: list[tuple[int, str, int, int]]) -> TraceState:
    schema = META.update_schema
    fs = FileSystem()
    bpart = write_part(LocalObjectStore(tmp_path, fs), "batches/b0/part-00000.parquet", schema,
                       [table_of(batch_rows)])
    ppart_ = write_part(LocalObjectStore(tmp_path, fs), "pending/p0.parquet", schema,
                        [table_of(pending_rows)])
    return TraceState(version=1, relation="r", relation_id="x", upper=10, since=2,
                      batches=(BatchDesc("b0", 0, 10, 2, 0, (bpart,)),),
                      pending=(PendingPart(10, 12, ppart_),))


def test_check_data_reads_every_file(tmp_path: Path) -> None:
    """Sound files pass; a batch with a bad time, a pending part outside its range and a
    damaged file are each caught, naming the file."""
    good = _trace_with(tmp_path / "good", [(1, "a", 2, 1), (1, "a", 9, 1)], [(1, "a", 11, 1)])
    check_data(LocalObjectStore(tmp_path / "good"), good, META)

    bad_batch = _trace_with(tmp_path / "b", [(1, "a", 10, 1)], [(1, "a", 11, 1)])
    with pytest.raises(CorruptionError, match="batch b0"):
        check_data(LocalObjectStore(tmp_path / "b"), bad_batch, META)

    bad_pending = _trace_with(tmp_path / "p", [(1, "a", 2, 1)], [(1, "a", 12, 1)])
    with pytest.raises(CorruptionError, match="pending part"):
        check_data(LocalObjectStore(tmp_path / "p"), bad_pending, META)

    path = tmp_path / "good" / good.batches[0].parts[0].path
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptionError, match="checksum") as info:
        check_data(LocalObjectStore(tmp_path / "good"), good, META)
    assert info.value.path == path
