"""lamina.trace.parquet: the compiled reader reads what pyarrow.parquet.ParquetFile reads,
selects columns by name the same way, and checks page checksums."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lamina.trace.parquet import FileMetaData, ParquetFile


def _file(path: Path) -> Path:
    table = pa.table({
        "id": pa.array(range(1000), pa.int64()),
        "item": pa.array([f"x{i % 13}" for i in range(1000)]),
        "nested": pa.array([{"a": i, "b": str(i)} for i in range(1000)]),
        "_time": pa.array(range(1000), pa.uint64()),
    })
    pq.write_table(table, path, row_group_size=300, write_page_checksum=True)
    return path


def test_reads_what_pyarrow_parquet_reads(tmp_path: Path) -> None:
    path = _file(tmp_path / "p.parquet")
    with pa.OSFile(str(path)) as f1, pa.OSFile(str(path)) as f2:
        ours, theirs = ParquetFile(f1), pq.ParquetFile(f2)
        assert isinstance(ours.metadata, FileMetaData)
        assert ours.metadata.num_row_groups == 4
        assert ours.schema_arrow.equals(theirs.schema_arrow)
        assert ours.read().equals(theirs.read())
        for cols in (["item"], ["_time", "id"], ["nested"], ["nested.b"], ["missing", "id"],
                     []):
            assert ours.read(columns=cols).equals(theirs.read(columns=cols)), cols
        assert ours.read_row_groups([1, 3], columns=["id"]).equals(
            theirs.read_row_groups([1, 3], columns=["id"]))
        got = list(ours.iter_batches(batch_size=128, columns=["id", "item"]))
        want = list(theirs.iter_batches(batch_size=128, columns=["id", "item"]))
        assert [b.num_rows for b in got] == [b.num_rows for b in want]
        assert pa.Table.from_batches(got).equals(pa.Table.from_batches(want))
        with pytest.raises(ValueError, match="greater than zero"):
            ours.iter_batches(0)


def test_a_footer_read_before_is_not_read_again(tmp_path: Path) -> None:
    path = _file(tmp_path / "p.parquet")
    footer = pq.read_metadata(path)
    with pa.OSFile(str(path)) as f:
        assert ParquetFile(f, metadata=footer).read(["id"]).num_rows == 1000


def test_a_damaged_page_fails_its_checksum(tmp_path: Path) -> None:
    path = _file(tmp_path / "p.parquet")
    data = bytearray(path.read_bytes())
    data[200] ^= 0xFF  # inside the first column chunk's pages
    path.write_bytes(bytes(data))
    with pa.OSFile(str(path)) as f, pytest.raises(OSError, match="CRC"):
        ParquetFile(f).read()
    with pa.OSFile(str(path)) as f:  # without the check the damage is not noticed
        ParquetFile(f, page_checksum_verification=False).read(["_time"])


def test_row_bytes_estimates_a_decoded_row_from_the_footer(tmp_path: Path) -> None:
    """Fixed-width columns count their width exactly; plain strings (as parts store a
    column of mostly distinct values) come within a few bytes of Arrow's offsets and data;
    a name the file lacks counts nothing."""
    path = tmp_path / "w.parquet"
    table = pa.table({"id": pa.array(range(5000), pa.int64()),
                      "s": pa.array([f"value-{i:08d}" for i in range(5000)])})
    pq.write_table(table, path, row_group_size=1000, use_dictionary=False,
                   compression="zstd")
    with pa.OSFile(str(path)) as f:
        pf = ParquetFile(f)
        assert pf.row_bytes(["id"]) == 8
        assert pf.row_bytes(["id", "missing"]) == 8
        decoded = table.column("s").nbytes / table.num_rows  # 4-byte offsets + 14 bytes
        assert decoded <= pf.row_bytes(["s"]) <= decoded + 6
        assert pf.row_bytes([]) == 1
