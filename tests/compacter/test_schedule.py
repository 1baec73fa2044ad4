"""The scheduling policy (lamina.compacter.executors.schedule), pure: which waiting steps
start next, in which jobs. No Spark, no disk."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from lamina.compacter.executors.schedule import Job, Waiting, large_slots_of, next_jobs

MB = 1 << 20


def small(key: int, since: float, size: int = MB, relation: str | None = None,
          isolated: bool = False) -> Waiting:
    return Waiting(key=key, relation=relation or f"r{key}", waiting_since=since, arrival=key,
                   bytes=size, large=False, isolated=isolated)


def large(key: int, since: float, size: int = 1 << 30) -> Waiting:
    return Waiting(key=key, relation=f"r{key}", waiting_since=since, arrival=key, bytes=size,
                   large=True)


def jobs(waiting: list[Waiting], *, free: int = 2, large_running: int = 0, slots: int = 2,
         max_steps: int = 128, max_bytes: int = 512 * MB) -> list[Job]:
    return next_jobs(waiting, free_slots=free, large_running=large_running,
                     large_slots=large_slots_of(slots), max_steps=max_steps,
                     max_bytes=max_bytes)


def test_small_steps_share_one_job_oldest_first() -> None:
    waiting = [small(k, since=100 - k) for k in range(10)]
    assert jobs(waiting, free=1) == [Job(tuple(range(9, -1, -1)), large=False)]


def test_a_pack_is_bounded_in_steps_and_bytes() -> None:
    waiting = [small(k, since=k) for k in range(10)]
    assert jobs(waiting, free=3, max_steps=4) == [Job((0, 1, 2, 3), False),
                                                 Job((4, 5, 6, 7), False),
                                                 Job((8, 9), False)]
    # 3 MB per pack: a step that does not fit is left for the next pack, a smaller
    # younger one fills the space
    sized = [small(0, 0, 2 * MB), small(1, 1, 2 * MB), small(2, 2, MB), small(3, 3, MB)]
    assert jobs(sized, free=1, max_bytes=3 * MB) == [Job((0, 2), False)]


def test_a_large_step_runs_alone_and_one_slot_stays_for_packs() -> None:
    waiting = [large(0, since=0), large(1, since=1), *(small(k, since=k) for k in (2, 3))]
    assert jobs(waiting, free=2) == [Job((0,), True), Job((2, 3), False)]
    # the large slot taken: the older large step waits, packs go on
    assert jobs([large(1, since=1), small(2, since=2)], free=1,
                large_running=1) == [Job((2,), False)]
    # with nothing small waiting the second slot stays free for one
    assert jobs([large(1, since=1)], free=1, large_running=1) == []
    assert large_slots_of(1) == 1
    assert large_slots_of(2) == 1
    assert large_slots_of(8) == 7


def test_the_oldest_large_step_gets_the_large_slot_first() -> None:
    waiting = [large(5, since=50), large(6, since=10), small(7, since=60)]
    assert jobs(waiting, free=1) == [Job((6,), True)]


def test_an_isolated_relation_runs_in_a_pack_of_its_own() -> None:
    waiting = [small(0, since=0, isolated=True), small(1, since=1), small(2, since=2),
               small(3, since=3, isolated=True)]
    assert jobs(waiting, free=4) == [Job((0,), False), Job((1, 2), False), Job((3,), False)]


@settings(max_examples=200)
@given(st.integers(min_value=1, max_value=4), st.integers(min_value=0, max_value=10_000))
def test_no_step_waits_behind_younger_ones_for_ever(slots: int, seed: int) -> None:
    """A simulation: jobs end at random, new small and large steps keep arriving (fewer
    than the slots can serve), each younger than everything before it. No step, large or
    small, waits without bound: every wait stays far below the length of the run, and what
    still waits at the end arrived recently."""
    rng = random.Random(seed)
    now = 0
    queue: dict[int, Waiting] = {}
    running: list[Job] = []
    started_at: dict[int, int] = {}
    arrived_at: dict[int, int] = {}
    key = 0
    for tick in range(300):
        for _ in range(rng.randint(0, 4)):
            key += 1
            now += 1
            w = large(key, since=now) if rng.random() < 0.1 else small(key, since=now)
            queue[key] = w
            arrived_at[key] = tick
        if running and (len(running) == slots or rng.random() < 0.7):
            running.pop(rng.randrange(len(running)))
        started = next_jobs(list(queue.values()), free_slots=slots - len(running),
                            large_running=sum(j.large for j in running),
                            large_slots=large_slots_of(slots), max_steps=8,
                            max_bytes=512 * MB)
        for job in started:
            for k in job.keys:
                assert k in queue
                del queue[k]
                started_at[k] = tick
            running.append(job)
    waits = [started_at[k] - arrived_at[k] for k in started_at]
    assert max(waits) < 60, sorted(waits)[-5:]
    assert all(300 - arrived_at[k] < 60 for k in queue), sorted(
        300 - arrived_at[k] for k in queue)[-5:]
