"""A relation with updates in every place a reader looks: merged trace batches with
forwarded times, pending parts (future updates) and a WAL tail; and its oracle."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lamina.store import Relation, Store
from lamina.trace.trace import Trace
from tests.trace.helpers import KEY, NAME, SCHEMA, Oracle, Update, collect_all, convert

ITEMS = ("a", "b", "c", "")


def random_rows(rng: random.Random, upper: int, n: int, keys: int) -> list[Update]:
    """Inserts, retractions and future updates (some far ahead: pending parts)."""
    rows = []
    for _ in range(n):
        r = rng.random()
        t = upper + (0 if r < 0.6 else rng.randrange(1, 8) if r < 0.9
                     else rng.randrange(8, 200))
        rows.append((rng.randrange(keys), rng.choice(ITEMS), t, rng.choice((1, 1, 2, -1))))
    return rows


def fill(rel: Relation, oracle: Oracle, trace: Trace, rng: random.Random, *, rounds: int,
         keys: int = 40, convert_every: int = 3, tail_rounds: int = 2) -> None:
    """``rounds`` appends + seals; since follows a few units behind; conversions, merges and
    garbage collection every ``convert_every`` rounds, none in the last ``tail_rounds``
    (so the WAL tail holds updates too)."""
    for i in range(rounds):
        oracle.append(rel, random_rows(rng, oracle.upper, rng.randrange(1, 12), keys))
        oracle.seal(rel, oracle.upper + rng.randrange(1, 4))
        if i % 4 == 3 and oracle.upper > 6:
            oracle.allow_compaction(rel, max(oracle.since, oracle.upper - 6))
        if i % convert_every == convert_every - 1 and i < rounds - tail_rounds:
            convert(trace, rel.wal_dir, per_plan=2)
            trace.delete_converted_segments(rel.wal_dir)
            collect_all(trace)


@contextmanager
def relation(root: Path, seed: int, rounds: int = 24, keys: int = 40,
             trace_url: str | None = None) -> Iterator[tuple[Relation, Oracle]]:
    with Store.open(root, segment_bytes=4096, fsync="never", trace_url=trace_url) as store:
        rel = store.create_relation(NAME, SCHEMA, KEY)
        oracle = Oracle()
        trace = Trace.open(store.layout.trace_store(NAME), rel.meta)
        fill(rel, oracle, trace, random.Random(seed), rounds=rounds, keys=keys)
        yield rel, oracle
