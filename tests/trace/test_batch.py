"""lamina.trace.batch: a batch file is published durably and whole, and any damage to it
is detected on read (size, CRC32C, Parquet structure, row count) as CorruptionError naming
the file; a file gone under a reader is FileNotFoundError (the reader retries)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lamina.errors import CorruptionError
from lamina.fs import crc32c
from lamina.layout import TraceLayout
from lamina.objstore.local import LocalObjectStore
from lamina.testing.faults import CountingFileSystem
from lamina.trace.batch import (
    ROW_GROUP_ROWS,
    VERIFY_BLOCK,
    BatchDesc,
    PartFile,
    new_id,
    read_part,
    write_part,
)
from tests.trace.helpers import SCHEMA, table_of, temp_files

UPDATE_SCHEMA = SCHEMA.append(pa.field("_time", pa.uint64(), False)).append(
    pa.field("_diff", pa.int64(), False))
ROWS = table_of([(1, "a", 0, 1), (1, "b", 3, -2), (2, "a", 1, 5)]).cast(UPDATE_SCHEMA)


def _write(tmp_path: Path, tables: list[pa.Table] | None = None) -> PartFile:
    return write_part(LocalObjectStore(tmp_path), TraceLayout.batch_part("b1", 0), UPDATE_SCHEMA,
                      [ROWS] if tables is None else tables)


def test_round_trip_records_rows_bytes_and_checksum(tmp_path: Path) -> None:
    """What write_part records is what is on disk; read_part gives the rows back."""
    part = _write(tmp_path)
    data = (tmp_path / part.path).read_bytes()
    assert part.path == "batches/b1/part-00000.parquet"
    assert (part.rows, part.bytes, part.crc32c) == (3, len(data), crc32c(data))
    assert read_part(LocalObjectStore(tmp_path), part).equals(ROWS)
    assert read_part(LocalObjectStore(tmp_path), part, columns=["id"]).column_names == ["id"]
    assert not temp_files(tmp_path)


def test_several_tables_and_empty_ones_make_one_file(tmp_path: Path) -> None:
    """Tables are written in order; empty tables add nothing; a cast aligns the schema."""
    empty = UPDATE_SCHEMA.empty_table()
    part = _write(tmp_path, [ROWS.slice(0, 1), empty, table_of([(1, "b", 3, -2),
                                                                 (2, "a", 1, 5)])])
    assert part.rows == 3
    assert read_part(LocalObjectStore(tmp_path), part).equals(ROWS)


def test_publication_is_temp_fsync_rename_dir_fsync(tmp_path: Path) -> None:
    """crash-safety rule 2, docs/architecture.md: written to a temp file, fdatasynced, renamed,
    directory synced."""
    fs = CountingFileSystem()
    write_part(LocalObjectStore(tmp_path, fs), TraceLayout.batch_part("b2", 0), UPDATE_SCHEMA,
               [ROWS])
    kinds = [op.kind for op in fs.ops]
    tail = kinds[kinds.index("fdatasync"):]
    assert tail == ["fdatasync", "rename", "fsync_dir"]
    assert all(k == "write" for k in kinds[kinds.index("write"):kinds.index("fdatasync")])
    writes = [op for op in fs.ops if op.kind == "write"]
    assert all(op.path.name.endswith(".tmp") for op in writes)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_flipped_byte_is_detected(tmp_path_factory: pytest.TempPathFactory,
                                      data: st.DataObject) -> None:
    """Flip any bit of any byte: the checksum catches it before Parquet is parsed."""
    root = tmp_path_factory.mktemp("flip")
    part = _write(root)
    path = root / part.path
    raw = bytearray(path.read_bytes())
    offset = data.draw(st.integers(0, len(raw) - 1), label="offset")
    raw[offset] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptionError, match="checksum mismatch") as info:
        read_part(LocalObjectStore(root), part)
    assert info.value.path == path


def test_a_part_of_several_verify_blocks_is_checked_whole(tmp_path: Path) -> None:
    """A part larger than the block its check reads at a time (VERIFY_BLOCK): read whole
    when intact; a flipped byte in a later block, or in the last, partial one, is caught."""
    rng = np.random.default_rng(5)
    n = 400_000  # random strings do not compress: several MiB
    big = pa.table({"id": pa.array(np.sort(rng.integers(0, 2**40, n))),
                    "item": pa.array(rng.integers(0, 2**62, n).astype(str)),
                    "_time": pa.array(np.zeros(n, np.uint64)),
                    "_diff": pa.array(np.ones(n, np.int64))}).cast(UPDATE_SCHEMA)
    part = _write(tmp_path, [big])
    path = tmp_path / part.path
    raw = path.read_bytes()
    assert len(raw) > 2 * VERIFY_BLOCK + 1
    assert read_part(LocalObjectStore(tmp_path), part).equals(big)
    for offset in (VERIFY_BLOCK + 7, len(raw) - 5):
        damaged = bytearray(raw)
        damaged[offset] ^= 0x10
        path.write_bytes(bytes(damaged))
        with pytest.raises(CorruptionError, match="checksum mismatch"):
            read_part(LocalObjectStore(tmp_path), part)
    path.write_bytes(raw[:2 * VERIFY_BLOCK])  # ends on a block boundary
    with pytest.raises(CorruptionError, match="bytes"):
        read_part(LocalObjectStore(tmp_path), part)


def test_truncated_or_extended_file_is_detected(tmp_path: Path) -> None:
    part = _write(tmp_path)
    path = tmp_path / part.path
    raw = path.read_bytes()
    path.write_bytes(raw[:-1])
    with pytest.raises(CorruptionError, match="bytes"):
        read_part(LocalObjectStore(tmp_path), part)
    path.write_bytes(raw + b"\0")
    with pytest.raises(CorruptionError, match="bytes"):
        read_part(LocalObjectStore(tmp_path), part)


def test_description_disagreeing_with_the_file_is_detected(tmp_path: Path) -> None:
    """A file that passes its checksum but is not Parquet, or holds another row count."""
    part = _write(tmp_path)
    wrong_rows = PartFile(part.path, part.rows + 1, part.bytes, part.crc32c)
    with pytest.raises(CorruptionError, match="rows"):
        read_part(LocalObjectStore(tmp_path), wrong_rows)
    junk = b"definitely not a parquet file"
    (tmp_path / "batches/b1/junk.parquet").write_bytes(junk)
    fake = PartFile("batches/b1/junk.parquet", 1, len(junk), crc32c(junk))
    with pytest.raises(CorruptionError, match="not readable Parquet"):
        read_part(LocalObjectStore(tmp_path), fake)


def test_missing_file_is_file_not_found(tmp_path: Path) -> None:
    """A reader racing garbage collection sees FileNotFoundError and retries."""
    part = _write(tmp_path)
    (tmp_path / part.path).unlink()
    with pytest.raises(FileNotFoundError):
        read_part(LocalObjectStore(tmp_path), part)


def test_description_round_trip_and_totals_check() -> None:
    """BatchDesc survives JSON; totals that disagree with the parts are refused."""
    parts = (PartFile("batches/b/part-00000.parquet", 3, 100, 7),
             PartFile("batches/b/part-00001.parquet", 2, 50, 9))
    desc = BatchDesc("b", 0, 10, 4, 2, parts)
    assert (desc.rows, desc.bytes) == (5, 150)
    assert BatchDesc.from_dict(desc.to_dict()) == desc
    bad = desc.to_dict() | {"rows": 6}
    with pytest.raises(ValueError, match="disagree"):
        BatchDesc.from_dict(bad)


def test_ids_are_fresh() -> None:
    """crash-safety rule 4, docs/architecture.md: a re-run writes under new names, never over an
    old file."""
    ids = {new_id("b") for _ in range(1000)}
    assert len(ids) == 1000
    assert all(i.startswith("b") and len(i) == 17 for i in ids)


def test_dictionaries_only_for_columns_whose_first_rows_repeat(tmp_path: Path) -> None:
    """A string column of distinct values (a UUID-like key) is written plain, and so is one
    whose values come in runs (a function of the key); one whose few values recur apart
    (a status) gets a dictionary, as the first row group's worth of rows says;
    integers stay delta-encoded; the rows read back as written, and a part of no rows is
    still one valid file."""
    n = 3 * ROW_GROUP_ROWS
    schema = pa.schema([("key", pa.string()), ("status", pa.string()), ("item", pa.string()),
                        ("n", pa.int64()), ("_time", pa.uint64()), ("_diff", pa.int64())])
    table = pa.table({"key": [f"{i:032x}" for i in range(n)],
                      "status": [("open", "shut", "gone")[i % 3] for i in range(n)],
                      "item": [f"item-{i // 10:07d}" for i in range(n)],
                      "n": np.arange(n), "_time": np.zeros(n, dtype=np.uint64),
                      "_diff": np.ones(n, dtype=np.int64)}, schema=schema)
    store = LocalObjectStore(tmp_path)
    part = write_part(store, TraceLayout.batch_part("b1", 0), schema,
                      [table.slice(0, 0), table.slice(0, 100), table.slice(100)])
    assert read_part(store, part).equals(table)
    meta = pq.ParquetFile(tmp_path / part.path).metadata
    encodings = {meta.schema.column(i).name: set(meta.row_group(0).column(i).encodings)
                 for i in range(meta.num_columns)}
    assert not encodings["key"] & {"PLAIN_DICTIONARY", "RLE_DICTIONARY"}, encodings
    assert encodings["status"] & {"PLAIN_DICTIONARY", "RLE_DICTIONARY"}, encodings
    assert not encodings["item"] & {"PLAIN_DICTIONARY", "RLE_DICTIONARY"}, encodings
    assert "DELTA_BINARY_PACKED" in encodings["n"], encodings
    empty = write_part(store, TraceLayout.batch_part("b1", 1), schema, [table.slice(0, 0)])
    assert empty.rows == 0
    assert read_part(store, empty).num_rows == 0
