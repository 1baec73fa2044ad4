"""Placeholder replaced by the trace read path."""

from __future__ import annotations

import pyarrow as pa

from lamina.layout import Layout
from lamina.schema import RelationMeta


def trace_updates(layout: Layout, meta: RelationMeta, as_of: int) -> tuple[list[pa.Table], int]:
    return [], 0
