"""WAL append throughput: lamina against the raw I/O of the uncompressed records.

    .venv/bin/python -m bench.wal_append [--seconds 10] [--repeat 1] [--rows 10000]
        [--compression none,lz4,zstd] [--burn N] [--dir DIR] [--output FILE]
    .venv/bin/python -m bench.wal_append --backlog [--scale 0.1]

Appends batches of ``--rows`` updates (int64 id, int64 value, 16-byte string) to a relation
with fsync "always" (each ``append`` returns after an fdatasync covered it), once per
``--compression`` setting (``Store.open(wal_compression=...)``, a fresh store each), and,
in the same run, writes the *uncompressed* record bytes of those batches
(``frame(UPDATES, encode_updates(batch))``) with one ``os.write`` + ``os.fdatasync`` per
batch to a plain file in the same directory: the cost of the I/O alone at the same
cadence. The sides take turns in short rounds (each round in another order) so that all
see the same disk.

Prints, per side, updates/s, MB/s (record bytes written), milliseconds per append (wall,
and CPU of the appending thread, syscalls included: lamina's own work is the difference to
raw's, which the wall clock of a loaded machine blurs) and each setting's ratio
lamina/raw, and writes bench/results/wal_append.json and wal_append.png; the headline
figures (``lamina``, ``ratio``) are the first setting's, the default's unless
``--compression`` says otherwise. Targets: ratio >= 0.8 and >= 1M updates/s. The ratio
depends on the disk as much as on lamina: lamina's work before a record is written
(conforming, encoding, compression) is a cost on top of the I/O, while the checks and the
CRC32C run during the record's write-back (lamina.wal.log, "Sealing a record last"), so a
slow ``fdatasync`` lifts the ratio towards 1 (and a compressed record, fewer bytes to
sync, above it) and a fast one lowers it; the per-append milliseconds of all sides say
which case a run was.

``--burn N`` runs N processes of our own that spin on a core each for the whole run
(started ``--burn-warmup`` seconds before measuring, so that the load average has risen,
and killed by their pids at the end): the machine loaded with CPU-bound work, as in
"holds its ratio on a loaded machine". Each run records the load average before it.

``--backlog`` measures instead what each setting makes of a realistic table's WAL: the
conversion benchmark's updates (bench.dataset, ``--scale`` 1.0 = 10M updates over 1M rows)
appended with each setting (fsync "never", the same 10,000-update appends and seals), the
bytes of the segments, the CPU seconds of the appends and of reading every update back
(:func:`lamina.wal.reader.segment_updates`, what readers and the reference executor do),
into bench/results/wal_backlog.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import pyarrow as pa

from bench import report
from lamina import Store
from lamina.schema import RelationMeta, conform_updates
from lamina.wal.record import (
    COMPRESSIONS,
    DEFAULT_COMPRESSION,
    Compression,
    RecordType,
    encode_updates,
    frame,
)

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
    cpu_seconds: float = 0.0
    """CPU time of the appending thread (user and system: the syscalls' own work too)."""

    @property
    def updates_per_s(self) -> float:
        return self.updates / self.seconds if self.seconds else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds else 0.0

    @property
    def ms_per_append(self) -> float:
        return self.seconds / self.appends * 1e3 if self.appends else 0.0

    @property
    def cpu_ms_per_append(self) -> float:
        return self.cpu_seconds / self.appends * 1e3 if self.appends else 0.0

    def summary(self) -> dict[str, float]:
        return {**asdict(self), "updates_per_s": round(self.updates_per_s),
                "mb_per_s": round(self.mb_per_s, 2),
                "ms_per_append": round(self.ms_per_append, 4),
                "cpu_ms_per_append": round(self.cpu_ms_per_append, 4)}


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


def run_lamina(rel: Any, batches: list[pa.Table], seconds: float, side: Side,
               record_sizes: list[int]) -> None:
    append = rel.append
    rows = batches[0].num_rows
    i = 0
    cpu = time.thread_time()
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        append(batches[i % len(batches)])
        i += 1
        if time.perf_counter() >= deadline:
            break
    side.seconds += time.perf_counter() - start
    side.cpu_seconds += time.thread_time() - cpu
    side.appends += i
    side.updates += i * rows
    side.bytes += sum(record_sizes[k % len(record_sizes)] for k in range(i))


def run_raw(fd: int, records: list[bytes], rows: int, seconds: float, side: Side) -> None:
    i = 0
    cpu = time.thread_time()
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
    side.cpu_seconds += time.thread_time() - cpu
    side.appends += i
    side.updates += i * rows
    side.bytes += sum(len(records[k % len(records)]) for k in range(i))


def record_sizes(work: Path, compression: Compression, batches: list[pa.Table]) -> list[int]:
    """The bytes each batch's record takes with ``compression``: measured by appending
    each once to a scratch relation (fsync "never") and reading the file sizes."""
    with Store.open(work / f"sizes-{compression}", fsync="never",
                    wal_compression=compression) as store:
        rel = store.create_relation("bench", SCHEMA, key=["id"])
        segment = next(rel.wal_dir.glob("*.wal.open"))
        sizes = []
        for batch in batches:
            before = segment.stat().st_size
            rel.append(batch)
            sizes.append(segment.stat().st_size - before)
    return sizes


def measure(args: argparse.Namespace, batches: list[pa.Table], records: list[bytes]
            ) -> tuple[dict[str, Side], Side, dict[str, list[int]]]:
    """One measurement: a fresh store per setting and a raw file, taking turns in rounds."""
    work = Path(tempfile.mkdtemp(prefix="lamina-bench-", dir=args.dir))
    try:
        sizes = {c: record_sizes(work, c, batches) for c in args.compression}
        stores = {c: Store.open(work / f"lamina-{c}", fsync="always", wal_compression=c)
                  for c in args.compression}
        rels = {c: s.create_relation("bench", SCHEMA, key=["id"]) for c, s in stores.items()}
        for rel in rels.values():
            rel.append(batches[0])  # open the writer before measuring
        fd = os.open(work / "raw.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        lamina = {c: Side() for c in args.compression}
        raw = Side()
        sides = ["raw", *args.compression]
        rounds = max(2, round(args.seconds))
        slot = args.seconds / rounds / len(sides)
        for r in range(rounds):  # take turns, each round starting with another side
            for name in sides[r % len(sides):] + sides[:r % len(sides)]:
                if name == "raw":
                    run_raw(fd, records, args.rows, slot, raw)
                else:
                    run_lamina(rels[name], batches, slot, lamina[name], sizes[name])
        os.close(fd)
        for store in stores.values():
            store.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return lamina, raw, sizes


class Burners:
    """``n`` processes of ours spinning on a CPU each, until :meth:`stop` kills them by
    pid."""

    def __init__(self, n: int) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                       start_new_session=True) for _ in range(n)]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()


def parse_compressions(text: str) -> list[Compression]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in COMPRESSIONS]
    if bad or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a comma-separated list of distinct settings of "
                                         f"{COMPRESSIONS}, got {text!r}")
    return [cast(Compression, c) for c in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.wal_append",
                                     description=__doc__.split("\n\n")[0] if __doc__ else "")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="measured time of one run, split evenly between raw and each "
                             "setting (default 10)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="independent runs (fresh stores and file each); the run with "
                             "the median ratio of the first setting is reported, every run "
                             "is kept (default 1)")
    parser.add_argument("--rows", type=int, default=10_000, help="updates per batch")
    default = ",".join([DEFAULT_COMPRESSION, *(c for c in COMPRESSIONS
                                               if c != DEFAULT_COMPRESSION)])
    parser.add_argument("--compression", type=parse_compressions,
                        default=parse_compressions(default),
                        help=f"the wal_compression settings to measure, the headline first "
                             f"(default {default}: the default setting first)")
    parser.add_argument("--burn", type=int, default=0,
                        help="CPU-bound processes of our own running next to the benchmark")
    parser.add_argument("--burn-warmup", type=float, default=60.0,
                        help="seconds the burners run before measuring (default 60: the "
                             "load average follows with a one-minute time constant)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write (default: a temp dir, removed afterwards)")
    parser.add_argument("--output", type=Path, default=None,
                        help="result file (default bench/results/wal_append.json, with "
                             "--backlog wal_backlog.json)")
    parser.add_argument("--backlog", action="store_true",
                        help="measure WAL bytes and CPU per setting on the conversion "
                             "benchmark's table instead")
    parser.add_argument("--scale", type=float, default=0.1,
                        help="--backlog: the table's scale (1.0 = 10M updates; default 0.1)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.burn < 0:
        parser.error("--burn must be >= 0")
    if args.backlog:
        return backlog(args, argv)
    output: Path = args.output or RESULTS

    batches = make_batches(args.rows)
    meta = RelationMeta.new("bench", SCHEMA, ["id"])
    records = [frame(RecordType.UPDATES, encode_updates(conform_updates(meta, b)))
               for b in batches]
    raw_size = len(records[0])
    assert all(len(r) == raw_size for r in records)

    burners = Burners(args.burn) if args.burn else None
    try:
        if burners is not None:
            time.sleep(args.burn_warmup)
        run = report.Run("wal_append", argv)
        runs: list[dict[str, Any]] = []
        for k in range(args.repeat):
            load = report.load_average()
            lamina, raw, sizes = measure(args, batches, records)
            ratios = {c: s.updates_per_s / raw.updates_per_s if raw.updates_per_s else 0.0
                      for c, s in lamina.items()}
            runs.append({"ratios": ratios, "lamina": lamina, "raw": raw, "sizes": sizes,
                         "load": load})
            if args.repeat > 1:
                print(f"run {k + 1}: " + ", ".join(
                    f"{c} ratio {ratios[c]:.3f} ({lamina[c].ms_per_append:.3f} ms/append)"
                    for c in args.compression)
                    + f"; raw {raw.ms_per_append:.3f} ms/append; load average {load[0]} "
                      "before", flush=True)
    finally:
        if burners is not None:
            burners.stop()
    head = args.compression[0]
    chosen = sorted(runs, key=lambda r: r["ratios"][head])[len(runs) // 2]
    ratio = chosen["ratios"][head]
    lamina, raw = chosen["lamina"], chosen["raw"]
    settings = {c: {"lamina": lamina[c].summary(), "ratio": round(chosen["ratios"][c], 3),
                    "record_bytes": round(sum(chosen["sizes"][c]) / len(chosen["sizes"][c])),
                    "median_ratio_of_runs": round(sorted(r["ratios"][c] for r in runs)[
                        len(runs) // 2], 3)}
                for c in args.compression}
    result = run.document({
        "seconds_measured": args.seconds,
        "rows_per_batch": args.rows,
        "record_bytes": raw_size,
        "fsync": "always",
        "compression": head,
        "burners": args.burn,
        "lamina": lamina[head].summary(),
        "raw": raw.summary(),
        "ratio": round(ratio, 3),
        "overhead_ms_per_append": round(lamina[head].ms_per_append - raw.ms_per_append, 4),
        "settings": settings,
        "repeat": args.repeat,
        "runs": [{"ratios": {c: round(v, 3) for c, v in r["ratios"].items()},
                  "lamina_ms_per_append": {c: round(s.ms_per_append, 4)
                                           for c, s in r["lamina"].items()},
                  "raw_ms_per_append": round(r["raw"].ms_per_append, 4),
                  "lamina_cpu_ms_per_append": {c: round(s.cpu_ms_per_append, 4)
                                               for c, s in r["lamina"].items()},
                  "raw_cpu_ms_per_append": round(r["raw"].cpu_ms_per_append, 4),
                  "load_average_before": r["load"]} for r in runs],
        "targets": {"ratio": TARGET_RATIO, "updates_per_s": TARGET_UPDATES_PER_S},
        "met": {"ratio": ratio >= TARGET_RATIO,
                "updates_per_s": lamina[head].updates_per_s >= TARGET_UPDATES_PER_S},
        "dir": str(args.dir or tempfile.gettempdir()),
    })
    print(f"batch: {args.rows} updates, {raw_size} record bytes uncompressed; fsync per "
          f"append; {args.burn} CPU burners")
    print(f"{'raw':>12}: {raw.appends:6d} appends  {raw.updates_per_s:12,.0f} updates/s  "
          f"{raw.mb_per_s:8.1f} MB/s  {raw.ms_per_append:7.3f} ms/append  "
          f"{raw.cpu_ms_per_append:6.3f} CPU ms/append")
    for c in args.compression:
        side = lamina[c]
        print(f"{'lamina ' + c:>12}: {side.appends:6d} appends  {side.updates_per_s:12,.0f} "
              f"updates/s  {side.mb_per_s:8.1f} MB/s  {side.ms_per_append:7.3f} ms/append  "
              f"{side.cpu_ms_per_append:6.3f} CPU ms/append  ratio {chosen['ratios'][c]:.3f}  "
              f"({settings[c]['record_bytes']} bytes/record)")
    if args.repeat > 1:
        head_ratios = sorted(round(r["ratios"][head], 3) for r in runs)
        print(f"  median of {args.repeat} runs by {head}'s ratio ({head_ratios}); that run's "
              "figures above")
    print(f"  ratio ({head}): {ratio:.3f} lamina/raw (target >= {TARGET_RATIO}); updates/s "
          f"target >= {TARGET_UPDATES_PER_S:,}: "
          f"{'met' if result['met']['updates_per_s'] else 'missed'}")
    report.write_result(output.stem, result, output.parent)
    report.bar_chart(output.stem, "WAL append with fsync per append", [
        ("updates/s", {**{f"lamina {c}": lamina[c].updates_per_s for c in args.compression},
                       "raw write+fdatasync": raw.updates_per_s}),
        ("MB/s of records", {**{f"lamina {c}": lamina[c].mb_per_s for c in args.compression},
                             "raw write+fdatasync": raw.mb_per_s}),
    ], ylabel="", results=output.parent,
        note=f"ratio {ratio:.3f} ({head}; target >= {TARGET_RATIO}); {args.rows} updates per "
             f"append; {args.burn} burners; load {result['load_average']['before'][0]}")
    print(f"wrote {output}")
    return 0


def backlog(args: argparse.Namespace, argv: list[str] | None) -> int:
    """The ``--backlog`` measurement (module docstring)."""
    from bench.dataset import PER_APPEND, TIME_STEP, conversion_input
    from lamina.wal.reader import segment_updates
    from lamina.wal.segment import list_segments

    output: Path = args.output or report.RESULTS / "wal_backlog.json"
    source = conversion_input(args.scale)
    tables = [t for seg in list_segments(source.wal_dir)
              for t in segment_updates(seg, "bench", source.meta.update_schema)]
    updates = sum(t.num_rows for t in tables)
    run = report.Run("wal_backlog", argv)
    found: dict[str, dict[str, Any]] = {}
    work = Path(tempfile.mkdtemp(prefix="lamina-backlog-", dir=args.dir))
    try:
        for c in args.compression:
            root = work / c
            started = time.process_time()
            with Store.open(root, fsync="never", wal_compression=c) as store:
                rel = store.create_relation("bench", source.meta.schema, key=["id"])
                for i, t in enumerate(tables):
                    rel.append(t)
                    rel.seal((i + 1) * TIME_STEP)
            append_cpu = time.process_time() - started
            wal_dir = root / "wal" / "bench"
            segments = list_segments(wal_dir)
            nbytes = sum(s.path.stat().st_size for s in segments)
            started = time.process_time()
            back = sum(t.num_rows for s in segments
                       for t in segment_updates(s, "bench", source.meta.update_schema))
            read_cpu = time.process_time() - started
            assert back == updates, (c, back, updates)
            found[c] = {"wal_bytes": nbytes, "segments": len(segments),
                        "append_cpu_seconds": round(append_cpu, 2),
                        "read_cpu_seconds": round(read_cpu, 2)}
            print(f"{c:>5}: {nbytes / 2**20:8.1f} MiB in {len(segments)} segments; appends "
                  f"{append_cpu:.2f} CPU s, reading back {read_cpu:.2f} CPU s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = found.get("none", {}).get("wal_bytes")
    for v in found.values():
        v["bytes_vs_none"] = round(v["wal_bytes"] / base, 3) if base else None
    result = run.document({"scale": args.scale, "updates": updates,
                           "updates_per_append": PER_APPEND, "settings": found})
    report.write_result(output.stem, result, output.parent)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
