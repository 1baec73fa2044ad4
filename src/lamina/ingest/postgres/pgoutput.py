"""A decoder of PostgreSQL's ``pgoutput`` logical replication protocol, version 1.

Pure functions over the bytes of one ``XLogData`` payload (what psycopg2's
``ReplicationMessage.payload`` holds with ``decode=False``); every message becomes a frozen
dataclass. Malformed bytes raise :class:`lamina.errors.SourceProtocolError` naming the message
type and the byte offset, never ``IndexError`` or ``struct.error``. The streaming hot path
reads the messages every transaction has without dataclasses: :func:`decode_fast` (Begin,
Commit, and the header of Insert / Update / Delete, whose tuples
:mod:`lamina.ingest.postgres.rows` decodes column-wise), answering None for anything it
does not expect, which :func:`decode` then names.

Byte layout (big-endian; ``Int8/16/32/64`` signed as the server writes them, ``String`` is
UTF-8 bytes ended by a NUL; LSNs are ``Int64``, timestamps ``Int64`` microseconds since
2000-01-01 00:00:00 UTC)::

    Begin     'B'  Int64 final_lsn (the commit record's LSN)  Int64 commit_time  Int32 xid
    Commit    'C'  Int8 flags (0)  Int64 commit_lsn  Int64 end_lsn  Int64 commit_time
    Origin    'O'  Int64 origin commit_lsn  String origin name
    Relation  'R'  Int32 relation oid  String namespace  String name
                   Int8 replica identity ('d' default, 'n' nothing, 'f' full, 'i' index)
                   Int16 ncolumns, then per column:
                       Int8 flags (1 = part of the replica identity key)
                       String name  Int32 type oid  Int32 type modifier (atttypmod)
    Type      'Y'  Int32 type oid  String namespace  String name
    Insert    'I'  Int32 relation oid  Byte1 'N'  TupleData (the new row)
    Update    'U'  Int32 relation oid
                   [Byte1 'K' TupleData (old key) | Byte1 'O' TupleData (old row)]  optional
                   Byte1 'N'  TupleData (the new row)
    Delete    'D'  Int32 relation oid  Byte1 'K' | 'O'  TupleData (old key or old row)
    Truncate  'T'  Int32 nrelations  Int8 options (1 CASCADE, 2 RESTART IDENTITY)
                   Int32 relation oid * nrelations
    Message   'M'  Int8 flags (1 = transactional)  Int64 lsn  String prefix
                   Int32 length  Byte[length] content

    TupleData      Int16 ncolumns, then per column one of:
                   Byte1 'n'                         NULL
                   Byte1 'u'                         unchanged TOASTed value (not sent)
                   Byte1 't'  Int32 len  Byte[len]   the value in the type's text format
                   Byte1 'b'  Int32 len  Byte[len]   binary format (only with ``binary``)

Protocol 2 and later add a transaction id to the messages of streamed (in-progress)
transactions and stream messages (``S``, ``E``, ``c``, ``A``); version 1, which lamina asks
for, has neither, and they are refused here.

A message ends exactly where its layout ends: trailing bytes are an error too, because they
mean the layout assumed here is not the one the server wrote.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

from lamina.errors import SourceProtocolError

__all__ = [
    "CHANGE_OID",
    "CHANGE_TAGS",
    "PG_EPOCH",
    "Begin",
    "Column",
    "Commit",
    "Delete",
    "Insert",
    "Message",
    "Origin",
    "PgMessage",
    "Relation",
    "Truncate",
    "TupleData",
    "Type",
    "Unchanged",
    "Update",
    "decode",
    "decode_fast",
    "format_lsn",
    "parse_lsn",
    "pg_time",
]

PG_EPOCH: Final = datetime(2000, 1, 1, tzinfo=UTC)
"""PostgreSQL timestamps count microseconds from here."""


class _UnchangedToast:
    """The marker of a TOASTed value the server did not send because it did not change."""

    _instance: _UnchangedToast | None = None

    def __new__(cls) -> _UnchangedToast:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "Unchanged"

    def __reduce__(self) -> str:
        return "Unchanged"


Unchanged: Final = _UnchangedToast()
"""A :class:`TupleData` value: an unchanged TOASTed value; take it from the old row."""

Value = str | bytes | None | _UnchangedToast
"""One column of a :class:`TupleData`: text (``str``), binary (``bytes``), NULL, or
:data:`Unchanged`."""


@dataclass(frozen=True)
class TupleData:
    """One row: a value per column, in the relation's column order."""

    values: tuple[Value, ...]


@dataclass(frozen=True)
class Begin:
    final_lsn: int
    commit_time: int
    xid: int


@dataclass(frozen=True)
class Commit:
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time: int


@dataclass(frozen=True)
class Origin:
    commit_lsn: int
    name: str


@dataclass(frozen=True)
class Column:
    flags: int
    name: str
    type_oid: int
    type_modifier: int

    @property
    def is_key(self) -> bool:
        return bool(self.flags & 1)


@dataclass(frozen=True)
class Relation:
    oid: int
    namespace: str
    name: str
    replica_identity: str
    columns: tuple[Column, ...]

    @property
    def qualified_name(self) -> str:
        return f"{self.namespace}.{self.name}"


@dataclass(frozen=True)
class Type:
    oid: int
    namespace: str
    name: str


@dataclass(frozen=True)
class Insert:
    relation_oid: int
    new: TupleData


@dataclass(frozen=True)
class Update:
    relation_oid: int
    old: TupleData | None
    """The old row ('O', with ``REPLICA IDENTITY FULL``) or old key ('K'), if sent."""
    old_kind: str | None
    """``"O"``, ``"K"`` or ``None``."""
    new: TupleData


@dataclass(frozen=True)
class Delete:
    relation_oid: int
    old: TupleData
    old_kind: str
    """``"O"`` (the whole old row) or ``"K"`` (only the key columns are non-NULL)."""


@dataclass(frozen=True)
class Truncate:
    options: int
    relation_oids: tuple[int, ...]

    @property
    def cascade(self) -> bool:
        return bool(self.options & 1)

    @property
    def restart_identity(self) -> bool:
        return bool(self.options & 2)


@dataclass(frozen=True)
class Message:
    flags: int
    lsn: int
    prefix: str
    content: bytes

    @property
    def transactional(self) -> bool:
        return bool(self.flags & 1)


PgMessage = (Begin | Commit | Origin | Relation | Type | Insert | Update | Delete | Truncate
             | Message)

_NAMES: Final = {
    ord("B"): "Begin", ord("C"): "Commit", ord("O"): "Origin", ord("R"): "Relation",
    ord("Y"): "Type", ord("I"): "Insert", ord("U"): "Update", ord("D"): "Delete",
    ord("T"): "Truncate", ord("M"): "Message",
}
_STREAMING: Final = {ord("S"): "Stream Start", ord("E"): "Stream Stop",
                     ord("c"): "Stream Commit", ord("A"): "Stream Abort"}

_LSN_RE: Final = re.compile(r"([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})")
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_U64 = struct.Struct(">Q")


class _Reader:
    """A cursor over one message that raises :class:`SourceProtocolError` on a short read."""

    __slots__ = ("data", "kind", "lsn", "pos")

    def __init__(self, data: bytes, kind: str, lsn: int | None) -> None:
        self.data = data
        self.kind = kind
        self.lsn = lsn
        self.pos = 1

    def fail(self, what: str, at: int | None = None) -> SourceProtocolError:
        where = f" (WAL position {format_lsn(self.lsn)})" if self.lsn is not None else ""
        return SourceProtocolError(
            f"malformed pgoutput {self.kind} message{where}: {what} at byte "
            f"{self.pos if at is None else at} of {len(self.data)}; the server speaks a "
            "protocol lamina does not expect: check that the slot uses the pgoutput plugin "
            "and report the bytes (logged) if it does",
            message_type=self.kind, offset=self.pos if at is None else at)

    def take(self, n: int, what: str) -> bytes:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise self.fail(f"{what} needs {n} bytes, {len(self.data) - self.pos} left")
        out = self.data[self.pos:end]
        self.pos = end
        return out

    def byte(self, what: str) -> int:
        if self.pos >= len(self.data):
            raise self.fail(f"{what} needs 1 byte, none left")
        b = self.data[self.pos]
        self.pos += 1
        return b

    def i16(self, what: str) -> int:
        v: int = _I16.unpack(self.take(2, what))[0]
        return v

    def i32(self, what: str) -> int:
        v: int = _I32.unpack(self.take(4, what))[0]
        return v

    def u32(self, what: str) -> int:
        v: int = _U32.unpack(self.take(4, what))[0]
        return v

    def i64(self, what: str) -> int:
        v: int = _I64.unpack(self.take(8, what))[0]
        return v

    def lsn64(self, what: str) -> int:
        v: int = _U64.unpack(self.take(8, what))[0]
        return v

    def string(self, what: str) -> str:
        end = self.data.find(b"\x00", self.pos)
        if end < 0:
            raise self.fail(f"{what} has no terminating NUL")
        raw = self.data[self.pos:end]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not UTF-8 ({e.reason})", self.pos + e.start) from None
        self.pos = end + 1
        return text

    def tuple_data(self, what: str) -> TupleData:
        """One TupleData: a fast path for well-formed text tuples; anything unusual (a
        binary value, a short read, bad UTF-8) is decoded again by the checked path,
        which names what is wrong."""
        data = self.data
        pos = self.pos
        size = len(data)
        values: list[Value] = []
        append = values.append
        try:
            ncols: int = _I16.unpack_from(data, pos)[0]
            pos += 2
            if ncols < 0:
                return self._tuple_data_checked(what)
            for _ in range(ncols):
                kind = data[pos]
                pos += 1
                if kind == 0x74:  # 't'
                    length: int = _I32.unpack_from(data, pos)[0]
                    pos += 4
                    end = pos + length
                    if length < 0 or end > size:
                        return self._tuple_data_checked(what)
                    append(data[pos:end].decode("utf-8"))
                    pos = end
                elif kind == 0x6E:  # 'n'
                    append(None)
                elif kind == 0x75:  # 'u'
                    append(Unchanged)
                else:
                    return self._tuple_data_checked(what)
        except (IndexError, struct.error, UnicodeDecodeError):
            return self._tuple_data_checked(what)
        self.pos = pos
        return TupleData(tuple(values))

    def _tuple_data_checked(self, what: str) -> TupleData:
        n = self.i16(f"{what} column count")
        if n < 0:
            raise self.fail(f"{what} column count {n} is negative", self.pos - 2)
        values: list[Value] = []
        for i in range(n):
            kind = self.byte(f"{what} column {i} kind")
            if kind == 0x6E:  # 'n'
                values.append(None)
            elif kind == 0x75:  # 'u'
                values.append(Unchanged)
            elif kind in (0x74, 0x62):  # 't', 'b'
                length = self.i32(f"{what} column {i} length")
                if length < 0:
                    raise self.fail(f"{what} column {i} length {length} is negative",
                                    self.pos - 4)
                raw = self.take(length, f"{what} column {i} value")
                if kind == 0x62:
                    values.append(raw)
                else:
                    try:
                        values.append(raw.decode("utf-8"))
                    except UnicodeDecodeError as e:
                        raise self.fail(f"{what} column {i} text is not UTF-8 ({e.reason}); "
                                        "the database encoding must be UTF8",
                                        self.pos - length + e.start) from None
            else:
                raise self.fail(f"{what} column {i} has unknown kind byte {kind:#04x}",
                                self.pos - 1)
        return TupleData(tuple(values))

    def end(self) -> None:
        if self.pos != len(self.data):
            raise self.fail(f"{len(self.data) - self.pos} trailing bytes after the message")


_BEGIN: Final = struct.Struct(">QqI")
_COMMIT: Final = struct.Struct(">BQQq")

CHANGE_TAGS: Final = frozenset(b"IUD")
"""The type bytes of Insert, Update and Delete: an Int32 relation oid at byte 1
(:data:`CHANGE_OID`), then the tuple marker at byte 5, then the tuples (``N`` new tuple;
``O`` old row or ``K`` old key first, for Update and Delete)."""
CHANGE_OID: Final = struct.Struct(">I")


def decode_fast(data: bytes) -> tuple[int, int, int] | None:
    """The messages every transaction has, as three ints rather than a dataclass (the
    streaming hot path), when they are well formed:

    - ``(ord("B"), final_lsn, commit_time)``, ``(ord("C"), commit_lsn, end_lsn)``;
    - ``(ord("I") | ord("U") | ord("D"), relation_oid, marker)``: ``marker`` is the byte
      after the oid (``N`` a new tuple follows, ``O`` the old row, ``K`` the old key); the
      tuples stay in the message (:mod:`lamina.ingest.postgres.rows` decodes them, column
      by column across many messages).

    None for any other message, and for a Begin or Commit of another length or with
    flags: :func:`decode` then gives the message or the error."""
    tag = data[0]
    size = len(data)
    if tag == 0x42:  # B
        if size != 21:
            return None
        lsn, when, _ = _BEGIN.unpack_from(data, 1)
        return tag, lsn, when
    if tag == 0x43:  # C
        if size != 26:
            return None
        flags, commit, end, _ = _COMMIT.unpack_from(data, 1)
        return (tag, commit, end) if flags == 0 else None
    if tag in CHANGE_TAGS and size >= 8:  # oid, marker, a column count
        return tag, CHANGE_OID.unpack_from(data, 1)[0], data[5]
    return None


def decode(data: bytes, *, lsn: int | None = None) -> PgMessage:
    """Decode one pgoutput (protocol 1) message; ``lsn`` only enriches error messages."""
    data = bytes(data)
    if not data:
        raise SourceProtocolError("empty pgoutput message: the server sent no type byte",
                                  message_type="?", offset=0)
    tag = data[0]
    if tag in _STREAMING:
        raise SourceProtocolError(
            f"pgoutput sent a {_STREAMING[tag]} message, which exists only in protocol 2 "
            "and later; lamina asks for proto_version '1' and must not see it",
            message_type=_STREAMING[tag], offset=0)
    if tag not in _NAMES:
        raise SourceProtocolError(
            f"unknown pgoutput message type byte {tag:#04x}: the slot is not a pgoutput "
            "protocol 1 stream; recreate the slot with the pgoutput plugin",
            message_type=f"{tag:#04x}", offset=0)
    r = _Reader(data, _NAMES[tag], lsn)
    msg: PgMessage
    if tag == 0x42:  # B
        msg = Begin(r.lsn64("final_lsn"), r.i64("commit_time"), r.u32("xid"))
    elif tag == 0x43:  # C
        msg = Commit(r.byte("flags"), r.lsn64("commit_lsn"), r.lsn64("end_lsn"),
                     r.i64("commit_time"))
    elif tag == 0x4F:  # O
        msg = Origin(r.lsn64("commit_lsn"), r.string("origin name"))
    elif tag == 0x52:  # R
        oid = r.u32("relation oid")
        ns = r.string("namespace")
        name = r.string("relation name")
        ident = chr(r.byte("replica identity"))
        n = r.i16("column count")
        if n < 0:
            raise r.fail(f"column count {n} is negative", r.pos - 2)
        cols = []
        for i in range(n):
            cols.append(Column(r.byte(f"column {i} flags"), r.string(f"column {i} name"),
                               r.u32(f"column {i} type oid"), r.i32(f"column {i} typmod")))
        msg = Relation(oid, ns, name, ident, tuple(cols))
    elif tag == 0x59:  # Y
        msg = Type(r.u32("type oid"), r.string("namespace"), r.string("type name"))
    elif tag == 0x49:  # I
        oid = r.u32("relation oid")
        marker = r.byte("new tuple marker")
        if marker != 0x4E:
            raise r.fail(f"expected 'N' before the new tuple, found {marker:#04x}", r.pos - 1)
        msg = Insert(oid, r.tuple_data("new tuple"))
    elif tag == 0x55:  # U
        oid = r.u32("relation oid")
        marker = r.byte("tuple marker")
        old: TupleData | None = None
        old_kind: str | None = None
        if marker in (0x4B, 0x4F):
            old_kind = chr(marker)
            old = r.tuple_data("old tuple")
            marker = r.byte("new tuple marker")
        if marker != 0x4E:
            raise r.fail(f"expected 'K', 'O' or 'N' tuple marker, found {marker:#04x}",
                         r.pos - 1)
        msg = Update(oid, old, old_kind, r.tuple_data("new tuple"))
    elif tag == 0x44:  # D
        oid = r.u32("relation oid")
        marker = r.byte("old tuple marker")
        if marker not in (0x4B, 0x4F):
            raise r.fail(f"expected 'K' or 'O' before the old tuple, found {marker:#04x}",
                         r.pos - 1)
        msg = Delete(oid, r.tuple_data("old tuple"), chr(marker))
    elif tag == 0x54:  # T
        n = r.i32("relation count")
        if n < 0:
            raise r.fail(f"relation count {n} is negative", r.pos - 4)
        options = r.byte("options")
        if n * 4 > len(data) - r.pos:
            raise r.fail(f"{n} relation oids need {n * 4} bytes, {len(data) - r.pos} left")
        msg = Truncate(options, tuple(r.u32(f"relation oid {i}") for i in range(n)))
    else:  # M
        flags = r.byte("flags")
        at = r.lsn64("lsn")
        prefix = r.string("prefix")
        length = r.i32("content length")
        msg = Message(flags, at, prefix, r.take(length, "content"))
    r.end()
    return msg


def pg_time(micros: int) -> datetime:
    """A pgoutput timestamp (microseconds since 2000-01-01 UTC) as an aware datetime."""
    return PG_EPOCH + timedelta(microseconds=micros)


def format_lsn(lsn: int) -> str:
    """An LSN as PostgreSQL writes it: ``16/B374D848``."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    """The inverse of :func:`format_lsn` (raises ``ValueError`` on anything else)."""
    m = _LSN_RE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"not an LSN: {text!r} (expected hex 'X/Y', e.g. '16/B374D848')")
    hi, lo = m.groups()
    return (int(hi, 16) << 32) | int(lo, 16)
