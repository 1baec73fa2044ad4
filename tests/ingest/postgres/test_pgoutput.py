"""The pgoutput decoder: bytes captured from a real PostgreSQL 15, live captures, fuzzing."""

from __future__ import annotations

import contextlib
import random
import select
import string
import time
from datetime import UTC, datetime

import psycopg2
import psycopg2.extras
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lamina.errors import SourceProtocolError
from lamina.ingest.postgres import pgoutput as po
from tests.ingest.postgres.server import PgServer

# Captured from PostgreSQL 15 (CREATE TABLE t (id int primary key, v text, n numeric(10,2))
# with REPLICA IDENTITY FULL; INSERT two rows, UPDATE one, DELETE one in one transaction,
# then TRUNCATE t, then pg_logical_emit_message(true, 'pfx', 'hello')).
BEGIN = b"B\x00\x00\x00\x00\x01\x92M0\x00\x03\x03\xfa\xa1\xd4\xf6\xbe\x00\x00\x02\xd6"
RELATION = (b"R\x00\x00@\x01public\x00t\x00f\x00\x03\x01id\x00\x00\x00\x00\x17\xff\xff\xff"
            b"\xff\x01v\x00\x00\x00\x00\x19\xff\xff\xff\xff\x01n\x00\x00\x00\x06\xa4\x00\n"
            b"\x00\x06")
INSERT = b"I\x00\x00@\x01N\x00\x03t\x00\x00\x00\x011t\x00\x00\x00\x01at\x00\x00\x00\x041.50"
INSERT_NULL = b"I\x00\x00@\x01N\x00\x03t\x00\x00\x00\x012nt\x00\x00\x00\x042.00"
UPDATE = (b"U\x00\x00@\x01O\x00\x03t\x00\x00\x00\x011t\x00\x00\x00\x01at\x00\x00\x00\x041.50"
          b"N\x00\x03t\x00\x00\x00\x011t\x00\x00\x00\x01bt\x00\x00\x00\x041.50")
DELETE = b"D\x00\x00@\x01O\x00\x03t\x00\x00\x00\x012nt\x00\x00\x00\x042.00"
COMMIT = (b"C\x00\x00\x00\x00\x00\x01\x92M0\x00\x00\x00\x00\x01\x92M`\x00\x03\x03\xfa\xa1"
          b"\xd4\xf6\xbe")
TRUNCATE = b"T\x00\x00\x00\x01\x00\x00\x00@\x01"
MESSAGE = b"M\x01\x00\x00\x00\x00\x01\x92Z\x90pfx\x00\x00\x00\x00\x05hello"
CAPTURED = [BEGIN, RELATION, INSERT, INSERT_NULL, UPDATE, DELETE, COMMIT, TRUNCATE, MESSAGE]


def test_captured_messages() -> None:
    assert po.decode(BEGIN) == po.Begin(final_lsn=0x1924D30, commit_time=848799921927870,
                                        xid=726)
    assert po.pg_time(848799921927870) == datetime(2026, 11, 24, 1, 45, 21, 927870,
                                                   tzinfo=UTC)
    rel = po.decode(RELATION)
    assert rel == po.Relation(16385, "public", "t", "f", (
        po.Column(1, "id", 23, -1), po.Column(1, "v", 25, -1),
        po.Column(1, "n", 1700, (10 << 16 | 2) + 4)))
    assert isinstance(rel, po.Relation)
    assert rel.qualified_name == "public.t"
    assert po.decode(INSERT) == po.Insert(16385, po.TupleData(("1", "a", "1.50")))
    assert po.decode(INSERT_NULL) == po.Insert(16385, po.TupleData(("2", None, "2.00")))
    assert po.decode(UPDATE) == po.Update(16385, po.TupleData(("1", "a", "1.50")), "O",
                                          po.TupleData(("1", "b", "1.50")))
    assert po.decode(DELETE) == po.Delete(16385, po.TupleData(("2", None, "2.00")), "O")
    assert po.decode(COMMIT) == po.Commit(0, 0x1924D30, 0x1924D60, 848799921927870)
    trunc = po.decode(TRUNCATE)
    assert trunc == po.Truncate(0, (16385,))
    assert isinstance(trunc, po.Truncate)
    assert not trunc.cascade
    msg = po.decode(MESSAGE)
    assert msg == po.Message(1, 0x1925A90, "pfx", b"hello")
    assert isinstance(msg, po.Message)
    assert msg.transactional


def test_the_fast_path_agrees_with_decode() -> None:
    assert po.decode_fast(BEGIN) == (ord("B"), 0x1924D30, 848799921927870)
    assert po.decode_fast(COMMIT) == (ord("C"), 0x1924D30, 0x1924D60)
    assert po.decode_fast(INSERT) == (ord("I"), 16385, ord("N"))
    assert po.decode_fast(UPDATE) == (ord("U"), 16385, ord("O"))
    assert po.decode_fast(DELETE) == (ord("D"), 16385, ord("O"))
    for other in (RELATION, TRUNCATE, MESSAGE, BEGIN[:-1], COMMIT[:-1]):
        assert po.decode_fast(other) is None          # left to decode()


def test_update_without_old_tuple_and_unchanged_toast() -> None:
    data = b"U\x00\x00@\x01N\x00\x03t\x00\x00\x00\x011ut\x00\x00\x00\x012"
    assert po.decode(data) == po.Update(16385, None, None, po.TupleData(("1", po.Unchanged,
                                                                          "2")))
    key = b"D\x00\x00@\x01K\x00\x01t\x00\x00\x00\x011"
    assert po.decode(key) == po.Delete(16385, po.TupleData(("1",)), "K")
    assert repr(po.Unchanged) == "Unchanged"


@pytest.mark.parametrize("data", CAPTURED)
def test_every_truncation_is_a_named_error(data: bytes) -> None:
    for n in range(len(data)):
        with pytest.raises(SourceProtocolError, match=r"pgoutput|message") as ei:
            po.decode(data[:n])
        if n:
            assert ei.value.message_type != "?"
            assert 0 <= ei.value.offset <= n
    with pytest.raises(SourceProtocolError, match="trailing bytes"):
        po.decode(data + b"\x00")


def test_errors_name_type_and_position() -> None:
    with pytest.raises(SourceProtocolError, match=r"Insert message \(WAL position 0/10\).*"
                                                   r"unknown kind byte 0x78 at byte 8"):
        po.decode(b"I\x00\x00@\x01N\x00\x01x", lsn=16)
    with pytest.raises(SourceProtocolError, match="protocol 2"):
        po.decode(b"S\x00\x00\x00\x01\x01")
    with pytest.raises(SourceProtocolError, match="unknown pgoutput message type byte 0x5a"):
        po.decode(b"Z")


def test_lsn_text() -> None:
    assert po.format_lsn(0x16B374D848) == "16/B374D848"
    assert po.parse_lsn("16/B374D848") == 0x16B374D848
    assert po.parse_lsn("0/0") == 0
    for bad in ("", "16", "-1/0", "1/+2", "g/0", "123456789/0"):
        with pytest.raises(ValueError, match="not an LSN"):
            po.parse_lsn(bad)


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=64))
def test_fuzz_random_bytes(data: bytes) -> None:
    with contextlib.suppress(SourceProtocolError):
        po.decode(data)


@settings(max_examples=1500, deadline=None)
@given(st.sampled_from(CAPTURED), st.data())
def test_fuzz_mutated_messages(base: bytes, data: st.DataObject) -> None:
    buf = bytearray(base)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    with contextlib.suppress(SourceProtocolError):
        po.decode(bytes(buf))


def _capture(pg: PgServer, statements: list[str]) -> list[po.PgMessage]:
    rc = psycopg2.connect(pg.dsn,
                          connection_factory=psycopg2.extras.LogicalReplicationConnection)
    try:
        cur = rc.cursor()
        cur.execute("CREATE_REPLICATION_SLOT cap LOGICAL pgoutput")
        pg.execute(*statements)
        cur.start_replication(slot_name="cap", decode=False, options={
            "proto_version": "1", "publication_names": "cap", "messages": "true"})
        out: list[po.PgMessage] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = cur.read_message()
            if m is None:
                if out and isinstance(out[-1], po.Commit):
                    break
                select.select([cur], [], [], 0.2)
                continue
            out.append(po.decode(m.payload, lsn=m.data_start))
        return out
    finally:
        rc.close()


def test_live_type_origin_and_toast(pg: PgServer) -> None:
    big = "".join(random.Random(0).choices(string.ascii_letters, k=100_000))  # not compressible
    pg.execute("CREATE TYPE mood AS ENUM ('sad', 'happy')",
               "CREATE TABLE m (id int PRIMARY KEY, feel mood, doc text)",
               f"INSERT INTO m VALUES (1, 'sad', '{big}')",  # noqa: S608
               "CREATE PUBLICATION cap FOR TABLE m",
               "SELECT pg_replication_origin_create('upstream_a')")
    msgs = _capture(pg, [
        "SELECT pg_replication_origin_session_setup('upstream_a')",
        "SELECT pg_replication_origin_xact_setup('0/AB', now())",
        "UPDATE m SET feel = 'happy' WHERE id = 1",
        "SELECT pg_logical_emit_message(true, 'lamina', 'x')"])
    kinds = [type(m).__name__ for m in msgs]
    assert kinds == ["Begin", "Origin", "Type", "Relation", "Update", "Message", "Commit"]
    assert msgs[1] == po.Origin(0xAB, "upstream_a")
    typ = msgs[2]
    assert isinstance(typ, po.Type)
    assert (typ.namespace, typ.name) == ("public", "mood")
    upd = msgs[4]
    # REPLICA IDENTITY DEFAULT: no old tuple, and the TOASTed doc is not sent
    assert upd == po.Update(upd.relation_oid, None, None,  # type: ignore[union-attr]
                            po.TupleData(("1", "happy", po.Unchanged)))
