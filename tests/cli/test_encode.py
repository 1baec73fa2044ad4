"""lamina.cli.encode: the column-wise JSON lines encoding against json, and the writers."""

from __future__ import annotations

import datetime
import decimal
import io
import json
import math

import pyarrow as pa
import pyarrow.csv as pcsv
from hypothesis import given, settings
from hypothesis import strategies as st

from lamina.cli.encode import BatchWriter, jsonl

texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=8)


@settings(max_examples=60, deadline=None)
@given(ints=st.lists(st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)), min_size=1,
                     max_size=20), data=st.data())
def test_jsonl_parses_back_to_the_values(ints: list[int | None], data: st.DataObject) -> None:
    n = len(ints)
    strs = data.draw(st.lists(st.one_of(st.none(), texts), min_size=n, max_size=n))
    floats = data.draw(st.lists(st.one_of(st.none(), st.floats(allow_nan=True,
                                                               allow_infinity=True)),
                                min_size=n, max_size=n))
    bools = data.draw(st.lists(st.one_of(st.none(), st.booleans()), min_size=n, max_size=n))
    batch = pa.record_batch({"i": pa.array(ints, pa.int64()), "s": pa.array(strs, pa.string()),
                             "f": pa.array(floats, pa.float64()),
                             "b": pa.array(bools, pa.bool_())})
    lines = jsonl(batch).decode().split("\n")[:-1]
    assert len(lines) == n
    for line, want in zip(lines, batch.to_pylist(), strict=True):
        got = json.loads(line)
        assert list(got) == ["i", "s", "f", "b"]
        for k in ("i", "s", "b"):
            assert got[k] == want[k]
        w, g = want["f"], got["f"]
        assert (g is None and w is None) or g == w or (math.isnan(w) and math.isnan(g))


def test_jsonl_other_types_are_strings() -> None:
    batch = pa.record_batch({
        "d": pa.array([datetime.date(2024, 1, 31), None]),
        "t": pa.array([datetime.datetime(2024, 1, 31, 12), None], pa.timestamp("us")),
        "n": pa.array([decimal.Decimal("12.50"), None], pa.decimal128(6, 2)),
        "bin": pa.array([b"ok", b"\xff"], pa.binary())})  # not UTF-8: the json fallback
    rows = [json.loads(line) for line in jsonl(batch).decode().split("\n")[:-1]]
    assert rows[0]["d"] == "2024-01-31"
    assert rows[1]["d"] is None
    assert rows[0]["t"].startswith("2024-01-31 12:00:00")
    assert rows[0]["n"] == "12.50"


def test_batch_writer_csv_has_one_header_and_progress_lines() -> None:
    sink = io.BytesIO()
    schema = pa.schema([("a", pa.int64())])
    w = BatchWriter(sink, schema, "csv")
    w.write(pa.record_batch({"a": [1, 2]}, schema=schema))
    w.progress(5)
    w.write(pa.record_batch({"a": [3]}, schema=schema))
    w.close()
    lines = sink.getvalue().decode().split("\n")[:-1]
    assert lines == ['"a"', "1", "2", "# progress 5", "3"]
    rows = pcsv.read_csv(io.BytesIO(b"\n".join(x.encode() for x in lines
                                              if not x.startswith("#"))))
    assert rows.column("a").to_pylist() == [1, 2, 3]
