"""Reading a relation with Spark: :func:`read_snapshot` gives the rows of
``Relation.snapshot(as_of)`` as a DataFrame, computed by Spark tasks (documented as
``lamina.spark.read_snapshot``; :mod:`lamina.spark` is its import path).

The driver reads only metadata and the WAL tail: it pins a consistent view with the
state-first protocol (:func:`lamina.read.view.pin`), takes the paths of the batch and
pending parts at or below ``as_of`` and decodes the WAL segments the compacter has not
converted yet (their updates at or below ``as_of``, consolidated, become a small
DataFrame). The DataFrame is::

    parquet(parts) + tail  →  filter _time <= as_of  →  group by row columns,
    sum(_diff) as decimal(38, 0)  →  filter sum != 0  →  fail if a sum leaves int64  →
    order by key columns, other row columns (nulls first)

so the parts are read by parallel tasks and nothing but the tail travels from the driver.
Page checksums are verified as the parts are read; the whole-file CRC32C of the parts is
not (that is ``lamina verify``'s job). How the tasks read the parts depends on the trace's
location: a ``file://`` trace by Spark's own Parquet reader (with
``parquet.page.verify-checksum.enabled``); any other store (``s3://``) by Python tasks that
open each part through lamina's object store (``mapInArrow``, one part list entry per
task, filtered to ``_time <= as_of`` as they read), so Spark needs no Hadoop S3 connector
and the executors take S3 credentials from their environment.

**The lease.** The DataFrame is lazy: Spark reads the files when an action runs, maybe
many minutes later, maybe several times. The driver holds a lease on the state it pinned
(lamina.trace.lease), renewed by this process, until :func:`release` is called on the
DataFrame or the DataFrame object is garbage-collected, so the compacter deletes none of
its files meanwhile, whatever ``keep_versions`` says. A DataFrame derived from it
(``df.where(...)``) reads the same files but does not hold the lease: keep the one
``read_snapshot`` returned referenced until the derived ones are evaluated.

Row order and values equal ``snapshot``'s for every supported type except float row
columns holding NaN, which Spark orders last and Arrow first.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from lamina.consolidate import INT64_MAX, INT64_MIN, consolidate
from lamina.datadir import DEFAULT_LEASE_SECONDS, DataDir
from lamina.errors import LaminaError
from lamina.objstore.local import LocalObjectStore
from lamina.read.view import new_lease, pin, resolve_as_of
from lamina.schema import DIFF, TIME, RelationMeta
from lamina.trace.batch import OpenPart
from lamina.trace.lease import Lease

_LEASE_ATTRIBUTE = "_lamina_lease"


def read_snapshot(spark: Any, path: str | os.PathLike[str], relation: str,
                  as_of: object = None, *,
                  lease_seconds: float = DEFAULT_LEASE_SECONDS) -> Any:
    """The consolidated rows of ``relation`` at ``as_of`` (None: the latest readable time;
    a timezone-aware datetime where the relation counts milliseconds) in the data directory
    ``path``, as a ``pyspark.sql.DataFrame`` (typed ``Any``: PySpark has no type
    information that mypy --strict accepts). Raises the errors ``snapshot`` raises.

    The files stay until :func:`release` or until the DataFrame is garbage-collected (the
    module docstring); ``lease_seconds``: how long the lease outlives this process if it
    dies (it is renewed while the process lives)."""

    root = Path(path)
    if not (root / "wal").is_dir():
        raise LaminaError(f"{root} is not a lamina data directory (no wal/ inside)")
    files = DataDir(root, lease_seconds=lease_seconds).relation(relation)
    meta = files.meta
    upper, since = files.frontiers()
    at = resolve_as_of(files, as_of, upper=upper, since=since)
    lease = new_lease(files, "Spark DataFrame")
    try:
        with pin(files, 0, at, verify=False, lease=lease) as view:
            # every part, whole or not: the tasks filter the times
            opened = [p for p, _ in view.parts(0, at)]
            tail = pa.concat_tables(view.wal) if view.wal else \
                meta.update_schema.empty_table()
        df = _dataframe(spark, meta, opened, tail, at)
    except BaseException:
        lease.release()
        raise
    if lease.version is None:
        lease.release()  # no trace state: the WAL tail is all, in the driver already
    else:
        setattr(df, _LEASE_ATTRIBUTE, lease)
        weakref.finalize(df, lease.release)
    return df


def release(df: Any) -> None:
    """Let the compacter collect the files of a DataFrame from :func:`read_snapshot` (its
    lease ends; a later action on it may fail). Idempotent; a DataFrame that holds no
    lease is left alone."""
    lease = getattr(df, _LEASE_ATTRIBUTE, None)
    if isinstance(lease, Lease):
        lease.release()


def _dataframe(spark: Any, meta: RelationMeta, opened: list[OpenPart], tail: pa.Table,
               as_of: int) -> Any:
    """The DataFrame of the module docstring over the parts ``opened`` and the WAL
    ``tail`` (its times at or below ``as_of``)."""
    from pyspark.sql import functions as F

    relation = meta.name
    rows, cols = meta.row_columns, meta.sort_columns
    tail = consolidate(tail.drop_columns([TIME]), rows, cols,  # pin kept times <= as_of
                       context=f"snapshot of {relation!r} at {as_of}")
    frames = []
    if opened and isinstance(opened[0].store, LocalObjectStore):
        files = [Path(p.path).resolve().as_uri() for p in opened]
        parts = (spark.read.option("parquet.page.verify-checksum.enabled", "true")
                 .parquet(*files))
        frames.append(parts.where(F.col(TIME) <= F.lit(as_of).cast("decimal(20,0)"))
                      .select(*rows, DIFF))
    elif opened:
        frames.append(_parts_by_tasks(spark, meta, opened, as_of))
    if tail.num_rows or not frames:
        tail_df = spark.createDataFrame(tail)
        if frames:
            types = {f.name: f.dataType for f in frames[0].schema.fields}
            tail_df = tail_df.select(*(F.col(c).cast(types[c]) for c in [*rows, DIFF]))
        frames.append(tail_df)
    df = frames[0] if len(frames) == 1 else frames[0].unionByName(frames[1])
    total = F.sum(F.col(DIFF).cast("decimal(38,0)"))
    summed = df.groupBy(*rows).agg(total.alias("__sum")).where(F.col("__sum") != 0)
    out_of_range = (F.col("__sum") < F.lit(INT64_MIN)) | (F.col("__sum") > F.lit(INT64_MAX))
    checked = F.when(out_of_range, F.raise_error(F.lit(
        f"snapshot of {relation!r} at {as_of}: diffs of one row sum outside the int64 range"))
    ).otherwise(F.col("__sum").cast("long"))
    return (summed.select(*rows, checked.alias(DIFF))
            .orderBy(*(F.col(c).asc_nulls_first() for c in cols)))


def _parts_by_tasks(spark: Any, meta: RelationMeta, opened: list[OpenPart], as_of: int) -> Any:
    """The rows (row columns and ``_diff``) of ``opened`` at times ``<= as_of``, read by
    Spark tasks through the parts' object store (one part per input row)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    store = opened[0].store
    rows = meta.row_columns
    out = pa.schema([meta.update_schema.field(c) for c in [*rows, DIFF]])
    limit = pa.scalar(as_of, pa.uint64())

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for b in batches:
            for key, size in zip(b.column(0).to_pylist(), b.column(1).to_pylist(), strict=True):
                f = pq.ParquetFile(store.open_input(key, size), pre_buffer=True,
                                   page_checksum_verification=True)
                for rb in f.iter_batches(columns=[*rows, TIME, DIFF]):
                    keep = rb.filter(pc.less_equal(rb.column(TIME), limit))
                    yield pa.RecordBatch.from_arrays(
                        [keep.column(c) for c in [*rows, DIFF]], schema=out)

    listing = [(p.part.path, p.part.bytes) for p in opened]
    df = spark.createDataFrame(listing, "key string, size long").repartition(len(listing))
    return df.mapInArrow(read, from_arrow_schema(out))
