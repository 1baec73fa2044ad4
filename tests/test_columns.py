"""lamina.columns: numpy to and from Arrow without pandas, and a cold read that imports
neither pandas nor pyarrow's Python layers (a fresh interpreter's first snapshot, lookup
and subscription snapshot)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from lamina import Store, columns
from lamina.datadir import DataDir
from lamina.trace.trace import Trace
from tests.cold_reads import every_read
from tests.trace.helpers import convert

SCHEMA = pa.schema([("id", pa.int64()), ("item", pa.string())])


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint64, np.float64])
def test_numbers_round_trip(dtype: type) -> None:
    values = np.arange(-3, 7).astype(dtype)
    arr = columns.array(values)
    assert arr.equals(pa.array(values))
    assert np.array_equal(columns.numpy(arr), values)
    assert np.array_equal(columns.numpy(arr.slice(2, 5)), values[2:7])  # an offset
    chunked = pa.chunked_array([arr, arr.slice(4)])
    assert np.array_equal(columns.numpy(chunked), np.concatenate([values, values[4:]]))


def test_booleans_round_trip_through_bits() -> None:
    values = np.array([True, False, True, True, False, False, True, False, True, True])
    arr = columns.array(values)
    assert arr.equals(pa.array(values))
    assert np.array_equal(columns.numpy(arr.slice(3, 6)), values[3:9])
    assert columns.numpy(pa.chunked_array([], pa.bool_())).dtype == np.bool_


def test_scalars_and_conversions_to_another_type() -> None:
    assert columns.scalar(2**64 - 1, pa.uint64()).equals(pa.scalar(2**64 - 1, pa.uint64()))
    assert columns.array(np.arange(3), pa.uint64()).type == pa.uint64()


def test_what_it_cannot_do_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="holds nulls"):
        columns.numpy(pa.array([1, None], pa.int64()))
    with pytest.raises(TypeError, match="not a primitive numeric type"):
        columns.numpy(pa.array(["a"]))
    with pytest.raises(TypeError, match="not a primitive numeric type"):
        columns.array(np.arange(3), pa.string())


def _store_with_trace_and_wal(root: Path) -> None:
    """A relation whose older updates are trace batches (converted and merged by the
    reference executor) and whose newest are still in the WAL."""
    rng = np.random.default_rng(5)
    with Store.open(root, segment_bytes=64 << 10) as store:
        rel = store.create_relation("t", SCHEMA, key=["id"])
        for t in range(6):
            ids = rng.integers(0, 2000, 3000)
            rel.append(pa.table({
                "id": ids, "item": pa.array([f"x{i % 7}" for i in ids.tolist()]),
                "_time": pa.array(np.full(len(ids), t, dtype=np.uint64)),
                "_diff": np.where(ids % 5 == 0, -1, 1)}))
            rel.seal(t + 1)
        rel.allow_compaction(1)  # the conversions forward time 0 to 1
    layout = DataDir(root)
    files = layout.relation("t")
    trace = Trace.open(layout.trace_store("t"), files.meta)
    assert convert(trace, layout.wal_dir("t"), per_plan=2, limit=4) >= 1
    assert trace.state.batches


COLD_READ_SKIPS = ("pandas", "pyarrow.compute", "pyarrow.parquet", "pyarrow.fs",
                   "pyarrow.dataset", "pyarrow.acero", "concurrent.futures", "logging")
"""Modules a cold read must not import: pandas (about half a second: lamina.columns),
pyarrow.compute's wrappers (40 to 65 ms: lamina.kernels), pyarrow.parquet and the file
systems behind it (30 to 130 ms: lamina.trace.parquet), concurrent.futures and the
logging it imports (6 to 11 ms: lamina.threads)."""


def test_a_cold_read_imports_neither_pandas_nor_pyarrows_python_layers(tmp_path: Path) -> None:
    """pandas is installed here (PySpark wants it), and importing it costs more than a
    whole cold snapshot; pyarrow.compute and pyarrow.parquet cost a third of one: a fresh
    interpreter reads without any of them, through every read of the API (the latest rows,
    an older time, a lookup, the streamed snapshot, the whole history and an interval of
    updates, a subscription; string rows, which are not packed, and times forwarded by
    since). The same reads in this process give what the child printed."""
    root = tmp_path / "data"
    _store_with_trace_and_wal(root)
    child = textwrap.dedent(f"""
        import sys
        from lamina import Store
        from tests.cold_reads import every_read
        with Store.open({str(root)!r}, read_only=True) as store:
            got = every_read(store.relation("t"))
        print(got, [m for m in {COLD_READ_SKIPS!r} if m in sys.modules] or False)
        """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         check=True, timeout=120, cwd=Path(__file__).parents[1])
    with Store.open(root, read_only=True) as store:
        want = every_read(store.relation("t"))
    assert out.stdout.split("\n")[0] == f"{want} False", out.stderr
    assert want[4] > want[0] > 0  # the history holds more rows than the latest snapshot
    assert want[6] > want[1]  # the subscription's intervals came after its snapshot


def test_strings_build_the_array_pyarrow_would() -> None:
    values = ["", "a", "ä€", "x" * 300]
    got = columns.strings(values)
    assert got.equals(pa.array(values, pa.string()))
    assert columns.strings([]).equals(pa.array([], pa.string()))
    assert columns.strings(values, pa.large_string()).equals(
        pa.array(values, pa.large_string()))
    with pytest.raises(TypeError, match="not string or large_string"):
        columns.strings(values, pa.binary())


def test_a_drill_coordinator_life_does_not_import_pandas(tmp_path: Path) -> None:
    """A coordinator of ``lamina drill`` (lamina.drill.workload: opening the store,
    creating relations, appends through the WAL encoder, seals) never imports pandas, which
    cost a second or two of each of the hundred-odd lives of a drill; the acknowledged
    operations are written."""
    ack = tmp_path / "ack.jsonl"
    child = textwrap.dedent(f"""
        import sys
        from lamina.drill import workload
        sys.argv = ["workload", {str(tmp_path / "data")!r}, {str(ack)!r}, "--seed", "3",
                    "--ops", "40", "--relations", "2"]
        workload.main()
        print("pandas" in sys.modules, file=sys.stderr)
        """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stderr.strip().splitlines()[-1] == "False", out.stderr
    acks = [line for line in ack.read_text().splitlines() if '"ack": true' in line]
    assert len(acks) == 40
