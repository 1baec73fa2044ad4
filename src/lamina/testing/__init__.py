"""Test-only parts of lamina: fault-injection seams that tests, the crash suites and the
restart drill select on purpose, never imported by the production path.

- :mod:`lamina.testing.faults`: storage layers (:class:`lamina.fs.FileSystem` subclasses)
  that count, crash, fail or simulate a power cut on a chosen file operation.

Fail points (:mod:`lamina.failpoints`) stay in the main package: they are compiled into
the production path at step boundaries (inert unless configured), so the drill can make a
real daemon or coordinator crash there.
"""
