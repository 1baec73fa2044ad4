"""Which waiting steps start next, and in which Spark jobs: the scheduling policy (pure).

The Spark executor (:mod:`lamina.compacter.executors.spark`) keeps every submitted step in
one queue and asks :func:`next_jobs` what to start whenever a step arrives or a job ends.
The answer depends only on its arguments, so the policy is tested without Spark.

The policy (docs/architecture.md, "Scheduling many relations"):

- **One queue, oldest first.** A step waits with the time its relation's work has been
  waiting (``waiting_since``: for a conversion, when the oldest finished segment it converts
  was finished; for a merge, when the pipeline found it due) and is served in that order,
  ties by arrival. Every relation has at most one step in the queue (its pipeline is
  serial), so no relation can crowd out another by submitting more: a relation's place
  is its age, and every waiting step becomes the oldest in time.
- **Small steps are packed.** A step whose input is at most ``single_task_bytes`` is
  *small*: it runs as one Spark task, and the oldest small steps, up to ``max_steps`` and
  ``max_bytes`` of input, share one Spark job (a *pack*), so Spark's fixed cost per job is
  paid once for many relations. A *large* step runs alone, in its own jobs (decode and
  write, :mod:`lamina.compacter.step`).
- **Slots.** At most ``slots`` jobs (packs or large steps) run at once, and at most
  ``large_slots`` of them large ones (one less than ``slots`` when ``slots`` is 2 or more), so
  one slot is always there for packs: a 10 GB backlog never holds a thousand small
  relations for longer than one pack. A large step skipped for want of a large slot keeps
  its place and starts as soon as a large slot frees; packs never take a large slot's
  share away (it is a cap, not a reservation), and a large step that has waited longest
  is always the first to get the large slot.
- **Isolation.** A relation whose last pack failed as a whole (a Spark or worker failure,
  not a failure of its own step, which fails it alone) runs in a pack of its own next
  time, so that one step that kills its Python worker cannot fail its neighbours again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_PACK_STEPS = 128
"""Default ``pack_max_steps``: small steps (tasks) per pack."""
DEFAULT_PACK_BYTES = 512 << 20
"""Default ``pack_max_bytes``: input bytes of the small steps of one pack."""


@dataclass(frozen=True)
class Waiting:
    """A step in the queue, as the policy sees it."""

    key: int
    relation: str
    waiting_since: float
    """Seconds since the epoch: how long the relation's work has waited (older first)."""
    arrival: int
    """Order of submission (ties)."""
    bytes: int
    """The step's input bytes (segments, and Parquet parts counted expanded)."""
    large: bool
    """Runs alone, in its own jobs (input above ``single_task_bytes``)."""
    isolated: bool = False
    """Its relation's last pack failed as a whole: it runs in a pack of its own."""


@dataclass(frozen=True)
class Job:
    """A Spark job to start: one large step, or a pack of small ones (oldest first)."""

    keys: tuple[int, ...]
    large: bool


def next_jobs(waiting: Sequence[Waiting], *, free_slots: int, large_running: int,
              large_slots: int, max_steps: int, max_bytes: int) -> list[Job]:
    """The jobs to start now, in the order to start them (see the module docstring)."""
    order = sorted(waiting, key=lambda w: (w.waiting_since, w.arrival))
    taken: set[int] = set()
    jobs: list[Job] = []
    for i, lead in enumerate(order):
        if free_slots <= 0:
            break
        if lead.key in taken:
            continue
        if lead.large:
            if large_running < large_slots:
                jobs.append(Job((lead.key,), large=True))
                taken.add(lead.key)
                large_running += 1
                free_slots -= 1
            continue
        members = [lead.key]
        size = lead.bytes
        if not lead.isolated:
            for other in order[i + 1:]:
                if len(members) >= max_steps:
                    break
                if (other.large or other.isolated or other.key in taken
                        or size + other.bytes > max_bytes):
                    continue
                members.append(other.key)
                size += other.bytes
        taken.update(members)
        jobs.append(Job(tuple(members), large=False))
        free_slots -= 1
    return jobs


def large_slots_of(slots: int) -> int:
    """How many of ``slots`` concurrent jobs may be large steps: all but one, at least one."""
    return max(1, slots - 1)
