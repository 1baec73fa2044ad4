"""lamina.threads.map_on_threads: results in item order, at most ``workers`` threads (the
caller's among them), every thread joined before it returns or raises, the first failing
item's error."""

from __future__ import annotations

import threading
import time

import pytest

from lamina.threads import map_on_threads


def test_results_come_back_in_item_order() -> None:
    together = threading.Barrier(4, timeout=60)  # passed only with four items at once
    seen: dict[int, str] = {}

    def last_first(i: int) -> int:
        together.wait()
        time.sleep(0.02 * (3 - i))  # the last item finishes first
        seen[i] = threading.current_thread().name
        return i * i

    assert map_on_threads(last_first, [0, 1, 2, 3], name="t") == [0, 1, 4, 9]
    assert set(seen.values()) == {threading.current_thread().name, "t-1", "t-2", "t-3"}


def test_no_items_and_one_item_start_no_thread() -> None:
    before = threading.active_count()
    assert map_on_threads(lambda x: x, [], name="t") == []
    assert map_on_threads(lambda x: x + 1, [41], name="t") == [42]
    assert threading.active_count() == before


def test_the_first_failing_item_raises_after_every_thread_is_done() -> None:
    done: list[int] = []

    def work(i: int) -> int:
        if i == 2:
            raise KeyError("two")
        if i == 1:
            time.sleep(0.1)
            raise ValueError("one")
        time.sleep(0.2)
        done.append(i)
        return i

    with pytest.raises(ValueError, match="one"):  # item 1 before item 2, though later
        map_on_threads(work, [0, 1, 2, 3], name="t")
    # item 0 was running when item 2 raised: it finished before the call raised; item 3
    # ran only if its thread took it before item 2 raised
    assert 0 in done
    assert set(done) <= {0, 3}
    assert not [t for t in threading.enumerate() if t.name.startswith("t-")]


def test_workers_bound_the_threads_and_every_item_runs_once() -> None:
    together = threading.Barrier(3, timeout=60)  # the first three items run at once
    lock = threading.Lock()
    running, most = 0, 0
    started: list[int] = []

    def work(i: int) -> int:
        nonlocal running, most
        with lock:
            started.append(i)
            running += 1
            most = max(most, running)
        if i < 3:
            together.wait()
        time.sleep(0.01)
        with lock:
            running -= 1
        return -i

    assert map_on_threads(work, list(range(9)), name="w", workers=3) == [-i for i in range(9)]
    assert most == 3
    assert sorted(started) == list(range(9))
    assert map_on_threads(work, [5, 6], name="w", workers=0) == [-5, -6]  # at least one


def test_no_item_is_taken_after_one_raised() -> None:
    ran: list[int] = []

    def work(i: int) -> int:
        ran.append(i)
        if i == 1:
            raise RuntimeError("stop")
        return i

    with pytest.raises(RuntimeError, match="stop"):
        map_on_threads(work, list(range(50)), name="s", workers=1)
    assert ran == [0, 1]
