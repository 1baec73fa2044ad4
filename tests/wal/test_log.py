"""lamina.wal.log: the WalWriter - appends, frontiers, rotation, recovery, group commit,
fsync policies, failure handling and the writer lock.

Faults and observations go through FileSystem subclasses overriding the ``os_*``
primitives (the sanctioned seam); files are real, in temp dirs.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lamina import CLOSED, Store
from lamina.datadir import DataDir
from lamina.errors import (
    CorruptionError,
    FrontierRegressionError,
    InvalidArgumentError,
    LockedError,
    StorageError,
    UpdateBeforeUpperError,
    WriterFailedError,
)
from lamina.fs import AppendFile, FileSystem
from lamina.schema import RelationMeta, conform_updates
from lamina.wal.log import FsyncPolicy, WalWriter, least_time
from lamina.wal.reader import appended_updates, frontiers, segment_updates
from lamina.wal.record import (
    COMPRESSIONS,
    HEADER,
    HEADER_SIZE,
    UNSEALED,
    Compression,
    RecordType,
    frame,
)
from lamina.wal.segment import (
    SegmentFile,
    encode_header,
    list_segments,
    opening_records,
    scan_buffer,
    scan_file,
    segment_name,
)
from tests.conftest import ORDERS, tree_digest, updates
from tests.wal.codecs import codec_of

NAME = "orders"
META = RelationMeta.new(NAME, ORDERS, ["id"])


# --- helpers ------------------------------------------------------------------------------

def new_relation(root: Path, compression: Compression = "none") -> Path:
    """Create the ORDERS relation through the public API (its first segment of the
    version ``compression`` writes); return its WAL directory."""
    with Store.open(root, wal_compression=compression) as store:
        store.create_relation(NAME, ORDERS, key=["id"])
    return root / "wal" / NAME


def batch(first_id: int, n: int, t: int) -> pa.Table:
    """``n`` updates with ids ``first_id..``, all at time ``t`` with diff 1."""
    return conform_updates(META, updates([(i, f"item-{i}", t, 1)
                                          for i in range(first_id, first_id + n)]))


def logged(wal_dir: Path) -> list[tuple[int, str, int, int]]:
    """Every update row in the relation's WAL, in log order (reading, never writing)."""
    rows: list[tuple[int, str, int, int]] = []
    for seg in list_segments(wal_dir):
        for t in segment_updates(seg, NAME, META.update_schema):
            rows.extend(zip(*(t.column(c).to_pylist() for c in t.column_names), strict=True))
    return rows


def logged_ids(wal_dir: Path) -> list[int]:
    return sorted(r[0] for r in logged(wal_dir))


def open_segment(wal_dir: Path) -> Path:
    (seg,) = [s for s in list_segments(wal_dir) if not s.finished]
    return seg.path


class CountingFS(FileSystem):
    """Counts fdatasync calls; ``delay`` makes each one take that long (a slow disk)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.syncs = 0
        self.delay = delay
        self._mu = threading.Lock()

    def os_fdatasync(self, fd: int, path: Path) -> None:
        with self._mu:
            self.syncs += 1
        if self.delay:
            time.sleep(self.delay)
        super().os_fdatasync(fd, path)


class FailingSyncFS(FileSystem):
    """fdatasync raises EIO once ``ok_syncs`` successful syncs have been spent
    (None: never fails)."""

    def __init__(self, ok_syncs: int | None = None, delay: float = 0.0) -> None:
        self.ok_syncs = ok_syncs
        self.delay = delay
        self._mu = threading.Lock()

    def os_fdatasync(self, fd: int, path: Path) -> None:
        if self.delay:
            time.sleep(self.delay)
        with self._mu:
            if self.ok_syncs is not None:
                if self.ok_syncs <= 0:
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                self.ok_syncs -= 1
        super().os_fdatasync(fd, path)


class FullDiskFS(FileSystem):
    """Accepts ``budget`` more bytes, then fails writes with ENOSPC (None: unlimited)."""

    def __init__(self) -> None:
        self.budget: int | None = None

    def os_write(self, fd: int, data: memoryview, path: Path) -> int:
        if self.budget is None:
            return super().os_write(fd, data, path)
        if self.budget == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = os.write(fd, data[: self.budget])
        self.budget -= n
        return n


# --- basics -------------------------------------------------------------------------------

def test_append_seal_since_survive_reopen(tmp_path: Path) -> None:
    """Appends, seals and compaction frontiers are read back after close and reopen; the
    reopened writer resumes: the upper still refuses old times and new appends land."""
    wal = new_relation(tmp_path)
    w = WalWriter(wal, NAME)
    assert (w.upper, w.since) == (0, 0)
    w.append(batch(0, 3, 0))
    w.seal(5)
    w.append(batch(3, 2, 9))  # a future update
    w.allow_compaction(4)
    w.close()
    assert frontiers(wal, NAME) == (5, 4)
    w = WalWriter(wal, NAME)
    assert (w.upper, w.since, w.seq) == (5, 4, 1)
    with pytest.raises(UpdateBeforeUpperError, match="time 4, below the sealed upper 5"):
        w.append(batch(10, 1, 4))
    w.append(batch(10, 1, 5))
    w.seal(7)
    w.close()
    assert logged_ids(wal) == [0, 1, 2, 3, 4, 10]
    assert frontiers(wal, NAME) == (7, 4)


def test_a_writer_keeps_an_encoder_for_each_of_two_table_forms(tmp_path: Path) -> None:
    """Tables of the exact update schema and tables built with ``pa.table()`` (every field
    nullable) in turn: the writer keeps an encoder for each, so alternating costs no
    encoder per append; both forms make records declaring the relation's schema, byte for
    byte alike. A third form replaces the one least recently used."""
    wal = new_relation(tmp_path / "alternating")
    exact = batch(0, 3, 0)
    loose = pa.Table.from_arrays(exact.columns, schema=META.loose_update_schema)
    w = WalWriter(wal, NAME, update_schema=META.update_schema)
    first = {"exact": w._encoder_for(exact.schema, "none"),
             "loose": w._encoder_for(loose.schema, "none")}
    for table in (exact, loose, loose, exact, loose):
        w.append(table)
    assert w._encoder_for(exact.schema, "none") is first["exact"]
    assert w._encoder_for(loose.schema, "none") is first["loose"]
    assert first["loose"].schema.equals(META.update_schema, check_metadata=True)
    w._encoder_for(exact.schema, "lz4")  # a third: the loose one was used last
    assert w._encoder_for(loose.schema, "none") is first["loose"]
    assert w._encoder_for(exact.schema, "none") is not first["exact"]
    w.close()
    records = [r for seg in list_segments(wal) for r in scan_file(seg, NAME)[0].records
               if r.rtype is RecordType.UPDATES]
    assert len(records) == 5
    assert len({bytes(r.payload) for r in records}) == 1
    assert logged_ids(wal) == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]


def test_repeated_frontiers_write_nothing(tmp_path: Path) -> None:
    """Sealing at the current upper, allowing compaction at the current since and
    appending an empty table are no-ops that leave the files as they were."""
    wal = new_relation(tmp_path)
    w = WalWriter(wal, NAME)
    w.seal(3)
    w.allow_compaction(2)
    before = tree_digest(tmp_path)
    w.seal(3)
    w.allow_compaction(2)
    w.append(batch(0, 0, 5))
    assert tree_digest(tmp_path) == before
    w.close()


def test_closed_frontier(tmp_path: Path) -> None:
    """seal(CLOSED) closes every time: appends are refused, since may go to CLOSED, and
    both frontiers read back as CLOSED (2**64) after reopen."""
    wal = new_relation(tmp_path)
    w = WalWriter(wal, NAME)
    w.append(batch(0, 1, 2**64 - 1))
    w.seal(CLOSED)
    with pytest.raises(UpdateBeforeUpperError, match="CLOSED"):
        w.append(batch(1, 1, 2**64 - 1))
    w.allow_compaction(CLOSED)
    w.close()
    w = WalWriter(wal, NAME)
    assert (w.upper, w.since) == (CLOSED, CLOSED)
    w.close()
    assert logged_ids(wal) == [0]


@pytest.mark.parametrize(("call", "exc", "match"), [
    (lambda w: w.seal(2), FrontierRegressionError, "backwards from 5"),
    (lambda w: w.allow_compaction(2), FrontierRegressionError, "since backwards from 3"),
    (lambda w: w.allow_compaction(6), FrontierRegressionError, "beyond the sealed upper 5"),
    (lambda w: w.append(batch(9, 1, 4)), UpdateBeforeUpperError, "below the sealed upper"),
    (lambda w: w.seal(-1), InvalidArgumentError, "outside"),
    (lambda w: w.seal(CLOSED + 1), InvalidArgumentError, "outside"),
    (lambda w: w.seal(True), InvalidArgumentError, "must be an int"),
    (lambda w: w.seal(7.0), InvalidArgumentError, "must be an int"),
    (lambda w: w.allow_compaction("4"), InvalidArgumentError, "must be an int"),
])
def test_bad_calls_raise_and_change_nothing(tmp_path: Path, call: object,
                                            exc: type[Exception], match: str) -> None:
    """Frontier regressions, since beyond upper, updates below the upper and ill-typed
    frontiers raise typed errors and leave every file byte-identical; the writer stays
    usable."""
    wal = new_relation(tmp_path)
    w = WalWriter(wal, NAME)
    w.append(batch(0, 2, 0))
    w.seal(5)
    w.allow_compaction(3)
    before = tree_digest(tmp_path)
    with pytest.raises(exc, match=match):
        call(w)  # type: ignore[operator]
    assert tree_digest(tmp_path) == before
    w.seal(6)
    w.close()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"fsync": "sometimes"}, "fsync policy"),
    ({"segment_bytes": 4095}, "below the minimum"),
    ({"compression": "gzip"}, "WAL compression 'gzip' is not one of"),
])
def test_bad_writer_options(tmp_path: Path, kwargs: dict[str, object], match: str) -> None:
    """Unknown fsync policies and compressions and tiny segments are refused before the
    lock is taken."""
    wal = new_relation(tmp_path)
    before = tree_digest(tmp_path)
    with pytest.raises(InvalidArgumentError, match=match):
        WalWriter(wal, NAME, **kwargs)  # type: ignore[arg-type]
    assert tree_digest(tmp_path) == before


def test_closed_writer_refuses_calls(tmp_path: Path) -> None:
    """After close every write raises InvalidArgumentError; close is idempotent."""
    w = WalWriter(new_relation(tmp_path), NAME)
    w.close()
    w.close()
    calls: list[Callable[[], None]] = [lambda: w.append(batch(0, 1, 0)), lambda: w.seal(1),
                                        lambda: w.allow_compaction(0)]
    for call in calls:
        with pytest.raises(InvalidArgumentError, match="closed"):
            call()


def test_second_writer_in_process_is_locked_out(tmp_path: Path) -> None:
    """A second WalWriter on the same relation in the same process gets LockedError naming
    the holder's pid; after the first closes, the lock is free."""
    wal = new_relation(tmp_path)
    w = WalWriter(wal, NAME)
    with pytest.raises(LockedError, match=f"pid {os.getpid()}"):
        WalWriter(wal, NAME)
    w.close()
    WalWriter(wal, NAME).close()


# --- rotation -----------------------------------------------------------------------------

def test_rotation_chains_segments(tmp_path: Path) -> None:
    """With a small size target, seals finish segments (renamed to .wal) and open the next
    with PROGRESS(upper) and SINCE(since): each finished segment's lower is its
    predecessor's upper, since is carried over, and nothing is lost or duplicated."""
    wal = new_relation(tmp_path)
    w = WalWriter(wal, NAME, segment_bytes=4096)
    for i in range(30):
        w.append(batch(i * 40, 40, i))
        w.seal(i + 1)
        if i % 7 == 3:
            w.allow_compaction(i)
    w.close()
    segs = list_segments(wal)
    assert len(segs) > 5
    assert all(s.finished for s in segs[:-1])
    assert not segs[-1].finished
    assert [s.seq for s in segs] == list(range(1, len(segs) + 1))
    scans = [scan_file(s, NAME)[0] for s in segs]
    for prev, nxt in itertools.pairwise(scans):
        assert nxt.lower == prev.upper
        assert nxt.since >= prev.since
        assert nxt.records[1].rtype.name == "SINCE"
    assert scans[-1].upper == 30
    assert scans[-1].since == 24
    assert all(s.valid_end >= 4096 for s in scans[:-1])
    assert logged_ids(wal) == list(range(1200))


def test_missing_open_segment_is_recreated(tmp_path: Path) -> None:
    """A crash between finishing a segment and creating the next leaves no open segment;
    reopening creates it with the last finished segment's upper and since."""
    wal = new_relation(tmp_path)
    w = WalWriter(wal, NAME, segment_bytes=4096)
    w.seal(1)
    w.allow_compaction(1)
    w.append(batch(0, 300, 1))
    w.seal(8)
    assert w.seq == 2
    w.close()
    open_segment(wal).unlink()
    w = WalWriter(wal, NAME, segment_bytes=4096)
    assert (w.seq, w.upper, w.since) == (2, 8, 1)
    w.append(batch(1000, 1, 8))
    w.close()
    assert logged_ids(wal) == [*range(300), 1000]


def test_concurrent_seals_and_appends_keep_segments_well_formed(tmp_path: Path) -> None:
    """Appends and seals racing a rotation (small segments, several threads, a disk slow
    enough that calls queue up behind syncs) must still end every finished segment with a
    PROGRESS record and rotate each segment once: every finished segment scans cleanly,
    frontiers chain, and every append is present once."""
    wal = new_relation(tmp_path)
    w = WalWriter(wal, NAME, segment_bytes=4096, fs=CountingFS(delay=0.0005))
    uppers = itertools.count(1)
    ids = itertools.count()
    acked: list[int] = []
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def appender() -> None:
        start.wait()
        for _ in range(150):
            i = next(ids)
            try:
                w.append(batch(i, 1, 10**9))  # far in the future: never below the upper
            except BaseException as exc:
                errors.append(exc)
                return
            acked.append(i)

    def sealer() -> None:
        start.wait()
        for _ in range(150):
            try:
                w.seal(next(uppers))
            except FrontierRegressionError:
                pass  # the other sealer went further first: a legal refusal
            except BaseException as exc:
                errors.append(exc)
                return

    threads = [threading.Thread(target=appender) for _ in range(4)]
    threads += [threading.Thread(target=sealer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    assert errors == []
    segs = list_segments(wal)
    assert len(segs) > 3
    scans = [scan_file(s, NAME)[0] for s in segs]  # finished ones must end with PROGRESS
    for prev, nxt in itertools.pairwise(scans):
        assert nxt.lower == prev.upper
    assert logged_ids(wal) == sorted(acked)


# --- recovery -----------------------------------------------------------------------------

@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_torn_last_record_at_every_offset(tmp_path: Path, compression: Compression) -> None:
    """Cut the open segment inside its last record (compressed or not) at every byte
    offset: reopening keeps exactly the complete prefix (the file is cut back to it and
    synced), the frontiers and the snapshot are those of the prefix, and the log takes new
    appends afterwards."""
    root = tmp_path / "data"
    wal = new_relation(root)
    w = WalWriter(wal, NAME, compression=compression)
    w.append(batch(0, 3, 1))
    w.seal(5)
    w.allow_compaction(2)
    seg = open_segment(wal)
    prefix = seg.stat().st_size
    w.append(batch(100, 20, 7))
    w.close()
    full = seg.read_bytes()
    expected = {"id": [0, 1, 2], "item": ["item-0", "item-1", "item-2"], "_diff": [1, 1, 1]}
    for cut in range(prefix, len(full)):
        seg.write_bytes(full[:cut])
        w = WalWriter(wal, NAME)
        assert seg.stat().st_size == prefix, cut
        assert (w.upper, w.since) == (5, 2)
        w.close()
        if cut % 50 == 0 or cut == len(full) - 1:  # the public read path, on a sample
            with Store.open(root) as store:
                rel = store.relation(NAME)
                assert (rel.upper, rel.since) == (5, 2)
                assert rel.snapshot(4).to_pydict() == expected
        assert seg.read_bytes() == full[:prefix]
    w = WalWriter(wal, NAME)
    w.append(batch(200, 1, 5))
    w.close()
    assert logged_ids(wal) == [0, 1, 2, 200]


def test_torn_open_segment_anywhere_keeps_frontiers(tmp_path: Path) -> None:
    """Cut a freshly rotated open segment at every byte (header, opening records, later
    records): neither readers nor the reopened writer lose the since or upper carried over
    from the finished segment, and the writer keeps exactly the complete records."""
    wal = new_relation(tmp_path)
    w = WalWriter(wal, NAME, segment_bytes=4096)
    w.seal(1)
    w.allow_compaction(1)
    w.append(batch(0, 300, 1))
    w.seal(10)
    assert w.seq == 2
    w.append(batch(1000, 5, 12))
    w.seal(15)
    w.allow_compaction(11)
    w.close()
    seg = open_segment(wal)
    full = seg.read_bytes()
    recs = scan_buffer(memoryview(full), seg, finished=False).records
    ends = [r.end for r in recs]  # P(10), S(1), U, P(15), S(11)
    for cut in range(len(full) + 1):
        seg.write_bytes(full[:cut])
        read_only = frontiers(wal, NAME)  # what readers see before any recovery
        w = WalWriter(wal, NAME, segment_bytes=4096)
        state = (w.upper, w.since)
        w.close()
        if cut < ends[2]:  # a torn header or opening is rebuilt from segment 1
            want, keep, ids = (10, 1), ends[1], 300
        elif cut < ends[3]:
            want, keep, ids = (10, 1), ends[2], 305
        elif cut < ends[4]:
            want, keep, ids = (15, 1), ends[3], 305
        else:
            want, keep, ids = (15, 11), ends[4], 305
        assert state == want, cut
        assert read_only == want, cut
        assert seg.read_bytes() == full[:keep], cut
        assert len(logged(wal)) == ids


def test_bad_record_followed_by_good_is_refused(tmp_path: Path) -> None:
    """A damaged record followed by a valid one in the open segment is corruption, not a
    torn tail: opening the writer raises CorruptionError naming the file and the bad
    record's offset, and nothing is cut or rewritten: through the Store the only change is
    the quarantine marker, which names the damage."""
    root = tmp_path / "data"
    wal = new_relation(root)
    w = WalWriter(wal, NAME)
    w.append(batch(0, 3, 1))
    seg = open_segment(wal)
    bad_at = seg.stat().st_size
    w.append(batch(10, 3, 1))
    w.seal(4)
    w.close()
    data = bytearray(seg.read_bytes())
    data[bad_at + 20] ^= 0x10
    seg.write_bytes(bytes(data))
    before = tree_digest(root)
    with pytest.raises(CorruptionError) as info:
        WalWriter(wal, NAME)
    assert info.value.path == seg
    assert info.value.offset == bad_at
    assert f"{seg} at byte {bad_at}" in str(info.value)
    assert tree_digest(root) == before
    with Store.open(root) as store, pytest.raises(CorruptionError, match=str(bad_at)):
        store.relation(NAME).append(updates([(99, "x", 5, 1)]))
    after = tree_digest(root)
    marker = f"wal/{NAME}/QUARANTINED"
    assert str(bad_at) in (root / marker).read_text()
    assert {k: v for k, v in after.items() if k != marker} == before
    fd = os.open(wal / "LOCK", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the failed opens released the lock
    finally:
        os.close(fd)


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_damaged_finished_segment_is_refused_by_readers(tmp_path: Path,
                                                         compression: Compression) -> None:
    """A single flipped bit in a finished segment (sampled over its whole length, every
    bit position; its records compressed or not) makes the public read path raise
    CorruptionError naming the file; the snapshot is never computed from a wrong
    record."""
    root = tmp_path / "data"
    wal = new_relation(root)
    w = WalWriter(wal, NAME, segment_bytes=4096, compression=compression)
    w.append(batch(0, 300, 1))
    w.seal(5)
    w.close(finish=True)  # compressed, the segment may stay below the size target
    finished = wal / segment_name(1, finished=True)
    pristine = finished.read_bytes()
    with Store.open(root) as store:
        rel = store.relation(NAME)
        assert rel.snapshot(4).num_rows == 300
        for pos in range(0, len(pristine), 37):
            for bit in range(8):
                flipped = bytearray(pristine)
                flipped[pos] ^= 1 << bit
                finished.write_bytes(bytes(flipped))
                with pytest.raises(CorruptionError) as info:
                    rel.snapshot(4)
                assert info.value.path == finished, (pos, bit)
        finished.write_bytes(pristine)
        assert rel.snapshot(4).num_rows == 300


# --- sealing a record last ---------------------------------------------------------------

class SealWatchFS(FileSystem):
    """Records the order of the writer's file operations on the open segment, and what a
    reader finds there when the writer's check runs."""

    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []

    def os_writev(self, fd: int, buffers: Sequence[Any], path: Path) -> int:
        start = os.fstat(fd).st_size
        n = super().os_writev(fd, buffers, path)
        self.events.append(("write", start, start + n, bytes(buffers[0])))
        return n

    def os_write(self, fd: int, data: memoryview, path: Path) -> int:
        start = os.fstat(fd).st_size
        n = super().os_write(fd, data, path)
        self.events.append(("write", start, start + n, bytes(data[:HEADER_SIZE])))
        return n

    def os_start_writeback(self, fd: int, offset: int, length: int, path: Path) -> None:
        self.events.append(("writeback", offset, offset + length))
        super().os_start_writeback(fd, offset, length, path)

    def os_pwrite(self, fd: int, data: bytes, offset: int, path: Path) -> int:
        self.events.append(("patch", offset, bytes(data)))
        return super().os_pwrite(fd, data, offset, path)

    def os_fdatasync(self, fd: int, path: Path) -> None:
        self.events.append(("fdatasync",))
        super().os_fdatasync(fd, path)


@pytest.mark.parametrize("policy", ["always", "never"])
def test_an_update_record_is_sealed_last(tmp_path: Path, policy: FsyncPolicy) -> None:
    """An append writes its record with a header of zeros, starts its write-back (fsync
    "always" only; from the first page boundary after the header to the record's end),
    runs the caller's check while a reader of the open segment sees a torn tail there,
    then writes the header over the zeros and syncs; the record then reads back."""
    wal = new_relation(tmp_path)
    fs = SealWatchFS()
    w = WalWriter(wal, NAME, fs=fs, fsync=policy)
    w.seal(1)
    seen: list[tuple[int | None, str]] = []

    def check(table: pa.Table) -> None:
        fs.events.append(("check", table.num_rows))
        scan, _ = scan_file(list_segments(wal)[-1], NAME)
        seen.append((scan.torn_at, scan.torn_reason))

    fs.events.clear()
    w.append(batch(0, 2000, 3), check)
    write, *rest = fs.events
    assert write[0] == "write"
    _, start, end, head = write
    assert head == UNSEALED
    assert seen == [(start, "unknown record type 0")]
    expected: list[tuple[object, ...]] = []
    if policy == "always":
        expected.append(("writeback", -(-(start + HEADER_SIZE) // 4096) * 4096, end))
    expected.append(("check", 2000))
    patch = rest[len(expected)]
    assert patch[:2] == ("patch", start)
    length, rtype, _ = HEADER.unpack(patch[2])
    assert (length, rtype) == (end - start - HEADER_SIZE, RecordType.UPDATES)
    expected.append(patch)
    if policy == "always":
        expected.append(("fdatasync",))
    assert rest == expected
    assert end - start > 2 * 4096  # the write-back range is not empty
    w.close()
    assert logged_ids(wal) == list(range(2000))


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_an_append_whose_check_fails_is_cut_off(tmp_path: Path,
                                                compression: Compression) -> None:
    """A check that raises (the diffs' range, for Relation.append) or an update below the
    upper, found after the record was written, cut it off again: every file is as it was,
    the writer stays usable, and the next record lands where the rejected one began."""
    wal = new_relation(tmp_path, compression)
    w = WalWriter(wal, NAME, compression=compression)
    w.append(batch(0, 5, 0))
    w.seal(2)
    before = tree_digest(tmp_path)
    size = open_segment(wal).stat().st_size

    def refuse(table: pa.Table) -> None:
        raise InvalidArgumentError(f"refused {table.num_rows} updates")

    with pytest.raises(InvalidArgumentError, match="refused 3000 updates"):
        w.append(batch(10, 3000, 5), refuse)
    assert tree_digest(tmp_path) == before
    with pytest.raises(UpdateBeforeUpperError, match="time 1, below the sealed upper 2"):
        w.append(pa.concat_tables([batch(20, 3000, 5), batch(9000, 1, 1)]))
    assert tree_digest(tmp_path) == before
    w.append(batch(30, 2, 5))
    records = scan_file(list_segments(wal)[-1], NAME)[0].records
    assert records[-1].offset == size
    w.close()
    assert logged_ids(wal) == [0, 1, 2, 3, 4, 30, 31]


def _open_segment_of_two_appends(root: Path) -> SegmentFile:
    """The open segment of a log of two sealed appends of 50 updates (ids 0 to 99)."""
    wal = new_relation(root)
    w = WalWriter(wal, NAME)
    w.append(batch(0, 50, 0))
    w.seal(1)
    w.append(batch(50, 50, 1))
    w.seal(2)
    w.close()
    seg = list_segments(wal)[-1]
    assert not seg.finished
    return seg


def _overwrite(seg: SegmentFile, at: int, value: bytes) -> None:
    with seg.path.open("r+b") as f:
        f.seek(at)
        f.write(value)


def test_a_read_racing_a_seal_reads_the_open_segment_again(tmp_path: Path) -> None:
    """A read of the open segment is not atomic against the writer: it can copy a record's
    header of zeros from before the writer sealed it and the next record from after the
    writer appended it (seen in CI: a subscription under the daemon). scan_file reads the
    file again until the header is there; a zero header that stays is corruption after the
    re-reads, and in a finished segment at once."""
    seg = _open_segment_of_two_appends(tmp_path)
    scan, data = scan_file(seg, NAME)
    at = scan.updates()[0].offset
    header = data[at:at + HEADER_SIZE]

    def put(value: bytes) -> None:
        _overwrite(seg, at, value)

    put(UNSEALED)  # what the racing read copied
    sealer = threading.Timer(0.004, put, (header,))  # the writer's seal, a moment later
    sealer.start()
    again, _ = scan_file(seg, NAME)
    sealer.join()
    assert [(r.offset, r.rtype) for r in again.records] == \
        [(r.offset, r.rtype) for r in scan.records]
    put(UNSEALED)  # and now for good: damage
    with pytest.raises(CorruptionError, match="unknown record type 0, followed by a valid"):
        scan_file(seg, NAME)
    start = time.monotonic()
    with pytest.raises(CorruptionError, match="unknown record type 0 in a finished segment"):
        scan_file(SegmentFile(seg.path, seg.seq, finished=True), NAME)
    assert time.monotonic() - start < 0.02  # no re-reads


def test_a_polling_read_racing_a_seal_reads_the_new_bytes_again(tmp_path: Path) -> None:
    """The same race for a subscription's read of what the open segment gained since its
    last poll (appended_updates, from a byte offset). It lacked the re-read that scan_file
    had, and tests/read/test_subscribe_daemon.py failed now and then with "unknown record
    type 0, followed by a valid record" on a segment that was whole (2026-11-29)."""
    seg = _open_segment_of_two_appends(tmp_path)
    scan, data = scan_file(seg, NAME)
    polled_to = scan.updates()[0].offset  # an earlier poll read up to the first update
    at = scan.updates()[1].offset  # the record whose seal the next poll races
    header = data[at:at + HEADER_SIZE]
    schema = META.update_schema
    whole, end = appended_updates(seg, schema, polled_to)

    def put(value: bytes) -> None:
        _overwrite(seg, at, value)

    put(UNSEALED)
    sealer = threading.Timer(0.004, put, (header,))
    sealer.start()
    again, again_end = appended_updates(seg, schema, polled_to)
    sealer.join()
    assert end == again_end == len(data)
    assert pa.concat_tables(again).equals(pa.concat_tables(whole))
    assert sorted(pa.concat_tables(again).column("id").to_pylist()) == list(range(100))
    put(UNSEALED)  # for good: damage, reported after the re-reads
    with pytest.raises(CorruptionError, match="unknown record type 0, followed by a valid"):
        appended_updates(seg, schema, polled_to)
    put(header)
    finished = SegmentFile(seg.path, seg.seq, finished=True)
    assert appended_updates(finished, schema, polled_to)[1] == len(data)


class _NoTruncate(AppendFile):
    def truncate(self, size: int) -> None:
        raise StorageError(errno.EIO, f"truncate failed on {self.path}")


class NoTruncateFS(FileSystem):
    """A disk on which cutting a file back fails."""

    def open_append(self, path: Path, *, create: bool = False) -> AppendFile:
        handle = super().open_append(path, create=create)
        return _NoTruncate(self, handle.path, handle._fd, handle.size)


def test_a_rejected_append_that_cannot_be_cut_off_fails_the_writer(tmp_path: Path) -> None:
    """If the unsealed record of a rejected append cannot be cut off, the caller still gets
    the rejection, the writer fails (it no longer knows its file's end), and reopening cuts
    the record off as a torn tail: the acknowledged updates, nothing of the rejected one."""
    wal = new_relation(tmp_path)
    w = WalWriter(wal, NAME, fs=NoTruncateFS())
    w.append(batch(0, 3, 0))
    w.seal(2)
    with pytest.raises(UpdateBeforeUpperError):
        w.append(batch(10, 500, 1))
    with pytest.raises(WriterFailedError, match="truncate failed"):
        w.append(batch(20, 1, 2))
    w.close()
    assert scan_file(list_segments(wal)[-1], NAME)[0].torn_reason == "unknown record type 0"
    w = WalWriter(wal, NAME)
    assert scan_file(list_segments(wal)[-1], NAME)[0].torn_at is None
    w.append(batch(30, 1, 2))
    w.close()
    assert logged_ids(wal) == [0, 1, 2, 30]


# --- group commit and fsync policies ------------------------------------------------------

def test_group_commit_shares_fsyncs(tmp_path: Path) -> None:
    """With fsync="always", 8 threads appending at once on a slow disk (2 ms per
    fdatasync) are acknowledged with far fewer fdatasyncs than appends; every append is
    present exactly once after reopen, and the reopened writer resumes."""
    wal = new_relation(tmp_path)
    fs = CountingFS(delay=0.002)
    w = WalWriter(wal, NAME, fs=fs, fsync="always")
    fs.syncs = 0
    threads, per_thread = 8, 25
    start = threading.Barrier(threads)

    def run(k: int) -> None:
        start.wait()
        for i in range(per_thread):
            w.append(batch(k * 1000 + i, 1, 3))

    pool = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    appends = threads * per_thread
    assert 0 < fs.syncs < appends // 2, fs.syncs
    w.seal(4)
    w.close()
    assert logged_ids(wal) == sorted(k * 1000 + i for k in range(threads)
                                     for i in range(per_thread))
    w = WalWriter(wal, NAME)
    assert (w.upper, w.since) == (4, 0)
    w.append(batch(99999, 1, 4))
    w.close()
    assert len(logged_ids(wal)) == appends + 1


def test_fsync_always_syncs_every_call(tmp_path: Path) -> None:
    """One thread, fsync="always": every append, seal and allow_compaction is followed by
    its own fdatasync before it returns."""
    wal = new_relation(tmp_path)
    fs = CountingFS()
    w = WalWriter(wal, NAME, fs=fs)
    fs.syncs = 0
    for i in range(5):
        w.append(batch(i, 1, i + 1))
        assert fs.syncs == 2 * i + 1
        w.seal(i + 2)
        assert fs.syncs == 2 * i + 2
    w.allow_compaction(1)
    assert fs.syncs == 11
    w.close()


def test_fsync_never(tmp_path: Path) -> None:
    """fsync="never": appends and seals do not fdatasync (close does, and so does
    finishing a segment); everything is readable after reopen."""
    wal = new_relation(tmp_path)
    fs = CountingFS()
    w = WalWriter(wal, NAME, fs=fs, fsync="never")
    fs.syncs = 0
    for i in range(20):
        w.append(batch(i, 1, i))
        w.seal(i + 1)
    assert fs.syncs == 0
    w.close()
    assert fs.syncs == 1
    assert logged_ids(wal) == list(range(20))
    w = WalWriter(wal, NAME, fs=fs, fsync="never", segment_bytes=4096)
    w.append(batch(100, 300, 20))
    w.seal(21)  # finishing a segment syncs it even under "never"
    assert fs.syncs >= 2
    assert list_segments(wal)[0].finished
    w.close()


def test_fsync_interval(tmp_path: Path) -> None:
    """fsync="interval": calls return without waiting for a sync; a background thread
    syncs within the interval; close syncs the rest and stops the thread."""
    wal = new_relation(tmp_path)
    fs = CountingFS()
    w = WalWriter(wal, NAME, fs=fs, fsync="interval", fsync_interval=0.05)
    fs.syncs = 0
    for i in range(20):
        w.append(batch(i, 1, i))
    assert fs.syncs < 20
    deadline = time.monotonic() + 5
    while fs.syncs == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fs.syncs >= 1
    w.seal(30)
    w.close()
    assert not any(t.name.startswith("lamina-wal-flush") for t in threading.enumerate())
    assert logged_ids(wal) == list(range(20))
    assert frontiers(wal, NAME) == (30, 0)


# --- failures -----------------------------------------------------------------------------

def test_fsync_error_fails_the_writer(tmp_path: Path) -> None:
    """An EIO from fdatasync fails the call (StorageError with the errno) and the writer
    for good: every later call raises WriterFailedError, the fsync is never retried.
    Reopening with a healthy FileSystem recovers exactly the acknowledged data; the
    unacknowledged record is not resurrected from the page cache."""
    root = tmp_path / "data"
    wal = new_relation(root)
    fs = FailingSyncFS()
    w = WalWriter(wal, NAME, fs=fs)
    w.append(batch(0, 2, 1))
    w.seal(3)
    fs.ok_syncs = 0
    with pytest.raises(StorageError) as info:
        w.append(batch(10, 2, 3))
    assert info.value.errno == errno.EIO
    calls: list[Callable[[], None]] = [lambda: w.append(batch(20, 1, 3)), lambda: w.seal(9),
                                        lambda: w.allow_compaction(1)]
    for call in calls:
        with pytest.raises(WriterFailedError, match="reopen"):
            call()
    w.close()
    w = WalWriter(wal, NAME)
    assert (w.upper, w.since) == (3, 0)
    w.close()
    assert logged_ids(wal) == [0, 1]
    with Store.open(root) as store:
        assert store.relation(NAME).snapshot(2).column("id").to_pylist() == [0, 1]


def test_fsync_error_under_concurrency(tmp_path: Path) -> None:
    """Threads appending while the disk starts failing: every thread gets an error instead
    of hanging, none is acknowledged after the failure, and after reopen the log holds
    exactly the acknowledged appends."""
    wal = new_relation(tmp_path)
    fs = FailingSyncFS(ok_syncs=15, delay=0.001)
    w = WalWriter(wal, NAME, fs=fs)
    acked: list[int] = []
    failures: list[BaseException] = []
    ids = itertools.count()

    def run() -> None:
        while True:
            i = next(ids)
            try:
                w.append(batch(i, 1, 0))
            except StorageError as exc:
                failures.append(exc)
                return
            acked.append(i)

    pool = [threading.Thread(target=run) for _ in range(6)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in pool)
    assert len(failures) == 6
    assert acked
    w.close()
    WalWriter(wal, NAME).close()
    assert logged_ids(wal) == sorted(acked)


def test_write_error_mid_record_fails_the_writer(tmp_path: Path) -> None:
    """ENOSPC after half a record: the call raises StorageError (ENOSPC), later calls
    WriterFailedError; reopening cuts the half record and keeps what was acknowledged."""
    wal = new_relation(tmp_path)
    fs = FullDiskFS()
    w = WalWriter(wal, NAME, fs=fs)
    w.append(batch(0, 2, 1))
    size = open_segment(wal).stat().st_size
    fs.budget = 50
    with pytest.raises(StorageError) as info:
        w.append(batch(10, 20, 1))
    assert info.value.errno == errno.ENOSPC
    with pytest.raises(WriterFailedError):
        w.append(batch(30, 1, 1))
    w.close()
    w = WalWriter(wal, NAME)
    w.close()
    assert open_segment(wal).stat().st_size == size
    assert logged_ids(wal) == [0, 1]


def test_fsync_error_during_rotation(tmp_path: Path) -> None:
    """A failing sync while finishing a segment fails the seal and the writer; the
    segment is not published as finished, and reopening recovers the acknowledged
    appends with the last acknowledged upper."""
    wal = new_relation(tmp_path)
    fs = FailingSyncFS()
    w = WalWriter(wal, NAME, fs=fs, segment_bytes=4096)
    w.append(batch(0, 300, 1))
    fs.ok_syncs = 0
    with pytest.raises(StorageError):
        w.seal(5)
    with pytest.raises(WriterFailedError):
        w.seal(6)
    w.close()
    assert [s.finished for s in list_segments(wal)] == [False]
    w = WalWriter(wal, NAME)
    assert w.upper == 0
    w.close()
    assert logged_ids(wal) == list(range(300))


# --- compression --------------------------------------------------------------------------

def update_codecs(wal: Path) -> list[tuple[int, str]]:
    """(segment seq, codec) of every UPDATES record of the log, in log order."""
    out = []
    for seg in list_segments(wal):
        scan, _ = scan_file(seg, NAME)
        out.extend((seg.seq, codec_of(r.payload)) for r in scan.updates())
    return out


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_a_store_writes_its_setting_and_every_reader_reads_it(tmp_path: Path,
                                                              compression: Compression) -> None:
    """Store.open(wal_compression=...) writes its appends' records with that setting, in
    finished segments and the open one, and every reader gets the same rows: snapshots
    (trace-less here: the WAL tail), the segment reader and ``lamina verify``; a compressed
    log takes a fraction of the uncompressed one's bytes."""
    from lamina.verify import verify_relation

    sizes = {}
    for c in dict.fromkeys(("none", compression)):
        root = tmp_path / c
        with Store.open(root, wal_compression=c, segment_bytes=8 << 10) as store:
            rel = store.create_relation(NAME, ORDERS, key=["id"])
            for i in range(12):
                rel.append(batch(i * 1000, 1000, i))
                rel.seal(i + 1)
            rel.append(batch(20_000, 10, 12))  # left in the open segment
            rel.seal(13)
            assert rel.snapshot(12).num_rows == 12_010
        wal = root / "wal" / NAME
        assert {codec for _, codec in update_codecs(wal)} == {c}
        assert len([s for s in list_segments(wal) if s.finished]) >= 2
        assert logged_ids(wal) == [*range(12_000), *range(20_000, 20_010)]
        with Store.open(root) as store:  # another process's view, another setting
            assert store.relation(NAME).snapshot(12).column("id").to_pylist() == [
                *range(12_000), *range(20_000, 20_010)]
        report = verify_relation(DataDir(root), NAME)
        assert report.ok, report.problems
        sizes[c] = sum(s.path.stat().st_size for s in list_segments(wal))
    if compression != "none":
        assert sizes[compression] < sizes["none"] / 2


def test_settings_mix_in_one_segment_and_in_a_log(tmp_path: Path) -> None:
    """Writers of different settings, one after the other, append to the same open
    segment; each record keeps the setting it was written with, the segment reads back in
    order, and after rotation the next segment takes the next writer's setting."""
    wal = new_relation(tmp_path, "lz4")
    order: list[Compression] = ["lz4", "none", "zstd", "lz4"]
    for k, c in enumerate(order):
        w = WalWriter(wal, NAME, compression=c)
        w.append(batch(k * 100, 100, k))
        w.close()
    assert update_codecs(wal) == [(1, c) for c in order]
    w = WalWriter(wal, NAME, compression="zstd", segment_bytes=4096)
    w.seal(10)  # past the size target: finishes segment 1
    w.append(batch(1000, 100, 10))
    w.close()
    assert update_codecs(wal) == [*((1, c) for c in order), (2, "zstd")]
    assert logged_ids(wal) == [*range(400), *range(1000, 1100)]


def test_a_version_1_open_segment_takes_uncompressed_records_until_it_finishes(
        tmp_path: Path) -> None:
    """An open segment of format version 1 (an older lamina's) is continued with
    uncompressed records, whatever the setting, so that its version stays true; the
    segment after it is version 2 and compressed; everything reads back."""
    wal = new_relation(tmp_path)
    seg = open_segment(wal)
    seg.write_bytes(encode_header(NAME, 1, 1) + opening_records(0, 0))
    w = WalWriter(wal, NAME, compression="lz4", segment_bytes=4096)
    w.append(batch(0, 200, 1))
    w.seal(2)  # past the size target: finishes the version 1 segment
    w.append(batch(200, 200, 3))
    w.close()
    versions = [scan_file(s, NAME)[0].version for s in list_segments(wal)]
    assert versions == [1, 2]
    assert update_codecs(wal) == [(1, "none"), (2, "lz4")]
    assert logged_ids(wal) == list(range(400))


def test_without_compression_segments_stay_version_1(tmp_path: Path) -> None:
    """A writer that does not compress (the default) creates version 1 segments, which a
    lamina that knows no compression reads: turning compression on is what makes new
    segments version 2."""
    wal = new_relation(tmp_path)
    w = WalWriter(wal, NAME, segment_bytes=4096)
    w.append(batch(0, 100, 1))
    w.seal(2)  # past the size target: a second segment
    w.close()
    w = WalWriter(wal, NAME, compression="zstd", segment_bytes=4096)
    w.append(batch(100, 100, 3))
    w.seal(4)
    w.close()
    versions = [scan_file(s, NAME)[0].version for s in list_segments(wal)]
    assert versions == [1, 1, 2]
    assert logged_ids(wal) == list(range(200))


def test_store_open_refuses_an_unknown_compression(tmp_path: Path) -> None:
    """A wrong wal_compression is an InvalidArgumentError naming the settings, and creates
    nothing."""
    for bad in ("gzip", "LZ4", None, 4):
        with pytest.raises(InvalidArgumentError, match="wal_compression must be one of"):
            Store.open(tmp_path / "d", wal_compression=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "d").exists()


def test_a_damaged_compressed_record_is_reported_by_verify(tmp_path: Path) -> None:
    """A compressed record whose checksum passes but whose buffer does not decompress
    (its declared length changed, the CRC32C recomputed) is a problem ``lamina verify``
    names with file and offset, and a snapshot refuses it as corruption."""
    import struct

    from lamina.verify import verify_relation

    root = tmp_path / "data"
    wal = new_relation(root, "lz4")
    w = WalWriter(wal, NAME, compression="lz4")
    w.append(batch(0, 100, 1))
    w.seal(2)
    w.close()
    seg = open_segment(wal)
    scan, data = scan_file(SegmentFile(seg, 1, False), NAME)
    rec = scan.updates()[0]
    payload = bytearray(rec.payload)
    at = payload.index(b"\x04\x22\x4d\x18") - 8
    (length,) = struct.unpack_from("<q", payload, at)
    struct.pack_into("<q", payload, at, length + 8)
    seg.write_bytes(data[:rec.offset] + frame(RecordType.UPDATES, bytes(payload))
                    + data[rec.end:])
    report = verify_relation(DataDir(root), NAME)
    assert any(f"{seg} at byte {rec.offset}" in p for p in report.problems), report.problems
    with Store.open(root) as store, pytest.raises(CorruptionError) as info:
        store.relation(NAME).snapshot(1)
    assert (info.value.path, info.value.offset) == (seg, rec.offset)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**64 - 1), max_size=6), max_size=4),
       st.integers(0, 12), st.integers(0, 12))
def test_least_time_reads_every_chunk_and_slice(chunks: list[list[int]], start: int,
                                               length: int) -> None:
    """The append's time check takes the least _time of a column of any chunks, sliced
    anywhere, as Arrow's own min does (CLOSED for no rows)."""
    column = pa.chunked_array([pa.array(c, pa.uint64()) for c in chunks], pa.uint64())
    table = pa.table({"_time": column}).slice(start, length)
    values = table.column("_time").to_pylist()
    assert least_time(table.column("_time")) == (min(values) if values else CLOSED)
