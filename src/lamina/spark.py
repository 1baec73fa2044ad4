"""``lamina.spark``: the documented import path of the Spark reader (README, DESIGN.md
section 10), which lives in :mod:`lamina.read.spark`: ``read_snapshot(spark, path,
relation, as_of=None)`` gives a relation's snapshot as a DataFrame computed by Spark tasks,
holding a lease on its files until ``release(df)`` or until the DataFrame is
garbage-collected."""

from lamina.read.spark import read_snapshot, release

__all__ = ["read_snapshot", "release"]
