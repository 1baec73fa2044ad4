"""The writer of one relation's write-ahead log.

One :class:`WalWriter` per relation at a time, enforced with ``fcntl.flock`` on the
relation's ``LOCK`` file (a second writer, in this process or another, gets LockedError).

Durability (docs/architecture.md, crash-safety rules):

- ``fsync="always"`` (default): a call returns after fdatasync covered its record. Group
  commit: threads that wrote while another thread was syncing wait for that sync or the
  next one, so N concurrent appends cost far fewer than N fsyncs.
- ``fsync="interval"``: a background thread syncs every ``fsync_interval`` seconds; a
  crash may lose calls acknowledged within the last interval.
- ``fsync="never"``: the OS decides (tests, scratch data). Finishing a segment still
  syncs, so finished segments are always complete.
- A write or sync error fails the writer for good (no retried fsync trusted to the page
  cache): every later call raises WriterFailedError; the open segment is cut back to the
  records acknowledged before the failure; reopening recovers from disk.

Sealing a record last: an UPDATES record is written with a header of zeros
(``lamina.wal.record.UNSEALED``), and with ``fsync="always"`` its write-back is started at
once (``sync_file_range``); while the disk takes its bytes, the appending thread checks
the updates (the caller's ``check``, the diffs' range for ``Relation.append``; the times
against the upper) and computes the CRC32C, then writes the real header over the zeros
(``AppendFile.patch``), and the fdatasync of group commit follows. That CPU work used to
run between two syncs while the disk idled, and cost a fifth of a 10,000-update append
(docs/performance.md, "WAL append"). All of it happens under the writer's lock, so no
later record is written, let alone synced, before an earlier one is sealed. Until sealed,
the record is a bad frame (type 0) at the end of the open segment: a reader stops there
(one whose read raced the seal and the next record reads the file again:
lamina.wal.segment.read_past_seal_races), and recovery after a crash cuts it off as a
torn tail, as it would a half-written record. An append whose check fails is cut off again
(``ftruncate`` to where it began; if that fails, the writer fails and its reopen cuts it),
so a rejected append leaves the log as it was. Frontier records are small and written
whole.

Compression: ``compression`` ("none", "lz4" or "zstd") is how this writer writes the
buffers of its UPDATES records (lamina.wal.record). It creates segments of format version
2 when it compresses and of version 1 when it does not (lamina.wal.segment.version_for:
uncompressed data stays readable by a lamina without compression); into a version 1 open
segment it recovers it writes uncompressed records until that segment finishes. Readers
take every record as it is, so a log may mix settings.

Rotation: ``seal`` writes a PROGRESS record; when the open segment has passed
``segment_bytes``, or is older than ``segment_max_age`` seconds and holds something to
convert (an update, or an upper past its lower), the next segment is created with
PROGRESS(upper) and SINCE(since) and synced (file and directory), and only then is the
old one finished (sync, rename ``.wal.open`` to ``.wal``, sync the directory). So at every
crash point some open segment holds both frontiers, even after the compacter deleted every
finished segment.

Recovery on open: the open segment keeps its longest valid prefix (a torn tail is cut off
and the cut synced). Two open segments in a row mean a crash during rotation: if the newer
one's opening is complete the older is finished now, else the newer is removed and the
older stays open.

``close(finish=True)`` (what ``Relation.close`` and ``Store.close`` use) first finishes an
open segment that holds something to convert, as a seal that rotates would, so a
coordinator that closes its store and goes quiet leaves nothing in the open segment for
the compacter to wait for.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from lamina import failpoints
from lamina.errors import (
    CorruptionError,
    FrontierRegressionError,
    InvalidArgumentError,
    StorageError,
    UpdateBeforeUpperError,
    WriterFailedError,
)
from lamina.frontier import CLOSED, check_frontier, fmt
from lamina.fs import AppendFile, FileSystem
from lamina.layout import LOCK_NAME
from lamina.lock import DirLock
from lamina.schema import DIFF, TIME, all_nullable
from lamina.wal.record import (
    COMPRESSIONS,
    HEADER_SIZE,
    MAX_PAYLOAD,
    Compression,
    RecordType,
    UpdatesEncoder,
    encode_frontier,
    frame,
)
from lamina.wal.segment import (
    Scan,
    SegmentFile,
    encode_header,
    list_segments,
    opening_records,
    scan_file,
    segment_name,
    version_for,
)

_PAGE = 4096
"""The page size write-back works in (``sync_file_range`` rounds to it)."""

FsyncPolicy = Literal["always", "interval", "never"]
FSYNC_POLICIES: tuple[str, ...] = ("always", "interval", "never")


def least_time(times: pa.ChunkedArray) -> int:
    """The least of a ``_time`` column (``CLOSED`` if it is empty).

    numpy over each chunk's value buffer (``_time`` has no nulls), not ``pc.min_max``:
    for one append's column Arrow's function dispatch (options, kernel selection and
    init, result scalars) cost three times the pass itself, and the check a sixth of
    ``Relation.append``'s samples in the append loop's profile (docs/performance.md)."""
    least = CLOSED
    for chunk in times.chunks:
        if len(chunk):
            values = np.frombuffer(chunk.buffers()[1], np.uint64, len(chunk), chunk.offset * 8)
            least = min(least, int(np.minimum.reduce(values)))
    return least


class WalWriter:
    """Appends updates and frontiers to one relation's log. Thread-safe."""

    def __init__(self, wal_dir: Path, relation: str, *, fs: FileSystem | None = None,
                 fsync: FsyncPolicy = "always", segment_bytes: int = 64 << 20,
                 fsync_interval: float = 0.1, segment_max_age: float = 60.0,
                 compression: Compression = "none",
                 update_schema: pa.Schema | None = None) -> None:
        if fsync not in FSYNC_POLICIES:
            raise InvalidArgumentError(f"fsync policy {fsync!r} is not one of {FSYNC_POLICIES}")
        if compression not in COMPRESSIONS:
            raise InvalidArgumentError(f"WAL compression {compression!r} is not one of "
                                       f"{COMPRESSIONS}")
        if segment_bytes < 4096:
            raise InvalidArgumentError(f"segment_bytes {segment_bytes} is below the minimum "
                                       "of 4096")
        self.dir = wal_dir
        self.relation = relation
        self.fs = fs or FileSystem()
        self.policy = fsync
        self.compression: Compression = compression
        self.segment_bytes = segment_bytes
        if not segment_max_age > 0:
            raise InvalidArgumentError(f"segment_max_age must be > 0 seconds, got "
                                       f"{segment_max_age!r}")
        self.segment_max_age = segment_max_age
        self._lock = DirLock(wal_dir / LOCK_NAME, f"relation {relation!r}")
        self._mu = threading.Lock()  # file writes and frontier state
        self._sync_cv = threading.Condition()  # group commit
        self._syncing = False
        self._written = 0  # records written, a sequence number for group commit
        self._synced = 0
        self._failed: BaseException | None = None
        self._closed = False
        self._tail_progress = False  # the open segment ends with a PROGRESS record
        self._segment_lower = 0  # the open segment's lower
        self._segment_updates = False  # the open segment holds an UPDATES record
        self._segment_version = version_for(compression)  # the open segment's version
        self._segment_born = time.monotonic()  # when this writer opened or created it
        self._encoders = threading.local()  # each appending thread's UpdatesEncoders
        self.update_schema = update_schema  # what records declare (append)
        self._loose = None if update_schema is None else all_nullable(update_schema)
        try:
            self._file, self.seq, self._upper, self._since = self._recover()
        except BaseException:
            self._lock.close()
            raise
        # Bytes of the open segment that every acknowledged call lies within: what a
        # failure cuts back to (see _fail).
        self._acked_size = self._file.size
        self._flusher: threading.Thread | None = None
        if fsync == "interval":
            self._stop = threading.Event()
            self._flusher = threading.Thread(target=self._flush_loop, args=(fsync_interval,),
                                             name=f"lamina-wal-flush-{relation}", daemon=True)
            self._flusher.start()

    # --- recovery -----------------------------------------------------------------------
    def _recover(self) -> tuple[AppendFile, int, int, int]:
        segments = list_segments(self.dir)
        opened = [s for s in segments if not s.finished]
        if len(opened) > 2 or (len(opened) == 2 and opened[1].seq != opened[0].seq + 1):
            raise CorruptionError(f"relation {self.relation!r} has open segments "
                                  f"{[s.seq for s in opened]}; expected one, or two in a row "
                                  "after a crash during rotation", path=opened[-1].path)
        if opened and segments[-1] is not opened[-1]:
            raise CorruptionError("the open segment is older than a finished one",
                                  path=opened[-1].path)
        if len(opened) == 2:
            # A crash during rotation: the next segment was being created, or was created
            # and synced but the old one not yet renamed (see _rotate).
            older, newer = opened
            if len(scan_file(newer, self.relation)[0].records) >= 2:
                self.fs.rename(older.path, self.dir / segment_name(older.seq, finished=True))
                opened = [newer]
            else:
                self.fs.unlink(newer.path)
                opened = [older]
        if opened:
            seg = opened[0]
            scan, _ = scan_file(seg, self.relation)
            # A segment opens with PROGRESS(lower) and SINCE(since), written at once; with
            # fewer records its opening was torn (keeping it would lose the since).
            if len(scan.records) >= 2:
                handle = self.fs.open_append(seg.path)
                if scan.torn_at is not None:
                    handle.truncate(scan.valid_end)
                    handle.sync()
                self._tail_progress = scan.records[-1].rtype is RecordType.PROGRESS
                self._segment_lower = scan.lower
                self._segment_updates = bool(scan.updates())
                self._segment_version = scan.version
                return handle, seg.seq, scan.upper, scan.since
            # A torn opening can only be left by an older lamina (rotation now makes the
            # next segment durable first) or by damage. Nothing in it was acknowledged.
            prev = [s for s in segments if s.finished]
            if not prev and seg.seq != 1:
                raise CorruptionError(
                    f"relation {self.relation!r}: the open segment's opening is torn and no "
                    "finished segment is left to recover the frontiers from", path=seg.path)
            self.fs.unlink(seg.path)
            lower, since = self._frontiers_of(prev[-1]) if prev else (0, 0)
            self._segment_lower = lower
            return self._create_segment(seg.seq, lower, since), seg.seq, lower, since
        finished = [s for s in segments if s.finished]
        if not finished:
            raise CorruptionError(f"relation {self.relation!r} has no segments", path=self.dir)
        lower, since = self._frontiers_of(finished[-1])
        seq = finished[-1].seq + 1
        self._segment_lower = lower
        return self._create_segment(seq, lower, since), seq, lower, since

    def _frontiers_of(self, seg: SegmentFile) -> tuple[int, int]:
        scan: Scan = scan_file(seg, self.relation)[0]
        return scan.upper, scan.since

    def _create_segment(self, seq: int, lower: int, since: int) -> AppendFile:
        path = self.dir / segment_name(seq, finished=False)
        handle = self.fs.open_append(path, create=True)
        try:
            handle.write(encode_header(self.relation, seq, version_for(self.compression))
                         + opening_records(lower, since))
            handle.sync()
            self.fs.fsync_dir(self.dir)
        except BaseException:
            handle.close()
            raise
        return handle

    # --- public state -------------------------------------------------------------------
    @property
    def upper(self) -> int:
        return self._upper

    @property
    def since(self) -> int:
        return self._since

    # --- writes ---------------------------------------------------------------------------
    def append(self, table: pa.Table,
               check: Callable[[pa.Table], object] | None = None) -> None:
        """Write one UPDATES record for ``table`` (already conformed to the schema; with
        ``update_schema`` given, a table of that schema with every field nullable is
        written under it as it is: its caller checked the non-nullable columns for nulls,
        lamina.schema.checked_updates).

        ``check(table)``, if given, runs while the record's bytes are on their way to the
        disk (module docstring, "Sealing a record last"); if it raises, or an update's time
        is below the upper, the record is cut off again and the exception propagates:
        nothing was appended."""
        if table.num_rows == 0:
            if check is not None:
                check(table)
            return
        # Read without the lock: a segment's version only ever rises (a version 1 open
        # segment is followed by version 2 ones), so a stale read writes an uncompressed
        # record into a version 2 segment, which is legal.
        codec = self.compression if self._segment_version >= 2 else "none"
        encoder = self._encoder_for(table.schema, codec)
        if codec != "none" and table.nbytes > MAX_PAYLOAD:  # readers rely on the bound
            raise InvalidArgumentError(f"append of {table.nbytes} bytes of columns exceeds "
                                       f"the {MAX_PAYLOAD}-byte record limit; split the "
                                       "table")
        record, size = encoder.encode_unsealed(table)  # pieces, written with one writev
        if size - HEADER_SIZE > MAX_PAYLOAD:
            raise InvalidArgumentError(f"append of {size - HEADER_SIZE} encoded bytes "
                                       f"exceeds the {MAX_PAYLOAD}-byte record limit; split "
                                       "the table")
        with self._mu:
            self._check_usable()
            seqno = self._write_updates(encoder, record, size, table, check)
            self._segment_updates = True
        self._await_durable(seqno)

    def _encoder_for(self, schema: pa.Schema, codec: Compression) -> UpdatesEncoder:
        """This thread's encoder for tables of ``schema``. The last two are kept, so a
        caller alternating between two forms of its tables (built with ``pa.table()``, and
        of the exact schema) does not build an encoder per append."""
        kept: list[UpdatesEncoder] = getattr(self._encoders, "kept", None) or []
        for i, encoder in enumerate(kept):
            if encoder.compression == codec and encoder.batches.equals(schema,
                                                                       check_metadata=True):
                if i:
                    kept.reverse()
                return encoder
        encoder = self._encoder(schema, codec)
        self._encoders.kept = [encoder, *kept[:1]]
        return encoder

    def _encoder(self, schema: pa.Schema, codec: Compression) -> UpdatesEncoder:
        """An encoder for tables of ``schema``, declaring ``update_schema`` where they are
        its loose form (every field nullable), else ``schema`` itself."""
        if schema.names[-2:] != [TIME, DIFF]:  # what least_time relies on
            raise InvalidArgumentError(f"updates for relation {self.relation!r} are not "
                                       f"a conformed update table: {schema.names}")
        if self._loose is not None and schema.equals(self._loose, check_metadata=True):
            return UpdatesEncoder(self.update_schema, codec, batches=schema)
        return UpdatesEncoder(schema, codec)

    def _write_updates(self, encoder: UpdatesEncoder, record: list[Any], size: int,
                       table: pa.Table, check: Callable[[pa.Table], object] | None) -> int:
        """Write an unsealed record, start its write-back, check the updates and compute
        the checksum meanwhile, then seal it (module docstring); caller holds ``_mu``."""
        start = self._file.size
        try:
            if failpoints.ACTIVE:  # some fail point configured (tests, drills): rare
                self._write_torn(record)
            else:
                self._file.writev(record)
            if self.policy == "always":  # the header's page is left to the fdatasync
                self._file.start_writeback(-(-(start + HEADER_SIZE) // _PAGE) * _PAGE,
                                           start + size)
        except StorageError as exc:
            self._fail(exc)
            raise
        try:
            if check is not None:
                check(table)
            # by position (a conformed table ends with _time, _diff): a lookup by name
            # cost a third as much as the pass over the column
            min_time = least_time(table.column(table.num_columns - 2))
            if min_time < self._upper:
                raise UpdateBeforeUpperError(
                    f"relation {self.relation!r}: an update has time {min_time}, below the "
                    f"sealed upper {fmt(self._upper)}; times below the upper are closed, so "
                    "send it at a time >= the upper")
            header = encoder.header(record, size)
        except BaseException:
            self._cut_back(start)
            raise
        failpoints.hit("wal.before_seal")
        try:
            self._file.patch(start, header)
        except StorageError as exc:
            self._fail(exc)
            raise
        return self._written_one(progress=False)

    def _cut_back(self, size: int) -> None:
        """Remove an unsealed record again (a rejected append); caller holds ``_mu``. If
        that fails, the writer fails (``_fail``): its reopen's recovery cuts it as a torn
        tail."""
        try:
            self._file.truncate(size)
        except StorageError as exc:
            self._fail(exc)

    def seal(self, upper: int) -> None:
        """Promise no update at a time below ``upper`` will arrive."""
        upper = check_frontier(upper, "upper")
        with self._mu:
            self._check_usable()
            if upper < self._upper:
                raise FrontierRegressionError(
                    f"relation {self.relation!r}: seal({fmt(upper)}) would move the upper "
                    f"backwards from {fmt(self._upper)}; an upper never decreases")
            if upper == self._upper:
                return
            seqno = self._write(frame(RecordType.PROGRESS, encode_frontier(upper)),
                                progress=True)
            self._upper = upper
            # The empty frontier closes the relation: finish the segment whatever its size,
            # so the compacter converts everything (nothing can be sealed after it).
            rotate = self._finish_due() or upper == CLOSED
        if rotate:
            self._rotate(force=upper == CLOSED)
        self._await_durable(seqno)

    def allow_compaction(self, since: int) -> None:
        """Allow history before ``since`` to be forgotten."""
        since = check_frontier(since, "since")
        with self._mu:
            self._check_usable()
            if since < self._since:
                raise FrontierRegressionError(
                    f"relation {self.relation!r}: allow_compaction({fmt(since)}) would move "
                    f"since backwards from {fmt(self._since)}; since never decreases")
            if since > self._upper:
                raise FrontierRegressionError(
                    f"relation {self.relation!r}: since {fmt(since)} is beyond the sealed "
                    f"upper {fmt(self._upper)}; seal up to it first")
            if since == self._since:
                return
            seqno = self._write(frame(RecordType.SINCE, encode_frontier(since)))
            self._since = since
        self._await_durable(seqno)

    def _write(self, data: bytes, *, progress: bool = False) -> int:
        """Append one frontier record (``frame``'s bytes) to the open segment; caller holds
        ``_mu``."""
        try:
            if failpoints.ACTIVE:  # some fail point configured (tests, drills): rare
                self._write_torn(data)
            else:
                self._file.write(data)
        except StorageError as exc:
            self._fail(exc)
            raise
        return self._written_one(progress=progress)

    def _written_one(self, *, progress: bool) -> int:
        """Account for a record just written whole; its sequence number for group commit."""
        failpoints.hit("wal.after_write")
        self._tail_progress = progress
        if self.policy != "always":  # acknowledged once written
            self._acked_size = self._file.size
        self._written += 1
        return self._written

    def _write_torn(self, data: bytes | list[Any]) -> None:
        """A record's write while fail points are configured. On the pass where
        ``wal.mid_record`` fires, half the record is written before its action (a kill or
        an injected error leaves that half as a torn tail; after a sleep the rest
        follows). Off the hot path: an append with no fail point configured pays one
        truthiness test of an empty dict for it. (Deciding at open would miss points
        configured at run time, ``failpoints.active``, for a writer already open.)"""
        record = memoryview(b"".join(data) if isinstance(data, list) else data)
        if failpoints.fires("wal.mid_record"):
            half = len(record) // 2
            self._file.write(record[:half])
            failpoints.act("wal.mid_record")
            record = record[half:]
        self._file.write(record)

    def _check_usable(self) -> None:
        if self._closed:
            raise InvalidArgumentError(f"the writer of relation {self.relation!r} is closed")
        if self._failed is not None:
            raise WriterFailedError(
                f"the writer of relation {self.relation!r} stopped after an I/O error "
                f"({self._failed}); close and reopen the store to recover from disk")

    def _fail(self, exc: BaseException) -> None:
        """Stop the writer for good; caller holds ``_mu``. The open segment is cut back to
        what was acknowledged: a failed fsync leaves unsynced records in the page cache
        (possibly marked clean yet never written), and a reopen must neither read them as
        if they were durable nor append durable records after a hole."""
        if self._failed is None:
            self._failed = exc
            with contextlib.suppress(StorageError):
                self._file.truncate(self._acked_size)

    # --- group commit -----------------------------------------------------------------------
    def _await_durable(self, seqno: int) -> None:
        if self.policy != "always":
            return
        with self._sync_cv:
            while self._synced < seqno:
                if self._failed is not None:
                    raise WriterFailedError(f"relation {self.relation!r}: the sync covering "
                                            f"this call failed: {self._failed}")
                if self._syncing:
                    self._sync_cv.wait()
                    continue
                self._syncing = True
                self._sync_cv.release()
                try:
                    self._sync_once()
                finally:
                    self._sync_cv.acquire()
                    self._syncing = False
                    self._sync_cv.notify_all()
            if self._failed is not None and self._synced < seqno:
                raise WriterFailedError(str(self._failed))

    def _sync_once(self) -> None:
        """fdatasync what was written so far; the caller holds the sync token."""
        with self._mu:
            target, handle, size = self._written, self._file, self._file.size
        if self._failed is not None:
            return
        try:
            handle.sync()
        except StorageError as exc:
            with self._mu:
                self._fail(exc)
            raise
        with self._mu:
            self._acked_size = max(self._acked_size, size)
        with self._sync_cv:
            self._synced = max(self._synced, target)

    def _flush_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self._sync_token(lambda: self._sync_once() if self._synced < self._written else None)

    def _sync_token(self, fn: object) -> None:
        """Run ``fn`` holding the sync token (no other sync or rotation runs meanwhile)."""
        with self._sync_cv:
            while self._syncing:
                self._sync_cv.wait()
            self._syncing = True
        try:
            with contextlib.suppress(StorageError):
                fn()  # type: ignore[operator]
        finally:
            with self._sync_cv:
                self._syncing = False
                self._sync_cv.notify_all()

    # --- rotation -------------------------------------------------------------------------
    def _holds_work(self) -> bool:
        """The open segment holds something to convert: an update or an advanced upper."""
        return self._segment_updates or self._upper > self._segment_lower

    def _finish_due(self) -> bool:
        """The open segment should finish at this seal: past the size target, or past the
        age limit with something to convert. Caller holds ``_mu``."""
        if self._file.size >= self.segment_bytes:
            return True
        return (time.monotonic() - self._segment_born >= self.segment_max_age
                and self._holds_work())

    def _rotate(self, *, force: bool = False) -> None:
        """Finish the open segment and start the next one."""
        errors: list[BaseException] = []

        def rotate() -> None:
            with self._mu:
                # Calls may have run between the seal and this point: another rotation
                # (then this segment is new and small), or appends and since records
                # after the seal's PROGRESS (then the segment needs a closing PROGRESS).
                if self._failed is not None:
                    return
                if not (force or self._finish_due()):
                    return
                if force and not self._holds_work():
                    return  # already rotated, or nothing to convert
                try:
                    if not self._tail_progress:
                        self._write(frame(RecordType.PROGRESS, encode_frontier(self._upper)),
                                    progress=True)
                    # The next segment is durable before the old one is finished, so at
                    # every crash point an open segment holds the frontiers, even after
                    # the compacter converted and deleted every finished segment.
                    old, seq = self._file, self.seq
                    old.sync()
                    # Durable now, closing PROGRESS included: a failure from here on must
                    # not cut it off, or the next segment (which starts at this upper)
                    # would follow an old one that no longer ends there.
                    self._acked_size = old.size
                    new = self._create_segment(seq + 1, self._upper, self._since)
                    try:
                        self.fs.rename(old.path, self.dir / segment_name(seq, finished=True))
                    except StorageError:
                        new.close()
                        raise
                    old.close()
                    self._file = new
                    self.seq = seq + 1
                    self._tail_progress = False
                    self._segment_lower = self._upper
                    self._segment_updates = False
                    self._segment_version = version_for(self.compression)
                    self._segment_born = time.monotonic()
                    self._acked_size = self._file.size
                    with self._sync_cv:
                        self._synced = self._written
                except StorageError as exc:
                    self._fail(exc)
                    errors.append(exc)

        self._sync_token(rotate)
        if errors:
            raise errors[0]
        self._check_usable()

    def close(self, *, finish: bool = False) -> None:
        """Sync what was written (under any policy) and release the lock. With ``finish``,
        first finish an open segment that holds something to convert; a failure to finish
        leaves the segment open, as a crash would, and the next writer recovers it."""
        if self._closed:
            return
        with self._mu:
            finish = finish and self._failed is None and self._holds_work()
        if finish:
            with contextlib.suppress(StorageError):
                self._rotate(force=True)
        if self._flusher is not None:
            self._stop.set()
            self._flusher.join()
        with self._mu:
            if self._failed is None:
                with contextlib.suppress(StorageError):
                    self._file.sync()
            self._file.close()
            self._closed = True
        self._lock.close()
