"""The test suite's own JVM options and class-data archive (tests/spark_jvm.py) reach the
JVMs it starts: here the shared SparkSession's driver; tests/compacter/test_cluster.py checks
a standalone cluster's master, worker and executor, test_bounded_memory.py a daemon's driver.
They change how those JVMs load and compile classes, not what they compute; this guards
against them silently ceasing to apply (a PySpark upgrade that reads its configuration
elsewhere, a file left in the conf directory, which class-data sharing refuses), which
would only show as a slower suite."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

import pytest

from lamina.compacter.spark import java_options
from tests import spark_jvm


def test_the_environment_is_the_suites() -> None:
    for name, value in spark_jvm.environment().items():
        assert os.environ[name] == value, name
    # on every JVM's class path: class-data sharing needs it empty
    assert spark_jvm.CONF_DIR.is_dir()
    assert not list(spark_jvm.CONF_DIR.iterdir())
    properties = spark_jvm.PROPERTIES.read_text()
    archive = spark_jvm.current_archive()
    for key in ("spark.driver.extraJavaOptions", "spark.executor.extraJavaOptions"):
        line = next(x for x in properties.splitlines() if x.startswith(key))
        options = shlex.split(line.removeprefix(key))
        for flag in (*spark_jvm.FLAGS, spark_jvm.SERIAL):
            assert flag in options, line
        if archive is None:  # not named until dumped (spark_jvm.current_archive)
            assert not any(o.startswith("-XX:SharedArchiveFile") for o in options), line
        else:
            assert f"-XX:SharedArchiveFile={archive}" in options, line
    for flag in (*spark_jvm.FLAGS, spark_jvm.SERIAL):
        assert flag in os.environ["SPARK_DAEMON_JAVA_OPTS"].split()


def test_paths_with_spaces_are_quoted_as_spark_splits_them(tmp_path: Path) -> None:
    """PySpark splits PYSPARK_SUBMIT_ARGS with shlex, Spark splits extraJavaOptions the
    same way: a checkout under a directory with a space keeps its paths whole."""
    archive, properties = tmp_path / "a b" / "x.jsa", tmp_path / "c d" / "p.conf"
    assert f"-XX:SharedArchiveFile={archive}" in shlex.split(spark_jvm.java_options(archive))
    assert shlex.split(spark_jvm.submit_args(properties)) == [
        "--properties-file", str(properties), "pyspark-shell"]


def test_the_archive_key_follows_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    before = spark_jvm.archive_path()
    assert before.parent == spark_jvm.ROOT
    assert before.suffix == ".jsa"
    assert spark_jvm.archive_path() == before  # stable
    monkeypatch.setattr(spark_jvm, "FLAGS", (*spark_jvm.FLAGS, "-XX:+AlwaysPreTouch"))
    assert spark_jvm.archive_path() != before
    monkeypatch.undo()
    monkeypatch.setattr(spark_jvm, "SERIAL", "-XX:+UseParallelGC")
    assert spark_jvm.archive_path() != before


def test_a_driver_at_the_minimum_heap_can_have_g1() -> None:
    """The serial collector reports a heap below Spark's minimum at -Xmx450m, so the
    bounded-memory test's driver takes G1 through ``gc``: one collector, never both."""
    for gc, other in ((spark_jvm.SERIAL, spark_jvm.G1), (spark_jvm.G1, spark_jvm.SERIAL)):
        for line in spark_jvm.properties_text(None, gc=gc).splitlines()[1:]:
            options = shlex.split(line.split(None, 1)[1])
            assert gc in options, line
            assert other not in options, line


@pytest.mark.spark
def test_the_shared_session_runs_with_the_suites_jvm_options(spark: Any) -> None:
    args = java_options(spark)
    for flag in (*spark_jvm.FLAGS, spark_jvm.SERIAL):
        assert flag in args, args
    bean = spark.sparkContext._jvm.java.lang.management.ManagementFactory
    collectors = [str(b.getName()) for b in bean.getGarbageCollectorMXBeans()]
    assert collectors == ["Copy", "MarkSweepCompact"], collectors  # the serial collector


@pytest.mark.spark
def test_the_shared_session_maps_the_class_archive(spark: Any) -> None:
    """The driver mapped the archive: its classes came from there, parsed and verified."""
    archive = spark_jvm.archive_path()
    if not archive.exists():
        if os.environ.get("CI"):
            pytest.fail(f"no class-data archive at {archive}: `make pytest` dumps it "
                        "(python -m tests.spark_jvm)")
        pytest.skip("no class-data archive yet: `python -m tests.spark_jvm` dumps it")
    pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
    with open(f"/proc/{pid}/maps") as f:
        assert str(archive) in f.read(), f"the driver (pid {pid}) did not map {archive}"
