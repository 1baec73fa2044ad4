"""``lag_seconds``: the age of the oldest upstream commit that is not sealed yet.

Ages are taken on the source's clock (:meth:`lamina.ingest.source.Source.clock`; for
PostgreSQL the server's, so a skewed clock on lamina's machine does not bend them):

- while transactions are read but not sealed (buffered for the next binding, or being
  written), the oldest of their commit times;
- otherwise every transaction read is sealed, and the oldest commit not sealed is one not
  read yet: it was made after the newest ``Upper.time`` (every commit before that time was
  read), so the lag is at most the age of that time, and that bound is what is reported.
  On a source that keeps up it stays near ``timestamp_interval_seconds``; while lamina
  falls behind it grows with the backlog (the transactions read are old), and while it
  reads nothing at all (stopped, retrying a lost connection) it grows by one second per
  second;
- 0 before anything is known.

Both inputs only move forward while a source runs; a new session (after a retry) keeps
them, so a reconnection does not make the lag look small.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from lamina.ingest.source import Transaction


class Lag:
    """Set by the source's thread, read by any (the metrics and ``/v1/sources``)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.unsealed: float | None = None
        """The oldest commit time among transactions read and not sealed."""
        self.covered: float | None = None
        """Every commit made before it was read."""

    def read_upto(self, time: float | None) -> None:
        """An ``Upper`` with this time arrived."""
        if time is not None and (self.covered is None or time > self.covered):
            self.covered = time

    def pending(self, txns: Iterable[Transaction]) -> None:
        """The transactions read and not sealed are now ``txns``."""
        self.unsealed = min((t.commit_time for t in txns if t.commit_time is not None),
                            default=None)

    def read(self, txn: Transaction) -> None:
        """One more transaction read (not sealed yet)."""
        if txn.commit_time is not None and (self.unsealed is None
                                            or txn.commit_time < self.unsealed):
            self.unsealed = txn.commit_time

    def seconds(self) -> float:
        since = self.unsealed if self.unsealed is not None else self.covered
        if since is None:
            return 0.0
        return max(0.0, self.clock() - since)
