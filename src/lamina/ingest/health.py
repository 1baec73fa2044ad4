"""Health of a source and of each of its outputs.

| state | meaning |
|---|---|
| ``starting`` | recovering, connecting, or retrying after a transient error (``error`` says |
|  | which, ``hint`` when the next attempt is) |
| ``running`` | reading upstream and sealing outputs every binding |
| ``stalled`` | a definite error: ``error`` says what happened, ``hint`` what to do; nothing |
|  | after it is skipped, the output's upper stays where its data stops |
| ``ceased`` | shut down (SIGTERM drained it), or the output no longer receives data |

A stalled output does not stop its source's other outputs; a stalled source stops all of
them. Both are reported on ``/v1/sources``, as ``lamina_source_state`` /
``lamina_source_output_state`` and in ``source.stalled`` / ``output.stalled`` log events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

State = Literal["starting", "running", "stalled", "ceased"]
STATES: tuple[State, ...] = ("starting", "running", "stalled", "ceased")


@dataclass(frozen=True)
class Health:
    """A state and, for ``stalled`` (or a retried ``starting``), the error and its remedy."""

    state: State
    error: str | None = None
    hint: str | None = None

    def as_json(self) -> dict[str, str | None]:
        return {"state": self.state, "error": self.error, "hint": self.hint}
