"""What the daemon knows of a relation's WAL directory between steps, kept for the price
of two ``stat`` calls per poll.

:meth:`WalWatch.poll` is what the daemon's poll does for each relation (all relations in
one thread, :meth:`lamina.compacter.daemon.Daemon` every ``poll_interval``):

- ``stat`` the WAL directory. Its mtime changes whenever an entry is created, renamed or
  deleted: a segment opened, finished (``.wal.open`` renamed to ``.wal``) or converted and
  deleted. Only then is the directory listed again (:func:`lamina.wal.segment.
  list_segments`) and each finished segment's size and finish time (its mtime: the last
  write, the PROGRESS record that finished it) taken. A directory changed less than
  :data:`RACY_SECONDS` ago is listed at every poll anyway: file systems stamp mtimes from
  a coarse clock, so a second change within one tick can leave the mtime as it was.
- ``stat`` the open segment. Its size changes with every append and seal; only then are
  the relation's frontiers (its sealed upper and since) read again, from frame headers
  (:func:`lamina.wal.reader.frontiers`).

So an idle relation costs two ``stat`` calls per poll and no reads, and the pipeline, the
metrics, ``/readyz`` and ``/v1/relations`` answer from what the watch holds: the finished
segments (:attr:`WalWatch.finished`), the backlog after a converted segment
(:meth:`WalWatch.backlog`) and the frontiers.

Nothing here writes; a relation whose directory vanished (dropped) raises
FileNotFoundError, and frontiers that cannot be read (a damaged segment) keep their last
known values: the pipeline, which reads the segments, is where damage is reported.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from lamina.errors import CorruptionError
from lamina.wal.reader import frontiers
from lamina.wal.segment import list_segments

RACY_SECONDS = 2.0
"""A directory whose mtime is younger than this is listed at every poll (see above)."""


class DirStamp:
    """Whether a directory's entries may have changed since the last call: its mtime moved,
    or it is younger than :data:`RACY_SECONDS` (see the module docstring)."""

    def __init__(self) -> None:
        self._mtime = -1

    def changed(self, path: Path, now: float) -> bool:
        """Raises FileNotFoundError when ``path`` is gone."""
        mtime = os.stat(path).st_mtime_ns
        moved = mtime != self._mtime or now - mtime / 1e9 < RACY_SECONDS
        self._mtime = mtime
        return moved


@dataclass(frozen=True)
class Finished:
    """A finished segment as the watch last listed it."""

    seq: int
    path: Path
    bytes: int
    finished_at: float
    """Its mtime (seconds since the epoch): when its last record was written."""


@dataclass(frozen=True)
class Backlog:
    """Finished segments after the trace's ``converted_through``."""

    segments: int
    bytes: int
    oldest: float | None
    """When the oldest of them was finished (None: there are none)."""

    def lag(self, now: float) -> float:
        """Seconds the oldest has waited (0 when none waits)."""
        return 0.0 if self.oldest is None else max(0.0, now - self.oldest)


class WalWatch:
    """One relation's WAL directory, polled cheaply (module docstring)."""

    def __init__(self, wal_dir: Path, relation: str) -> None:
        self.wal_dir = wal_dir
        self.relation = relation
        self.finished: tuple[Finished, ...] = ()
        self.upper = 0
        """The sealed upper (of the WAL), as last read."""
        self.since = 0
        self._dir = DirStamp()
        self._open: Path | None = None
        self._open_stamp: tuple[int, int] = (-1, -1)
        self._mu = threading.Lock()

    def poll(self, now: float | None = None) -> bool:
        """Look for changes; True when the finished segments changed (work may be ready).
        Raises FileNotFoundError when the directory is gone."""
        now = time.time() if now is None else now
        with self._mu:
            changed = self._relist() if self._dir.changed(self.wal_dir, now) else False
            self._refresh_frontiers(force=changed)
            return changed

    def _relist(self) -> bool:
        finished: list[Finished] = []
        opened: Path | None = None
        for seg in list_segments(self.wal_dir):
            if not seg.finished:
                opened = seg.path
                continue
            try:
                st = seg.path.stat()
            except FileNotFoundError:  # converted and deleted meanwhile
                continue
            finished.append(Finished(seg.seq, seg.path, st.st_size, st.st_mtime))
        self._open = opened
        new = tuple(finished)
        changed = [f.seq for f in new] != [f.seq for f in self.finished]
        self.finished = new
        return changed

    def _refresh_frontiers(self, *, force: bool) -> None:
        stamp = (-1, -1)
        if self._open is not None:
            try:
                st = self._open.stat()
                stamp = (st.st_size, st.st_mtime_ns)
            except FileNotFoundError:  # finished meanwhile: the next poll relists
                force = True
        if not force and stamp == self._open_stamp:
            return
        try:
            self.upper, self.since = frontiers(self.wal_dir, self.relation)
        except (FileNotFoundError, CorruptionError):
            return  # dropped, or damaged: the pipeline reports it
        self._open_stamp = stamp

    def backlog(self, converted_through: int) -> Backlog:
        """The finished segments after ``converted_through``, as last listed."""
        waiting = [f for f in self.finished if f.seq > converted_through]
        return Backlog(segments=len(waiting), bytes=sum(f.bytes for f in waiting),
                       oldest=min((f.finished_at for f in waiting), default=None))
