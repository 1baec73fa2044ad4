"""Relations with a WAL backlog, and the in-process compacter parts around them: what the
pipeline, executor and in-process daemon suites share (no Spark anywhere)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lamina.compacter.executors.inprocess import InProcessExecutor
from lamina.compacter.metrics import Metrics
from lamina.compacter.pipeline import RelationPipeline
from lamina.compacter.settings import Settings
from lamina.datadir import DataDir
from lamina.fs import TMP_SUFFIX
from lamina.store import Store
from lamina.trace.trace import Trace
from lamina.wal.reader import SegmentSpan, segment_spans
from tests.trace.helpers import KEY, SCHEMA, NoSyncFileSystem, Oracle

FAST = {"poll_interval": 0.05, "retry_initial_seconds": 0.1, "retry_max_seconds": 0.4,
        "gc_interval_seconds": 3600.0, "shutdown_grace_seconds": 5.0}
"""Settings that make the loops turn quickly (GC only when a test asks for it)."""


def backlog(root: Path, name: str = "orders", *, rounds: int = 12, rows: int = 8,
            oracle: Oracle | None = None) -> Oracle:
    """``rounds`` appends of ``rows`` updates (one future update each) and seals, in
    segments of about two rounds; the store is closed, so every segment is finished."""
    return backlogs(root, [name], rounds=rounds, rows=rows,
                    oracles=None if oracle is None else {name: oracle})[name]


def backlogs(root: Path, names: list[str], *, rounds: int = 12, rows: int = 8,
             oracles: dict[str, Oracle] | None = None) -> dict[str, Oracle]:
    """:func:`backlog` of each of ``names``, written round by round side by side in one
    store: closing it finishes their last segments together, so a running daemon's next
    poll finds them all ready at once."""
    oracles = dict(oracles or {})
    with Store.open(root, segment_bytes=4096, fsync="never") as store:
        rels = {}
        for name in names:
            oracles.setdefault(name, Oracle())
            try:
                rels[name] = store.relation(name)
            except LookupError:
                rels[name] = store.create_relation(name, SCHEMA, key=KEY)
        for r in range(rounds):
            for name in names:
                oracle, rel = oracles[name], rels[name]
                t = oracle.upper
                batch = [(r * rows + i, f"{name}-{r}-{i}-" + "x" * 200, t, 1)
                         for i in range(rows)]
                batch.append((10_000 + r, "future", t + 50, 1))
                oracle.append(rel, batch)
                oracle.seal(rel, t + 2)
    return oracles


def snapshot(root: Path, name: str, as_of: int) -> list[dict[str, Any]]:
    with Store.open(root) as store:
        rows: list[dict[str, Any]] = store.relation(name).snapshot(as_of).to_pylist()
        return rows


def spans(trace: Trace, wal_dir: Path) -> list[SegmentSpan]:
    """The finished segments the trace has not converted, in order."""
    return list(segment_spans(wal_dir, trace.meta.name, after=trace.state.converted_through))


def corrupt_payload(path: Path) -> None:
    """Flip a byte in the middle of a segment (inside a record's payload)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def settings(root: Path, **overrides: Any) -> Settings:
    return Settings(data_dir=root, **{"executor": "inprocess", **FAST, **overrides})


def pipeline(root: Path, name: str = "orders", *, executor: Any = None,
             metrics: Metrics | None = None, **overrides: Any) -> RelationPipeline:
    layout = DataDir(root)
    with Store.open(root) as store:
        meta = store.relation(name).meta
    s = settings(root, **overrides)
    pipe = RelationPipeline(name=name, meta=meta, layout=layout, settings=s,
                            executor=executor or InProcessExecutor(s.max_concurrent_jobs),
                            metrics=metrics or Metrics(), fs=NoSyncFileSystem())
    pipe.metrics.watch_relations(lambda: [pipe.gauges(time.time())])  # as the daemon does
    return pipe


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def writing(trace_dir: Path) -> bool:
    """Whether a step has a temp file open in the trace: it read all its input and is
    writing its output (where the tests' ``fs.before_rename`` sleep holds it)."""
    return trace_dir.exists() and any(p.name.endswith(TMP_SUFFIX) for p in trace_dir.rglob("*"))


async def until(what: str, cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
