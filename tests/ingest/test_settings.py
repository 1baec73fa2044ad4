"""Ingest settings: TOML, environment, flags; every bad input names its key."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pytest

from lamina.errors import ConfigError
from lamina.ingest.settings import (
    FilesSourceSettings,
    PostgresSourceSettings,
    arrow_type,
    load_settings,
)

FILES = """
data_dir = "/tmp/x"
[[sources]]
name = "clicks"
kind = "files"
path = "/var/spool/clicks"
format = "csv"
schema = { id = "int64", at = "timestamp[us, tz=UTC]", price = "decimal128(18, 2)" }
key = ["id"]
errors = "relation"
"""

PG = """
[[sources]]
name = "shop"
kind = "postgres"
dsn = "host=/run/postgresql dbname=shop user=lamina"
tables = ["public.orders", "customers"]
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "ingest.toml"
    p.write_text(text)
    return p


def test_files_source_from_toml_env_and_flags(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, FILES), env={"LAMINA_LOG_LEVEL": "debug",
                                                   "LAMINA_HTTP": "0.0.0.0:1",
                                                   "LAMINA_INGEST_HTTP": "127.0.0.1:9999"},
                      overrides={"data_dir": "/tmp/y", "http": None})
    assert s.data_dir == Path("/tmp/y")
    assert s.log_level == "debug"
    assert s.http == "127.0.0.1:9999"          # LAMINA_HTTP is the compacter's
    src = s.sources[0]
    assert isinstance(src, FilesSourceSettings)
    assert src.arrow_schema == pa.schema([
        pa.field("id", pa.int64(), False), pa.field("at", pa.timestamp("us", tz="UTC")),
        pa.field("price", pa.decimal128(18, 2))])
    assert src.outputs() == {"clicks": "clicks", "clicks.errors": "clicks.errors"}
    assert src.remap_relation == "clicks.remap"
    assert src.file_pattern == "*.csv"
    assert load_settings(write(tmp_path, FILES), env={}).http == "127.0.0.1:9741"


def test_postgres_defaults_follow_the_design(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, PG), env={})
    src = s.sources[0]
    assert isinstance(src, PostgresSourceSettings)
    assert src.publication_name == "lamina_shop"
    assert src.slot_name == "lamina_shop"
    assert src.outputs() == {"public.orders": "shop.orders", "public.customers": "shop.customers"}
    assert src.timestamp_interval_seconds == 1.0
    assert s.segment_max_age_seconds == 60.0  # Store.open's default


def test_retention_defaults_to_an_hour_and_a_table_can_set_its_own(tmp_path: Path) -> None:
    """``retain_history_seconds``: 3600 unless set; a source's value applies to each of its
    tables, a table's own (``inf`` included) to that table alone, and so does
    ``on_truncate``."""
    text = PG.replace('tables = ["public.orders", "customers"]', """\
retain_history_seconds = 60
on_truncate = "stall"
[sources.tables]
"public.orders" = {}
"public.events" = { relation = "events", retain_history_seconds = inf }
"public.audit" = { retain_history_seconds = 0, on_truncate = "retract" }""")
    src = load_settings(write(tmp_path, text), env={}).sources[0]
    assert isinstance(src, PostgresSourceSettings)
    out = src.output_settings()
    assert {t: (o.relation, o.retention.seconds, o.on_truncate) for t, o in out.items()} == {
        "public.orders": ("shop.orders", 60.0, "stall"),
        "public.events": ("events", math.inf, "stall"),
        "public.audit": ("shop.audit", 0.0, "retract")}
    assert out["public.events"].retention.since_at(10**9, 0) is None  # never moves
    assert out["public.audit"].retention.since_at(5000, 0) == 5000    # newest time only
    default = load_settings(write(tmp_path, PG), env={}).sources[0]
    assert isinstance(default, PostgresSourceSettings)
    assert {o.retention.seconds for o in default.output_settings().values()} == {3600.0}


@pytest.mark.parametrize(("text", "needle"), [
    (FILES.replace('"int64"', '"int65"'), "sources.0.files.schema"),
    (FILES.replace('key = ["id"]', 'key = ["nope"]'), "key column 'nope'"),
    (FILES.replace('name = "clicks"', 'name = "Clicks/x"'), "sources.0.files.name"),
    (FILES.replace('format = "csv"', 'format = "xml"'), "sources.0.files.format"),
    (FILES + "typo = 1\n", "typo"),
    (FILES.replace('"int64"', '"uint8"'), "does not store"),
    (FILES + FILES.replace('data_dir = "/tmp/x"', ""), "repeat"),
    (PG.replace('"customers"', '"customers"]\nslot = 3\n#'), "sources.0.postgres.slot"),
    ('http = "nohost"\n' + PG, "HOST:PORT"),
    ("segment_max_age_seconds = 0\n" + PG, "segment_max_age_seconds"),
    ("", "sources"),
])
def test_bad_settings_name_the_key(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        load_settings(write(tmp_path, text), env={})
    assert needle in str(info.value)


def test_missing_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml", env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(write(tmp_path, "[[sources]\n"), env={})


def test_arrow_type_names() -> None:
    assert arrow_type("string") == pa.string()
    assert arrow_type("timestamp[us]") == pa.timestamp("us")
    with pytest.raises(ValueError, match="unknown Arrow type"):
        arrow_type("varchar")
