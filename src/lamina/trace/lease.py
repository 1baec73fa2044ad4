"""Read leases: what keeps the files of a read alive while it runs (DESIGN.md section 10).

A read that pins trace state version N holds a lease on N, as persist's leased readers hold
a seqno: a small object in the relation's trace (:meth:`lamina.layout.TraceLayout.lease`)::

    leases/<id>.v<N>.x<expiry, epoch ms>.json
    {"format_version": 1, "id": "<32 hex>", "holder": "<host>:<pid> <what reads>",
     "version": N, "expires_at": <epoch seconds>}

Garbage collection (:meth:`lamina.trace.trace.Trace.collect_garbage`) keeps every state
version a live lease holds, and so every file that version names, however many newer
versions exist and whatever ``keep_versions`` says; a lease past its expiry holds nothing
(its reader died or stopped renewing), and GC deletes its object. The version and the
expiry are in the key, so GC learns every lease from one listing of ``leases/``
(:func:`scan`) without reading any, whatever their number.

**Taking a lease** (:meth:`Lease.hold_newest`). GC does not read the leases atomically with
the state versions, so a reader confirms what it holds:

1. list ``state/``: the newest version is N;
2. put the lease on N;
3. list ``state/`` again: if N is still the newest, N is held. Otherwise hold the newer one
   and check again.

Why that suffices: a GC pass lists the state versions first and the leases after. A pass
that missed the lease listed its leases before step 2 returned, so it listed its versions
earlier still, when the newest was at most N (step 3 found N the newest later on). If it
listed N, N was its newest version, which GC always keeps. If it did not, it never prunes
N, and N's files are files of versions it kept or files younger than its grace period
(a step's fresh output). Every later pass sees the lease.

**Renewing.** One daemon thread per process (:class:`LeaseKeeper`) renews the leases held
in the process once a third of their duration has passed: the lease is put under its new
key first and the old key deleted after, so for a moment both exist and GC keeps the union.
A read that moves to a newer version (a subscription, interval by interval) moves its lease
the same way. Released (:meth:`Lease.release`), its object is deleted.

**Clocks.** The expiry is the reader's clock, compared by GC with its own; they must agree
to well within a lease's duration (NTP does; the default duration is 60 s,
:data:`lamina.datadir.DEFAULT_LEASE_SECONDS`).

**Where a lease cannot be written** (a read-only copy of a data directory, an S3 key without
write permission) the read goes on without one, as reads did before leases: it retries
from a fresh state when files vanish while it opens them. A warning says so. No compacter
runs on such a copy, so nothing is collected under it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lamina.errors import InvalidArgumentError, StorageError
from lamina.layout import TraceLayout
from lamina.objstore.base import ObjectMeta, ObjectStore
from lamina.objstore.local import LocalObjectStore
from lamina.trace.state import StateStore

FORMAT_VERSION = 1
_KEY = re.compile(r"([0-9a-f]{32})\.v(\d+)\.x(\d+)\.json")
_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
_RETRIES = 50


@dataclass(frozen=True)
class LeaseKey:
    """What a lease's key says: its id, the version it holds, its expiry (epoch ms)."""

    id: str
    version: int
    expires_ms: int

    @classmethod
    def parse(cls, key: str) -> LeaseKey | None:
        m = _KEY.fullmatch(key.rsplit("/", 1)[-1])
        if m is None:
            return None
        return cls(m.group(1), int(m.group(2)), int(m.group(3)))

    def live(self, now: float) -> bool:
        return self.expires_ms > now * 1000


@dataclass(frozen=True)
class LeaseScan:
    """One listing of ``leases/``: the versions live leases hold, and the objects of
    leases expired before the cut-off (garbage to delete)."""

    held: frozenset[int]
    live: int
    expired: tuple[ObjectMeta, ...]


def scan(store: ObjectStore, now: float, *, forget_before: float) -> LeaseScan:
    """The leases of a trace, from one listing: the versions held by leases live at
    ``now``, and the objects of leases that expired before ``forget_before``. Objects
    that are not leases are left alone."""
    held: set[int] = set()
    live = 0
    expired = []
    for obj in store.list(TraceLayout.LEASES):
        lease = LeaseKey.parse(obj.key)
        if lease is None:
            continue
        if lease.live(now):
            held.add(lease.version)
            live += 1
        elif lease.expires_ms < forget_before * 1000:
            expired.append(obj)
    return LeaseScan(frozenset(held), live, tuple(expired))


class Lease:
    """One read's lease on a trace state version (module docstring). Made unheld; the
    read holds versions through :meth:`hold_newest` and ends with :meth:`release`."""

    def __init__(self, store: ObjectStore, *, seconds: float, holder: str,
                 clock: Callable[[], float] = time.time,
                 keeper: LeaseKeeper | None = None) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not (
                0 < seconds < 10**9):
            raise InvalidArgumentError(f"a lease lasts a positive number of seconds, got "
                                       f"{seconds!r}")
        self.store = store
        self.seconds = float(seconds)
        self.holder = f"{socket.gethostname()}:{os.getpid()} {holder}"
        self.id = uuid.uuid4().hex
        self.version: int | None = None
        """The version held, or None."""
        self.expires_at = 0.0
        self.writable = True
        """False once the store refused the lease (the read goes on without one)."""
        self.released = False
        self._clock = clock
        self._keeper = keeper or KEEPER
        self._key: str | None = None
        self._confirmed = False
        self._renew_at = math.inf
        self._mu = threading.Lock()

    # --- taking and moving ------------------------------------------------------------
    def hold_newest(self, states: StateStore) -> int | None:
        """Hold the newest state version with the protocol of the module docstring and
        return it (None, holding nothing, when no version exists). Where the store refuses
        leases, the newest version is returned unheld."""
        for _ in range(_RETRIES):
            versions = states.versions()
            if not versions:
                self.drop()
                return None
            newest = versions[-1]
            if self.version == newest and self._confirmed:
                return newest
            if not self.hold(newest):
                return newest
            if states.versions()[-1:] == [newest]:
                self._confirmed = True
                return newest
        raise StorageError(f"the trace state versions in {states.dir} kept changing while a "
                           f"read took its lease ({_RETRIES} attempts); retry the read")

    def hold(self, version: int) -> bool:
        """Put the lease on ``version`` (unconfirmed: :meth:`hold_newest` confirms); False
        when the store refuses to keep leases."""
        with self._mu:
            if self.released:
                raise InvalidArgumentError(f"lease {self.id} was released; a read takes a "
                                           "new one")
            if not self.writable:
                return False
            if self.version != version:
                self._confirmed = False
            try:
                self._put(version)
            except StorageError as exc:
                if exc.errno not in _UNWRITABLE:
                    raise
                self.writable = False
                self._forget()
                warnings.warn(f"{self.store.location(TraceLayout.LEASES)} refuses the lease "
                              f"of a read ({exc}); reading without one: the compacter may "
                              "collect files the read still needs (docs/reading.md, Leases)",
                              RuntimeWarning, stacklevel=3)
                return False
        self._keeper.add(self)
        return True

    def drop(self) -> None:
        """Hold nothing (delete the object), staying usable: a later :meth:`hold` puts it
        again."""
        with self._mu:
            key = self._forget()
        self._keeper.discard(self)
        if key is not None:
            with contextlib.suppress(StorageError):  # left behind, it expires by itself
                self.store.delete(key)
            if isinstance(self.store, LocalObjectStore):
                # a read leaves nothing behind: not even the directory its lease made
                # (rmdir fails while another lease is in it; a lease being put retries)
                with contextlib.suppress(OSError):
                    self.store.path(TraceLayout.LEASES).rmdir()

    def release(self) -> None:
        """End the lease: its object is deleted and it is renewed no more (idempotent)."""
        with self._mu:
            if self.released:
                return
            self.released = True
        self.drop()

    # --- renewal ------------------------------------------------------------------------
    @property
    def renew_at(self) -> float:
        return self._renew_at

    def renew(self) -> None:
        """Put the lease again with a fresh expiry (the keeper calls this). A failure
        leaves the old object (live until its expiry) and is retried soon."""
        with self._mu:
            if self.released or self.version is None:
                return
            try:
                self._put(self.version)
            except Exception as exc:  # the keeper thread must go on
                self._renew_at = self._clock() + min(1.0, self.seconds / 10)
                warnings.warn(f"the lease of a read on {self.store.location(TraceLayout.LEASES)}"
                              f" could not be renewed ({exc}); retrying", RuntimeWarning,
                              stacklevel=2)

    # --- internals (under _mu) ------------------------------------------------------------
    def _put(self, version: int) -> None:
        now = self._clock()
        expires_ms = math.floor((now + self.seconds) * 1000)
        key = TraceLayout.lease(self.id, version, expires_ms)
        body = {"format_version": FORMAT_VERSION, "id": self.id, "holder": self.holder,
                "version": version, "expires_at": expires_ms / 1000}
        data = json.dumps(body).encode() + b"\n"
        for attempt in range(5):
            try:  # not synced: a lease matters only while its reader lives
                if isinstance(self.store, LocalObjectStore):  # so, nor is its directory
                    _mkdir(self.store.path(TraceLayout.LEASES))
                with self.store.writer(key, durable=False) as out:
                    out.write(data)
                break
            except (FileNotFoundError, StorageError) as exc:
                # another read removed the empty leases/ directory meanwhile (drop)
                if attempt == 4 or (isinstance(exc, StorageError)
                                    and exc.errno != errno.ENOENT):
                    raise
        old, self._key = self._key, key
        self.version, self.expires_at = version, expires_ms / 1000
        self._renew_at = now + self.seconds / 3
        if old is not None and old != key:
            with contextlib.suppress(StorageError):  # left behind, it expires by itself
                self.store.delete(old)

    def _forget(self) -> str | None:
        key, self._key = self._key, None
        self.version, self._confirmed, self._renew_at = None, False, math.inf
        return key

    def __repr__(self) -> str:
        return f"Lease({self.id}, version={self.version}, holder={self.holder!r})"


def _mkdir(path: Path) -> None:
    try:
        path.mkdir(exist_ok=True)
    except OSError as exc:
        raise StorageError(exc.errno, f"mkdir of {path} failed: {exc.strerror}") from exc


class LeaseKeeper:
    """The thread that renews every lease held in this process (one per process, started
    with the first lease, sleeping until the next renewal is due)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._leases: set[Lease] = set()
        self._cv = threading.Condition()
        self._started = False
        # a forked child has no keeper thread and holds none of its parent's reads
        os.register_at_fork(after_in_child=self._forget_parent)

    def _forget_parent(self) -> None:
        self._leases, self._cv, self._started = set(), threading.Condition(), False

    def add(self, lease: Lease) -> None:
        with self._cv:
            if not self._started:
                self._started = True
                threading.Thread(target=self._run, name="lamina-lease-keeper",
                                 daemon=True).start()
            self._leases.add(lease)
            self._cv.notify()

    def discard(self, lease: Lease) -> None:
        with self._cv:
            self._leases.discard(lease)

    def held(self) -> int:
        with self._cv:
            return len(self._leases)

    def _run(self) -> None:
        cv = self._cv  # this process's (a forked child makes its own)
        while True:
            with cv:
                now = self._clock()
                due = [lease for lease in self._leases if lease.renew_at <= now]
                if not due:
                    nxt = min((lease.renew_at for lease in self._leases), default=math.inf)
                    cv.wait(None if nxt == math.inf else max(0.01, nxt - now))
                    continue
            for lease in due:
                lease.renew()


KEEPER = LeaseKeeper()
"""This process's keeper (a renewal thread belongs to a process, like its leases)."""
