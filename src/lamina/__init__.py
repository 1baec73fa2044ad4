"""lamina: a durable, compacting store for timestamped update streams."""

from lamina.errors import LaminaError
from lamina.frontier import CLOSED
from lamina.read.subscribe import Progress
from lamina.store import Relation, Store

__all__ = ["CLOSED", "LaminaError", "Progress", "Relation", "Store"]
__version__ = "0.1.0"
