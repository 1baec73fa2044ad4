"""Cost of one subscription poll's frontier read on a large open WAL segment.

    .venv/bin/python -m bench.poll_cost [--mib 32] [--rows 4096] [--repeat 20]

Fills one relation's open segment to ``--mib`` MiB (appends of ``--rows`` rows, sealed after
each, segment_bytes large enough that it never rotates, fsync "never"), then times

- ``lamina.wal.reader.frontiers`` (what a subscription runs whenever the WAL changed, and
  what ``Relation.upper``/``since`` run) and a full ``scan_file`` of the same segment;
- one subscription interval (``lamina.read.subscribe.interval_updates``) after one more append
  and seal: with the subscription's warm ``TailCache`` (only the new records are read) and
  without one (the whole open segment decoded, as every interval did before the cache
  kept the open segment).

Prints the medians in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from lamina import Store
from lamina.read.subscribe import TailCache, interval_updates
from lamina.wal.reader import frontiers
from lamina.wal.segment import list_segments, scan_file


def _median_ms(fn: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    schema = pa.schema([("id", pa.int64()), ("v", pa.int64())])
    rows = args.rows
    with tempfile.TemporaryDirectory() as tmp, \
            Store.open(Path(tmp), segment_bytes=1 << 34, fsync="never") as store:
        rel = store.create_relation("r", schema, ("id",))
        ids = pa.array(np.arange(rows, dtype=np.int64))
        t = 0
        while True:
            seg = list_segments(rel.wal_dir)[-1]
            if seg.path.stat().st_size >= args.mib << 20:
                break
            rel.append(pa.table({"id": ids, "v": ids, "_time": pa.array(
                np.full(rows, t, dtype=np.uint64)), "_diff": pa.array(
                np.ones(rows, dtype=np.int64))}))
            t += 1
            rel.seal(t)
        assert not seg.finished
        size = seg.path.stat().st_size
        records = len(scan_file(seg, "r")[0].records)
        assert frontiers(rel.wal_dir, "r") == (t, 0)
        poll = _median_ms(lambda: frontiers(rel.wal_dir, "r"), args.repeat)
        full = _median_ms(lambda: scan_file(seg, "r"), args.repeat)
        print(f"open segment {size / (1 << 20):.1f} MiB, {records} records: "
              f"frontiers {poll:.2f} ms, full scan_file {full:.2f} ms "
              f"(median of {args.repeat})")
        cache = TailCache(rel.meta)
        interval_updates(rel.files, 0, t, cache)  # warm: the whole segment
        one = pa.table({"id": ids[:1], "v": ids[:1], "_time": pa.array([0], pa.uint64()),
                        "_diff": pa.array([1], pa.int64())})
        warm, cold = [], []
        for _ in range(args.repeat):
            rel.append(one.set_column(2, "_time", pa.array([t], pa.uint64())))
            rel.seal(t + 1)
            start = time.perf_counter()
            a = interval_updates(rel.files, t, t + 1, cache)
            warm.append(time.perf_counter() - start)
            start = time.perf_counter()
            b = interval_updates(rel.files, t, t + 1)
            cold.append(time.perf_counter() - start)
            assert a.equals(b)
            assert a.num_rows == 1
            t += 1
        print(f"one interval: with TailCache {statistics.median(warm) * 1000:.2f} ms, "
              f"decoding the open segment {statistics.median(cold) * 1000:.2f} ms")


if __name__ == "__main__":
    main()
