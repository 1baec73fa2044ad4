"""lamina: a durable, compacting store for timestamped update streams."""

from typing import TYPE_CHECKING, Any

from lamina.errors import LaminaError
from lamina.frontier import CLOSED
from lamina.store import Relation, Store

if TYPE_CHECKING:
    from lamina.read.subscribe import Progress

__all__ = ["CLOSED", "LaminaError", "Progress", "Relation", "Store"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``Progress`` on first use: the subscription's modules stay out of a process that
    only writes, or reads snapshots (a cold read imports what it uses; bench.cold_read)."""
    if name == "Progress":
        from lamina.read.subscribe import Progress

        return Progress
    raise AttributeError(f"module 'lamina' has no attribute {name!r}")
