"""The JVMs of a test run: their options, and the class-data archive they share.

On 2 cores the suite is CPU-bound from its first test to its last, and its JVMs (each
worker's shared session, every ``lamina serve`` and ``lamina drill`` daemon, a standalone
cluster's master, worker and executors) took about a third of its CPU, most of it in JVMs
that live seconds to minutes: compiling and loading classes, not running jobs. Three JVM
options take some of that out (the product's daemon runs with the first one too,
``lamina.compacter.spark.DAEMON_JAVA_OPTIONS``; the tests' options come after it):

- ``-XX:TieredStopAtLevel=1``: C1 only, no C2 compiler warming up. A driver started as the
  daemon starts it, with 3 small jobs: 20.7 s of JVM CPU, 12.6 s with it (40 jobs: 36.3 s,
  26.5 s).
- ``-XX:SharedArchiveFile``: a dynamic class-data-sharing (AppCDS) archive of the classes
  a Spark driver loads, dumped once by :func:`ensure_archive` (``python -m
  tests.spark_jvm``, which ``make pytest`` runs first); a JVM then maps the classes,
  already parsed and verified, instead of reading and verifying them from Spark's jars.
  The same driver: 12.9 s with C1 only, 6.8 s with the archive too (40 jobs: 29.4 s,
  21.0 s; ``python -m bench.suite_jvm --options " -XX:TieredStopAtLevel=1" --cds``). A
  JVM whose class path differs from the dump's would run as it would without the archive
  (``-Xlog:cds=off`` keeps it from saying so on stdout); the drivers and a standalone
  cluster's master, worker and executors all map it (tests/test_suite_jvm.py and
  tests/compacter/test_cluster.py check the maps of the drivers, master and worker). Until
  the archive exists the JVMs are not told of it. The options choose how the JVM loads and
  compiles, not what it computes.
- ``-XX:+UseSerialGC``: one collector thread that stops the world, instead of G1's
  concurrent threads and regions. A JVM of a test holds little and lives briefly, so it
  pays G1's set-up and bookkeeping and gains nothing from its concurrency. The same driver
  with C1 only and an archive dumped under its own options: 12.6 s of JVM CPU with G1,
  11.0 s serial (3 jobs); 40.3 s and 40.4 s (40 jobs): the short-lived JVMs gain, the
  long-lived ones lose nothing (``python -m bench.suite_jvm --jobs 3 40 --rounds 3
  --options " -XX:TieredStopAtLevel=1" " -XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
  --cds-each``, 2026-11-29). Spark's 450 MiB minimum is checked against
  the heap the JVM reports, and the serial collector reports one survivor space less
  (435 MiB at ``-Xmx450m``), so a driver at the minimum (the bounded-memory test) runs
  :data:`G1` instead: :func:`properties_text` takes the collector.

How they reach every JVM: :func:`environment` (set by tests/conftest.py, inherited by every
process a test starts)

- ``PYSPARK_SUBMIT_ARGS`` names :data:`PROPERTIES`, the run's ``spark-defaults`` (written
  by :func:`write_properties`): ``spark.driver.extraJavaOptions`` for every driver,
  ``spark.executor.extraJavaOptions`` for a cluster's executors;
- ``SPARK_DAEMON_JAVA_OPTS`` for a standalone cluster's master and worker;
- ``SPARK_CONF_DIR`` is :data:`CONF_DIR`, kept **empty**: Spark puts the conf directory on
  every JVM's class path, and class-data sharing refuses a class path holding a non-empty
  directory (the dump fails with "Cannot have non-empty directory in paths"). This is why
  the properties go through ``--properties-file`` and the daemon options through the
  environment rather than through files in a conf directory.

Everything generated lives in ``tests/.jvm/`` (git-ignored): ``conf/`` (empty), the
properties, and ``spark-<key>.jsa``, whose key hashes what the archive depends on (the
``java`` binary, Spark's jars, the conf directory's path and the options), so an upgrade
makes a new one and never maps a stale one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

#: the options of every JVM of a test run (the module docstring says why)
FLAGS = ("-XX:TieredStopAtLevel=1",)
#: the collector of a test run's JVMs, and the one for a driver at Spark's minimum heap
SERIAL, G1 = "-XX:+UseSerialGC", "-XX:+UseG1GC"
#: the log tags a JVM that cannot use the archive would warn under, on its stdout
QUIET_CDS = ("-Xlog:cds=off", "-Xlog:cds+dynamic=off")

ROOT = Path(__file__).parent / ".jvm"
CONF_DIR = ROOT / "conf"
PROPERTIES = ROOT / "spark-defaults.conf"


def _spark_jars() -> Path:
    spec = importlib.util.find_spec("pyspark")  # found, not imported: conftest calls this
    if spec is None or spec.origin is None:
        raise RuntimeError("pyspark is not installed: `make` installs it into .venv")
    return Path(spec.origin).parent / "jars"


def archive_path() -> Path:
    """Where the archive for this machine's Java and Spark is (it may not exist yet)."""
    digest = hashlib.sha256()
    # the java Spark's launcher runs: $JAVA_HOME/bin/java if set, else the one on PATH
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    for path in [Path(java).resolve() if java and Path(java).exists() else None,
                 *sorted(_spark_jars().glob("*.jar"))]:
        if path is not None:
            st = path.stat()
            digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    digest.update(f"{CONF_DIR}\0{FLAGS}\0{SERIAL}\n".encode())
    return ROOT / f"spark-{digest.hexdigest()[:16]}.jsa"


def current_archive() -> Path | None:
    """The archive if it has been dumped. Only an existing one is named to the JVMs: one
    given a ``-XX:SharedArchiveFile`` it cannot read would also go without the JDK's own
    base archive, and start slower than with no option at all."""
    path = archive_path()
    return path if path.exists() else None


def java_options(archive: Path | None, gc: str = SERIAL) -> str:
    """The options of the run's JVMs, with collector ``gc`` (Spark splits them like a
    shell, so a path with a space is quoted)."""
    cds = ((*QUIET_CDS, "-XX:SharedArchiveFile=" + shlex.quote(str(archive)))
           if archive is not None else ())
    return " ".join((*FLAGS, gc, *cds))


def properties_text(archive: Path | None, extra: str = "", gc: str = SERIAL) -> str:
    """A ``spark-defaults`` file: the suite's JVM options (with collector ``gc``) for
    drivers and executors, then ``extra`` (more properties, one per line)."""
    options = java_options(archive, gc)
    return ("# Written by tests/spark_jvm.py for a test run: see its docstring.\n"
            f"spark.driver.extraJavaOptions    {options}\n"
            f"spark.executor.extraJavaOptions  {options}\n" + extra)


def submit_args(properties: Path) -> str:
    """``PYSPARK_SUBMIT_ARGS`` for drivers that read ``properties``."""
    return f"--properties-file {shlex.quote(str(properties))} pyspark-shell"


def environment() -> dict[str, str]:
    """The variables that give every JVM a test starts the suite's options (the archive
    once it exists: a standalone master and worker map it like a driver)."""
    return {"SPARK_CONF_DIR": str(CONF_DIR),
            "PYSPARK_SUBMIT_ARGS": submit_args(PROPERTIES),
            "SPARK_DAEMON_JAVA_OPTS": java_options(current_archive())}


def write_properties() -> None:
    """Write :data:`PROPERTIES` (naming the archive if it has been dumped) and create the
    empty :data:`CONF_DIR`. Each process writes its own file and renames it into place, so
    xdist workers starting together never leave a half-written one."""
    CONF_DIR.mkdir(parents=True, exist_ok=True)
    text = properties_text(current_archive())
    if not PROPERTIES.exists() or PROPERTIES.read_text() != text:
        tmp = PROPERTIES.with_name(f".{PROPERTIES.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(PROPERTIES)


# What the dumping driver runs: a session started as the daemon starts it, and jobs of the
# shapes the compacter and the readers run (the compacter's RDD of one id per partition,
# Arrow batches through Python workers, a group-by, a DataFrame from Arrow), so that their
# classes are in the archive.
_DUMP = """
import sys
import pyarrow as pa
from lamina.compacter.spark import build_session
spark = build_session("local[2]", app_name="lamina-tests-cds",
                      conf={"spark.driver.extraJavaOptions": sys.argv[1]})
df = spark.range(0, 100_000, numPartitions=4).selectExpr("id", "id % 7 AS k")
def same(batches):
    yield from batches
for _ in range(3):
    df.mapInArrow(same, df.schema).groupBy("k").count().collect()
spark.createDataFrame(pa.table({"a": pa.array(range(1000), pa.int64())})).count()
spark.sparkContext.parallelize(range(4), 4).mapPartitions(lambda ids: [sum(ids)]).collect()
spark.stop()
"""


def ensure_archive(timeout: float = 600.0) -> Path:
    """Dump the archive if this machine has none yet (25 to 36 s on 2 cores: a driver, a
    few jobs, then the dump at its exit); return its path. Raises RuntimeError naming the
    JVM's output if the dump fails or outlasts ``timeout``. Concurrent callers each dump to
    their own file and the last rename wins; older archives (another Java or Spark) are
    removed. Writes :data:`PROPERTIES` either way."""
    write_properties()  # the dumping driver reads it (without the archive, not there yet)
    target = archive_path()
    if target.exists():
        return target
    tmp = target.with_name(f".{target.stem}.{os.getpid()}.jsa")
    env = {**os.environ, **environment()}
    options = " ".join((*FLAGS, SERIAL, "-XX:ArchiveClassesAtExit=" + shlex.quote(str(tmp))))
    start = time.monotonic()
    # Its own session, so a timeout kills the JVM too. The pipes matter: the JVM inherits
    # them and writes the archive after the Python child has exited, and communicate()
    # returns only when the last holder (the JVM) has closed them.
    proc = subprocess.Popen([sys.executable, "-c", _DUMP, options], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"dumping the tests' class-data archive took over {timeout:.0f} s:"
                           f"\n{err[-3000:]}") from None
    if proc.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"dumping the tests' class-data archive failed (exit "
                           f"{proc.returncode}):\n{err[-3000:]}\n{out[-2000:]}")
    tmp.replace(target)
    for old in ROOT.glob("spark-*.jsa"):
        if old != target:
            old.unlink(missing_ok=True)
    write_properties()
    print(f"tests/spark_jvm.py: dumped {target.name} "
          f"({target.stat().st_size >> 20} MiB) in {time.monotonic() - start:.0f} s")
    return target


def main() -> int:
    """``python -m tests.spark_jvm``: dump the archive. A failure fails CI (``CI`` set),
    where tests/test_suite_jvm.py requires the archive; elsewhere the suite runs without
    it, slower, and this says so."""
    try:
        ensure_archive()
    except RuntimeError as exc:
        print(f"tests/spark_jvm.py: {exc}", file=sys.stderr)
        if os.environ.get("CI"):
            return 1
        print("tests/spark_jvm.py: the tests' JVMs run without a class-data archive",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
