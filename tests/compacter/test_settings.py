"""Settings checked at start-up. The driver memory: a value Spark would refuse (below its
450 MiB minimum) or the JVM would misread (``512mb``, a bare number) fails with exit code 2
before any JVM starts, naming the key. Retention by time: from the environment, never
negative."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from lamina.compacter.settings import MIN_DRIVER_MEMORY_MIB, jvm_size_mib, load_settings
from lamina.drill.procs import LAMINA, free_port
from lamina.errors import ConfigError


@pytest.mark.parametrize(("value", "mib"), [("450m", 450), ("1g", 1024), ("2G", 2048),
                                            ("460800k", 450), ("1t", 1024 * 1024)])
def test_driver_memory_accepted(value: str, mib: float) -> None:
    assert jvm_size_mib(value) == mib
    settings = load_settings(env={"LAMINA_SPARK_DRIVER_MEMORY": value})
    assert settings.spark_driver_memory == value


@pytest.mark.parametrize(("value", "why"), [
    ("449m", f"at least {MIN_DRIVER_MEMORY_MIB}m"),
    ("256m", f"at least {MIN_DRIVER_MEMORY_MIB}m"),
    ("512mb", "JVM heap size"),
    ("512", "JVM heap size"),
    ("lots", "JVM heap size"),
])
def test_driver_memory_refused(value: str, why: str) -> None:
    with pytest.raises(ConfigError, match="spark_driver_memory") as info:
        load_settings(env={"LAMINA_SPARK_DRIVER_MEMORY": value})
    assert why in str(info.value)


def test_serve_refuses_a_driver_memory_spark_cannot_start_with(tmp_path: Path) -> None:
    proc = subprocess.run(
        [LAMINA, "serve", "--data-dir", str(tmp_path / "data"), "--http",
         f"127.0.0.1:{free_port()}"],
        env={**os.environ, "LAMINA_SPARK_DRIVER_MEMORY": "256m"}, capture_output=True,
        text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "spark_driver_memory" in proc.stderr
    assert "at least 450m" in proc.stderr


def test_keep_versions_seconds_from_the_environment() -> None:
    """Retention by time: off by default, set from the environment, never negative."""
    assert load_settings(env={}).keep_versions_seconds == 0
    settings = load_settings(env={"LAMINA_KEEP_VERSIONS_SECONDS": "600",
                                  "LAMINA_KEEP_VERSIONS": "1"})
    assert (settings.keep_versions, settings.keep_versions_seconds) == (1, 600.0)
    with pytest.raises(ConfigError, match="keep_versions_seconds"):
        load_settings(env={"LAMINA_KEEP_VERSIONS_SECONDS": "-1"})


def test_scratch_compression_reaches_the_conversions(tmp_path: Path) -> None:
    """``scratch_compression`` (auto by default; lz4, zstd or none from the environment,
    anything else refused naming the key) is what the Spark executor's steps write their
    runs with (``auto`` resolved per step: tests/compacter/test_step.py)."""
    from lamina.compacter.daemon import Daemon
    from lamina.compacter.executors.spark import SparkExecutor

    assert load_settings(env={}).scratch_compression == "auto"
    with pytest.raises(ConfigError, match="scratch_compression"):
        load_settings(env={"LAMINA_SCRATCH_COMPRESSION": "gzip"})
    for env, want in (({}, "auto"), ({"LAMINA_SCRATCH_COMPRESSION": "lz4"}, "lz4"),
                      ({"LAMINA_SCRATCH_COMPRESSION": "zstd"}, "zstd"),
                      ({"LAMINA_SCRATCH_COMPRESSION": "none"}, "none")):
        daemon = Daemon(load_settings(env={"LAMINA_DATA_DIR": str(tmp_path), **env}))
        executor = daemon._spark_executor()  # builds no JVM: the session is only stored
        assert isinstance(executor, SparkExecutor)
        assert executor.tuning.run_compression == want


def test_the_daemons_session_runs_c1_only_unless_the_operator_says_otherwise(
        tmp_path: Path) -> None:
    """The daemon's JVM options are defaults (``spark.driver.defaultJavaOptions``, before
    any ``extraJavaOptions``); the operator's ``spark_conf`` wins over every key."""
    from lamina.compacter.daemon import Daemon
    from lamina.compacter.spark import DAEMON_JAVA_OPTIONS

    conf = Daemon(load_settings(env={"LAMINA_DATA_DIR": str(tmp_path),
                                     "LAMINA_SPARK_DRIVER_MEMORY": "700m"})).session_conf()
    assert conf["spark.driver.defaultJavaOptions"] == DAEMON_JAVA_OPTIONS
    assert conf["spark.executor.defaultJavaOptions"] == DAEMON_JAVA_OPTIONS
    assert "-XX:TieredStopAtLevel=1" in DAEMON_JAVA_OPTIONS.split()
    assert conf["spark.driver.memory"] == "700m"
    config = tmp_path / "lamina.toml"  # how an operator sets spark_conf
    config.write_text('[lamina.spark_conf]\n"spark.driver.defaultJavaOptions" = ""\n'
                      '"spark.driver.memory" = "900m"\n')
    conf = Daemon(load_settings(config, env={"LAMINA_DATA_DIR": str(tmp_path)})).session_conf()
    assert conf["spark.driver.defaultJavaOptions"] == ""
    assert conf["spark.driver.memory"] == "900m"
    assert conf["spark.executor.defaultJavaOptions"] == DAEMON_JAVA_OPTIONS
