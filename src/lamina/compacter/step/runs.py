"""The scratch run format: what decode tasks leave for the write tasks.

A *run* is one decode task's rows, ordered by an integer lead column, as an Arrow IPC file
of record batches (uncompressed, LZ4 or ZSTD, as the daemon's ``scratch_compression``
says: :data:`ScratchCompression`, resolved per step by :func:`run_codec`) under the
step's scratch directory
(``TraceLayout.scratch(batch_id)``, i.e. ``batches/<batch id>.scratch/``):

- ``run-<group:05d>.arrow``: the group's batch rows ordered by the prefix column, in
  record batches of :func:`run_batch_rows` rows;
- ``future-<group:05d>.arrow``: its future rows ordered by the bucket column, in record
  batches of :data:`RUN_BATCH_ROWS` rows.

Both have the update columns plus the prefix column, and future runs also the bucket
column (:mod:`lamina.compacter.step.context`). A :class:`Run` names a batch-row run and
records for each record batch the first and last prefix, so that a write task decompresses
only the batches its key range overlaps; future rows are addressed by (path, start,
length) within their run, one slice per bucket (:func:`bucket_runs`).

Batch sizes bound a write task's memory. A part's task decompresses every run's record
batches that overlap the part's key range, so its memory is about its part's rows: the
decode tasks cut their runs into batches of about a quarter of what a run holds for one
part (:func:`run_batch_rows`), which bounds the excess to about half the part however many
runs the step has (batches keep at least :data:`MIN_RUN_BATCH_ROWS` rows, so for runs too
short for that the excess is at most two such batches per run).

Runs are objects of the trace store (``ObjectStore.writer``: whole or absent), named by
group, so a retried or speculative decode task rewrites the same run with the same rows.
On a directory they are not synced (``durable=False``): a run only lives for its step, and
a lost one fails the step, which is retried from its inputs. Write tasks read only the
record batches they need (``ObjectStore.open_input``: on S3, ranged gets of the footer and
those batches). The driver deletes the scratch prefix when the step ends, whether it
succeeded or not; one left by a crashed driver holds no object a state names and is
collected like any garbage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pyarrow as pa

from lamina.objstore.base import ObjectStore
from lamina.trace.order import Key

RunCompression = Literal["lz4", "zstd", "none"]
"""The codec of a run's record batches. LZ4 (what ``auto`` picks where room is short)
costs the least CPU of the two codecs; ZSTD (level 1) makes the runs of the peers
benchmark's stream about 2.4 times smaller (24.7 against 10.2 MB for 3.75M sorted updates
of four int64 columns) for more CPU
(0.22 against 0.12 s to write those rows, 0.40 against 0.37 s to read them back): the trade
for a disk that is short of room, where a large conversion's runs are most of what the
trace directory holds while it runs (docs/operations.md, "Disk"). ``none`` writes the
buffers as they are: on 3M sorted rows of the conversion benchmark's table, 168 MB against
50 (LZ4) and 21 MB (ZSTD), and 0.07 s of CPU to write and 0.03 s to read against 0.20 and
0.12 s (LZ4); the 10M-update conversion took 3.48 s against 4.13 s (docs/performance.md),
for a peak of scratch about its decoded input. Readers need not know it: Arrow IPC names
each batch's codec."""

ScratchCompression = Literal["auto", "lz4", "zstd", "none"]
"""The daemon's ``scratch_compression``: a :data:`RunCompression`, or ``auto`` (the default),
which :func:`run_codec` resolves for each step that writes runs."""

AUTO_ROOM = 8
"""``auto`` writes a step's runs uncompressed when the store has at least this many times
the step's decoded input free (:func:`run_codec`)."""


def run_codec(setting: ScratchCompression, input_bytes: int, free_bytes: int | None
              ) -> RunCompression:
    """The codec of one step's runs. ``auto`` trades scratch space for CPU only where the
    space is plainly there: uncompressed runs take about the step's decoded input
    (``input_bytes``, at most ``max_bytes_per_job``), and are written when the store has
    :data:`AUTO_ROOM` times that free (``ObjectStore.free_bytes``: the filesystem of a
    local trace); LZ4 where it has less, or cannot tell (an object store, where the runs
    also cross the network). Uncompressed runs took a tenth off the 10M-update conversion
    (docs/performance.md, "Radix-sorted prefixes, and uncompressed runs where there is
    room")."""
    if setting != "auto":
        return setting
    if free_bytes is not None and free_bytes >= AUTO_ROOM * input_bytes:
        return "none"
    return "lz4"


RUN_BATCH_ROWS = 1 << 16
"""Rows per record batch of a future run, and the most per batch of a batch-row run (a
write task decompresses only the batches its key range overlaps)."""
MIN_RUN_BATCH_ROWS = 1 << 10
"""The fewest rows per record batch of a batch-row run (see :func:`run_batch_rows`)."""
RUN_BATCHES_PER_PART = 4
"""A batch-row run is cut into about this many record batches per part of the step."""


_READ_OPTIONS = pa.ipc.IpcReadOptions(use_threads=False)
"""Runs are decompressed on the task's own thread (see :func:`write_run`)."""


def run_batch_rows(rows: int, parts: int) -> int:
    """Rows per record batch of a run of ``rows`` batch rows in a step writing ``parts``
    parts. A part's key range covers about ``1 / parts`` of every run, and its task
    decompresses every batch that range overlaps, i.e. its share plus at most one partial
    batch at either end. With batches of a quarter of that share, a write task holds about
    1.5 times its part's rows; with batches of a fixed size it would hold a batch of every
    run, which grows with the step (a step of G runs: G batches per task, so most of the
    input when runs are not much longer than a batch). Batches keep at least
    :data:`MIN_RUN_BATCH_ROWS` rows, which bounds the per-batch overhead."""
    share = math.ceil(rows / (RUN_BATCHES_PER_PART * max(1, parts)))
    return max(MIN_RUN_BATCH_ROWS, min(RUN_BATCH_ROWS, share))


@dataclass(frozen=True)
class Run:
    """A run object (its key in the trace store and its size, so a reader needs no HEAD),
    and for each of its record batches the first and last value of the column it is
    ordered by."""

    path: str
    spans: tuple[tuple[int, int], ...]
    size: int

    def window(self, lower: Key | None, upper: Key | None) -> tuple[int, int] | None:
        """The batches (first, last) that may hold rows with a prefix from ``lower``'s to
        ``upper``'s (None: unbounded); None when no batch does."""
        hits = [i for i, (a, b) in enumerate(self.spans)
                if (lower is None or b >= lower[0]) and (upper is None or a <= upper[0])]
        return (hits[0], hits[-1]) if hits else None


def write_run(store: ObjectStore, key: str, table: pa.Table, lead: str,
              batch_rows: int = RUN_BATCH_ROWS, *, compression: RunCompression = "lz4"
              ) -> Run:
    """Write rows ordered by the integer column ``lead`` as an Arrow IPC file of batches of
    ``batch_rows`` rows compressed with ``compression`` (not synced: see the module
    docstring). LZ4 makes the file a quarter of the size for a fraction of the cost of
    writing the rest; ZSTD makes it about 2.4 times smaller again, for more CPU
    (:data:`RunCompression`).

    The codec runs on the task's own thread (``use_threads=False``, and so does
    :func:`read_run`): a Spark Python worker's Arrow pool has one thread (PySpark sets
    ``OMP_NUM_THREADS`` to ``spark.task.cpus``, which sizes it), so handing buffers to it
    only adds hand-offs, and the other core is busy with another task. The 10M-update
    conversion took 3.55 to 3.70 s against 3.81 to 3.86 s (docs/performance.md, "One
    gather per side, and codecs on the task's thread")."""
    table = table.combine_chunks()
    values = table.column(lead).to_numpy()
    spans = []
    options = pa.ipc.IpcWriteOptions(compression=None if compression == "none" else compression,
                                     use_threads=False)
    with store.writer(key, durable=False) as out:
        sink = pa.PythonFile(out, mode="w")
        with pa.ipc.new_file(sink, table.schema, options=options) as writer:
            for start in range(0, table.num_rows, batch_rows):
                writer.write_table(table.slice(start, batch_rows), max_chunksize=batch_rows)
                end = min(start + batch_rows, table.num_rows)
                spans.append((int(values[start]), int(values[end - 1])))
        size = out.tell()
    return Run(key, tuple(spans), size)


def read_run(store: ObjectStore, run: Run, first: int, last: int) -> pa.Table:
    """Batches ``first`` to ``last`` (inclusive) of a run."""
    with store.open_input(run.path, run.size) as source:
        reader = pa.ipc.open_file(source, options=_READ_OPTIONS)
        return pa.Table.from_batches([reader.get_batch(i) for i in range(first, last + 1)],
                                     schema=reader.schema)


def bucket_runs(future: pa.Table, bucket: str) -> list[tuple[int, int, int]]:
    """(bucket lower end, start, length) of the runs of equal buckets of sorted rows."""
    if not future.num_rows:
        return []
    lows = future.column(bucket).to_numpy()
    starts = np.flatnonzero(np.concatenate([[True], lows[1:] != lows[:-1]]))
    ends = np.append(starts[1:], len(lows))
    return [(int(lows[s]), int(s), int(e - s)) for s, e in zip(starts, ends, strict=True)]
