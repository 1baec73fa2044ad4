"""The WAL writer's record tearing (the ``wal.mid_record`` fail point), in this process.

A kill or error at the point leaves half a record as the segment's torn tail
(tests/test_failpoints.py); these check the other actions and the run-time switch: a
``sleep`` writes the other half after it (the log stays whole), and a point configured
while a writer is already open applies to it."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from lamina import failpoints
from lamina.errors import StorageError
from lamina.wal.log import WalWriter
from lamina.wal.segment import list_segments, scan_file
from tests.wal.test_log import NAME, batch, logged_ids, new_relation, open_segment


def test_sleep_at_mid_record_writes_the_record_whole(tmp_path: Path) -> None:
    """``wal.mid_record=sleep`` pauses half-way through a record, then finishes it: every
    record is intact and nothing is torn."""
    wal = new_relation(tmp_path)
    with failpoints.active("wal.mid_record=sleep:0.01@2"):
        w = WalWriter(wal, NAME)
        for k in range(3):
            w.append(batch(10 * k, 3, 0))
        w.close()
    assert all(scan_file(seg, NAME)[0].torn_at is None for seg in list_segments(wal))
    assert logged_ids(wal) == [0, 1, 2, 10, 11, 12, 20, 21, 22]


def test_point_configured_after_open_tears_the_next_record(tmp_path: Path) -> None:
    """Fail points switched on at run time reach a writer opened before: the record
    written at the point is half on disk, the call fails, reopening cuts the half."""
    wal = new_relation(tmp_path)
    w = WalWriter(wal, NAME)
    w.append(batch(0, 2, 0))
    size = open_segment(wal).stat().st_size
    with failpoints.active("wal.mid_record=error"), pytest.raises(StorageError) as info:
        w.append(batch(10, 50, 0))
    assert info.value.errno == errno.EIO
    w.close()
    w = WalWriter(wal, NAME)
    w.close()
    assert open_segment(wal).stat().st_size == size
    assert logged_ids(wal) == [0, 1]
