"""The driver<->task wire format: what tasks receive from and return to the driver.

Every job runs ``n`` tasks, one id each (``parallelize(range(n), n)``, through
``lamina.compacter.step.driver._run_tasks``): a task function receives its id as a one-column
Arrow batch, as ``spark.range`` would give it (:func:`task_ids`), finds its work in the
pickled :class:`~lamina.compacter.step.context.StepContext` by that id, and returns
metadata only, as Arrow batches of a fixed schema (a ``*_FIELDS`` list, which the driver
holds them to) that reach the driver as pyspark Rows; the rows never enter the JVM.

- Decode tasks return one row per group (:data:`RUN_FIELDS`): the group id, a
  :class:`Decoded` record as JSON (its runs, the future rows' bucket ranges, how many
  updates it decoded) and its sample of batch-row keys as Arrow IPC.
- Write tasks and single tasks return :data:`META_FIELDS` rows, one :class:`Written` per
  written part (``input_rows`` 0), and from a single task also one *tally* row (no part)
  whose ``input_rows`` is the number of updates the task decoded.

Bucket lower ends are uint64 but travel in a Spark bigint column, shifted by
:data:`TIME_SHIFT`. Each record is encoded and decoded here and nowhere else.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from lamina.compacter.step.runs import Run
from lamina.trace.batch import PartFile
from lamina.wal.record import decode_updates, encode_updates

TIME_SHIFT = 1 << 63
"""Bucket lows (uint64) travel to the driver in a Spark bigint column, shifted by this."""

META_FIELDS = [("bucket", pa.int64()), ("part_index", pa.int32()), ("path", pa.string()),
               ("rows", pa.int64()), ("bytes", pa.int64()), ("crc32c", pa.int64()),
               ("input_rows", pa.int64())]
"""What write tasks and single tasks return (:class:`Written`)."""
RUN_FIELDS = [("group", pa.int64()), ("info", pa.string()), ("sample", pa.binary())]
"""What decode tasks return (:class:`Decoded`)."""


def task_ids(batches: Iterator[pa.RecordBatch]) -> Iterator[int]:
    """The ids a task received (one per task here)."""
    for rb in batches:
        yield from rb.column(0).to_pylist()


@dataclass(frozen=True)
class Decoded:
    """What a decode task reports for its group."""

    group: int
    rows: int
    """Batch rows the group's run holds."""
    input_rows: int
    """Updates the group decoded (before forwarding and consolidation)."""
    past: Run | None
    """The run of batch rows (None: the group has none)."""
    future: Run | None
    """The run of future rows (None: none)."""
    buckets: tuple[tuple[int, int, int], ...]
    """(bucket lower end, start, length) of each bucket's rows in the future run."""
    sample: pa.Table
    """Every so many batch rows' full key columns (for the cuts)."""

    def row(self) -> dict[str, Any]:
        """The :data:`RUN_FIELDS` row carrying this record."""
        info = {"rows": self.rows, "input_rows": self.input_rows,
                "past": _run_doc(self.past), "future": _run_doc(self.future),
                "buckets": self.buckets}
        return {"group": self.group, "info": json.dumps(info),
                "sample": encode_updates(self.sample)}  # the sample as Arrow IPC

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Decoded:
        info = json.loads(row["info"])
        return cls(group=int(row["group"]), rows=int(info["rows"]),
                   input_rows=int(info["input_rows"]), past=_run_of(info["past"]),
                   future=_run_of(info["future"]),
                   buckets=tuple((int(lo), int(s), int(n)) for lo, s, n in info["buckets"]),
                   sample=decode_updates(row["sample"]))


def _run_doc(run: Run | None) -> dict[str, Any] | None:
    if run is None:
        return None
    return {"path": run.path, "spans": run.spans, "size": run.size}


def _run_of(doc: dict[str, Any] | None) -> Run | None:
    if doc is None:
        return None
    return Run(str(doc["path"]), tuple((int(a), int(b)) for a, b in doc["spans"]),
               int(doc["size"]))


@dataclass(frozen=True)
class Written:
    """A part a write or single task wrote, or (``part`` None) a single task's tally."""

    part: PartFile | None
    index: int = 0
    """The batch part's index (0 for pending parts; -1 in a tally)."""
    bucket: int | None = None
    """The pending part's bucket lower end (unsigned); None for a batch part."""
    input_rows: int = 0
    """Updates a single task decoded (in its tally; 0 in every part's row)."""

    @classmethod
    def tally(cls, input_rows: int) -> Written:
        """The row of a single task that carries how many updates it decoded (no part)."""
        return cls(part=None, index=-1, input_rows=input_rows)

    def row(self) -> dict[str, Any]:
        """The :data:`META_FIELDS` row carrying this record."""
        p = self.part
        return {"bucket": None if self.bucket is None else self.bucket - TIME_SHIFT,
                "part_index": self.index, "path": p.path if p else None,
                "rows": p.rows if p else 0, "bytes": p.bytes if p else 0,
                "crc32c": p.crc32c if p else 0, "input_rows": self.input_rows}

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Written:
        part = None
        if row["path"] is not None:
            part = PartFile(path=str(row["path"]), rows=int(row["rows"]),
                            bytes=int(row["bytes"]), crc32c=int(row["crc32c"]))
        bucket = row["bucket"]
        return cls(part=part, index=int(row["part_index"]),
                   bucket=None if bucket is None else int(bucket) + TIME_SHIFT,  # unsigned
                   input_rows=int(row["input_rows"] or 0))


def batch_of(rows: list[dict[str, Any]], fields: list[tuple[str, pa.DataType]]
             ) -> pa.RecordBatch:
    """Rows as the record batch a task yields."""
    return pa.RecordBatch.from_pylist(rows, schema=pa.schema(fields))
