"""The contenders of bench/peers.py, each run as its own process.

    .venv/bin/python -m bench.peers_contenders CONTENDER CELL WORKDIR     # one run
    .venv/bin/python -m bench.peers_contenders --writer CONTENDER CELL WORKDIR

A run ingests the cell's stream (:mod:`bench.peers_stream`) into ``WORKDIR``, measures,
and prints one JSON line (the last line of stdout). Contenders:

- ``lamina``: :class:`lamina.Store` with fsync "always" (``append`` then ``seal(i + 1)``
  per append; ``allow_compaction(upper - lag)`` every ``M`` appends), 4 MiB WAL segments
  rolled on age after 5 s, and ``lamina serve`` (Spark ``local[*]``, poll 0.2 s, GC every
  2 s with no grace and one kept trace version: the same retention as the zero-retention
  vacuum) compacting as it runs. At the end the store is closed (finishing the
  open segment) and the run waits until the daemon has settled (the trace has caught up
  and no merge is due, as Delta's last maintenance pass has finished when its run ends)
  and two GC rounds passed.
- ``lamina-default``: the same with the daemon's default retention, the last 8 trace
  versions' files (what readers of older states rely on), to show what it costs on disk.
- ``lamina-lz4``, ``lamina-zstd``: ``lamina`` with the store's WAL records compressed
  (``Store.open(wal_compression=...)``), to show what compression does to the peak bytes
  (the unconverted WAL is most of lamina's peak) and to the append path. ``lamina-zstd``
  also runs the daemon as docs/operations.md configures it for a disk short of room
  (``bench.peers_lamina.DAEMON_SETTINGS``: scratch runs in ZSTD, conversions of at most
  128 MiB decoded), and its writing store bounds the WAL backlog
  (``bench.peers_lamina.WAL_BACKLOG_BYTES``: appends wait while more than 4 MiB of
  finished segments await conversion).
- ``delta``: ``write_deltalake(mode="append")`` per append with the upper in the commit
  (custom metadata and an app transaction), then fsync of the commit's data files, the
  commit file and both directories (delta-rs does not fsync on a local disk); every ``M``
  commits the consolidation a Delta user would write (updates before ``since = upper -
  lag`` summed by row and rewritten at ``since - 1`` with ``mode="overwrite"`` and a
  predicate), ``optimize.compact()`` and ``vacuum`` with no retention (as lamina's GC
  grace); the same once more at the end.
- ``delta-nofsync``: the same without the fsyncs (not durable against power loss).
- ``delta-merge``: a keyed table ``(id, qty, cnt)``; per append the append's updates summed
  by row, then ``MERGE`` (``cnt + d``, delete where it reaches zero, insert otherwise) and
  the fsyncs; ``optimize.compact()`` and ``vacuum`` every ``M`` commits and at the end.
  It keeps no history but Delta's versions.

Measured in the child: latency of each durable append (``append`` to fsynced), wall time
of the whole ingest (maintenance included), maintenance CPU seconds and bytes written
(``/proc/self/io`` around it for Delta; the daemon's process tree for lamina, its start-up
excluded), bytes written by the appends, bytes and files on disk at the end and at the
peak (sampled every 0.25 s), the latest snapshot and the one at ``since`` (DuckDB over the
current files, as many threads as cores, for Delta; ``Relation.snapshot`` for lamina)
with the checksum of the latest, whether a time halfway through still answers, and
recovery: a writer process (``--writer``) appends on, is killed with SIGKILL, and the
time to reopen and read the latest snapshot is taken, with the last acknowledged upper
against the recovered one.

The modules: :mod:`bench.peers_measure` (what every contender measures with),
:mod:`bench.peers_lamina` and :mod:`bench.peers_delta` (the contenders, each with its own
writer and reopen for recovery); this one holds the schedule (``M`` and the lag) both
sides share, the recovery harness and the entry point.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.peers_delta import delta_recover, delta_writer, run_delta
from bench.peers_lamina import (
    DAEMON_SETTINGS,
    KEEP_VERSIONS,
    WAL_BACKLOG_BYTES,
    WAL_COMPRESSION,
    lamina_recover,
    lamina_writer,
    run_lamina,
)
from bench.peers_measure import proc_io
from bench.peers_stream import CELLS, Cell

CONTENDERS = ("lamina", "lamina-default", "lamina-lz4", "lamina-zstd", "delta", "delta-nofsync",
              "delta-merge")


def maintenance_every(cell: Cell) -> int:
    """``M``: commits between maintenance passes (ten passes per run)."""
    return max(10, cell.appends // 10)


def lag(cell: Cell) -> int:
    """How far ``since`` trails the upper: a tenth of the run."""
    return max(2, cell.appends // 10)


# --- recovery after kill -9 ------------------------------------------------------------------

def writer(contender: str, cell: Cell, work: Path) -> int:
    """Append on after the run, printing ``acked <upper>`` once each append is durable."""
    if contender in KEEP_VERSIONS:
        return lamina_writer(cell, work, WAL_COMPRESSION.get(contender, "none"))
    return delta_writer(contender, cell, work)


def recovery(contender: str, cell: Cell, work: Path, acks: int = 10) -> dict[str, Any]:
    """Kill a writer with SIGKILL after ``acks`` acknowledged appends; reopen and read."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.peers_contenders", "--writer",
                             contender, cell.name, str(work)], stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[1])
    assert proc.stdout is not None
    acked = 0
    for line in proc.stdout:
        acked = int(line.split()[1])
        acks -= 1
        if acks <= 0:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    started = time.perf_counter()
    if contender in KEEP_VERSIONS:
        recovered, rows = lamina_recover(work)
    else:
        recovered, rows = delta_recover(work, contender == "delta-merge")
    return {"seconds": round(time.perf_counter() - started, 4), "acked_upper": acked,
            "recovered_upper": recovered, "lost_acked": max(0, acked - recovered),
            "rows": rows}


def run(contender: str, cell: Cell, work: Path, budget: float) -> dict[str, Any]:
    every, behind = maintenance_every(cell), lag(cell)
    if contender in KEEP_VERSIONS:
        out = run_lamina(cell, work, budget, every=every, behind=behind,
                         keep_versions=KEEP_VERSIONS[contender],
                         compression=WAL_COMPRESSION.get(contender, "none"),
                         settings=DAEMON_SETTINGS.get(contender),
                         backlog_bytes=WAL_BACKLOG_BYTES.get(contender))
    else:
        out = run_delta(cell, work, budget, contender, every=every, behind=behind)
    out["recovery"] = recovery(contender, cell, work)
    out["process_io"] = {k: v for k, v in proc_io().items()
                         if k in ("read_bytes", "write_bytes")}
    return out


def main(argv: list[str]) -> int:
    if argv[0] == "--writer":
        return writer(argv[1], CELLS[argv[2]], Path(argv[3]))
    contender, cell, work = argv[0], CELLS[argv[1]], Path(argv[2])
    budget = float(argv[3]) if len(argv) > 3 else 1800.0
    work.mkdir(parents=True, exist_ok=True)
    print(json.dumps(run(contender, cell, work, budget)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
