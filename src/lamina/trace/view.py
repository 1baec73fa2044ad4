"""The trace side of the read path (see lamina.read): the trace batches and pending parts
a reader opens, and the last WAL segment they already cover.

Parts are objects of the relation's trace store (:meth:`lamina.layout.Layout.trace_store`),
kept open (:class:`OpenPart`) and read whole or row group by row group: with
``verify`` the file is first streamed once through CRC32C (bounded memory); lookups, which
must not read whole files, rely on Parquet's page checksums instead (parts are written with
them, lamina.trace.batch)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from lamina.errors import CorruptionError
from lamina.fs import crc32c
from lamina.layout import Layout
from lamina.objstore.base import ObjectStore
from lamina.schema import RelationMeta
from lamina.trace.batch import BatchDesc, PartFile
from lamina.trace.state import PendingPart, StateStore, TraceState


def current_state(layout: Layout, meta: RelationMeta) -> TraceState | None:
    """The newest trace state of this incarnation of the relation, if any."""
    state = StateStore(layout.trace_store(meta.name)).load_latest()
    if state is None or state.relation_id != meta.relation_id:
        return None
    return state


class OpenPart:
    """One part opened for reading: a :class:`pyarrow.parquet.ParquetFile` over the store's
    reader (``ObjectStore.open_input``). On a local file system an open handle keeps the
    bytes readable after garbage collection unlinks the file, so a long streaming read pins
    what it opened; on an object store a part deleted under a reader older than the grace
    period reads as missing, and the reader retries from a fresh state."""

    def __init__(self, store: ObjectStore, part: PartFile, *, verify: bool,
                 metadata: pq.FileMetaData | None = None) -> None:
        self.part = part
        self.store = store
        self.path = store.location(part.path)
        """Where the part lives (a path or a URL), for messages."""
        self._file: pa.NativeFile = store.open_input(part.path, part.bytes)
        try:
            if verify:
                self._verify()
            # no pre-buffering: it coalesces reads through an I/O thread pool, which for
            # the small, scattered row-group reads of a lookup from a local file cost a
            # third more time (measured; an object store would want it back)
            self.file = pq.ParquetFile(self._file, metadata=metadata, pre_buffer=False,
                                       page_checksum_verification=True)
            if self.file.metadata.num_rows != part.rows:
                raise CorruptionError(f"batch file has {self.file.metadata.num_rows} rows, "
                                      f"its description says {part.rows}", path=self.path)
        except (pa.ArrowException, OSError) as exc:
            self.close()
            if isinstance(exc, FileNotFoundError):
                raise
            raise CorruptionError(f"batch file is not readable Parquet: {exc}",
                                  path=self.path) from exc
        except BaseException:
            self.close()
            raise

    def _verify(self) -> None:
        """Check size and CRC32C in blocks (bounded memory), then rewind."""
        crc, size = 0, 0
        while block := self._file.read(_VERIFY_BLOCK):
            crc = crc32c(block, crc)
            size += len(block)
        if size != self.part.bytes:
            raise CorruptionError(f"batch file has {size} bytes, its description says "
                                  f"{self.part.bytes}", path=self.path)
        if crc != self.part.crc32c:
            raise CorruptionError("batch file checksum mismatch", path=self.path)
        self._file.seek(0)

    def close(self) -> None:
        self._file.close()


_VERIFY_BLOCK = 8 << 20


@dataclass
class PinnedView:
    """The files of one consistent read, opened: trace parts (batch by batch, in key
    order within a batch), pending parts and the WAL tail's segments (read at open time).
    Close it when done; :func:`lamina.read.pin` builds it with the state-first protocol."""

    state: TraceState | None
    batches: list[tuple[BatchDesc, list[OpenPart]]]
    pending: list[tuple[PendingPart, OpenPart]]
    wal: list[pa.Table]

    @property
    def since(self) -> int:
        return self.state.since if self.state is not None else 0

    def parts(self, lo: int, hi: int) -> Iterator[tuple[OpenPart, bool]]:
        """Every opened part, batch parts first (in batch order, key order within a
        batch), then pending parts, each with ``whole``: True when all its times are known
        to lie in ``[lo, hi]`` (a batch with ``lo <= lower`` and ``upper - 1 <= hi``: its
        times are below its upper, or forwarded to its since, which readers keep at or below
        ``hi``), so the reader needs no time filter; pending parts are never whole."""
        for b, parts in self.batches:
            whole = lo <= b.lower and b.upper - 1 <= hi
            for p in parts:
                yield p, whole
        for _, p in self.pending:
            yield p, False

    def close(self) -> None:
        for _, parts in self.batches:
            for p in parts:
                p.close()
        for _, p in self.pending:
            p.close()

    def __enter__(self) -> PinnedView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Footers = Callable[[ObjectStore, PartFile], "pq.FileMetaData | None"]
"""Known footers of immutable part files (lamina.lookup caches them), or None."""


def open_view(layout: Layout, meta: RelationMeta, state: TraceState | None,
              lo: int, hi: int, *, verify: bool, footers: Footers | None = None) -> tuple[
                  list[tuple[BatchDesc, list[OpenPart]]], list[tuple[PendingPart, OpenPart]]]:
    """Open the batch and pending parts of ``state`` whose time range meets ``[lo, hi]``.
    A batch may also hold times forwarded to its since; readers that need them (snapshots,
    lo = 0) get them, and a subscription checks they do not cross its frontier
    (lamina.subscribe). FileNotFoundError passes through (retry from a fresh state)."""
    if state is None:
        return [], []
    store = layout.trace_store(meta.name)
    batches: list[tuple[BatchDesc, list[OpenPart]]] = []
    pending: list[tuple[PendingPart, OpenPart]] = []
    try:
        for b in state.batches:
            if b.lower <= hi and b.upper > lo:
                parts: list[OpenPart] = []
                batches.append((b, parts))
                for p in b.parts:
                    md = footers(store, p) if footers is not None else None
                    parts.append(OpenPart(store, p, verify=verify, metadata=md))
        for pp in state.pending:
            if pp.lower <= hi and pp.upper > lo:
                md = footers(store, pp.part) if footers is not None else None
                pending.append((pp, OpenPart(store, pp.part, verify=verify, metadata=md)))
    except BaseException:
        PinnedView(state, batches, pending, []).close()
        raise
    return batches, pending
