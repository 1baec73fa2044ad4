"""A bound on a relation's WAL backlog: appends wait while the compacter is behind.

A coordinator appends as fast as its disk syncs; the compacter converts finished segments
as fast as Spark runs. When the appends outrun the conversions, the finished segments
the compacter has not converted yet (the *backlog*, ``wal_bytes_pending`` in ``lamina
status``) pile up on the WAL's disk, up to the whole stream. ``Store.open(...,
wal_backlog_bytes=N)`` bounds it, as RocksDB's write stalls bound its pending compaction
bytes: an ``append`` first waits, polling, while the relation's backlog is above ``N``
bytes, and then writes as usual. What the disk holds at most is then about ``N`` plus
the open segment (``segment_bytes``) plus what a conversion in flight writes. The price
is the append rate: on a bound that is reached, appends go at the compacter's pace
(docs/operations.md, "Disk", has what it costs in the peers benchmark).

Rules:

- Only ``append`` waits. ``seal`` and ``allow_compaction`` never do: a seal is what
  finishes a segment and lets the compacter go on, and neither adds updates.
- The backlog counts the finished segments after the trace's ``converted_through`` (file
  sizes, :func:`lamina.wal.reader.finished_sizes`). A check lists them once and sums
  every finished segment's size; only when that passes the bound is the trace state read,
  since the compacter may keep a converted segment that holds the frontiers
  (lamina.wal.retire).
- The backlog grows only when this writer finishes a segment, and the compacter only
  shrinks it, so once a check has passed, no append checks again until the open segment
  changes (:attr:`lamina.wal.log.WalWriter.seq`): an append costs nothing more while the
  bound holds.
- A wait polls with a backoff from 5 ms to 250 ms. When the backlog has not shrunk for
  ``timeout`` seconds (no compacter running, or one that is failing), the append raises
  :class:`lamina.errors.BacklogTimeoutError`, which names the backlog and the bound, and
  writes nothing: the updates can be appended again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from lamina.errors import BacklogTimeoutError
from lamina.wal.reader import finished_sizes

DEFAULT_TIMEOUT = 300.0
"""``wal_backlog_timeout``'s default: five minutes without a conversion finishing is a
compacter that is down or failing, not one that is slow (a conversion is at most
``max_bytes_per_job``, 1 GiB decoded by default)."""
FIRST_POLL = 0.005
"""Seconds before the first re-check of a backlog over the bound."""
LAST_POLL = 0.25
"""The longest pause between two checks: the backoff doubles up to it."""


class BacklogGate:
    """The bound of one relation's writer: :meth:`wait` before each append.

    ``converted_through`` returns the trace's ``converted_through`` (0 before the first
    conversion); it is called only when the finished segments together pass the bound."""

    def __init__(self, relation: str, wal_dir: Path, limit: int, timeout: float,
                 converted_through: Callable[[], int]) -> None:
        self.relation = relation
        self.wal_dir = wal_dir
        self.limit = limit
        self.timeout = timeout
        self._converted_through = converted_through
        self._mu = threading.Lock()
        self._clear_at: int | None = None  # the open segment when a check last passed
        self.waited_seconds = 0.0
        """Seconds appends have spent waiting for the backlog so far (a stall's cost)."""

    def pending(self) -> tuple[int, int]:
        """``(segments, bytes)`` of the backlog now: one listing of the finished segments,
        and the trace state only when they together pass the bound."""
        sizes = finished_sizes(self.wal_dir)
        if sum(n for _, n in sizes) > self.limit:
            converted = self._converted_through()
            sizes = [(seq, n) for seq, n in sizes if seq > converted]
        return len(sizes), sum(n for _, n in sizes)

    def wait(self, open_seq: int) -> None:
        """Return once the backlog is at or below the bound (at once when a check passed
        since segment ``open_seq`` opened); raise BacklogTimeoutError when it has not
        shrunk for ``timeout`` seconds."""
        with self._mu:
            if self._clear_at == open_seq:
                return
        started = time.monotonic()
        last_change, delay = started, FIRST_POLL
        segments, nbytes = self.pending()
        while nbytes > self.limit:
            now = time.monotonic()
            if now - last_change >= self.timeout:
                self._add_wait(now - started)
                raise BacklogTimeoutError(
                    f"relation {self.relation!r}: the WAL backlog ({nbytes} bytes in "
                    f"{segments} finished segments not yet converted) stayed above "
                    f"wal_backlog_bytes={self.limit} without shrinking for {self.timeout:g} "
                    f"s, so the append was refused and nothing was written; the compacter "
                    f"is behind or not running (`lamina status` shows wal_bytes_pending, "
                    f"the daemon's log why); append again once it has caught up, or raise "
                    f"the bound")
            time.sleep(min(delay, max(0.0, last_change + self.timeout - now)))
            delay = min(delay * 2, LAST_POLL)
            before = nbytes
            segments, nbytes = self.pending()
            if nbytes < before:
                last_change = time.monotonic()
        self._add_wait(time.monotonic() - started)
        with self._mu:
            self._clear_at = open_seq

    def _add_wait(self, seconds: float) -> None:
        with self._mu:
            self.waited_seconds += seconds
