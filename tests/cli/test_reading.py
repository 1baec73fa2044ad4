"""snapshot, lookup and subscribe as a user runs them: ``--as-of`` left out (latest), keys
holding commas, keys of several columns, keys that do not parse, JSON lines that strict
parsers and polars read back."""

from __future__ import annotations

import datetime
import decimal
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pytest

from lamina import CLOSED
from lamina.store import Store
from tests.cli.procs import lamina, one_line, orders


def _strict(line: bytes) -> dict[str, Any]:
    def refuse(name: str) -> None:
        raise ValueError(f"bare {name}")

    doc = json.loads(line, parse_constant=refuse)
    assert isinstance(doc, dict)
    return doc


def test_as_of_defaults_to_the_latest_readable_time(tmp_path: Path) -> None:
    orders(tmp_path, rows=3)
    with Store.open(tmp_path) as store:
        rel = store.relation("orders")
        rel.append(pa.table({"id": pa.array([0, 7], pa.int64()), "item": ["item-0", "new"],
                             "_time": pa.array([4, 4], pa.uint64()),
                             "_diff": pa.array([-1, 1], pa.int64())}))
        rel.seal(5)
    latest = lamina("snapshot", "orders", "--format", "jsonl", "--data-dir", str(tmp_path))
    explicit = lamina("snapshot", "orders", "--as-of", "latest", "--format", "jsonl",
                      "--data-dir", str(tmp_path))
    at_4 = lamina("snapshot", "orders", "--as-of", "4", "--format", "jsonl", "--data-dir",
                  str(tmp_path))
    assert latest.returncode == explicit.returncode == at_4.returncode == 0, latest.stderr
    assert latest.stdout == explicit.stdout == at_4.stdout
    assert [_strict(x)["id"] for x in latest.stdout.splitlines()] == [1, 2, 7]
    look = lamina("lookup", "orders", "0", "7", "--format", "jsonl", "--data-dir",
                  str(tmp_path))
    assert [_strict(x)["id"] for x in look.stdout.splitlines()] == [7]


def test_as_of_of_a_millisecond_relation_takes_an_iso_timestamp(tmp_path: Path) -> None:
    """A relation timed in epoch milliseconds reads ``--as-of`` as an ISO-8601 timestamp
    with its zone (the same rows as the integer), and refuses one without a zone by
    name."""
    t0 = 1_795_000_000_000  # 2026-11-18T07:06:40Z
    with Store.open(tmp_path) as store:
        rel = store.create_relation("events", pa.schema([("id", pa.int64())]), key=["id"],
                                    time_unit="ms")
        rel.append(pa.table({"id": pa.array([1, 2, 1], pa.int64()),
                             "_time": pa.array([t0, t0 + 1000, t0 + 1000], pa.uint64()),
                             "_diff": pa.array([1, 1, -1], pa.int64())}))
        rel.seal(t0 + 2000)
    at = datetime.datetime.fromtimestamp(t0 / 1000, datetime.UTC)
    runs = {text: lamina("snapshot", "events", "--as-of", text, "--format", "jsonl",
                         "--data-dir", str(tmp_path))
            for text in (at.isoformat(), at.strftime("%Y-%m-%dT%H:%M:%SZ"), str(t0),
                         (at + datetime.timedelta(seconds=1)).isoformat())}
    first, z, integer, later = runs.values()
    assert first.returncode == z.returncode == integer.returncode == 0, first.stderr
    assert [_strict(x)["id"] for x in first.stdout.splitlines()] == [1]
    assert first.stdout == z.stdout == integer.stdout
    assert [_strict(x)["id"] for x in later.stdout.splitlines()] == [2]
    naive = lamina("snapshot", "events", "--as-of", "2026-11-18T07:06:40", "--data-dir",
                   str(tmp_path))
    assert naive.returncode == 2
    assert b"ISO-8601 timestamp with its timezone" in naive.stderr


def test_latest_of_a_relation_with_nothing_readable(tmp_path: Path) -> None:
    with Store.open(tmp_path) as store:
        store.create_relation("fresh", pa.schema([("id", pa.int64())]), key=["id"])
        rel = store.create_relation("caught", pa.schema([("id", pa.int64())]), key=["id"])
        rel.seal(3)
        rel.allow_compaction(3)
    for name, why in (("fresh", "upper 0, since 0; nothing is sealed"),
                      ("caught", "upper 3, since 3; every sealed time was compacted away")):
        for command in ("snapshot", "subscribe"):
            out = lamina(command, name, "--data-dir", str(tmp_path))
            assert out.returncode == 1
            message = one_line(out.stderr)
            assert f"relation {name!r} has nothing readable yet: {why}" in message


@pytest.fixture
def keyed(tmp_path: Path) -> Path:
    """``people`` keyed by one string column whose values hold commas and quotes;
    ``stock`` keyed by (sku string, bin int32, day date32)."""
    with Store.open(tmp_path, fsync="never") as store:
        people = store.create_relation("people", pa.schema([("name", pa.string()),
                                                            ("age", pa.int64())]),
                                       key=["name"])
        names = ["Smith, J.", "Smith", ' J."', "[1]"]
        people.append(pa.table({"name": names, "age": pa.array([40, 50, 60, 70], pa.int64()),
                                "_time": pa.array([0] * 4, pa.uint64()),
                                "_diff": pa.array([1] * 4, pa.int64())}))
        people.seal(1)
        stock = store.create_relation("stock", pa.schema([
            ("sku", pa.string()), ("bin", pa.int32()), ("day", pa.date32()),
            ("qty", pa.decimal128(8, 2))]), key=["sku", "bin", "day"])
        days = [datetime.date(2024, 1, 1), datetime.date(2024, 1, 2)]
        stock.append(pa.table({
            "sku": ["a,b", "a,b", "c"], "bin": pa.array([1, 2, 1], pa.int32()),
            "day": pa.array([days[0], days[1], days[0]]),
            "qty": pa.array([decimal.Decimal("1.50"), decimal.Decimal("2.00"),
                             decimal.Decimal("3.25")], pa.decimal128(8, 2)),
            "_time": pa.array([0] * 3, pa.uint64()), "_diff": pa.array([1] * 3, pa.int64())}))
        stock.seal(1)
    return tmp_path


def lookup(root: Path, *args: str) -> list[dict[str, Any]]:
    out = lamina("lookup", *args, "--format", "jsonl", "--data-dir", str(root))
    assert out.returncode == 0, out.stderr
    return [_strict(line) for line in out.stdout.splitlines()]


def test_a_one_column_key_is_taken_as_it_is(keyed: Path) -> None:
    rows = lookup(keyed, "people", "Smith, J.", ' J."', "[1]", "nobody")
    assert [(r["name"], r["age"]) for r in rows] == [(' J."', 60), ("Smith, J.", 40),
                                                     ("[1]", 70)]


def test_a_key_of_several_columns_as_json(keyed: Path) -> None:
    rows = lookup(keyed, "stock", '["a,b", 2, "2024-01-02"]',
                  '{"day": "2024-01-01", "bin": 1, "sku": "c"}', '["a,b", 1, "2024-01-09"]')
    assert [(r["sku"], r["bin"], r["day"], r["qty"]) for r in rows] == [
        ("a,b", 2, "2024-01-02", "2.00"), ("c", 1, "2024-01-01", "3.25")]


@pytest.mark.parametrize(("relation", "key", "message"), [
    ("stock", '["a,b", "two", "2024-01-01"]',
     "keys do not parse: \"two\" is not a value of key column 'bin' (int32)"),
    ("stock", '["a,b", 1.5, "2024-01-01"]',
     "keys do not parse: 1.5 is not a value of key column 'bin' (int32)"),
    ("stock", '["a,b", 1, "January"]',
     "keys do not parse: \"January\" is not a value of key column 'day' (date32[day])"),
    ("stock", '["a,b", 99999999999, "2024-01-01"]',
     "keys do not parse: 99999999999 is not a value of key column 'bin' (int32)"),
    ("stock", "a,b,1,2024-01-01", "is not JSON; relation 'stock' has the key columns"),
    ("stock", '["a,b", 1]', "does not name every key column once"),
    ("stock", '{"sku": "c", "bin": 1}', "does not name every key column once"),
], ids=["text-for-int", "fraction", "date", "overflow", "not-json", "short", "object"])
def test_keys_that_do_not_parse(keyed: Path, relation: str, key: str, message: str) -> None:
    out = lamina("lookup", relation, key, "--data-dir", str(keyed))
    assert out.returncode == 2
    text = one_line(out.stderr)
    assert message in text
    assert "pyarrow" not in text
    assert "Arrow" not in text


def test_jsonl_of_every_stored_type_is_strict_json(tmp_path: Path) -> None:
    """``lamina snapshot --format jsonl`` of a relation holding every type lamina stores,
    with NaN, infinities, bytes that are not UTF-8 and timestamps with and without
    microseconds: every line parses with a strict parser, and polars reads the file."""
    schema = pa.schema([("id", pa.int64()), ("f", pa.float64()), ("g", pa.float32()),
                        ("ok", pa.bool_()), ("s", pa.string()), ("b", pa.binary()),
                        ("d", pa.date32()), ("t", pa.timestamp("us")),
                        ("tz", pa.timestamp("us", "UTC")), ("n", pa.decimal128(12, 3))])
    n = 6
    values = {
        "id": pa.array(range(n), pa.int64()),
        "f": pa.array([math.nan, math.inf, -math.inf, 0.1, None, -0.0]),
        "g": pa.array([1.5, math.nan, None, math.inf, 0.25, 2.0], pa.float32()),
        "ok": pa.array([True, False, None, True, True, False]),
        "s": pa.array(["a\x00b", "tab\t", '"q"', None, "é", ""]),
        "b": pa.array([b"\xff", b"\x00\x01", None, b"", b"text", b"\x80abc"]),
        "d": pa.array([datetime.date(2024, 1, 31)] * 5 + [None]),
        "t": pa.array([datetime.datetime(2024, 1, 31, 12), None,
                       datetime.datetime(2024, 1, 31, 12, 0, 0, 1)] * 2, pa.timestamp("us")),
        "tz": pa.array([datetime.datetime(2024, 1, 31, 12, tzinfo=datetime.UTC)] * n,
                       pa.timestamp("us", "UTC")),
        "n": pa.array([decimal.Decimal("1.500")] * n, pa.decimal128(12, 3)),
    }
    with Store.open(tmp_path, fsync="never") as store:
        rel = store.create_relation("all", schema, key=["id"])
        rel.append(pa.table({**values, "_time": pa.array([0] * n, pa.uint64()),
                             "_diff": pa.array([1] * n, pa.int64())}))
        rel.seal(1)
    target = tmp_path / "all.jsonl"
    out = lamina("snapshot", "all", "--format", "jsonl", "--output", str(target),
                 "--data-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    rows = [_strict(line) for line in target.read_bytes().splitlines()]
    assert [r["f"] for r in rows] == ["NaN", "Infinity", "-Infinity", 0.1, None, -0.0]
    assert [r["b"] for r in rows] == ["/w==", "AAE=", None, "", "dGV4dA==", "gGFiYw=="]
    assert [r["t"] for r in rows][:3] == ["2024-01-31T12:00:00.000000", None,
                                          "2024-01-31T12:00:00.000001"]
    assert rows[0]["tz"] == "2024-01-31T12:00:00.000000Z"
    assert rows[0]["n"] == "1.500"
    assert rows[0]["s"] == "a\x00b"
    df = pl.read_ndjson(target)
    assert df.height == n
    assert df["id"].to_list() == list(range(n))


def test_subscribe_from_latest_ends_at_closed(tmp_path: Path) -> None:
    orders(tmp_path, rows=2)
    with Store.open(tmp_path) as store:
        store.relation("orders").seal(CLOSED)
    out = lamina("subscribe", "orders", "--data-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    lines = [_strict(line) for line in out.stdout.splitlines()]
    assert [r.get("id") for r in lines[:2]] == [0, 1]
    assert lines[-1] == {"_progress": CLOSED}


@pytest.mark.parametrize(("command", "fmt", "unused"), [
    ("snapshot", "jsonl", ("pandas",)), ("snapshot", "csv", ("pandas", "pyarrow.compute")),
    ("snapshot", "arrow", ("pandas", "pyarrow.compute")),
    ("snapshot", "parquet", ("pandas", "pyarrow.compute")),
    ("lookup", "arrow", ("pandas", "pyarrow.compute"))])
def test_a_reading_command_imports_only_what_its_format_needs(
        tmp_path: Path, command: str, fmt: str, unused: tuple[str, ...]) -> None:
    """``lamina snapshot`` and ``lamina lookup`` are cold reads: pyarrow imports pandas (half
    a second) on its first array or scalar of a Python value, and ``pyarrow.compute`` (40
    to 65 ms) builds a wrapper per kernel. Only JSON lines need those kernels, and nothing
    needs pandas. The rows are the relation's."""
    orders(tmp_path, rows=3)
    out = tmp_path / f"out.{fmt}"
    keys = ["1", "2"] if command == "lookup" else []
    child = (
        "import sys\n"
        "from lamina.cli.main import main\n"
        f"code = main([{command!r}, 'orders', *{keys!r}, '--format', {fmt!r}, "
        f"'--data-dir', {str(tmp_path)!r}, '--output', {str(out)!r}])\n"
        f"print(code, [m for m in {unused!r} if m in sys.modules])\n")
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          check=True, timeout=120)
    assert done.stdout.split("\n")[0] == "0 []", done.stderr
    with Store.open(tmp_path) as store:
        rel = store.relation("orders")
        want = rel.lookup({"id": [1, 2]}) if keys else rel.snapshot()
    assert want.num_rows == (2 if keys else 3)
    if fmt == "jsonl":
        got = [_strict(line) for line in out.read_bytes().splitlines()]
        assert got == want.to_pylist()
    elif fmt == "csv":
        assert pl.read_csv(out).to_arrow().column("id").to_pylist() == \
            want.column("id").to_pylist()
    elif fmt == "arrow":
        assert pa.ipc.open_stream(out.read_bytes()).read_all().to_pylist() == want.to_pylist()
    else:
        assert pl.read_parquet(out).to_dicts() == want.to_pylist()
