"""The compacter's settings: one frozen, validated object built at start-up.

Sources, later ones winning: defaults, a TOML file (``--config``; keys as below, at the top
level or under a ``[lamina]`` table), ``LAMINA_<NAME>`` environment variables (e.g.
``LAMINA_SPARK_MASTER``, ``LAMINA_POLL_INTERVAL``), then command-line flags. Unknown keys are
errors, so a typo never passes silently. Defaults serve a laptop: ``./lamina-data``, Spark
``local[*]``, HTTP on 127.0.0.1:9740.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from lamina.compacter.executors.schedule import DEFAULT_PACK_BYTES, DEFAULT_PACK_STEPS
from lamina.compacter.step.runs import ScratchCompression
from lamina.service.settings import ENV_PREFIX, S3Section, ServiceSettings, load_toml_settings

__all__ = ["ENV_PREFIX", "Settings", "jvm_size_mib", "load_settings"]
MIN_DRIVER_MEMORY_MIB = 450
"""Spark refuses to start a driver whose JVM heap is below 1.5 times its 300 MiB of
reserved memory (``UnifiedMemoryManager``), i.e. 450 MiB; the same bound holds in local
mode, where the executors share the driver's JVM."""
_JVM_SIZE = re.compile(r"(\d+)([kmgt])", re.IGNORECASE)
_UNIT_MIB = {"k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}


def jvm_size_mib(value: str) -> float:
    """MiB of a JVM heap size such as ``512m`` or ``2g``; ValueError for anything else
    (``512mb`` and a bare ``512`` are refused: Spark hands the value to the JVM as
    ``-Xmx<value>``, which rejects the first and reads the second as bytes)."""
    m = _JVM_SIZE.fullmatch(value.strip())
    if m is None:
        raise ValueError(f"expected a JVM heap size such as 512m or 2g, got {value!r}")
    return int(m.group(1)) * _UNIT_MIB[m.group(2).lower()]


class Settings(ServiceSettings):
    """Every knob of the compacter."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    data_dir: Path = Path("lamina-data")
    trace_url: str | None = Field(
        None, description="where the traces live: file:///abs/dir or s3://bucket/prefix; "
        "recorded in the data directory at the first start (default <data_dir>/trace), "
        "and a data directory refuses a different one later")
    s3: S3Section = Field(default_factory=lambda: S3Section.model_validate({}))
    stage_segments: Literal["auto", "always", "never"] = Field(
        "auto", description="copy WAL segments into the trace store for conversions, so "
        "executors need no access to the daemon's disk (auto: when the Spark master is not "
        "local and the trace is not file://)")
    executor: Literal["spark", "inprocess"] = Field(
        "spark", description="what runs the jobs: Spark, or the pyarrow reference in the "
        "daemon's process (lamina.compacter.executors.inprocess; no JVM, for small relations)")
    spark_master: str = "local[*]"
    spark_driver_memory: str = "1g"
    spark_conf: dict[str, str] = Field(default_factory=dict)
    http: str = "127.0.0.1:9740"
    poll_interval: float = Field(1.0, gt=0, description="seconds between WAL directory scans")
    max_concurrent_jobs: int = Field(2, ge=1, description="Spark jobs (packs or large steps) "
                                     "running at once; all but one may be large steps")
    pack_max_steps: int = Field(DEFAULT_PACK_STEPS, ge=1, description="most small steps "
                                "(of as many relations) in one Spark job, one task each")
    pack_max_bytes: int = Field(DEFAULT_PACK_BYTES, ge=1, description="most input bytes of "
                                "the small steps in one Spark job")
    relation_metrics: bool = Field(True, description="export the per-relation gauges with a "
                                   "relation label (7 + levels series per relation); false: "
                                   "each once, summed or maximal over relations")
    max_segments_per_job: int = Field(64, ge=1)
    max_bytes_per_job: int = Field(1 << 30, ge=1, description="WAL bytes per conversion (decoded)")
    scratch_compression: ScratchCompression = Field(
        "auto", description="codec of a large conversion's scratch runs (auto: none where "
        "the trace's filesystem has 8 times the conversion's decoded input free, else lz4; "
        "lz4; zstd: about 2.4 times smaller for more CPU, where disk is short, with the "
        "writers' wal_compression; none: the runs at their decoded size, faster "
        "conversions)")
    retry_initial_seconds: float = Field(1.0, gt=0)
    retry_max_seconds: float = Field(60.0, gt=0)
    shutdown_grace_seconds: float = Field(30.0, ge=0)
    gc_interval_seconds: float = Field(30.0, gt=0)
    gc_grace_seconds: float = Field(600.0, ge=0)
    keep_versions: int = Field(8, ge=1, description="trace state versions GC always keeps, "
                               "with the files they name: how far back time travel goes (a "
                               "running read is kept by its lease, whatever this says)")
    keep_versions_seconds: float = Field(
        0.0, ge=0, description="a superseded trace state version is also kept until it has "
        "been superseded this long: time travel by age (0: by count only)")
    ready_backlog_bytes: int = Field(4 << 30, ge=0, description="WAL backlog above which "
                                     "/readyz fails")
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    def stages_segments(self, trace_url: str) -> bool:
        """Whether conversions stage their segments (``stage_segments``) for this trace."""
        if self.stage_segments != "auto":
            return self.stage_segments == "always"
        return not self.spark_master.startswith("local") and not trace_url.startswith("file:")

    @field_validator("spark_driver_memory")
    @classmethod
    def _check_driver_memory(cls, v: str) -> str:
        if jvm_size_mib(v) < MIN_DRIVER_MEMORY_MIB:
            raise ValueError(f"Spark needs a driver heap of at least {MIN_DRIVER_MEMORY_MIB}m "
                             f"(it refuses to start below), got {v!r}")
        return v.strip()


def load_settings(config_file: str | os.PathLike[str] | None = None,
                  env: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Any] | None = None) -> Settings:
    """Merge defaults, TOML, environment and flags; raise ConfigError naming the bad key."""
    return load_toml_settings(Settings, config_file, env, overrides)
