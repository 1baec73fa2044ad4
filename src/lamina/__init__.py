"""lamina: a durable, compacting store for timestamped update streams."""

from lamina.errors import LaminaError
from lamina.frontier import CLOSED
from lamina.store import Relation, Store
from lamina.subscribe import Progress

__all__ = ["CLOSED", "LaminaError", "Progress", "Relation", "Store"]
__version__ = "0.1.0"
