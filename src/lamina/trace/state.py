"""The versioned trace state of one relation and its compare-and-set publication.

A state version is a JSON object ``state/{version:020d}.json`` in the relation's trace
(an :class:`~lamina.objstore.base.ObjectStore` rooted at it: a directory or a bucket
prefix)::

    {"checksum": <CRC32C of the canonical JSON of "state">,
     "state": {"format_version": 1, "version": N, "relation": "orders",
               "relation_id": "<hex>", "writer": "<random nonce of this version>",
               "upper": U, "since": S,
               "converted_through": <last converted WAL segment sequence, 0 = none>,
               "batches": [BatchDesc...], "pending": [PendingPart...]}}

Publication is compare-and-set: version N+1 is created with ``put_if_absent`` (on a
directory an exclusive link of a synced temp file, on S3 a PutObject with
``If-None-Match: *``), so of two writers that both read version N exactly one creates N+1;
the other gets StateConflictError and must stop. The writer nonce makes every publication's
bytes unique: a create whose response was lost and whose retry finds the object is told
apart from a race lost to another writer by reading the object back
(``ObjectStore.put_if_absent``), the indeterminate outcome persist names. The nonce is
drawn by :meth:`TraceState.next` and covered by the checksum; a version written before it
existed reads with an empty one. Data files are written before the state that names them
(crash-safety rules, docs/architecture.md).

Recovery reads the newest version. A newest version that fails its checksum is corruption,
not a reason to fall back to an older one: the WAL segments the newest version marked
converted may already be deleted, so an older version would silently lose their updates.

Size stays bounded: a state names only live batches (O(log N)) and pending parts (bounded
by lamina.trace.pending), and only the newest ``keep`` versions are kept (and those a read
holds a lease on, lamina.trace.lease).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lamina.errors import CorruptionError, ObjectExistsError, StateConflictError, decode_failure
from lamina.fs import crc32c
from lamina.layout import TraceLayout
from lamina.objstore.base import ObjectStore
from lamina.trace.batch import BatchDesc, PartFile

FORMAT_VERSION = 1


@dataclass(frozen=True)
class PendingPart:
    """Future updates with times in ``[lower, upper)``, stored in one Parquet file."""

    lower: int
    upper: int
    part: PartFile

    def to_dict(self) -> dict[str, Any]:
        return {"lower": self.lower, "upper": self.upper, "part": self.part.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PendingPart:
        return cls(lower=int(d["lower"]), upper=int(d["upper"]),
                   part=PartFile.from_dict(d["part"]))


@dataclass(frozen=True)
class TraceState:
    """One version of a relation's trace."""

    version: int
    relation: str
    relation_id: str
    upper: int = 0
    since: int = 0
    converted_through: int = 0
    batches: tuple[BatchDesc, ...] = ()
    pending: tuple[PendingPart, ...] = field(default=())
    writer: str = ""
    """A random nonce per version (:meth:`next`): no two writers publish equal bytes."""
    format_version: int = FORMAT_VERSION

    @classmethod
    def empty(cls, relation: str, relation_id: str) -> TraceState:
        """Version 0: the state before anything was converted (never written)."""
        return cls(version=0, relation=relation, relation_id=relation_id)

    def next(self, **changes: Any) -> TraceState:
        return replace(self, version=self.version + 1, writer=uuid.uuid4().hex, **changes)

    def files(self) -> set[str]:
        """Paths (relative to the trace dir) of every data file this version names."""
        names = {p.path for b in self.batches for p in b.parts}
        names.update(p.part.path for p in self.pending)
        return names

    @property
    def rows(self) -> int:
        return sum(b.rows for b in self.batches)

    @property
    def bytes(self) -> int:
        return sum(b.bytes for b in self.batches) + sum(p.part.bytes for p in self.pending)

    def batches_by_level(self) -> dict[int, int]:
        levels: dict[int, int] = {}
        for b in self.batches:
            levels[b.level] = levels.get(b.level, 0) + 1
        return dict(sorted(levels.items()))

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": self.format_version, "version": self.version,
                "relation": self.relation, "relation_id": self.relation_id,
                "writer": self.writer, "upper": self.upper, "since": self.since,
                "converted_through": self.converted_through,
                "batches": [b.to_dict() for b in self.batches],
                "pending": [p.to_dict() for p in self.pending]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TraceState:
        return cls(version=int(d["version"]), relation=str(d["relation"]),
                   relation_id=str(d["relation_id"]), upper=int(d["upper"]),
                   since=int(d["since"]), converted_through=int(d["converted_through"]),
                   batches=tuple(BatchDesc.from_dict(b) for b in d["batches"]),
                   pending=tuple(PendingPart.from_dict(p) for p in d["pending"]),
                   writer=str(d.get("writer", "")),
                   format_version=int(d["format_version"]))


def _canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def encode_state(state: TraceState) -> bytes:
    body = state.to_dict()
    return json.dumps({"checksum": crc32c(_canonical(body)), "state": body},
                      sort_keys=True, indent=1).encode() + b"\n"


def decode_state(data: bytes, path: str | Path) -> TraceState:
    """Parse a state object (``path``: where it lives, ending in its name); any damage
    raises CorruptionError naming it."""
    try:
        doc = json.loads(data)
        body = doc["state"]
        if crc32c(_canonical(body)) != int(doc["checksum"]):
            raise CorruptionError("trace state checksum mismatch", path=path)
        if int(body["format_version"]) != FORMAT_VERSION:
            raise CorruptionError(f"trace state format version {body['format_version']}; "
                                  f"this lamina reads {FORMAT_VERSION}", path=path)
        state = TraceState.from_dict(body)
    except CorruptionError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError,
            OverflowError) as exc:  # OverflowError: int() of an infinite float
        raise CorruptionError(f"trace state is unreadable: {decode_failure(exc)}",
                              path=path) from exc
    if str(path).rsplit("/", 1)[-1] != state_file_name(state.version):
        raise CorruptionError(f"trace state says version {state.version}", path=path)
    return state


def state_file_name(version: int) -> str:
    return f"{version:020d}.json"


class StateStore:
    """The ``state/`` versions of one relation's trace, in its object store."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.dir = store.location(TraceLayout.STATE)
        """Where the versions live, for messages."""

    @staticmethod
    def key(version: int) -> str:
        return f"{TraceLayout.STATE}/{state_file_name(version)}"

    def versions(self) -> list[int]:
        return [v for v, _ in self.listed()]

    def listed(self) -> list[tuple[int, float]]:
        """The published versions, oldest first, each with its object's mtime (when it
        was published): one listing of ``state/``."""
        out = []
        for meta in self.store.list(TraceLayout.STATE):
            stem, dot, ext = meta.key.rsplit("/", 1)[-1].partition(".")
            if ext == "json" and dot and len(stem) == 20 and stem.isdigit():
                out.append((int(stem), meta.mtime))
        return sorted(out)

    def load(self, version: int) -> TraceState:
        key = self.key(version)
        return decode_state(self.store.get(key), self.store.location(key))

    def load_latest(self) -> TraceState | None:
        """The newest version, or None when nothing was published yet. A version deleted
        by pruning between listing and reading is retried from a fresh listing."""
        for _ in range(10):
            versions = self.versions()
            if not versions:
                return None
            try:
                return self.load(versions[-1])
            except FileNotFoundError:
                continue
        raise CorruptionError("trace state versions kept vanishing while loading", path=self.dir)

    def sync(self) -> None:
        """Make the listed versions durable (a writer may have died before it did)."""
        self.store.sync(TraceLayout.STATE)

    def publish(self, state: TraceState) -> None:
        """Publish ``state`` as its version, which must not exist yet (compare-and-set)."""
        newer = [v for v in self.versions() if v >= state.version]
        try:
            if newer:
                raise ObjectExistsError(f"version {newer[-1]} exists")
            self.store.put_if_absent(self.key(state.version), encode_state(state))
        except ObjectExistsError:
            raise StateConflictError(
                f"trace state version {state.version} of relation {state.relation!r} was "
                f"published by another writer in {self.dir}; this writer stops (is a second "
                "compacter running on the same trace?)") from None

    def prune(self, keep: int, *, superseded_before: float | None = None,
              held: Collection[int] = (),
              listed: list[tuple[int, float]] | None = None) -> list[int]:
        """Delete all but the newest ``keep`` versions; return the versions deleted.

        With ``superseded_before`` (seconds since the epoch), a version is also kept while
        it was superseded at or after that time: the version after it was published then
        (its object's mtime). Versions in ``held`` (what live read leases hold,
        lamina.trace.lease) are kept too. ``listed``: a listing the caller already made
        (:meth:`listed`)."""
        listed = self.listed() if listed is None else listed
        doomed = []
        for (v, _), (_, successor_mtime) in zip(listed[:-keep] if keep > 0 else [],
                                                listed[1:], strict=False):
            if v in held:
                continue
            if superseded_before is None or successor_mtime < superseded_before:
                doomed.append(v)
        for v in doomed:
            self.store.delete(self.key(v))
        return doomed
