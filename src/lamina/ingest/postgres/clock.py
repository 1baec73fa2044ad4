"""The PostgreSQL server's clock as seen from lamina, for commit ages (``lag_seconds``).

Commit timestamps are the server's; comparing them with lamina's own clock would add the
two machines' skew to every lag. The source therefore reads the server's clock
(``clock_timestamp()``) at open and at every catalog check, and extrapolates between
readings with lamina's monotonic clock: ``now = max over readings of (server time +
monotonic time elapsed since)``. Each reading is a lower bound of the server's time when
its answer arrives, so the largest is the best; a reading delayed by a slow query never
moves the clock backwards.
"""

from __future__ import annotations

import time


class ServerClock:
    """``now()`` in Unix seconds by the server's clock; safe from any thread."""

    def __init__(self) -> None:
        self._offset: float | None = None

    def observe(self, server_time: float) -> None:
        """A reading of the server's clock (Unix seconds) that has just arrived."""
        offset = server_time - time.monotonic()
        if self._offset is None or offset > self._offset:
            self._offset = offset

    def now(self) -> float:
        offset = self._offset
        if offset is None:          # not read yet: lamina's own clock
            return time.time()
        return offset + time.monotonic()
