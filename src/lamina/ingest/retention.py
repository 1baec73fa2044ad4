"""Retained history of ingested relations: how far their compaction frontier follows the
bindings (``retain_history_seconds``).

As a source seals an output to ``T + 1`` it allows compaction (``since``) up to ``T``
minus the retention, so reads at any time within the window keep their answers (time
travel) while the compacter consolidates what lies before it, as for any relation.

- ``retain_history_seconds = 0``: ``since`` follows ``T`` itself: only the newest readable
  time (what the latest read needs) is kept.
- ``retain_history_seconds = inf`` (TOML ``inf``): ``since`` never moves; every version is
  kept.

``since`` is a durable WAL record, so it is not written at every binding: it moves once
the frontier has advanced by a *step* of a tenth of the retention (at least 1 ms, at most
60 s). ``since`` therefore trails ``T - retention`` by less than one step, and a time
within the window is always readable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_STEP_MS = 60_000
"""The most ``since`` lags behind ``T - retention`` (for long retentions)."""


@dataclass(frozen=True)
class Retention:
    """How much history a relation keeps behind its newest binding time."""

    seconds: float
    """``inf`` keeps everything."""

    @property
    def window_ms(self) -> int | None:
        """The window in milliseconds; None for ``inf``."""
        return None if math.isinf(self.seconds) else round(self.seconds * 1000)

    @property
    def step_ms(self) -> int:
        window = self.window_ms or 0
        return max(1, min(MAX_STEP_MS, window // 10))

    def since_at(self, time: int, since: int) -> int | None:
        """The compaction frontier to allow once a relation is sealed past binding time
        ``time`` and its since is ``since``; None when it should stay where it is."""
        window = self.window_ms
        if window is None:
            return None
        target = max(0, time - window)
        if target < since + self.step_ms:
            return None
        return target
