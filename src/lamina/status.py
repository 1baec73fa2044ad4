"""Per-relation status, as ``lamina status`` prints it and ``/v1/relations`` serves it.

Keys (README, Command line): ``name``, ``sealed_upper``, ``since``, ``trace_upper``,
``wal_segments_pending``, ``wal_bytes_pending``, ``batches_by_level`` (level as a string
to a count), ``trace_bytes``, ``quarantined``. Frontiers are integers; the empty frontier
is ``lamina.CLOSED`` (lamina.frontier). Read from disk only, so it works with or without a daemon.
"""

from __future__ import annotations

from typing import Any

from lamina.datadir import DataDir
from lamina.errors import CorruptionError, RelationNotFoundError
from lamina.wal.reader import backlog

KEYS = ("name", "sealed_upper", "since", "trace_upper", "wal_segments_pending",
        "wal_bytes_pending", "batches_by_level", "trace_bytes", "quarantined")


def relation_status(layout: DataDir, name: str) -> dict[str, Any]:
    """The status of one relation; fields that cannot be read are None."""
    out: dict[str, Any] = dict.fromkeys(KEYS)
    out.update(name=name, quarantined=layout.quarantine_reason(name) is not None,
               wal_segments_pending=0, wal_bytes_pending=0, batches_by_level={},
               trace_bytes=0, trace_upper=0)
    wal_dir = layout.wal_dir(name)
    try:
        files = layout.relation(name)
        out["sealed_upper"], out["since"] = files.frontiers()
        state = files.state()
    except (FileNotFoundError, RelationNotFoundError):
        return out
    except CorruptionError:
        out["quarantined"] = True
        return out
    converted = 0
    if state is not None:
        converted = state.converted_through
        out["trace_upper"] = state.upper
        out["batches_by_level"] = {str(k): v for k, v in state.batches_by_level().items()}
        out["trace_bytes"] = state.bytes
    out["wal_segments_pending"], out["wal_bytes_pending"] = backlog(wal_dir, converted)
    return out


def store_status(layout: DataDir) -> list[dict[str, Any]]:
    return [relation_status(layout, name) for name in layout.relation_names()]
