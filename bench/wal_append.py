"""WAL append throughput: lamina against the raw I/O it performs.

    .venv/bin/python -m bench.wal_append [--seconds 10] [--repeat 1] [--rows 10000] [--dir DIR]

Appends batches of ``--rows`` updates (int64 id, int64 value, 16-byte string) to a relation
with fsync "always" (each ``append`` returns after an fdatasync covered it), and, in the
same run, writes the very record bytes lamina writes for those batches
(``frame(UPDATES, encode_updates(batch))``) with one ``os.write`` + ``os.fdatasync`` per
batch to a plain file in the same directory: the cost of the I/O alone at the same
cadence. The two alternate in short rounds so that both see the same disk.

Prints updates/s, MB/s (record bytes written), milliseconds per append and the ratio
lamina/raw, and writes bench/results/wal_append.json and wal_append.png. Targets: ratio >=
0.8 and >= 1M updates/s. The ratio depends on the disk as much as on lamina: lamina's own
work per append (checks, encoding, CRC32C) is a fixed cost on top of the I/O, so a slow
``fdatasync`` (a loaded machine) lifts the ratio towards 1 and a fast one lowers it; the
per-append milliseconds of both sides, and their difference, say which case a run was.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa

from bench import report
from lamina import Store
from lamina.schema import RelationMeta, conform_updates
from lamina.wal.record import RecordType, encode_updates, frame

SCHEMA = pa.schema([("id", pa.int64()), ("value", pa.int64()), ("tag", pa.string())])
RESULTS = report.RESULTS / "wal_append.json"
TARGET_RATIO = 0.8
TARGET_UPDATES_PER_S = 1_000_000
DISTINCT_BATCHES = 8


@dataclass
class Side:
    """What one side of the comparison did."""

    appends: int = 0
    updates: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def updates_per_s(self) -> float:
        return self.updates / self.seconds if self.seconds else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds else 0.0

    @property
    def ms_per_append(self) -> float:
        return self.seconds / self.appends * 1e3 if self.appends else 0.0

    def summary(self) -> dict[str, float]:
        return {**asdict(self), "updates_per_s": round(self.updates_per_s),
                "mb_per_s": round(self.mb_per_s, 2),
                "ms_per_append": round(self.ms_per_append, 4)}


def make_batches(rows: int) -> list[pa.Table]:
    """A few distinct batches (so no layer can cache one), each of ``rows`` updates."""
    out = []
    for b in range(DISTINCT_BATCHES):
        base = b * rows
        out.append(pa.table({
            "id": pa.array(range(base, base + rows), pa.int64()),
            "value": pa.array([(i * 7919) % 1_000_003 for i in range(base, base + rows)],
                              pa.int64()),
            "tag": pa.array([f"{i:016x}" for i in range(base, base + rows)], pa.string()),
            "_time": pa.array([0] * rows, pa.uint64()),
            "_diff": pa.array([1] * rows, pa.int64()),
        }))
    return out


def run_lamina(rel: object, batches: list[pa.Table], seconds: float, side: Side,
               record_size: int) -> None:
    append = rel.append  # type: ignore[attr-defined]
    rows = batches[0].num_rows
    i = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        append(batches[i % len(batches)])
        i += 1
        if time.perf_counter() >= deadline:
            break
    side.seconds += time.perf_counter() - start
    side.appends += i
    side.updates += i * rows
    side.bytes += i * record_size


def run_raw(fd: int, records: list[bytes], rows: int, seconds: float, side: Side) -> None:
    i = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        data = memoryview(records[i % len(records)])
        while data:
            data = data[os.write(fd, data):]
        os.fdatasync(fd)
        i += 1
        if time.perf_counter() >= deadline:
            break
    side.seconds += time.perf_counter() - start
    side.appends += i
    side.updates += i * rows
    side.bytes += sum(len(records[k % len(records)]) for k in range(i))


def measure(args: argparse.Namespace, batches: list[pa.Table], records: list[bytes],
            record_size: int) -> tuple[Side, Side]:
    """One measurement: a fresh store and raw file, lamina and raw alternating in rounds."""
    work = Path(tempfile.mkdtemp(prefix="lamina-bench-", dir=args.dir))
    try:
        store = Store.open(work / "lamina", fsync="always")
        rel = store.create_relation("bench", SCHEMA, key=["id"])
        rel.append(batches[0])  # open the writer before measuring
        fd = os.open(work / "raw.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        lamina, raw = Side(), Side()
        rounds = max(2, round(args.seconds))
        half = args.seconds / rounds / 2
        for r in range(rounds):  # alternate, and alternate who goes first
            if r % 2 == 0:
                run_lamina(rel, batches, half, lamina, record_size)
                run_raw(fd, records, args.rows, half, raw)
            else:
                run_raw(fd, records, args.rows, half, raw)
                run_lamina(rel, batches, half, lamina, record_size)
        os.close(fd)
        store.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return lamina, raw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.wal_append",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="measured time of one run, split between lamina and raw "
                             "(default 10)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="independent runs (fresh store and file each); the run with "
                             "the median ratio is reported, every run is kept (default 1)")
    parser.add_argument("--rows", type=int, default=10_000, help="updates per batch")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write (default: a temp dir, removed afterwards)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    run = report.Run("wal_append", argv)

    batches = make_batches(args.rows)
    meta = RelationMeta.new("bench", SCHEMA, ["id"])
    records = [frame(RecordType.UPDATES, encode_updates(conform_updates(meta, b)))
               for b in batches]
    record_size = len(records[0])
    assert all(len(r) == record_size for r in records)

    runs: list[tuple[float, Side, Side, list[float]]] = []
    for k in range(args.repeat):
        load = report.load_average()
        lamina, raw = measure(args, batches, records, record_size)
        ratio = lamina.updates_per_s / raw.updates_per_s if raw.updates_per_s else 0.0
        runs.append((ratio, lamina, raw, load))
        if args.repeat > 1:
            print(f"run {k + 1}: ratio {ratio:.3f}, lamina {lamina.ms_per_append:.3f} ms/append, "
                  f"raw {raw.ms_per_append:.3f}, load average {load[0]} before")
    ratio, lamina, raw, _ = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    result = run.document({
        "seconds_measured": args.seconds,
        "rows_per_batch": args.rows,
        "record_bytes": record_size,
        "fsync": "always",
        "lamina": lamina.summary(),
        "raw": raw.summary(),
        "ratio": round(ratio, 3),
        "overhead_ms_per_append": round(lamina.ms_per_append - raw.ms_per_append, 4),
        "repeat": args.repeat,
        "runs": [{"ratio": round(r, 3), "lamina_ms_per_append": round(la.ms_per_append, 4),
                  "raw_ms_per_append": round(ra.ms_per_append, 4), "load_average_before": ld}
                 for r, la, ra, ld in runs],
        "targets": {"ratio": TARGET_RATIO, "updates_per_s": TARGET_UPDATES_PER_S},
        "met": {"ratio": ratio >= TARGET_RATIO,
                "updates_per_s": lamina.updates_per_s >= TARGET_UPDATES_PER_S},
        "dir": str(args.dir or tempfile.gettempdir()),
    })
    print(f"batch: {args.rows} updates, {record_size} record bytes; fsync per append")
    for name, side in (("lamina", lamina), ("raw", raw)):
        print(f"{name:>7}: {side.appends:6d} appends  {side.updates_per_s:12,.0f} updates/s  "
              f"{side.mb_per_s:8.1f} MB/s  {side.ms_per_append:7.3f} ms/append")
    if args.repeat > 1:
        ratios = sorted(round(r[0], 3) for r in runs)
        print(f"  median of {args.repeat} runs (ratios {ratios}); that run's figures above")
    print(f"  ratio: {ratio:.3f} lamina/raw (target >= {TARGET_RATIO}); updates/s target "
          f">= {TARGET_UPDATES_PER_S:,}: {'met' if result['met']['updates_per_s'] else 'missed'}")
    report.write_result(args.output.stem, result, args.output.parent)
    report.bar_chart(args.output.stem, "WAL append with fsync per append", [
        ("updates/s", {"lamina": lamina.updates_per_s, "raw write+fdatasync": raw.updates_per_s}),
        ("MB/s of records", {"lamina": lamina.mb_per_s, "raw write+fdatasync": raw.mb_per_s}),
    ], ylabel="", results=args.output.parent,
        note=f"ratio {ratio:.3f} (target >= {TARGET_RATIO}); {args.rows} updates per append; "
             f"load {result['load_average']['before'][0]}")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
