"""Which data directory a command works on, and how it opens it.

``--data-dir``, else ``LAMINA_DATA_DIR``, else ``./lamina-data``. Reads open the store
read-only: nothing is created, and a path that is not a data directory is one line naming
it. Writes (``lamina drop``) first check the same way, so a mistyped path is refused rather
than turned into a new, empty data directory.
"""

from __future__ import annotations

import argparse
import os

from lamina.errors import InvalidArgumentError
from lamina.store import Store

DEFAULT_DATA_DIR = "lamina-data"
DATA_DIR_ENV = "LAMINA_DATA_DIR"


def data_dir(args: argparse.Namespace) -> str:
    """``--data-dir``, else ``$LAMINA_DATA_DIR``, else ``./lamina-data``."""
    given: str | None = args.data_dir
    return given or os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR


def open_store(args: argparse.Namespace, *, write: bool = False) -> Store:
    """The command's store: read-only, or (``write``) writable once it proved to be a data
    directory."""
    path = data_dir(args)
    try:
        store = Store.open(path, read_only=True)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{exc} (pass --data-dir DIR or set {DATA_DIR_ENV})"
                                   ) from None
    if not write:
        return store
    store.close()
    return Store.open(path)
