"""Where a command's output goes, and what it says about its progress.

- :func:`output`: the binary sink of ``--output FILE`` (published whole: a temporary name in
  the same directory, fsync, rename, by :meth:`lamina.fs.FileSystem.create_synced`; a
  command that fails or is interrupted leaves no file, and the temporary one is removed),
  or standard output.
- :class:`Progress`: progress on standard error while it is a terminal (a rich bar, when
  rich is installed), then one summary line (``wrote <rows> rows to <file> in <seconds>
  s``). When standard error is not a terminal (a pipe, a file, a log), nothing: the
  output is the data and errors only.
- :func:`print_table`: plain aligned columns for people (``lamina status``,
  ``lamina relations``); ``--json`` is the form for programs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any

from lamina.errors import LaminaError
from lamina.fs import FileSystem


class Interrupted(KeyboardInterrupt):
    """SIGTERM while a command writes ``--output``: handled like Ctrl-C (no partial file),
    exit ``128 + signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def output(path: str | None) -> Iterator[IO[bytes]]:
    """Yield the sink of ``--output path`` (None: standard output). A file appears only
    when the block ends normally; on any exception, Ctrl-C and SIGTERM included, the
    temporary file is removed and no ``path`` is left behind."""
    if path is None:
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    target = Path(path)
    parent = target.parent
    if target.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        why = ("it is a directory" if target.is_dir() else
               f"{parent} is not an existing directory" if not parent.is_dir() else
               f"{parent} is not writable")
        raise LaminaError(f"cannot write --output {path}: {why}; pass a path in an existing, "
                          "writable directory")

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        with FileSystem().create_synced(target) as sink:
            yield sink  # type: ignore[misc]  # SyncedWriter is a binary file-like sink
    finally:
        signal.signal(signal.SIGTERM, previous)


def is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def count(n: int, unit: str) -> str:
    """``3,000,000 rows``; bytes as ``1.2 GB``."""
    if unit != "bytes":
        return f"{n:,} {unit}"
    size = float(n)
    for suffix in ("bytes", "kB", "MB", "GB", "TB"):
        if size < 1000 or suffix == "TB":
            return f"{n:,} bytes" if suffix == "bytes" else f"{size:.1f} {suffix}"
        size /= 1000
    raise AssertionError("unreachable")


class Progress:
    """Progress of one long command on standard error, only while it is a terminal.

    ``advance(n)`` counts rows or bytes (``unit``); with a ``total`` the bar shows how far
    along it is. ``bar=False`` keeps the live bar off (the data itself goes to the same
    terminal) and leaves only the summary. Use as a context manager (the bar stops on any
    exit), then :meth:`finish` with the summary."""

    def __init__(self, description: str, *, unit: str = "rows", total: int | None = None,
                 bar: bool = True) -> None:
        self.enabled = is_terminal(sys.stderr)
        self.unit = unit
        self.done = 0
        self.started = time.monotonic()
        self._bar: Any = None
        self._task: Any = None
        if not (self.enabled and bar):
            return
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            from rich.progress import Progress as Bar
        except ImportError:  # rich comes with lamina[compacter]; without it: summary only
            return
        columns: list[Any] = [SpinnerColumn(), TextColumn("{task.description}")]
        if total:
            columns.append(BarColumn())
        columns += [TextColumn("{task.fields[counted]}"), TimeElapsedColumn()]
        self._bar = Bar(*columns, console=Console(file=sys.stderr), transient=True,
                        redirect_stdout=is_terminal(sys.stdout), redirect_stderr=False)
        self._task = self._bar.add_task(description, total=total or None,
                                        counted=self._counted(total))
        self._bar.start()

    def _counted(self, total: int | None) -> str:
        done = count(self.done, self.unit)
        return f"{done} of {count(total, self.unit)}" if total else done

    def advance(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            total = self._bar.tasks[0].total
            self._bar.update(self._task, advance=n, counted=self._counted(
                int(total) if total else None))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def finish(self, summary: str) -> None:
        """Stop the bar and print ``<summary> in <seconds> s`` (terminal only)."""
        self.close()
        if self.enabled:
            seconds = time.monotonic() - self.started
            print(f"{summary} in {seconds:.1f} s", file=sys.stderr, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Columns padded to their widest cell, two spaces apart; the last one unpadded."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    for line in [list(headers), *rows]:
        cells = [c.ljust(w) for c, w in zip(line[:-1], widths, strict=False)]
        print("  ".join([*cells, line[-1]]))
