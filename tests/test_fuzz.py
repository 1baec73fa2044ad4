"""Fuzzing the two decoders that read bytes from disk: the WAL segment scanner with the
update decoder behind it (``scan_buffer`` + ``updates_of``) and the trace state loader
(``decode_state``). Whatever the bytes, only lamina's typed errors (``LaminaError``
subclasses, here always CorruptionError naming the file) may come out: never IndexError,
struct.error, ArrowInvalid, UnicodeDecodeError, OverflowError...

Inputs are random bytes and mutations of real encoded segments and state files (bit
flips, truncations, splices of another input, duplicated, overwritten, deleted and
inserted ranges), twice over: raw (mostly caught by the checksums) and re-sealed, with the
mutation applied behind the checksum (an update record's Arrow IPC payload or a frontier
payload re-framed with a valid CRC32C; a state's JSON body mutated and re-checksummed) so
the decoders behind the checksums are fuzzed too.

10,900 examples in all, with fixed seeds (``LAMINA_FUZZ_SEED`` changes them) and no
example database, so CI runs are repeatable. relation.json, the third file a reader
decodes, is fuzzed too.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from lamina.errors import CorruptionError, LaminaError
from lamina.frontier import CLOSED
from lamina.fs import crc32c
from lamina.schema import RelationMeta
from lamina.trace.batch import BatchDesc, PartFile
from lamina.trace.state import PendingPart, TraceState, decode_state, encode_state
from lamina.wal.reader import updates_of
from lamina.wal.record import RecordType, encode_frontier, encode_updates, frame
from lamina.wal.segment import encode_header, opening_records, scan_buffer

SEED = int(os.environ.get("LAMINA_FUZZ_SEED", "20261121"))
FUZZ = settings(deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string()), ("price", pa.decimal128(10, 2)),
                    ("at", pa.timestamp("us", tz="UTC")), ("score", pa.float64())])
META = RelationMeta.new("fuzz", SCHEMA, ["id"])
SEGMENT = Path("/fuzz/wal/fuzz/0000000000000003.wal")
STATE = Path("/fuzz/trace/fuzz/state/00000000000000000007.json")


# --- the corpus: real encodings ------------------------------------------------------------------

def _updates(n: int, start: int) -> pa.Table:
    return pa.Table.from_pydict({
        "id": [start + i for i in range(n)],
        "name": [None if i % 5 == 0 else f"név-{i}" * (i % 3) for i in range(n)],
        "price": [Decimal(f"{i}.{i % 100:02d}") for i in range(n)],
        "at": [1_700_000_000_000_000 + i for i in range(n)],
        "score": [math.nan if i % 7 == 0 else i / 3 for i in range(n)],
        "_time": pa.array([10 + i % 4 for i in range(n)], pa.uint64()),
        "_diff": pa.array([1 - 2 * (i % 2) for i in range(n)], pa.int64()),
    }, schema=META.update_schema)


def _segment(*tables: pa.Table, finished: bool = True) -> bytes:
    body = encode_header("fuzz", 3) + opening_records(10, 4)
    for t in tables:
        body += frame(RecordType.UPDATES, encode_updates(t))
        body += frame(RecordType.SINCE, encode_frontier(6))
    if finished:
        body += frame(RecordType.PROGRESS, encode_frontier(14))
    return body


SEGMENTS = [
    _segment(_updates(3, 0)),
    _segment(_updates(1, 0), _updates(40, 100)),
    _segment(pa.concat_tables([_updates(5, 0), _updates(5, 5)]), finished=False),
    encode_header("fuzz", 3) + opening_records(0, 0) + frame(RecordType.PROGRESS,
                                                             encode_frontier(CLOSED)),
]


def _state() -> bytes:
    part = PartFile("batches/b0123456789abcdef/part-00000.parquet", rows=12, bytes=3456,
                    crc32c=0xDEADBEEF)
    batches = tuple(BatchDesc(id=f"b{i:016x}", lower=10 * i, upper=10 * i + 10, since=5,
                              level=2 - min(i, 2),
                              parts=(PartFile(f"batches/b{i:016x}/part-{j:05d}.parquet",
                                              rows=10 + j, bytes=1000 + j, crc32c=j),
                                     ) * 1 + ((part,) if i == 0 and j == 0 else ()))
                    for i in range(3) for j in range(1))
    pending = (PendingPart(32, 64, PartFile("pending/p0123456789abcdef.parquet", 3, 900, 7)),)
    return encode_state(TraceState(version=7, relation="fuzz", relation_id="ab" * 8, upper=30,
                                   since=5, converted_through=9, batches=batches,
                                   pending=pending))


STATES = [_state(), encode_state(TraceState(version=7, relation="fuzz", relation_id="00"))]


# --- mutations -----------------------------------------------------------------------------------
#
# Hypothesis draws each example's seed; plain Python applies the edits it picks. An example
# then costs a few draws instead of dozens (which is what fits 10,000 of them into the time
# budget), and a failure is reported with its input bytes and replays from its seed.

EDITS = ("flip", "flip", "truncate", "splice", "duplicate", "overwrite", "delete", "insert",
         "byte")


def mutate(rng: random.Random, data: bytes, corpus: list[bytes], steps: int) -> bytes:
    """``data`` changed by ``steps`` random edits (splices take bytes from ``corpus``)."""
    buf = bytearray(data)
    for _ in range(steps):
        n = len(buf)
        at = rng.randint(0, n)
        end = rng.randint(at, min(n, at + 64))
        kind = rng.choice(EDITS)
        if kind == "flip" and n:
            buf[min(at, n - 1)] ^= 1 << rng.randrange(8)
        elif kind == "truncate":
            del buf[at:]
        elif kind == "splice":
            other = rng.choice(corpus)
            o = rng.randint(0, len(other))
            buf[at:end] = other[o:o + rng.randint(0, 128)]
        elif kind == "duplicate":
            buf[end:end] = buf[at:end]
        elif kind == "overwrite":
            buf[at:end] = rng.randbytes(end - at)
        elif kind == "delete":
            del buf[at:end]
        elif kind == "insert":
            buf[at:at] = rng.randbytes(rng.randint(0, 16))
        elif n:
            buf[min(at, n - 1)] = rng.choice([0x00, 0x01, 0x02, 0x03, 0x7F, 0x80, 0xFF])
    return bytes(buf)


seeds = st.integers(0, 2**64 - 1).map(random.Random)


@st.composite
def mutations(draw: st.DrawFn, corpus: list[bytes], max_steps: int = 4) -> bytes:
    """A corpus entry changed by 1..max_steps random edits, or (one in ten) random bytes."""
    rng = draw(seeds)
    if rng.random() < 0.1:
        return rng.randbytes(rng.randint(0, 512))
    return mutate(rng, rng.choice(corpus), corpus, rng.randint(1, max_steps))


def _records(segment: bytes) -> tuple[bytes, list[tuple[RecordType, bytes]]]:
    """A valid corpus segment split into its header and its records."""
    scan = scan_buffer(memoryview(segment), SEGMENT, finished=False)
    header = segment[:scan.records[0].offset]
    return header, [(r.rtype, bytes(r.payload)) for r in scan.records]


@st.composite
def resealed_segments(draw: st.DrawFn) -> bytes:
    """A corpus segment with one record's payload mutated and framed again with a valid
    checksum, so the payload's decoder (Arrow IPC, frontier) sees the damage."""
    rng = draw(seeds)
    header, records = _records(rng.choice(SEGMENTS))
    updates = [j for j, (t, _) in enumerate(records) if t is RecordType.UPDATES]
    i = rng.choice(updates) if updates and rng.random() < 0.7 else rng.randrange(len(records))
    rtype, payload = records[i]
    if rng.random() < 0.1:
        rtype = rng.choice(list(RecordType))
    records[i] = (rtype, mutate(rng, payload, [payload], rng.randint(1, 3)))
    return header + b"".join(frame(t, p) for t, p in records)


SPECIAL: list[object] = [math.inf, -math.inf, math.nan, 2**64, 2**63, -1, 10**40, 1.5, "7", "",
                         [], {}, None, True, "part-00000.parquet"]
"""Values a careless loader trips over: non-finite floats, out-of-range integers, numbers
as strings, empty containers."""


def random_json(rng: random.Random, depth: int = 2) -> object:
    """A random JSON value, often one of SPECIAL."""
    roll = rng.random()
    if roll < 0.4:
        return rng.choice(SPECIAL)
    if roll < 0.55:
        return rng.randint(-(2**70), 2**70)
    if roll < 0.65:
        return rng.uniform(-1e300, 1e300)
    if roll < 0.75:
        return "".join(rng.choice("az09 _-./\u00e9\u2603\"") for _ in range(rng.randint(0, 8)))
    if depth and roll < 0.88:
        return [random_json(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    if depth:
        return {rng.choice(["id", "path", "rows", "x", ""]): random_json(rng, depth - 1)
                for _ in range(rng.randint(0, 3))}
    return None


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def resealed_states(draw: st.DrawFn) -> bytes:
    """A corpus state whose JSON body has nodes replaced, deleted or nested, then is
    checksummed again, so the loader's field checks see the damage."""
    rng = draw(seeds)
    body = json.loads(rng.choice(STATES))["state"]
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in _paths(body) if p]
        if not paths:
            break
        path = rng.choice(paths)
        parent = body
        for k in path[:-1]:
            parent = parent[k]
        action = rng.choice(["replace", "replace", "delete", "nest"])
        if action == "delete":
            del parent[path[-1]]
        elif action == "nest":
            parent[path[-1]] = [parent[path[-1]]] if rng.random() < 0.5 else {
                "x": parent[path[-1]]}
        else:
            parent[path[-1]] = random_json(rng)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    doc = {"checksum": crc32c(canonical), "state": body}
    return json.dumps(doc, sort_keys=True, indent=1).encode()


# --- the properties ------------------------------------------------------------------------------

def _scan_all(data: bytes, *, finished: bool, relation: str | None, seq: int | None) -> None:
    """Scan and decode everything; only CorruptionError naming the file may escape, and
    whatever decodes is a valid Arrow table."""
    error: LaminaError | None = None
    try:
        scan = scan_buffer(memoryview(data), SEGMENT, finished=finished, relation=relation,
                           seq=seq)
        for table in updates_of(scan, META.update_schema):
            table.validate(full=True)
    except LaminaError as exc:
        error = exc
    assert error is None or (isinstance(error, CorruptionError) and error.path == SEGMENT)


def _load(data: bytes) -> None:
    error: LaminaError | None = None
    try:
        decode_state(data, STATE)
    except LaminaError as exc:
        error = exc
    assert error is None or (isinstance(error, CorruptionError) and error.path == STATE)


def test_relation_json_loader_on_mutated_files() -> None:
    """relation.json (no checksum of its own: every field is checked as it is parsed),
    raw and with JSON fields replaced: typed errors only."""
    good = META.to_json()

    @seed(SEED + 4)
    @settings(FUZZ, max_examples=600)
    @given(data=mutations([good]), rng=seeds, raw=st.booleans())
    def run(data: bytes, rng: random.Random, raw: bool) -> None:
        if not raw:
            doc = json.loads(good)
            doc[rng.choice(["format_version", "name", "schema", "key", "relation_id"])] = (
                random_json(rng))
            data = json.dumps(doc).encode()
        with contextlib.suppress(LaminaError):
            RelationMeta.from_json(data, "relation.json")

    run()


def test_corpus_is_valid() -> None:
    """The seeds decode cleanly, so the mutations start from real encodings."""
    for seg in SEGMENTS:
        scan = scan_buffer(memoryview(seg), SEGMENT, finished=seg is not SEGMENTS[2],
                           relation="fuzz", seq=3)
        assert scan.torn_at is None
        list(updates_of(scan, META.update_schema))
    for state in STATES:
        assert decode_state(state, STATE).version == 7


@seed(SEED)
@settings(FUZZ, max_examples=3000)
@given(data=mutations(SEGMENTS), finished=st.booleans(),
       relation=st.sampled_from([None, "fuzz"]), seq=st.sampled_from([None, 3]))
def test_wal_decoder_on_mutated_segments(data: bytes, finished: bool, relation: str | None,
                                         seq: int | None) -> None:
    """Raw mutations of segments and random bytes: typed errors only."""
    _scan_all(data, finished=finished, relation=relation, seq=seq)


@seed(SEED + 1)
@settings(FUZZ, max_examples=3000)
@given(data=resealed_segments(), finished=st.booleans())
def test_wal_decoder_behind_valid_checksums(data: bytes, finished: bool) -> None:
    """Mutated payloads under valid CRCs reach the Arrow IPC and frontier decoders: typed
    errors only, and whatever decodes is a valid Arrow table of the relation's schema."""
    _scan_all(data, finished=finished, relation="fuzz", seq=3)


@seed(SEED + 2)
@settings(FUZZ, max_examples=2200)
@given(data=mutations(STATES))
def test_state_loader_on_mutated_states(data: bytes) -> None:
    """Raw mutations of state files and random bytes: typed errors only."""
    _load(data)


@seed(SEED + 3)
@settings(FUZZ, max_examples=2100)
@given(data=resealed_states())
def test_state_loader_behind_valid_checksums(data: bytes) -> None:
    """JSON bodies with replaced, deleted and nested fields under a valid checksum: typed
    errors only."""
    _load(data)
