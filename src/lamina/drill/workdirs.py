"""Where a drill works: a scratch data directory and the work directory beside it (logs,
ack logs, the report), for ``lamina drill`` and ``lamina drill --ingest``."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path


def drill_dirs(data_dir_arg: str | None, prefix: str) -> tuple[Path, Path, Path | None] | None:
    """``(data dir, work dir, scratch)`` of a drill: a temporary data directory when none is
    given (``scratch``, removed after a clean run), else one that must be empty; the work
    directory beside it (``<data>.drill``) must be empty too. None after printing why not."""
    scratch: Path | None = None
    if data_dir_arg is None:
        scratch = Path(tempfile.mkdtemp(prefix=prefix))
        data_dir = scratch / "data"
    else:
        data_dir = Path(data_dir_arg)
        if data_dir.exists() and (not data_dir.is_dir() or any(data_dir.iterdir())):
            print(f"lamina drill: {data_dir} is not an empty directory; the drill "
                  "writes and kills freely, so it needs a scratch directory (omit "
                  "--data-dir for a temporary one)", file=sys.stderr)
            return None
    work = data_dir.parent / f"{data_dir.name}.drill"
    if work.exists() and any(work.iterdir()):
        print(f"lamina drill: {work} (the drill's work directory) is not empty; "
              "remove it or choose another --data-dir", file=sys.stderr)
        return None
    work.mkdir(parents=True, exist_ok=True)
    return data_dir, work, scratch
