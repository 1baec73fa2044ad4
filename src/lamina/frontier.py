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

**Time units.** A relation may record what its times count (``RelationMeta.time_unit``):
``"ms"``, milliseconds since the Unix epoch (every ingested relation), or nothing (plain
integers). Where a relation counts milliseconds, every API that takes a time or a frontier
also takes a timezone-aware :class:`datetime.datetime` (:func:`time_arg`, :func:`frontier_arg`):
a time (``as_of``: updates at or before it) is the millisecond the instant falls in
(rounded down); a frontier (``seal``, ``allow_compaction``, the bounds of
``Relation.updates``: times before it) is the first millisecond not before the instant
(rounded up), so that ``t < frontier`` holds for exactly the times before the instant. A
naive datetime is refused: it names no instant.

This module owns those constants: nothing else spells ``2**64``.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from lamina.errors import InvalidArgumentError

TIME_UNITS = ("ms",)
"""The time units a relation can record (``None``: plain integers)."""

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


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


def _from_datetime(value: datetime, unit: str | None, what: str, *, up: bool) -> int:
    if unit != "ms":
        raise InvalidArgumentError(
            f"{what} is a datetime, but this relation's times have no unit (plain integers; "
            "a relation created with time_unit='ms' counts epoch milliseconds); pass an int")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidArgumentError(
            f"{what} {value.isoformat()} is a naive datetime, which names no instant; pass a "
            "timezone-aware one, e.g. datetime.now(timezone.utc) or "
            "datetime(2026, 1, 1, tzinfo=timezone.utc)")
    ms, rest = divmod(value - _EPOCH, _MS)
    if up and rest:
        ms += 1
    if not 0 <= ms <= MAX_TIME:
        raise InvalidArgumentError(f"{what} {value.isoformat()} is before the Unix epoch; "
                                   "times are milliseconds since 1970-01-01T00:00:00Z")
    return int(ms)


def time_arg(value: object, unit: str | None, what: str) -> int:
    """A time argument (an ``as_of``): an int, or where ``unit`` is ``"ms"`` a
    timezone-aware datetime, rounded down to its millisecond (module docstring). Range
    checks are the caller's; a wrong type is InvalidArgumentError."""
    if isinstance(value, datetime):
        return _from_datetime(value, unit, what, up=False)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(
            f"{what} must be an int{' or a timezone-aware datetime' if unit == 'ms' else ''}"
            f", got {type(value).__name__}")
    return value


def frontier_arg(value: object, unit: str | None, what: str) -> int:
    """A frontier argument: :func:`check_frontier`'s int, or where ``unit`` is ``"ms"`` a
    timezone-aware datetime, rounded up to a millisecond (module docstring)."""
    if isinstance(value, datetime):
        return _from_datetime(value, unit, what, up=True)
    if unit == "ms" and (isinstance(value, bool) or not isinstance(value, int)):
        raise InvalidArgumentError(f"{what} must be an int or a timezone-aware datetime, "
                                   f"got {type(value).__name__}")
    return check_frontier(value, what)
