"""lamina: a durable, compacting store for timestamped update streams."""

from lamina.errors import LaminaError
from lamina.store import Relation, Store
from lamina.wal.record import CLOSED

__all__ = ["CLOSED", "LaminaError", "Relation", "Store"]
__version__ = "0.1.0"
