"""The upper a PostgreSQL source reports, and its time.

Three positions, all LSNs:

- the **stream** upper: every change below it was decoded (a commit's end LSN, or the
  ``wal_end`` of keepalives while nothing is open: decoded WAL with nothing published);
- the **confirmed** position: every live table was still published below it. A catalog
  check (:func:`lamina.ingest.postgres.catalog.check`) that sees them published confirms
  the WAL position read by the check *before* it (see that module for why not its own);
- the **reported** upper: the lesser of the two (while any table's membership matters), so
  no output is ever sealed past a point where its table may have left the publication.
  It never goes backwards.

Each carries a time for ``lag_seconds`` (:class:`~lamina.ingest.source.Upper`): a commit's
timestamp for the stream upper it moves, a check's server clock for its WAL position (once
the stream reaches it: every commit made before the check lies below it).
"""

from __future__ import annotations

from lamina.ingest.postgres.catalog import CheckResult
from lamina.ingest.source import Upper


class Frontier:
    """The reported upper of one streaming session, from ``start`` on."""

    def __init__(self, start: int, first_check: CheckResult) -> None:
        self.stream = start
        self.time: float | None = None
        self.confirmed: tuple[int, float | None] = (start, None)
        self.check = first_check
        """The newest catalog check (the first: read at open, before streaming)."""
        self.reported = start
        self._at_check = start

    def committed(self, end_lsn: int, commit_time: float) -> None:
        """A transaction ending at ``end_lsn`` was decoded."""
        if end_lsn > self.stream:
            self.stream = end_lsn
            self._raise_time(commit_time)

    def idle(self, wal_end: int) -> None:
        """Nothing open and nothing to read: the walsender decoded up to ``wal_end``."""
        self.stream = max(self.stream, wal_end)
        if self.check.lsn <= self.stream:
            self._raise_time(self.check.clock)

    def checked(self, found: CheckResult) -> None:
        """A new catalog check found every live table still published (a table that left
        is stalled at :attr:`confirmed` first and no longer counts)."""
        previous = self.check
        if previous.lsn > self.confirmed[0]:
            self.confirmed = (previous.lsn, previous.clock)
        self.check = found
        self._at_check = self.stream
        if found.lsn <= self.stream:
            self._raise_time(found.clock)

    def stuck(self) -> bool:
        """Whether the stream has not moved since the last check and stays below its WAL
        position (on an idle server, keepalives can stop short of it)."""
        return self.stream < self.check.lsn and self.stream == self._at_check

    def upper(self, *, clamp: bool) -> Upper:
        """The upper to report (``clamp``: while some table's membership matters)."""
        offset, when = self.stream, self.time
        if clamp and self.confirmed[0] < offset:
            offset, when = self.confirmed
        self.reported = max(self.reported, offset)
        return Upper(self.reported, when)

    def lag_offsets(self) -> int:
        """WAL bytes between the server's position at the last check and the upper."""
        return max(0, self.check.lsn - self.reported)

    def _raise_time(self, when: float) -> None:
        if self.time is None or when > self.time:
            self.time = when
