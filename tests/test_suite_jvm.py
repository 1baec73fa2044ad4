"""The test suite's own JVM options (tests/spark-conf, through SPARK_CONF_DIR) reach the
JVMs it starts: here the shared SparkSession's driver; tests/compacter/test_cluster.py checks
a standalone cluster's master, worker and executor, test_bounded_memory.py a daemon's driver.
The options change how those JVMs compile, not what they compute; this guards against them
silently ceasing to apply (a PySpark upgrade that reads its configuration elsewhere), which
would only show as a slower suite."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SPARK_CONF_DIR

FLAGS = ("-XX:TieredStopAtLevel=1",)


def jvm_arguments(spark: Any) -> list[str]:
    bean = spark.sparkContext._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
    return [str(a) for a in bean.getInputArguments()]


def test_the_conf_dir_is_the_suites() -> None:
    assert Path(os.environ["SPARK_CONF_DIR"]) == SPARK_CONF_DIR
    for flag in FLAGS:
        assert flag in (SPARK_CONF_DIR / "spark-defaults.conf").read_text()
        assert flag in (SPARK_CONF_DIR / "spark-env.sh").read_text()


@pytest.mark.spark
def test_the_shared_session_runs_with_the_suites_jvm_options(spark: Any) -> None:
    args = jvm_arguments(spark)
    for flag in FLAGS:
        assert flag in args, args
