"""Child of test_leases: a reader that pins a relation's state with a streaming snapshot,
reads one batch, says ``PINNED <version>`` and waits to be killed. Must not import
pytest.

    python -m tests.read.lease_child DATA_DIR RELATION LEASE_SECONDS
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main() -> int:
    from lamina import Store

    data, relation, seconds = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    store = Store.open(data, lease_seconds=seconds)
    reader = store.relation(relation).snapshot_reader()
    reader.read_next_batch()
    state = store.relation(relation).files.state()
    assert state is not None
    print(f"PINNED {state.version}", flush=True)
    while True:  # holding the reader (and its lease, renewed) until SIGKILL
        time.sleep(60)


if __name__ == "__main__":
    sys.exit(main())
