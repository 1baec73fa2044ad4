"""lamina: a durable, compacting store for timestamped update streams."""

from typing import TYPE_CHECKING, Any

from lamina.errors import LaminaError
from lamina.frontier import CLOSED

if TYPE_CHECKING:
    from lamina.read.subscribe import Progress
    from lamina.store import Relation, Store

__all__ = ["CLOSED", "LaminaError", "Progress", "Relation", "Store"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """The API's classes on first use. ``Progress``: the subscription's modules stay out of
    a process that only writes, or reads snapshots (a cold read imports what it uses;
    bench.cold_read). ``Store`` and ``Relation``: ``import lamina`` imports no numpy, so
    the command line (:mod:`lamina.cli`) can start OpenBLAS with one thread before numpy
    loads it (:mod:`lamina.blas`)."""
    if name == "Progress":
        from lamina.read.subscribe import Progress

        return Progress
    if name in ("Store", "Relation"):
        from lamina import store

        return getattr(store, name)
    raise AttributeError(f"module 'lamina' has no attribute {name!r}")
