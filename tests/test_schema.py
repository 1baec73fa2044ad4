"""lamina.schema: relation names, relation metadata and the conforming of user updates."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lamina.errors import CorruptionError, InvalidArgumentError, InvalidNameError, SchemaError
from lamina.schema import (
    DIFF,
    FORMAT_VERSION,
    TIME,
    RelationMeta,
    checked_updates,
    conform_updates,
    validate_name,
)
from tests.conftest import ORDERS, updates
from tests.strategies import batches, same_table, schemas

SUPPORTED_TYPES = [
    pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.float32(), pa.float64(), pa.bool_(),
    pa.string(), pa.binary(), pa.date32(), pa.timestamp("us"), pa.timestamp("us", tz="UTC"),
    pa.decimal128(10, 2), pa.decimal128(38, 0),
]

UNSUPPORTED_TYPES = [
    pa.uint8(), pa.uint64(), pa.float16(), pa.large_string(), pa.large_binary(),
    pa.date64(), pa.timestamp("ns"), pa.timestamp("ms"), pa.time64("us"), pa.null(),
    pa.list_(pa.int64()), pa.struct([("a", pa.int64())]),
    pa.dictionary(pa.int32(), pa.string()), pa.decimal256(40, 0), pa.duration("us"),
]


@given(st.from_regex(r"[a-z0-9][a-z0-9_.-]{0,63}", fullmatch=True))
def test_every_name_of_the_rule_is_accepted(name: str) -> None:
    """Any name matching ``[a-z0-9][a-z0-9_.-]{0,63}`` is valid and returned unchanged."""
    assert validate_name(name) == name


@pytest.mark.parametrize("name", [
    "", "a" * 65, "Orders", "oRders", "../x", "a/b", "/abs", ".", "..", ".hidden", "_x", "-x",
    "a b", "a\\b", "caf\u00e9", "a\x00", "x\n", 7, None, b"orders",
])
def test_bad_names_are_refused(name: object) -> None:
    """Empty, 65-character, uppercase, path-like, hidden, non-ASCII and non-string names
    raise InvalidNameError (an InvalidArgumentError and a ValueError)."""
    with pytest.raises(InvalidNameError, match="invalid relation name"):
        validate_name(name)


def test_longest_name_is_64_characters() -> None:
    """The limit is exactly 64 characters."""
    assert validate_name("a" * 64) == "a" * 64
    with pytest.raises(InvalidNameError):
        validate_name("a" * 65)


@pytest.mark.parametrize("t", SUPPORTED_TYPES, ids=str)
def test_supported_types_are_accepted(t: pa.DataType) -> None:
    """Each supported row type can be used in a relation schema."""
    meta = RelationMeta.new("r", pa.schema([("c", t)]), None)
    assert meta.schema.field("c").type == t


@pytest.mark.parametrize("t", UNSUPPORTED_TYPES, ids=str)
def test_unsupported_types_are_refused(t: pa.DataType) -> None:
    """Types that not every stage (IPC, Parquet, Spark, Arrow sort) orders and groups the
    same way are refused with a SchemaError naming the column. float16 is among them:
    Arrow cannot sort it, so a snapshot would fail."""
    with pytest.raises(SchemaError, match="'c'"):
        RelationMeta.new("r", pa.schema([("c", t)]), None)


@pytest.mark.parametrize(("schema", "key", "match"), [
    (pa.schema([]), None, "no columns"),
    (pa.schema([("_time", pa.int64())]), None, "reserved"),
    (pa.schema([("a", pa.int64()), ("_diff", pa.int64())]), None, "reserved"),
    (pa.schema([("a", pa.int64()), ("a", pa.string())]), None, "duplicate"),
    (ORDERS, ["nope"], "not in the schema"),
    (ORDERS, ["id", "id"], "repeat"),
])
def test_bad_schemas_are_refused(schema: pa.Schema, key: list[str] | None, match: str) -> None:
    """Empty schemas, reserved or duplicate column names and bad key columns are
    SchemaErrors."""
    with pytest.raises(SchemaError, match=match):
        RelationMeta.new("r", schema, key)


def test_schema_must_be_a_pyarrow_schema() -> None:
    """A non-schema argument is a SchemaError, not an AttributeError."""
    with pytest.raises(SchemaError, match=r"pyarrow\.Schema"):
        RelationMeta.new("r", {"id": "int64"}, None)


def test_bad_name_is_checked_before_the_schema() -> None:
    """RelationMeta.new validates the name too."""
    with pytest.raises(InvalidNameError):
        RelationMeta.new("../x", ORDERS, None)


def test_meta_json_round_trip_and_layout() -> None:
    """relation.json holds the documented fields and reads back to an equal RelationMeta;
    sort columns are the key columns, then the other row columns."""
    schema = pa.schema([("a", pa.string()), ("b", pa.int64(), False), ("c", pa.float64())])
    meta = RelationMeta.new("rel-1", schema, ["c"])
    doc = json.loads(meta.to_json())
    assert set(doc) == {"format_version", "name", "relation_id", "schema", "columns", "key",
                        "created_at"}
    assert doc["format_version"] == 1  # no time unit: the version every lamina reads
    assert doc["columns"] == ["a: string", "b: int64", "c: double"]
    back = RelationMeta.from_json(meta.to_json())
    assert back == meta
    assert not back.schema.field("b").nullable
    assert meta.sort_columns == ["c", "a", "b"]
    assert meta.update_schema.names == ["a", "b", "c", TIME, DIFF]
    assert meta.update_schema.field(TIME).type == pa.uint64()
    assert meta.update_schema.field(DIFF).type == pa.int64()


def test_a_time_unit_is_format_version_2_and_version_1_still_reads() -> None:
    """The format version rule (lamina.schema): a relation with a time unit is written as
    version 2 with ``time_unit``; one without is version 1, exactly the fields an older
    lamina wrote, and reads back with no unit; an unknown unit is refused."""
    meta = RelationMeta.new("clicks", ORDERS, ["id"], time_unit="ms")
    doc = json.loads(meta.to_json())
    assert doc["format_version"] == FORMAT_VERSION == 2
    assert doc["time_unit"] == "ms"
    assert RelationMeta.from_json(meta.to_json()) == meta
    old = json.loads(RelationMeta.new("old", ORDERS, None).to_json())
    assert "time_unit" not in old
    assert RelationMeta.from_json(json.dumps(old).encode()).time_unit is None
    with pytest.raises(InvalidArgumentError, match="time_unit"):
        RelationMeta.new("x", ORDERS, None, time_unit="s")
    doc["time_unit"] = "fortnights"
    with pytest.raises(CorruptionError, match="time unit"):
        RelationMeta.from_json(json.dumps(doc).encode(), "/x/relation.json")


def test_relation_ids_differ_between_incarnations() -> None:
    """Each RelationMeta.new mints a fresh relation_id."""
    assert RelationMeta.new("r", ORDERS, None).relation_id != \
        RelationMeta.new("r", ORDERS, None).relation_id


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(format_version=3),
    lambda d: d.update(format_version=2),  # version 2 must carry time_unit
    lambda d: d.pop("schema"),
    lambda d: d.update(schema="not base64 arrow"),
    lambda d: d.update(name="Bad/Name"),
])
def test_unreadable_meta_is_corruption(mutate: object) -> None:
    """A relation.json with a wrong version, a missing or garbled schema or a bad name is a
    CorruptionError naming the file, never a KeyError or a silently wrong relation."""
    doc = json.loads(RelationMeta.new("r", ORDERS, None).to_json())
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(CorruptionError, match=r"relation\.json"):
        RelationMeta.from_json(json.dumps(doc).encode(), "/x/relation.json")
    with pytest.raises(CorruptionError):
        RelationMeta.from_json(b"{not json", "/x/relation.json")


ORDERS_META = RelationMeta.new("orders", ORDERS, ["id"])


def test_conform_reorders_and_casts_losslessly() -> None:
    """Columns come back in schema order; int32 ids, int64 times and a large_string column
    are converted to the relation's types; a RecordBatch is accepted too."""
    data = pa.table({
        "_diff": pa.array([1, -1], pa.int32()),
        "item": pa.array(["a", "b"], pa.large_string()),
        "_time": pa.array([3, 4], pa.int64()),
        "id": pa.array([1, 2], pa.int32()),
    })
    out = conform_updates(ORDERS_META, data)
    assert out.schema.equals(ORDERS_META.update_schema)
    assert out.to_pydict() == {"id": [1, 2], "item": ["a", "b"], TIME: [3, 4], DIFF: [1, -1]}
    batch = conform_updates(ORDERS_META, updates([(1, "a", 0, 1)]).to_batches()[0])
    assert batch.num_rows == 1


@pytest.mark.parametrize(("data", "match"), [
    (updates([(1, "a", 0, 1)]).drop_columns(["item"]), "missing columns \\['item'\\]"),
    (updates([(1, "a", 0, 1)]).append_column("x", pa.array([1])), "unexpected columns"),
    (updates([(1, "a", 0, 1)]).drop_columns([DIFF]), "missing columns"),
    (updates([(1, "a", 0, 1)]).set_column(1, "item", pa.array([1])), "'item' has type"),
    (updates([(1, "a", 0, 1)]).set_column(0, "id", pa.array(["1"])), "'id' has type"),
    (updates([(1, "a", 0, 1)]).set_column(2, TIME, pa.array([-1])), "without loss"),
    (updates([(1, "a", 0, 1)]).set_column(2, TIME, pa.array([1.5])), "'_time' has type"),
    (updates([(1, "a", 0, 1)]).set_column(3, DIFF, pa.array([2**63], pa.uint64())),
     "without loss"),
    (updates([(1, "a", 0, 1)]).set_column(2, TIME, pa.array([None], pa.uint64())), "nulls"),
    (updates([(1, "a", 0, 1)]).set_column(3, DIFF, pa.array([None], pa.null())), "nulls"),
    (pa.table({"id": [1], "item": ["a"], TIME: pa.array([0], pa.uint64()),
               DIFF: [1]}).append_column("id", pa.array([2])), "unexpected|repeat"),
    ({"id": [1]}, "pyarrow Table"),
])
def test_conform_refuses_mismatches(data: object, match: str) -> None:
    """Missing, extra, repeated and wrongly typed columns, lossy casts and nulls in
    non-nullable columns are SchemaErrors that say which column."""
    with pytest.raises(SchemaError, match=match):
        conform_updates(ORDERS_META, data)


def test_conform_refuses_nulls_in_a_non_nullable_row_column() -> None:
    """A row column declared non-nullable refuses nulls."""
    meta = RelationMeta.new("r", pa.schema([pa.field("a", pa.int64(), nullable=False)]), None)
    data = pa.table({"a": pa.array([None], pa.int64()), TIME: pa.array([0], pa.uint64()),
                     DIFF: pa.array([1], pa.int64())})
    with pytest.raises(SchemaError, match="'a' holds 1 nulls"):
        conform_updates(meta, data)


def test_schema_errors_are_invalid_arguments() -> None:
    """Schema and name errors are caught as InvalidArgumentError and ValueError."""
    assert issubclass(SchemaError, InvalidArgumentError)
    assert issubclass(InvalidNameError, ValueError)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_conform_paths_agree(data: st.DataObject) -> None:
    """The same updates given with the exact update schema, with every field nullable (as
    ``pa.table`` builds them) or with columns reordered and widened types conform to the
    same table, whose schema is exactly the relation's update schema."""
    meta = RelationMeta.new("r", data.draw(schemas()), None)
    table = data.draw(batches(meta, min_rows=1))
    loose = pa.Table.from_arrays(table.columns, schema=meta.loose_update_schema)
    shuffled = pa.table({n: table.column(n) for n in reversed(table.column_names)})
    shuffled = shuffled.set_column(shuffled.schema.get_field_index(DIFF), DIFF,
                                   table.column(DIFF).cast(pa.int64()))
    for variant in (table, loose, shuffled):
        out = conform_updates(meta, variant)
        assert out.schema.equals(meta.update_schema)
        assert not out.schema.field(TIME).nullable
        assert same_table(out, table)
    # what Relation.append passes to the WAL writer: the loose table as it is
    assert checked_updates(meta, loose) is loose
    assert checked_updates(meta, table) is table
    checked = checked_updates(meta, shuffled)
    assert checked.schema.equals(meta.update_schema)
    assert same_table(checked, table)


def test_checked_updates_check_the_loose_form_and_never_pass_metadata_on() -> None:
    """A table right but for its nullable fields is checked for nulls in the columns the
    relation declares non-nullable (and refused, naming the column); one that carries
    schema or field metadata (pandas' own, say) comes back without it, under the
    relation's schema."""
    meta = RelationMeta.new("r", pa.schema([pa.field("a", pa.int64(), nullable=False),
                                            pa.field("b", pa.string())]), None)
    for column, values in (("a", {"a": [1, None], "b": ["x", None]}),
                           (TIME, {"a": [1, 2], "b": ["x", None]})):
        data = pa.table({**values, TIME: pa.array([0, None if column == TIME else 1],
                                                  pa.uint64()),
                         DIFF: pa.array([1, 1], pa.int64())})
        assert data.schema.equals(meta.loose_update_schema)
        with pytest.raises(SchemaError, match=f"{column!r} holds 1 nulls"):
            checked_updates(meta, data)
    plain = pa.table({"a": [1], "b": ["x"], TIME: pa.array([0], pa.uint64()),
                      DIFF: pa.array([1], pa.int64())})
    field_tagged = plain.schema.set(1, plain.schema.field(1).with_metadata({"k": "v"}))
    for tagged in (plain.replace_schema_metadata({"k": "v"}), plain.cast(field_tagged)):
        out = checked_updates(meta, tagged)
        assert out.schema.equals(meta.update_schema, check_metadata=True)
        assert out.column("b").to_pylist() == ["x"]
