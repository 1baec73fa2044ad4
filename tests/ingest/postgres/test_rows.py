"""Change messages decoded column by column across many of them (numpy) give exactly what
decoding them one by one gives; what the vectorised walk does not expect falls back to
the per-message decoder, which names the problem."""

from __future__ import annotations

import struct

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lamina.errors import SourceStalledError
from lamina.ingest.postgres import rows

WIDTH = 3
Value = str | None | bytes   # bytes: an unchanged TOAST marker in these tests


def tuple_data(values: list[Value]) -> bytes:
    out = struct.pack(">h", len(values))
    for v in values:
        if v is None:
            out += b"n"
        elif v == b"u":
            out += b"u"
        else:
            raw = v.encode() if isinstance(v, str) else v
            out += b"t" + struct.pack(">i", len(raw)) + raw
    return out


def message(kind: str, old: list[Value] | None, new: list[Value] | None) -> bytes:
    head = kind.encode() + struct.pack(">I", 16384)
    if kind == "I":
        return head + b"N" + tuple_data(new or [])
    if kind == "D":
        return head + b"O" + tuple_data(old or [])
    return head + b"O" + tuple_data(old or []) + b"N" + tuple_data(new or [])


text = st.one_of(st.none(), st.text(max_size=12))
row = st.lists(text, min_size=WIDTH, max_size=WIDTH)
change = st.one_of(
    st.tuples(st.just("I"), st.none(), row),
    st.tuples(st.just("D"), row, st.none()),
    st.tuples(st.just("U"), row,
              st.lists(st.one_of(text, st.just(b"u")), min_size=WIDTH, max_size=WIDTH)))


@settings(max_examples=200, deadline=None)
@given(st.lists(change, max_size=40))
def test_vectorised_equals_one_by_one(changes: list[tuple[str, list[Value] | None,
                                                          list[Value] | None]]) -> None:
    msgs = [message(k, o, n) for k, o, n in changes]
    fast = rows._vectorised(msgs, WIDTH)
    assert fast is not None
    slow = rows._one_by_one(msgs, WIDTH, "public.t")
    assert [c.to_pylist() for c in fast[0]] == [c.to_pylist() for c in slow[0]]
    assert fast[1].to_pylist() == slow[1].to_pylist()
    # an update's unchanged TOAST value is the old row's
    for (k, old, new), got in zip(changes, _new_rows(changes, fast), strict=True):
        if k == "U":
            assert old is not None
            assert new is not None
            assert got == [o if v == b"u" else v for v, o in zip(new, old, strict=True)]


def _new_rows(changes: list[tuple[str, list[Value] | None, list[Value] | None]],
              got: tuple[list[pa.Array], pa.Array]) -> list[list[Value] | None]:
    cols = [c.to_pylist() for c in got[0]]
    out: list[list[Value] | None] = []
    i = 0
    for k, _, _ in changes:
        i += k != "I"                 # the old row comes first
        if k == "D":
            out.append(None)
            continue
        out.append([cols[c][i] for c in range(WIDTH)])
        i += 1
    return out


@pytest.mark.parametrize(("msg", "why"), [
    (message("I", None, ["1", "2"]), "has 2 columns"),                  # another width
    (message("I", None, ["1", b"u", "3"]), "unchanged TOAST"),           # nothing to take
    (message("I", None, ["1", "2", "3"]).replace(b"t\x00\x00\x00\x013", b"b\x00\x00\x00\x013"),
     "binary"),
])
def test_what_the_walk_does_not_expect_is_named(msg: bytes, why: str) -> None:
    good = message("I", None, ["a", "b", "c"])
    assert rows._vectorised([good, msg], WIDTH) is None
    with pytest.raises(SourceStalledError, match=why):
        rows.to_columns([good, msg], WIDTH, table="public.t")


def test_invalid_utf8_is_not_taken_as_text() -> None:
    bad = message("I", None, ["a", "b", "c"]).replace(b"c", b"\xff")
    assert rows._vectorised([bad], WIDTH) is None
    with pytest.raises(SourceStalledError, match="not UTF-8"):
        rows.to_columns([bad], WIDTH, table="public.t")
