"""The upper a PostgreSQL source reports: never past the position up to which the catalog
checks confirmed the tables' publication membership (a check confirms the one before it),
never backwards, with the time that feeds lag_seconds."""

from __future__ import annotations

from lamina.ingest.postgres.catalog import CheckResult
from lamina.ingest.postgres.frontier import Frontier
from lamina.ingest.source import Upper

NONE: frozenset[int] = frozenset()


def check(lsn: int, clock: float) -> CheckResult:
    return CheckResult(lsn, clock, NONE, NONE, NONE)


def test_the_upper_waits_for_the_next_check_to_confirm_membership() -> None:
    f = Frontier(100, check(150, 10.0))                 # the check at open: L0 = 150
    f.committed(200, 11.0)
    assert f.upper(clamp=True) == Upper(100, None)      # nothing confirmed beyond the start
    f.checked(check(260, 12.0))                         # confirms L0 = 150
    assert f.upper(clamp=True) == Upper(150, 10.0)
    f.committed(300, 13.0)
    f.checked(check(320, 14.0))                         # confirms 260
    assert f.upper(clamp=True) == Upper(260, 12.0)
    assert f.lag_offsets() == 320 - 260
    assert f.upper(clamp=False) == Upper(300, 13.0)     # no table's membership matters
    f.checked(check(330, 15.0))                         # confirms 320: never backwards
    assert f.upper(clamp=True).offset == 300


def test_idle_keepalives_and_checks_move_the_time() -> None:
    f = Frontier(100, check(100, 10.0))
    f.idle(100)
    assert f.upper(clamp=False) == Upper(100, 10.0)     # caught up with the check at open
    f.checked(check(180, 20.0))
    assert f.stuck()                                    # below the check, not moving
    f.idle(180)                                         # (a wake-up message decoded)
    assert not f.stuck()
    assert f.upper(clamp=False) == Upper(180, 20.0)
    f.checked(check(180, 30.0))                         # an idle server: the clock goes on
    assert f.upper(clamp=True) == Upper(180, 30.0)
