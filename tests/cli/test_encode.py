"""lamina.cli.encode: JSON lines are strict JSON (RFC 8259) with one encoding per type, read
back by a strict parser and by polars; CSV takes any binary; the writers."""

from __future__ import annotations

import base64
import datetime
import decimal
import io
import json
import math
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.csv as pcsv
from hypothesis import given, settings
from hypothesis import strategies as st

from lamina.cli.encode import BatchWriter, jsonl

texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=8)


def _no_constants(name: str) -> Any:
    raise ValueError(f"not RFC 8259 JSON: bare {name}")


def strict(line: str) -> dict[str, Any]:
    """``line`` parsed as RFC 8259 JSON: no NaN/Infinity literals, no raw control
    characters in strings (json's ``strict``), one object per line."""
    doc = json.loads(line, parse_constant=_no_constants, strict=True)
    assert isinstance(doc, dict), line
    return doc


def lines_of(batch: pa.RecordBatch) -> list[dict[str, Any]]:
    text = jsonl(batch).decode("utf-8")
    assert text.endswith("\n")
    return [strict(line) for line in text.split("\n")[:-1]]


def _float_back(v: Any) -> float | None:
    """A float column's JSON value as the float it stands for."""
    specials = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
    return specials[v] if isinstance(v, str) else v


@settings(max_examples=80, deadline=None)
@given(ints=st.lists(st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)), min_size=1,
                     max_size=20), data=st.data())
def test_jsonl_is_strict_and_parses_back_to_the_values(ints: list[int | None],
                                                      data: st.DataObject) -> None:
    n = len(ints)
    strs = data.draw(st.lists(st.one_of(st.none(), texts), min_size=n, max_size=n))
    floats = data.draw(st.lists(st.one_of(st.none(), st.floats(allow_nan=True,
                                                               allow_infinity=True)),
                                min_size=n, max_size=n))
    bools = data.draw(st.lists(st.one_of(st.none(), st.booleans()), min_size=n, max_size=n))
    blobs = data.draw(st.lists(st.one_of(st.none(), st.binary(max_size=6)), min_size=n,
                               max_size=n))
    batch = pa.record_batch({"i": pa.array(ints, pa.int64()), "s": pa.array(strs, pa.string()),
                             "f": pa.array(floats, pa.float64()),
                             "b": pa.array(bools, pa.bool_()),
                             "bin": pa.array(blobs, pa.binary())})
    got_rows = lines_of(batch)
    assert len(got_rows) == n
    for got, want in zip(got_rows, batch.to_pylist(), strict=True):
        assert list(got) == ["i", "s", "f", "b", "bin"]
        for k in ("i", "s", "b"):
            assert got[k] == want[k]
        w, g = want["f"], _float_back(got["f"])
        assert (g is None and w is None) or g == w or (
            g is not None and math.isnan(w) and math.isnan(g))
        assert got["bin"] is None if want["bin"] is None else \
            base64.b64decode(got["bin"], validate=True) == want["bin"]


def every_type() -> pa.RecordBatch:
    """Each type lamina stores, plus nested ones, with the awkward values: NaN and the
    infinities, bytes that are not UTF-8, control characters, whole-second timestamps
    (the old encoder's str() dropped their microseconds mid-file), a timezone, nulls."""
    ts = [datetime.datetime(2024, 1, 31, 12), datetime.datetime(2024, 1, 31, 12, 0, 0, 5),
          None, datetime.datetime(1970, 1, 1)]
    return pa.record_batch({
        "i": pa.array([1, -2, None, 2**62], pa.int64()),
        "f32": pa.array([0.5, math.nan, None, -math.inf], pa.float32()),
        "f": pa.array([math.nan, math.inf, -math.inf, 0.1], pa.float64()),
        "s": pa.array(["a\x01b", 'q"\\\n\t\x1f', None, "é☃\u2028"], pa.string()),
        "bin": pa.array([b"\xff\x00", b"", None, b"ok"], pa.binary()),
        "d": pa.array([datetime.date(2024, 1, 31), None, datetime.date(1, 1, 1),
                       datetime.date(9999, 12, 31)]),
        "t": pa.array(ts, pa.timestamp("us")),
        "tz": pa.array(ts, pa.timestamp("us", "UTC")),
        "n": pa.array([decimal.Decimal("12.50"), None, decimal.Decimal("-0.01"),
                       decimal.Decimal("99999999.99")], pa.decimal128(10, 2)),
        "ok": pa.array([True, False, None, True]),
        "l": pa.array([[1.5, math.nan], None, [], [math.inf]], pa.list_(pa.float64())),
        "st": pa.array([{"b": b"\xfe", "t": datetime.datetime(2024, 1, 1)}, None,
                        {"b": None, "t": None}, {"b": b"", "t": datetime.datetime(2024, 1, 1,
                                                                                  0, 0, 1)}],
                       pa.struct([("b", pa.binary()), ("t", pa.timestamp("us"))])),
    })


def test_every_type_is_written_one_way() -> None:
    rows = lines_of(every_type())
    col = {k: [r[k] for r in rows] for k in rows[0]}
    assert col["i"] == [1, -2, None, 2**62]
    assert col["f32"] == [0.5, "NaN", None, "-Infinity"]
    assert col["f"] == ["NaN", "Infinity", "-Infinity", 0.1]
    assert col["s"] == ["a\x01b", 'q"\\\n\t\x1f', None, "é☃\u2028"]
    assert col["bin"] == ["/wA=", "", None, "b2s="]
    assert col["d"] == ["2024-01-31", None, "0001-01-01", "9999-12-31"]
    assert col["t"] == ["2024-01-31T12:00:00.000000", "2024-01-31T12:00:00.000005", None,
                        "1970-01-01T00:00:00.000000"]
    assert col["tz"] == ["2024-01-31T12:00:00.000000Z", "2024-01-31T12:00:00.000005Z", None,
                         "1970-01-01T00:00:00.000000Z"]
    assert col["n"] == ["12.50", None, "-0.01", "99999999.99"]
    assert col["ok"] == [True, False, None, True]
    assert col["l"] == [[1.5, "NaN"], None, [], ["Infinity"]]
    assert col["st"] == [{"b": "/g==", "t": "2024-01-01T00:00:00.000000"}, None,
                         {"b": None, "t": None}, {"b": "", "t": "2024-01-01T00:00:01.000000"}]


def test_polars_reads_the_file(tmp_path: Path) -> None:
    """polars.read_ndjson takes the whole file, several batches long, each column with
    one type throughout (the issue's file changed a timestamp's format mid-file)."""
    batch = every_type()
    path = tmp_path / "out.jsonl"
    with open(path, "wb") as sink:
        w = BatchWriter(sink, batch.schema, "jsonl")
        for _ in range(3):
            w.write(batch)
        w.close()
    df = pl.read_ndjson(path)
    assert df.height == 12
    assert df["i"].to_list() == [1, -2, None, 2**62] * 3
    assert df["t"].to_list()[:2] == ["2024-01-31T12:00:00.000000", "2024-01-31T12:00:00.000005"]
    assert df["bin"].to_list()[:2] == ["/wA=", ""]
    parsed = df.select(pl.col("t").str.to_datetime("%Y-%m-%dT%H:%M:%S%.f"))["t"].to_list()
    assert parsed[:4] == [datetime.datetime(2024, 1, 31, 12),
                          datetime.datetime(2024, 1, 31, 12, 0, 0, 5), None,
                          datetime.datetime(1970, 1, 1)]


def test_csv_writes_binary_that_is_not_utf8_as_base64() -> None:
    sink = io.BytesIO()
    schema = pa.schema([("id", pa.int64()), ("bin", pa.binary())])
    w = BatchWriter(sink, schema, "csv")
    w.write(pa.record_batch({"id": [1, 2, 3, 4], "bin": [b"\xff\xfe", None, b"ok", b""]},
                            schema=schema))
    w.close()
    # a null is an empty field, an empty value a quoted empty string
    options = pcsv.ConvertOptions(strings_can_be_null=True, quoted_strings_can_be_null=False)
    back = pcsv.read_csv(io.BytesIO(sink.getvalue()), convert_options=options)
    assert back.column("id").to_pylist() == [1, 2, 3, 4]
    assert [None if v is None else base64.b64decode(v)
            for v in back.column("bin").to_pylist()] == [b"\xff\xfe", None, b"ok", b""]


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
