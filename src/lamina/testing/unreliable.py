"""A fault-injecting object store, for tests and drills (after persist's ``UnreliableBlob``).

:class:`UnreliableStore` wraps any :class:`~lamina.objstore.base.ObjectStore` and, on the
operations its rules pick, does one of:

- ``"fail"``: raise :class:`~lamina.errors.StorageError` (EIO) *without* performing the
  operation (a refused request);
- ``"timeout"``: wait ``seconds``, then raise ``StorageError`` (ETIMEDOUT) without
  performing it (a request that never reached the server);
- ``"delay"``: wait ``seconds``, then perform it normally (a slow server);
- ``"lose_response"``: perform it, *then* raise ``StorageError`` (EIO): the object was
  written (or deleted, or read) but the caller cannot know. This is the indeterminate
  outcome a retried conditional create must resolve (``ObjectStore.put_if_absent`` does, by
  reading the object back).

A rule names an operation kind (``get``, ``get_range``, ``put``, ``create``, ``list``,
``delete``) and either call numbers (counted per kind from 1, over the wrapper's life) or a
probability drawn from a seeded ``random.Random`` (the same seed and call sequence inject
the same faults). The first rule that fires for a call decides it. Every injected fault is
recorded in :attr:`UnreliableStore.injected`.

``crash_at_mutation=k`` models a process killed between two requests: the k-th mutating
call (``put``, ``create`` or ``delete``, counted together from 1) is not performed and
raises :class:`SimulatedCrash` (a ``BaseException``, so no ``except Exception`` handler
swallows it), and so does every later call of any kind, as if the process were gone.
:attr:`UnreliableStore.mutations` records every mutating call (performed or not), so a
dry run without a crash counts the points to crash at.

``ignore_conditional=True`` makes the wrapper behave like an S3-compatible server that
ignores ``If-None-Match``: a conditional create overwrites and reports success. It is what
:func:`lamina.objstore.probe.check_conditional_put` must refuse.

``put_if_absent``, ``delete_prefix``, ``open_input`` and ``writer`` are the base class's,
built on the wrapped primitives here, so faults reach the reads, puts and deletes they
make too; ``child`` wraps the inner store's child under the same rules.
"""

from __future__ import annotations

import copy
import errno
import random
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Literal, TypeVar

from lamina.errors import InvalidArgumentError, StorageError
from lamina.objstore.base import ObjectMeta, ObjectStore

OpKind = Literal["get", "get_range", "put", "create", "list", "delete"]
OP_KINDS: tuple[OpKind, ...] = ("get", "get_range", "put", "create", "list", "delete")
Action = Literal["fail", "timeout", "delay", "lose_response"]
ACTIONS: tuple[Action, ...] = ("fail", "timeout", "delay", "lose_response")

_T = TypeVar("_T")


@dataclass(frozen=True)
class Rule:
    """Inject ``action`` on ``op`` calls numbered in ``calls`` (None: any call), each with
    probability ``probability``; ``seconds`` is the wait of ``timeout`` and ``delay``."""

    op: OpKind
    action: Action
    calls: frozenset[int] | None = None
    probability: float = 1.0
    seconds: float = 0.0


@dataclass(frozen=True)
class Injected:
    """One fault that was injected: the operation, its per-kind call number, the key."""

    op: OpKind
    number: int
    action: Action
    key: str


class SimulatedCrash(BaseException):
    """The process "died" before this store call (``crash_at_mutation``)."""


class UnreliableStore(ObjectStore):
    """``inner`` with faults injected by rules (module docstring). Thread-safe."""

    def __init__(self, inner: ObjectStore, *, seed: int = 0,
                 ignore_conditional: bool = False, crash_at_mutation: int | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.inner = inner
        self.crash_at_mutation = crash_at_mutation
        self.mutations: list[tuple[OpKind, str]] = []
        """Every put, create and delete asked of this store and its children, in order."""
        self._crashed: list[bool] = [False]  # shared with children
        self.url = inner.url
        self.ignore_conditional = ignore_conditional
        self._sleep = sleep
        self._rng = random.Random(seed)
        self._mu = threading.Lock()
        self.rules: list[Rule] = []
        self.calls: dict[OpKind, int] = dict.fromkeys(OP_KINDS, 0)
        self.injected: list[Injected] = []

    def inject(self, op: OpKind, action: Action, *, calls: Collection[int] | None = None,
               probability: float = 1.0, seconds: float = 0.0) -> UnreliableStore:
        """Add a rule; returns self, so rules chain."""
        if op not in OP_KINDS or action not in ACTIONS:
            raise InvalidArgumentError(f"unknown operation {op!r} or action {action!r}; "
                                       f"operations: {OP_KINDS}, actions: {ACTIONS}")
        if not 0.0 <= probability <= 1.0 or seconds < 0:
            raise InvalidArgumentError(f"probability {probability} must be in [0, 1] and "
                                       f"seconds {seconds} >= 0")
        with self._mu:
            self.rules.append(Rule(op, action, frozenset(calls) if calls is not None else None,
                                   probability, seconds))
        return self

    def clear(self) -> None:
        """Drop every rule (counters and the record stay)."""
        with self._mu:
            self.rules.clear()

    def _decide(self, op: OpKind, key: str) -> tuple[int, Rule | None]:
        with self._mu:
            self.calls[op] += 1
            n = self.calls[op]
            for rule in self.rules:
                if rule.op != op or (rule.calls is not None and n not in rule.calls):
                    continue
                if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                    continue
                self.injected.append(Injected(op, n, rule.action, key))
                return n, rule
            return n, None

    def _run(self, op: OpKind, key: str, call: Callable[[], _T]) -> _T:
        with self._mu:
            if op in ("put", "create", "delete"):
                self.mutations.append((op, key))
                if len(self.mutations) == self.crash_at_mutation:
                    self._crashed[0] = True
            if self._crashed[0]:
                raise SimulatedCrash(f"{self.url}: crashed before {op} of {key!r}")
        n, rule = self._decide(op, key)
        if rule is None:
            return call()
        what = f"{self.url}: injected {rule.action} of {op} #{n} ({key!r})"
        if rule.action == "fail":
            raise StorageError(errno.EIO, f"{what}: the operation was not performed "
                               "(a test fault; retry)")
        if rule.action == "timeout":
            self._sleep(rule.seconds)
            raise StorageError(errno.ETIMEDOUT, f"{what}: timed out, not performed "
                               "(a test fault; retry)")
        if rule.action == "delay":
            self._sleep(rule.seconds)
            return call()
        call()
        raise StorageError(errno.EIO, f"{what}: the operation was performed but its "
                           "response was lost (a test fault; the outcome is unknown)")

    def child(self, prefix: str) -> UnreliableStore:
        """The inner store's child, under the same rules, counters and record."""
        c = copy.copy(self)
        c.inner = self.inner.child(prefix)
        c.url = c.inner.url
        return c

    def get(self, key: str) -> bytes:
        return self._run("get", key, lambda: self.inner.get(key))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._run("get_range", key, lambda: self.inner.get_range(key, start, end))

    def put(self, key: str, data: bytes) -> None:
        self._run("put", key, lambda: self.inner.put(key, data))

    def create(self, key: str, data: bytes) -> bool:
        if self.ignore_conditional:
            def overwrite() -> bool:
                self.inner.put(key, data)
                return True
            return self._run("create", key, overwrite)
        return self._run("create", key, lambda: self.inner.create(key, data))

    def list(self, prefix: str = "") -> list[ObjectMeta]:
        return self._run("list", prefix, lambda: self.inner.list(prefix))

    def delete(self, key: str) -> None:
        self._run("delete", key, lambda: self.inner.delete(key))

    def free_bytes(self, key: str) -> int | None:
        return self.inner.free_bytes(key)  # a question, not an operation: no faults
