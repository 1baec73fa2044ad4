"""The time domain: times, frontiers, and how they are written.

Times are totally ordered uint64 values, so a frontier is one value or *empty* ("closed for
ever"). In Python a frontier is an ``int`` in ``[0, CLOSED]`` where ``CLOSED = 2**64``
stands for the empty frontier: ``time < upper`` then reads the same for both, with no
special case. ``MAX_TIME = 2**64 - 1`` is the largest time an update can carry; where a
frontier must become a uint64 value (an Arrow scalar, a Parquet filter), :func:`as_time`
clamps ``CLOSED`` to it.

On disk a frontier is a u64 plus a flag for the empty one (lamina.wal.record); in JSON
(state versions, status) it is the integer itself, ``2**64`` for the empty one; for people
(messages, the CLI) it is :func:`fmt`'s ``"CLOSED"``.

This module owns those constants: nothing else spells ``2**64``.
"""

from __future__ import annotations

from lamina.errors import InvalidArgumentError

CLOSED = 2**64
"""The empty frontier: every time is closed."""

MAX_TIME = 2**64 - 1
"""The largest time an update can carry."""


def fmt(frontier: int) -> str:
    """A frontier for people: the number, or ``CLOSED``."""
    return "CLOSED" if frontier == CLOSED else str(frontier)


def as_time(frontier: int) -> int:
    """A frontier as a uint64 value: ``CLOSED`` becomes ``MAX_TIME``."""
    return min(frontier, MAX_TIME)


def check_frontier(value: object, what: str) -> int:
    """``value`` as a frontier argument, or InvalidArgumentError saying why not."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{what} must be an int, got {type(value).__name__}")
    if not 0 <= value <= CLOSED:
        raise InvalidArgumentError(f"{what} {value} is outside [0, 2**64] (2**64 is "
                                   "lamina.CLOSED, the empty frontier)")
    return value
