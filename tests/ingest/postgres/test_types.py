"""Every supported PostgreSQL type through a real table: snapshot (COPY) and stream (pgoutput)."""

from __future__ import annotations

import math
import random
from datetime import UTC, date, datetime
from decimal import Decimal

import pyarrow as pa
import pytest

from lamina.errors import SourceStalledError
from lamina.ingest.postgres import PostgresSource
from lamina.ingest.postgres.types import BYTEA, NUMERIC, PgType, arrow_type, to_arrow
from tests.ingest.postgres.helpers import Collector, arrow
from tests.ingest.postgres.server import PgServer

# (column, SQL type, Arrow type, [(SQL literal, expected Python value)])
COLUMNS: list[tuple[str, str, pa.DataType, list[tuple[str, object]]]] = [
    ("i2", "int2", pa.int16(), [("-32768", -32768), ("32767", 32767)]),
    ("i4", "int4", pa.int32(), [("-2147483648", -2147483648), ("7", 7)]),
    ("i8", "int8", pa.int64(), [("9223372036854775807", 9223372036854775807), ("-1", -1)]),
    ("dec", "numeric(12,3)", pa.decimal128(12, 3),
     [("-123456789.125", Decimal("-123456789.125")), ("0.5", Decimal("0.500"))]),
    ("num", "numeric", pa.string(),
     [("'NaN'", "NaN"), ("123456789012345678901234567890.0000000001",
                         "123456789012345678901234567890.0000000001")]),
    ("f4", "float4", pa.float32(), [("1.5", 1.5), ("'-Infinity'", -math.inf)]),
    ("f8", "float8", pa.float64(), [("0.1", 0.1), ("'NaN'", math.nan)]),
    ("b", "bool", pa.bool_(), [("true", True), ("false", False)]),
    ("t", "text", pa.string(),
     [("E'a,\"b\"\\n\\tc\\\\'", 'a,"b"\n\tc\\'), ("''", "")]),
    ("vc", "varchar(8)", pa.string(), [("'żółw'", "żółw"), ("'NULL'", "NULL")]),
    ("ch", "char(4)", pa.string(), [("'ab'", "ab  "), ("'abcd'", "abcd")]),
    ("\"Mixed Case\"", "\"char\"", pa.string(), [("'x'", "x"), ("'y'", "y")]),
    ("by", "bytea", pa.binary(), [("'\\x00ff0a'", b"\x00\xff\n"), ("''", b"")]),
    ("d", "date", pa.date32(), [("'2024-02-29'", date(2024, 2, 29)),
                                ("'0001-01-01'", date(1, 1, 1))]),
    ("tm", "time", pa.string(), [("'13:45:00.25'", "13:45:00.25"), ("'24:00'", "24:00:00")]),
    ("ts", "timestamp", pa.timestamp("us"),
     [("'2024-01-02 03:04:05.123456'", datetime(2024, 1, 2, 3, 4, 5, 123456)),
      ("'1999-12-31 23:59:59'", datetime(1999, 12, 31, 23, 59, 59))]),
    ("tz", "timestamptz", pa.timestamp("us", "UTC"),
     [("'2024-01-02 03:04:05.5+02'", datetime(2024, 1, 2, 1, 4, 5, 500000, tzinfo=UTC)),
      ("'1970-01-01 00:00:00Z'", datetime(1970, 1, 1, tzinfo=UTC))]),
    ("u", "uuid", pa.string(), [("'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11'",
                                 "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
                                ("'00000000-0000-0000-0000-000000000000'",
                                 "00000000-0000-0000-0000-000000000000")]),
    ("js", "json", pa.string(), [("'{\"a\":  1}'", '{"a":  1}'), ("'[]'", "[]")]),
    ("jb", "jsonb", pa.string(), [("'{\"b\":2,  \"a\":1}'", '{"a": 1, "b": 2}'),
                                  ("'null'", "null")]),
    ("ai", "int4[]", pa.string(), [("'{1,NULL,3}'", "{1,NULL,3}"), ("'{}'", "{}")]),
    ("at", "text[]", pa.string(), [("ARRAY['a b', 'c\"']", '{"a b","c\\""}'),
                                   ("'{x}'", "{x}")]),
    ("iv", "interval", pa.string(), [("'1 day 02:00'", "1 day 02:00:00"),
                                     ("'-3 mons'", "-3 mons")]),
    ("pos", "posint", pa.int32(), [("5", 5), ("1", 1)]),
    ("mood", "mood", pa.string(), [("'happy'", "happy"), ("'sad'", "sad")]),
]


def _setup(pg: PgServer) -> None:
    cols = ", ".join(f"{c} {t}" for c, t, _, _ in COLUMNS)
    pg.execute("CREATE DOMAIN posint AS int4 CHECK (VALUE > 0)",
               "CREATE TYPE mood AS ENUM ('sad', 'happy')",
               f"CREATE TABLE ty (id int PRIMARY KEY, {cols})",
               "ALTER TABLE ty REPLICA IDENTITY FULL")


def _insert(pg: PgServer, first_id: int) -> None:
    rows = []
    for i in range(2):
        vals = ", ".join(vs[i][0] for _, _, _, vs in COLUMNS)
        rows.append(f"({first_id + i}, {vals})")
    nulls = ", ".join("NULL" for _ in COLUMNS)
    rows.append(f"({first_id + 2}, {nulls})")
    pg.execute(f"INSERT INTO ty VALUES {', '.join(rows)}")  # noqa: S608


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _check(data: pa.Table, ids: list[int]) -> None:
    for (col, _, typ, vals) in COLUMNS:
        name = col.strip('"')
        assert data.schema.field(name).type == typ, name
        got = {r["id"]: r[name] for r in data.to_pylist()}
        for i, (_, want) in enumerate(vals):
            assert _same(got[ids[i]], want), (name, got[ids[i]], want)
        assert got[ids[2]] is None, name


def test_every_type_snapshot_and_stream(pg: PgServer) -> None:
    _setup(pg)
    _insert(pg, 1)
    src = PostgresSource("ty", pg.dsn, ["ty"])
    try:
        specs = src.open(None)
        spec = specs["public.ty"]
        assert [spec.schema.field(c.strip('"')).type for c, _, _, _ in COLUMNS] == [
            t for _, _, t, _ in COLUMNS]
        c = Collector(src)
        c.poll_until(lambda c: c.upper > 0)
        (snap,) = c.transactions
        _check(snap.changes["public.ty"], [1, 2, 3])
        _insert(pg, 11)
        c.poll_until(lambda c: len(c.transactions) == 2)
        streamed = arrow(c.transactions[1].changes["public.ty"])
        assert streamed.schema == snap.changes["public.ty"].schema
        _check(streamed, [11, 12, 13])
    finally:
        src.close()


def test_unrepresentable_value_stalls_the_table_with_the_value(pg: PgServer) -> None:
    pg.execute("CREATE TABLE d (id int PRIMARY KEY, day date)",
               "ALTER TABLE d REPLICA IDENTITY FULL")
    src = PostgresSource("d", pg.dsn, ["d"])
    try:
        src.open(None)
        c = Collector(src)
        c.poll_until(lambda c: c.upper > 0)
        pg.execute("INSERT INTO d VALUES (1, 'infinity')")
        c.poll_until(lambda c: len(c.transactions) == 1)
        # values become Arrow once per binding, where the runner stalls the output
        with pytest.raises(SourceStalledError, match=r"'infinity'.*date32"):
            arrow(c.transactions[0].changes["public.d"])
    finally:
        src.close()


def test_numeric_mapping() -> None:
    def mod(p: int, s: int) -> int:
        return ((p << 16) | (s & 0x7FF)) + 4

    assert arrow_type(NUMERIC, mod(38, 10)) == pa.decimal128(38, 10)
    assert arrow_type(NUMERIC, mod(39, 0)) == pa.string()
    assert arrow_type(NUMERIC, mod(5, -2)) == pa.string()
    assert arrow_type(NUMERIC) == pa.string()
    with pytest.raises(SourceStalledError, match="'NaN' cannot be stored"):
        to_arrow(["1.5", "NaN"], PgType(NUMERIC, mod(5, 2), "numeric(5,2)"))
    with pytest.raises(SourceStalledError, match="expected 't' or 'f'"):
        to_arrow(["t", "x"], PgType(16, -1, "boolean"))


def test_bytea_column_decoded_at_once_like_value_by_value() -> None:
    rng = random.Random(7)
    values = [None if rng.random() < 0.1 else bytes(rng.randrange(256)
                                                    for _ in range(rng.randrange(6)))
              for _ in range(2000)]
    text = pa.array([None if v is None else "\\x" + v.hex() for v in values], pa.string())
    bytea = PgType(BYTEA, -1, "bytea")
    for part, want in [(text, values), (text.slice(7, 900), values[7:907]),
                       (text.slice(3, 0), []), (pa.array([None, "\\x"], pa.string()),
                                                [None, b""]),
                       (pa.array(["\\xAbCd"], pa.string()), [b"\xab\xcd"])]:
        got = to_arrow(part, bytea)
        got.validate(full=True)
        assert got.type == pa.binary()
        assert got.to_pylist() == want
    # anything but plain hex of even length is named, value by value
    for bad, says in [(["\\x00", "zz"], "'zz' is not in the hex format"),
                      (["\\xabc"], "non-hexadecimal"), (["\\xa b "], "non-hexadecimal"),
                      (["\\xgg"], "non-hexadecimal")]:
        with pytest.raises(SourceStalledError, match=says):
            to_arrow(bad, bytea)
