"""Parquet parts read through pyarrow's compiled reader, without ``pyarrow.parquet``.

``import pyarrow.parquet`` costs 30 to 130 ms in a fresh process, most of it
``pyarrow.fs`` (the module of every file system pyarrow knows, and ``ssl`` behind them).
The reader itself is ``pyarrow._parquet.ParquetReader`` (2 ms to import), which
``pyarrow.parquet.ParquetFile`` wraps; :class:`ParquetFile` here wraps it the same way, for
what lamina reads: columns by name, a whole part, some row groups, batches. So a process
that opens a store and reads a snapshot or a lookup does not pay for that import before
it reads a row (``tests/test_columns.py`` checks in a fresh interpreter, beside
``pyarrow.compute``: lamina.kernels). Writing parts (:func:`lamina.trace.batch.write_part`)
and the compacter's Spark side use ``pyarrow.parquet``.

``pyarrow._parquet`` is private to pyarrow, which pyproject.toml pins to one major
version; ``tests/trace/test_parquet.py`` reads the same files through both and compares.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeAlias

import pyarrow as pa
from pyarrow import _parquet

FileMetaData: TypeAlias = _parquet.FileMetaData
"""A part's footer (``pyarrow.parquet.FileMetaData`` is this class)."""


class ParquetFile:
    """One Parquet file opened for reading (the subset of ``pyarrow.parquet.ParquetFile``
    that lamina uses). ``source`` is an open Arrow file; it stays the caller's to close.
    With ``metadata`` the footer is not read again. Pages are checked against their
    CRC32 as they are read (``page_checksum_verification``), and read as asked, with no
    pre-buffering."""

    def __init__(self, source: pa.NativeFile, *, metadata: FileMetaData | None = None,
                 page_checksum_verification: bool = True) -> None:
        self.reader = _parquet.ParquetReader()
        self.reader.open(source, metadata=metadata, pre_buffer=False,
                         page_checksum_verification=page_checksum_verification,
                         arrow_extensions_enabled=True)
        # a column name selects every leaf under it, as pyarrow.parquet.ParquetFile's
        # names do ("a" selects "a.b" and "a.c"); a name the file lacks selects nothing
        self._leaves: dict[str, list[int]] = {}
        for i, path in enumerate(self.reader.column_paths):
            for depth in range(1, len(path) + 1):
                self._leaves.setdefault(".".join(path[:depth]), []).append(i)

    @property
    def metadata(self) -> FileMetaData:
        return self.reader.metadata

    @property
    def schema_arrow(self) -> pa.Schema:
        return self.reader.schema_arrow

    def _indices(self, columns: Sequence[str] | None) -> list[int] | None:
        if columns is None:
            return None
        return [i for name in columns for i in self._leaves.get(name, ())]

    def read(self, columns: Sequence[str] | None = None) -> pa.Table:
        """The whole file (``columns`` only, when given)."""
        return self.reader.read_all(column_indices=self._indices(columns), use_threads=True)

    def read_row_groups(self, row_groups: Sequence[int],
                        columns: Sequence[str] | None = None) -> pa.Table:
        return self.reader.read_row_groups(list(row_groups),
                                           column_indices=self._indices(columns),
                                           use_threads=True)

    def row_bytes(self, columns: Sequence[str]) -> int:
        """About how many bytes a row of ``columns`` takes decoded, from the footer alone:
        a fixed-width column's width, and for any other its uncompressed Parquet bytes per
        row and 4 more (a plain string's length prefix is as long as Arrow's offset; the 4
        cover levels, page headers and a large string's wider offsets; a
        dictionary-encoded column counts little more than its indices). At least 1."""
        md = self.reader.metadata
        rows = md.num_rows
        if rows == 0:
            return 1
        fields = {f.name: f for f in self.schema_arrow}
        width = 0
        varying: list[int] = []  # the leaves of the columns that are not fixed-width
        for name in columns:
            field = fields.get(name)
            if field is None:
                continue
            try:
                width += max(1, field.type.bit_width // 8)
            except ValueError:  # not fixed-width: counted from the footer below
                width += 4
                varying.extend(self._leaves.get(name, ()))
        if varying:  # only their column chunks: a footer holds every column's, per group
            stored = 0
            for g in range(md.num_row_groups):
                group = md.row_group(g)
                stored += sum(group.column(j).total_uncompressed_size for j in varying)
            width += -(-stored // rows)
        return max(1, width)

    def iter_batches(self, batch_size: int, columns: Sequence[str] | None = None
                     ) -> Iterator[pa.RecordBatch]:
        """The file's rows in record batches of at most ``batch_size`` rows."""
        if batch_size <= 0:
            raise ValueError("batch_size must be greater than zero")
        groups = range(self.reader.metadata.num_row_groups)
        batches: Iterator[pa.RecordBatch] = self.reader.iter_batches(
            batch_size, row_groups=groups, column_indices=self._indices(columns),
            use_threads=True)
        return batches
