"""lamina.trace.state: state versions round-trip, any damage to the newest version is
CorruptionError (never a silent fall-back to an older version, whose converted segments
may be gone), publication is compare-and-set, pruning keeps the newest, and the state
stays small however many conversions and merges ran."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lamina.errors import CorruptionError, StateConflictError
from lamina.fs import crc32c
from lamina.objstore.local import LocalObjectStore
from lamina.store import Store
from lamina.trace.batch import BatchDesc, PartFile
from lamina.trace.state import (
    PendingPart,
    StateStore,
    TraceState,
    _canonical,
    decode_state,
    encode_state,
    state_file_name,
)
from lamina.trace.trace import Trace
from tests.trace.helpers import (
    KEY,
    NAME,
    SCHEMA,
    NoSyncFileSystem,
    Oracle,
    check_snapshots,
    collect_all,
    convert,
)

STATE = TraceState(
    version=7, relation="r", relation_id="abc", upper=30, since=12, converted_through=9,
    batches=(BatchDesc("b1", 0, 20, 12, 1, (PartFile("batches/b1/part-00000.parquet", 4,
                                                     900, 123),)),
             BatchDesc("b2", 20, 30, 12, 0, ())),
    pending=(PendingPart(30, 31, PartFile("pending/p1.parquet", 1, 300, 5)),))


def test_round_trip() -> None:
    data = encode_state(STATE)
    assert decode_state(data, state_file_name(7)) == STATE
    assert STATE.files() == {"batches/b1/part-00000.parquet", "pending/p1.parquet"}
    assert (STATE.rows, STATE.bytes) == (4, 1200)
    assert STATE.batches_by_level() == {0: 1, 1: 1}


def _tampered(change: str) -> bytes:
    doc = json.loads(encode_state(STATE))
    if change == "value":
        doc["state"]["upper"] = 31
    elif change == "checksum":
        doc["checksum"] += 1
    elif change == "format":
        doc["state"]["format_version"] = 2
    elif change == "missing":
        del doc["state"]["batches"]
    return json.dumps(doc).encode()


@pytest.mark.parametrize(("data", "error"), [
    (_tampered("value"), "checksum mismatch"),
    (_tampered("checksum"), "checksum mismatch"),
    (encode_state(STATE)[:-40], "unreadable"),
    (b"", "unreadable"),
    (b"[]", "unreadable"),
    (b"\xff\xfe", "unreadable"),
], ids=["value", "checksum", "truncated", "empty", "not-object", "not-utf8"])
def test_damage_is_corruption(data: bytes, error: str) -> None:
    path = Path("/t/state") / state_file_name(7)
    with pytest.raises(CorruptionError, match=error) as info:
        decode_state(data, str(path))
    assert info.value.path == path


def test_damage_is_described_in_bounded_length() -> None:
    """A damaged state is described (what, where), never quoted: the message goes to
    verify, the QUARANTINED marker and the log."""
    data = bytearray(encode_state(STATE)) + b" " * 100_000
    data[40] = 0xFF
    for damaged in (bytes(data), b"{" + b"x" * 100_000):
        with pytest.raises(CorruptionError) as info:
            decode_state(damaged, state_file_name(7))
        assert len(info.value.reason) < 300, info.value.reason
        assert "b'" not in info.value.reason
    assert info.value.reason.startswith("trace state is unreadable: not valid JSON (")


def test_format_version_and_file_name_are_checked() -> None:
    """A checksummed state of another format version, or in a file named for another
    version, is refused."""
    doc = json.loads(encode_state(STATE))
    doc["state"]["format_version"] = 2
    doc["checksum"] = crc32c(_canonical(doc["state"]))
    with pytest.raises(CorruptionError, match="format version 2"):
        decode_state(json.dumps(doc).encode(), state_file_name(7))
    with pytest.raises(CorruptionError, match="says version 7"):
        decode_state(encode_state(STATE), state_file_name(8))


def test_corrupt_newest_version_is_refused_not_skipped(tmp_path: Path) -> None:
    """Trace.open on a trace whose newest version fails its checksum raises
    CorruptionError naming the file, although an older valid version exists."""
    oracle = Oracle()
    with Store.open(tmp_path, segment_bytes=4096, fsync="never") as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        for i in range(14):
            oracle.append(rel, [(i, "a", oracle.upper, 1)])
            oracle.seal(rel, oracle.upper + 1)
        trace = Trace.open(store.layout.trace_store(NAME), rel.meta)
        assert convert(trace, rel.wal_dir, merge=False) >= 2
        states = StateStore(trace.store)
        newest = states.store.root / "state" / state_file_name(states.versions()[-1])
        raw = bytearray(newest.read_bytes())
        raw[raw.index(b'"upper"') + 9] ^= 0x01  # a digit of the upper changes
        newest.write_bytes(bytes(raw))
        with pytest.raises(CorruptionError, match="checksum mismatch") as info:
            Trace.open(trace.store, rel.meta)
        assert info.value.path == newest
        with pytest.raises(CorruptionError):
            rel.snapshot(0)


def test_publish_is_compare_and_set(tmp_path: Path) -> None:
    states = StateStore(LocalObjectStore(tmp_path))
    assert states.load_latest() is None
    first = TraceState.empty("r", "x").next()
    states.publish(first)
    with pytest.raises(StateConflictError, match="version 1"):
        states.publish(first)
    states.publish(first.next())
    states.publish(first.next().next())
    assert states.versions() == [1, 2, 3]
    with pytest.raises(StateConflictError):  # a version below the newest
        states.publish(first.next())
    assert states.prune(2) == [1]
    assert states.versions() == [2, 3]
    with pytest.raises(StateConflictError):  # pruned, but newer versions exist
        states.publish(first)
    latest = states.load_latest()
    assert latest is not None
    assert latest.version == 3
    assert not list((states.store.root / "state").glob("*.tmp"))


def test_state_stays_small_after_many_conversions_and_merges(tmp_path: Path) -> None:
    """After 64 conversions (with merges and garbage collection) the state names
    O(log N) batches and its JSON stays a few KiB; only the kept versions remain."""
    oracle = Oracle()
    fs = NoSyncFileSystem()
    with Store.open(tmp_path, segment_bytes=4096, fsync="never", fs=fs) as store:
        rel = store.create_relation(NAME, SCHEMA, key=KEY)
        trace = Trace.open(store.layout.trace_store(NAME, fs), rel.meta, fs=fs)
        conversions = 0
        sizes = []
        while conversions < 64:
            for i in range(7):
                j = conversions * 7 + i
                oracle.append(rel, [(j % 50, "ab"[j % 2], oracle.upper, 1),
                                    (j % 7, "f", oracle.upper + 3 + j % 29, 1)])
                oracle.seal(rel, oracle.upper + 1)
            conversions += convert(trace, rel.wal_dir)
            trace.delete_converted_segments(rel.wal_dir)
            collect_all(trace, keep_versions=2)
            sizes.append(len(encode_state(trace.state)))
            assert len(trace.state.batches) <= math.log2(conversions) + 1
        assert max(sizes) < 16 * 1024
        assert len(StateStore(trace.store).versions()) == 2
        check_snapshots(rel, oracle)
