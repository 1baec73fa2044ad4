"""The settings of ``lamina ingest``: one frozen, validated object built at start-up.

Sources, later ones winning: defaults, a TOML file (``--config``; keys at the top level or
under a ``[lamina]`` table, sources as ``[[sources]]`` arrays of tables), ``LAMINA_<NAME>``
environment variables for the top-level scalars (``LAMINA_DATA_DIR``, ``LAMINA_HTTP``,
``LAMINA_LOG_LEVEL``, ...; the HTTP address from ``LAMINA_INGEST_HTTP``, since
``LAMINA_HTTP`` belongs to the compacter and one environment may serve both daemons), then
command-line flags. Unknown keys are errors, so a typo never passes
silently; every message names the key (``sources.1.schema.ts: ...``).

A files source::

    [[sources]]
    name = "clicks"                  # relation-name rules; remap relation "clicks.remap"
    kind = "files"
    path = "/var/spool/clicks"       # a directory; files read in name order
    format = "jsonl"                 # jsonl | csv | parquet
    pattern = "*.jsonl"              # default by format: *.jsonl, *.csv, *.parquet
    schema = { id = "int64", url = "string", at = "timestamp[us, tz=UTC]" }
    key = ["id"]
    relation = "clicks"              # default: the source name
    errors = "stall"                 # or "relation": bad lines go to "clicks.errors"

A PostgreSQL source takes the keys of docs/ingestion.md (``dsn``, ``tables``, ``publication``,
``slot``). Both take ``timestamp_interval_seconds`` (default 1.0), ``retain_history_seconds``
(default 3600; ``inf`` keeps everything, see :mod:`lamina.ingest.retention`) and
``on_truncate`` (``"retract"``, the default, or ``"stall"``). A PostgreSQL table may
override the last two (and name its relation) in the ``tables`` table::

    tables = { "public.orders" = "orders",
               "public.events" = { relation = "events", retain_history_seconds = 86400,
                                   on_truncate = "stall" } }
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import pyarrow as pa
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from lamina.errors import InvalidNameError, SchemaError
from lamina.ingest.retention import Retention
from lamina.schema import RelationMeta, validate_name
from lamina.service.settings import ENV_PREFIX, ServiceSettings, load_toml_settings

DEFAULT_HTTP = "127.0.0.1:9741"
ERRORS_SUFFIX = ".errors"
REMAP_SUFFIX = ".remap"

_TIMESTAMP = re.compile(r"timestamp\[(s|ms|us|ns)(?:,\s*tz=([^\]]+))?\]")
_DECIMAL = re.compile(r"decimal(?:128)?\((\d+),\s*(\d+)\)")


def arrow_type(name: str) -> pa.DataType:
    """The Arrow type named ``name``: an alias (``int64``, ``string``, ``float64``,
    ``bool``, ``date32``, ``binary``, ...), ``timestamp[us]``, ``timestamp[us, tz=UTC]``
    or ``decimal128(P, S)``. ValueError for anything else."""
    text = name.strip()
    m = _TIMESTAMP.fullmatch(text)
    if m:
        return pa.timestamp(m.group(1), tz=m.group(2).strip() if m.group(2) else None)
    m = _DECIMAL.fullmatch(text)
    if m:
        return pa.decimal128(int(m.group(1)), int(m.group(2)))
    try:
        return pa.type_for_alias(text)
    except (ValueError, KeyError):
        raise ValueError(f"unknown Arrow type name {name!r}; use e.g. int64, string, "
                         "float64, bool, date32, binary, timestamp[us], "
                         "timestamp[us, tz=UTC] or decimal128(18, 2)") from None


def _check_name(v: str) -> str:
    try:
        return validate_name(v)
    except InvalidNameError as exc:
        raise ValueError(str(exc)) from None


OnTruncate = Literal["retract", "stall"]


@dataclass(frozen=True)
class OutputSettings:
    """How one upstream table is written: its relation and the policies for it."""

    relation: str
    retention: Retention
    on_truncate: OnTruncate


class _SourceBase(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    name: str
    timestamp_interval_seconds: float = Field(1.0, gt=0, le=3600)
    retain_history_seconds: float = Field(default=3600.0, ge=0)
    """History kept behind the newest binding (``inf``: all of it)."""
    on_truncate: OnTruncate = "retract"

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check_name(v)

    @property
    def retention(self) -> Retention:
        """The source's own retention (its remap relation's, and its tables' default)."""
        return Retention(self.retain_history_seconds)

    def output_settings(self) -> dict[str, OutputSettings]:
        """Upstream table -> how it is written."""
        raise NotImplementedError

    def outputs(self) -> dict[str, str]:
        """Upstream table name -> output relation name."""
        return {u: o.relation for u, o in self.output_settings().items()}

    @property
    def remap_relation(self) -> str:
        return self.name + REMAP_SUFFIX

    @property
    def interval_ms(self) -> int:
        return max(1, round(self.timestamp_interval_seconds * 1000))


class FilesSourceSettings(_SourceBase):
    """A directory of append-only JSON Lines or CSV files (or Parquet files dropped whole)."""

    kind: Literal["files"]
    path: Path
    format: Literal["jsonl", "csv", "parquet"]
    pattern: str | None = None
    columns: dict[str, str] = Field(alias="schema", min_length=1)
    key: tuple[str, ...] = ()
    relation: str | None = None
    errors: Literal["stall", "relation"] = "stall"
    csv_header: bool = True
    poll_interval_seconds: float = Field(0.1, gt=0, le=60)
    max_batch_bytes: int = Field(8 << 20, ge=1024)

    @field_validator("columns")
    @classmethod
    def _types(cls, v: dict[str, str]) -> dict[str, str]:
        for col, tname in v.items():
            try:
                arrow_type(tname)
            except ValueError as exc:
                raise ValueError(f"column {col!r}: {exc}") from None
        return v

    @field_validator("relation")
    @classmethod
    def _relation(cls, v: str | None) -> str | None:
        return None if v is None else _check_name(v)

    @model_validator(mode="after")
    def _schema_and_key(self) -> FilesSourceSettings:
        for k in self.key:
            if k not in self.columns:
                raise ValueError(f"key column {k!r} is not in schema {list(self.columns)}")
        try:
            RelationMeta.new(self.output_relation, self.arrow_schema, self.key)
        except (SchemaError, InvalidNameError) as exc:
            raise ValueError(str(exc)) from None
        reserved = {self.remap_relation, self.errors_relation}
        if self.output_relation in reserved:
            raise ValueError(f"relation {self.output_relation!r} collides with the source's "
                             f"own relations {sorted(reserved)}; choose another name")
        return self

    @property
    def arrow_schema(self) -> pa.Schema:
        return pa.schema([pa.field(c, arrow_type(t), nullable=c not in self.key)
                          for c, t in self.columns.items()])

    @property
    def output_relation(self) -> str:
        return self.relation or self.name

    @property
    def errors_relation(self) -> str:
        return self.name + ERRORS_SUFFIX

    @property
    def file_pattern(self) -> str:
        return self.pattern or {"jsonl": "*.jsonl", "csv": "*.csv",
                                "parquet": "*.parquet"}[self.format]

    def output_settings(self) -> dict[str, OutputSettings]:
        rels = [self.output_relation]
        if self.errors == "relation":
            rels.append(self.errors_relation)
        return {r: OutputSettings(r, self.retention, self.on_truncate) for r in rels}


class TableSettings(BaseModel):
    """A PostgreSQL table's own settings (a value of the ``tables`` table)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    relation: str | None = None
    retain_history_seconds: float | None = Field(default=None, ge=0)
    on_truncate: OnTruncate | None = None

    @field_validator("relation")
    @classmethod
    def _relation(cls, v: str | None) -> str | None:
        return None if v is None else _check_name(v)


class PostgresSourceSettings(_SourceBase):
    """A PostgreSQL database read by logical replication (``pgoutput``)."""

    kind: Literal["postgres"]
    dsn: str
    tables: list[str] | dict[str, str | TableSettings] = Field(min_length=1)
    publication: str | None = None
    slot: str | None = None

    @field_validator("tables")
    @classmethod
    def _tables(cls, v: list[str] | dict[str, str | TableSettings],
                ) -> list[str] | dict[str, str | TableSettings]:
        if isinstance(v, dict):
            for rel in v.values():
                if isinstance(rel, str):
                    _check_name(rel)
        return v

    @property
    def publication_name(self) -> str:
        return self.publication or "lamina_" + self.name.replace(".", "_").replace("-", "_")

    @property
    def slot_name(self) -> str:
        return self.slot or "lamina_" + self.name.replace(".", "_").replace("-", "_")

    def output_settings(self) -> dict[str, OutputSettings]:
        """Upstream table name (``schema.table``) -> how it is written."""
        items: dict[str, str | TableSettings] = (
            self.tables if isinstance(self.tables, dict) else dict.fromkeys(self.tables, ""))
        out = {}
        for table, value in items.items():
            own = value if isinstance(value, TableSettings) else TableSettings(
                relation=value or None)
            relation = own.relation or _check_name(
                f"{self.name}.{table.rpartition('.')[2].lower()}")
            retain = own.retain_history_seconds
            out[_qualified(table)] = OutputSettings(
                relation, self.retention if retain is None else Retention(retain),
                own.on_truncate or self.on_truncate)
        return out


def _qualified(table: str) -> str:
    return table if "." in table else "public." + table


SourceSettings = Annotated[FilesSourceSettings | PostgresSourceSettings,
                           Field(discriminator="kind")]


class IngestSettings(ServiceSettings):
    """Every knob of ``lamina ingest``."""

    http_port_zero: ClassVar[bool] = True

    model_config = ConfigDict(frozen=True, extra="forbid")

    data_dir: Path = Path("lamina-data")
    http: str = DEFAULT_HTTP
    sources: tuple[SourceSettings, ...] = Field(min_length=1)
    retry_initial_seconds: float = Field(0.5, gt=0)
    retry_max_seconds: float = Field(30.0, gt=0)
    shutdown_grace_seconds: float = Field(30.0, ge=0)
    segment_max_age_seconds: float = Field(60.0, gt=0)
    """The outputs' WAL segments finish at a seal once this old (Store.open's option), so
    the compacter converts what ingest wrote within about this long."""
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="after")
    def _unique(self) -> IngestSettings:
        names = [s.name for s in self.sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"source names repeat: {dup}; give each source its own name")
        owner: dict[str, str] = {}
        for s in self.sources:
            for rel in [s.remap_relation, *s.outputs().values()]:
                if rel in owner:
                    raise ValueError(f"relation {rel!r} is written by both source "
                                     f"{owner[rel]!r} and source {s.name!r}; rename one")
                owner[rel] = s.name
        return self


def load_settings(config_file: str | os.PathLike[str] | None = None,
                  env: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None) -> IngestSettings:
    """Merge defaults, TOML, environment and flags; raise ConfigError naming the bad key."""
    return load_toml_settings(
        IngestSettings, config_file, env, overrides,
        env_fields=[n for n in IngestSettings.model_fields if n not in ("sources", "http")],
        env_names={ENV_PREFIX + "INGEST_HTTP": "http"}, what="ingest settings",
        missing_hint="; pass an existing TOML file with --config",
        invalid_hint=f"; fix the config file {config_file or '(none)'} or the LAMINA_* "
                     "variables")
