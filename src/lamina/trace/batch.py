"""Trace batches: immutable Parquet parts plus a description.

A batch covers the half-open time interval ``[lower, upper)``. Its rows are updates
(row columns, ``_time`` uint64, ``_diff`` int64), consolidated (no two rows with equal row
and time but a sum outside int64 kept as a carry, see :mod:`lamina.consolidate`; no zero
diff) and ordered by (key columns, other row columns, time) across its
parts in order. A time below ``lower`` only appears as the batch's ``since``, where logical
compaction forwarded it.

Files are objects of the relation's trace (:class:`~lamina.objstore.base.ObjectStore`,
names from :class:`lamina.layout.TraceLayout`)::

    batches/<batch id>/part-00000.parquet   parts of one batch, written by parallel tasks
    pending/<part id>.parquet               future updates (lamina.trace.pending)

Ids are fresh per attempt (crash-safety rule 4, docs/architecture.md): a step re-run after a crash
writes new
files, and only what the published state names is data; the rest is garbage.

Every file appears whole or not at all (``ObjectStore.writer``: on a directory temp +
fsync + rename + directory fsync, on S3 one put), and its CRC32C is recorded in the
description and checked on every read.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from lamina import kernels
from lamina.errors import CorruptionError
from lamina.fs import crc32c
from lamina.trace.parquet import FileMetaData, ParquetFile

if TYPE_CHECKING:
    from lamina.objstore.base import ObjectStore

PARQUET_COMPRESSION = "zstd"
PARQUET_COMPRESSION_LEVEL = 1
ROW_GROUP_ROWS = 1 << 12
"""Rows per Parquet row group of a part. Parts are sorted by key, so each row group's
min/max statistics bound a narrow key range and a key lookup (lamina.read.lookup) decodes only
the row groups that can hold its keys: smaller groups read less per key, larger ones
compress and scan a little better (docs/performance.md, "Reading")."""


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:16]}"


@dataclass(frozen=True)
class PartFile:
    """One Parquet file: its path relative to the trace directory, rows, bytes, CRC32C."""

    path: str
    rows: int
    bytes: int
    crc32c: int

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "rows": self.rows, "bytes": self.bytes,
                "crc32c": self.crc32c}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PartFile:
        return cls(path=str(d["path"]), rows=int(d["rows"]), bytes=int(d["bytes"]),
                   crc32c=int(d["crc32c"]))


@dataclass(frozen=True)
class BatchDesc:
    """The description of one trace batch."""

    id: str
    lower: int
    upper: int
    since: int
    level: int
    parts: tuple[PartFile, ...]

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.parts)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "lower": self.lower, "upper": self.upper, "since": self.since,
                "level": self.level, "rows": self.rows, "bytes": self.bytes,
                "parts": [p.to_dict() for p in self.parts]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BatchDesc:
        desc = cls(id=str(d["id"]), lower=int(d["lower"]), upper=int(d["upper"]),
                   since=int(d["since"]), level=int(d["level"]),
                   parts=tuple(PartFile.from_dict(p) for p in d["parts"]))
        if desc.rows != int(d["rows"]) or desc.bytes != int(d["bytes"]):
            raise ValueError(f"batch {desc.id}: row or byte totals disagree with its parts")
        return desc


DICTIONARY_MAX_DISTINCT = 0.5
"""A column that is not delta-encoded gets a dictionary only when a row group's worth of its
first rows holds at most this share of distinct values... (:func:`parquet_options`)"""
DICTIONARY_MIN_RUNS = 3
"""...and at least this many runs of equal neighbours per distinct value: its values recur
apart from each other, which zstd over plain values does not catch as well."""


def wants_dictionary(head: pa.Array | pa.ChunkedArray) -> bool:
    """Whether a column whose first row group's worth of values is ``head`` gets a Parquet
    dictionary (:func:`parquet_options`): few distinct values, recurring apart."""
    rows = len(head)
    distinct = kernels.count_distinct(head)
    if rows == 0 or distinct > DICTIONARY_MAX_DISTINCT * rows:
        return False
    changes = int(kernels.sum(kernels.not_equal(head.slice(1), head.slice(0, rows - 1)))
                  .as_py() or 0)
    return changes + 1 >= DICTIONARY_MIN_RUNS * distinct


def parquet_options(schema: pa.Schema, sample: pa.Table | pa.RecordBatch | None = None
                    ) -> dict[str, Any]:
    """How parts are encoded: zstd level 1; integer, date and timestamp columns (stored as
    Parquet INT32/INT64) with DELTA_BINARY_PACKED and no dictionary. Rows are sorted by key
    and then time, so the deltas are small: the 10M-update conversion of bench/convert.py
    writes 25.7 MB where the dictionary default wrote 41.8 MB (docs/performance.md).

    The other columns (strings, binary, floats, ...) get a dictionary only where it pays,
    judged from the first ``ROW_GROUP_ROWS`` rows of ``sample`` (the part's first rows) by
    :func:`wants_dictionary`: a dictionary is built per row group, so a column of mostly
    distinct values gains nothing from it and pays for hashing every value, and a column
    whose values come in runs (a function of the key, in rows sorted by key) compresses
    better plain, since zstd takes each run as one match. Measured on 2M rows of a
    12-character string (docs/performance.md, "Dictionaries only where values recur apart"):
    in runs of about ten, plain took 27% less CPU to encode, 19% less to read and half the
    bytes; 200,000 values in random order, 37%, 22% and 29% less; 20 to 1,000 values in
    random order are where the dictionary is smaller (3.89 against 4.81 MB for 1,000
    values), at about the same CPU (``python -m bench.profile encodings``). Arrow's writer
    has no such check of its own; parquet-mr falls back to plain when a dictionary does not
    shrink the column. Without a sample every such column gets a dictionary."""
    delta = [f.name for f in schema if pa.types.is_integer(f.type)
             or pa.types.is_date32(f.type) or pa.types.is_timestamp(f.type)]
    dictionary = [f.name for f in schema if f.name not in delta]
    if sample is not None and sample.num_rows:
        head = sample.slice(0, ROW_GROUP_ROWS)
        dictionary = [name for name in dictionary if name in head.column_names
                      and wants_dictionary(head.column(name))]
    return {"compression": PARQUET_COMPRESSION,
            "compression_level": PARQUET_COMPRESSION_LEVEL,
            "use_dictionary": dictionary,
            "column_encoding": dict.fromkeys(delta, "DELTA_BINARY_PACKED"),
            "write_statistics": True, "write_page_checksum": True}


def write_part(store: ObjectStore, key: str, schema: pa.Schema,
               tables: Iterable[pa.Table | pa.RecordBatch]) -> PartFile:
    """Write ``tables`` (already ordered) as one Parquet object, durably; return its entry.
    Which columns get a dictionary is decided from the first rows
    (:func:`parquet_options`)."""
    import pyarrow.parquet as pq  # the writer: not on the read path (lamina.trace.parquet)

    rows = 0
    pending = iter(tables)
    first = next((t for t in pending if t.num_rows), None)
    with store.writer(key) as out:
        writer = pq.ParquetWriter(out, schema, **parquet_options(schema, first))
        try:
            for t in itertools.chain([first] if first is not None else [], pending):
                if t.num_rows:
                    writer.write(t if t.schema.equals(schema) else t.cast(schema),
                                 row_group_size=ROW_GROUP_ROWS)
                    rows += t.num_rows
        finally:
            writer.close()
        size, crc = out.tell(), out.crc32c
    return PartFile(path=key, rows=rows, bytes=size, crc32c=crc)


def read_part(store: ObjectStore, part: PartFile, columns: list[str] | None = None
              ) -> pa.Table:
    """Read one part, checking size and checksum first. FileNotFoundError passes through
    (a reader racing garbage collection retries); damage raises CorruptionError."""
    where = store.location(part.path)
    data = store.get(part.path)
    if len(data) != part.bytes:
        raise CorruptionError(f"batch file has {len(data)} bytes, its description says "
                              f"{part.bytes}", path=where)
    if crc32c(data) != part.crc32c:
        raise CorruptionError("batch file checksum mismatch", path=where)
    try:
        table = ParquetFile(pa.BufferReader(data), page_checksum_verification=False
                            ).read(columns)  # the whole file's CRC32C is checked above
    except (pa.ArrowException, OSError) as exc:
        raise CorruptionError(f"batch file is not readable Parquet: {exc}", path=where) from exc
    if table.num_rows != part.rows:
        raise CorruptionError(f"batch file has {table.num_rows} rows, its description says "
                              f"{part.rows}", path=where)
    return table


VERIFY_BLOCK = 1 << 20
"""Bytes a part's whole-file CRC32C check reads at a time, into one reused buffer."""


class OpenPart:
    """One part opened for reading: a :class:`lamina.trace.parquet.ParquetFile` over the store's
    reader (``ObjectStore.open_input``), verifying the pages it reads by their checksums
    and, with ``verify``, the whole file's size and CRC32C first (readers, and the one-pass
    merge's tasks, lamina.compacter.step.merge). A read's lease keeps the part in the store until
    the read ends (lamina.trace.lease); on a local file system the open handle alone also
    keeps its bytes readable after garbage collection unlinks the file."""

    def __init__(self, store: ObjectStore, part: PartFile, *, verify: bool,
                 metadata: FileMetaData | None = None) -> None:
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
            self.file = ParquetFile(self._file, metadata=metadata)
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
        """Check size and CRC32C in blocks into one reused buffer (bounded memory; a new
        8 MiB ``bytes`` per block took twice as long, most of it the page faults of its
        fresh memory: docs/performance.md), then rewind."""
        crc, size = 0, 0
        block = bytearray(VERIFY_BLOCK)
        view = memoryview(block)
        while n := self._file.readinto(block):
            crc = crc32c(view[:n], crc)
            size += n
        if size != self.part.bytes:
            raise CorruptionError(f"batch file has {size} bytes, its description says "
                                  f"{self.part.bytes}", path=self.path)
        if crc != self.part.crc32c:
            raise CorruptionError("batch file checksum mismatch", path=self.path)
        self._file.seek(0)

    def close(self) -> None:
        self._file.close()
