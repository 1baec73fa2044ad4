"""lamina relations, describe and drop; every command on $LAMINA_DATA_DIR."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa

from lamina import CLOSED
from lamina.cli.relations import DETAIL_KEYS, SUMMARY_KEYS
from lamina.status import KEYS as STATUS_KEYS
from lamina.store import Store
from tests.cli.procs import lamina, one_line, orders


def two_relations(root: Path) -> None:
    orders(root, rows=5)
    with Store.open(root, fsync="never") as store:
        rel = store.create_relation("events", pa.schema([("at", pa.timestamp("us")),
                                                         ("n", pa.float64())]))
        rel.seal(3)
        rel.allow_compaction(2)


def test_relations_lists_name_key_columns_frontiers(tmp_path: Path) -> None:
    two_relations(tmp_path)
    out = lamina("relations", "--json", "--data-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [tuple(r) for r in rows] == [SUMMARY_KEYS] * 2
    assert rows == [
        {"name": "events", "key": [], "columns": [
            {"name": "at", "type": "timestamp[us]", "nullable": True},
            {"name": "n", "type": "double", "nullable": True}], "upper": 3, "since": 2},
        {"name": "orders", "key": ["id"], "columns": [
            {"name": "id", "type": "int64", "nullable": True},
            {"name": "item", "type": "string", "nullable": True}], "upper": 1, "since": 0},
    ]
    table = lamina("relations", "--data-dir", str(tmp_path))
    assert table.returncode == 0
    lines = table.stdout.decode().splitlines()
    assert lines[0].split() == ["name", "key", "upper", "since", "columns"]
    assert lines[1].split()[:4] == ["events", "-", "3", "2"]
    assert lines[2].split()[:4] == ["orders", "id", "1", "0"]
    assert "item string" in lines[2]


def test_describe(tmp_path: Path) -> None:
    two_relations(tmp_path)
    with Store.open(tmp_path) as store:
        store.relation("orders").seal(CLOSED)
        relation_id = store.relation("orders").meta.relation_id
    out = lamina("describe", "orders", "--json", "--data-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert tuple(doc) == DETAIL_KEYS
    assert set(STATUS_KEYS) <= set(DETAIL_KEYS)
    assert doc["relation_id"] == relation_id
    assert doc["upper"] == CLOSED
    assert doc["key"] == ["id"]
    assert doc["trace_url"] == (tmp_path / "trace").absolute().as_uri()
    assert doc["quarantined"] is False
    assert doc["quarantine_reason"] is None
    text = lamina("describe", "orders", "--data-dir", str(tmp_path))
    assert text.returncode == 0
    assert b"upper        CLOSED" in text.stdout
    assert b"quarantined  no" in text.stdout
    missing = lamina("describe", "nope", "--data-dir", str(tmp_path))
    assert missing.returncode == 1
    assert "'nope' does not exist" in one_line(missing.stderr)
    assert "events" in one_line(missing.stderr)  # the message names the existing ones


def test_drop_needs_yes(tmp_path: Path) -> None:
    two_relations(tmp_path)
    refused = lamina("drop", "orders", "--data-dir", str(tmp_path))
    assert refused.returncode == 2
    assert "nothing was dropped" in one_line(refused.stderr)
    with Store.open(tmp_path, read_only=True) as store:
        assert store.relations() == ["events", "orders"]
    done = lamina("drop", "orders", "--yes", "--data-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert b"dropped relation 'orders'" in done.stdout
    with Store.open(tmp_path, read_only=True) as store:
        assert store.relations() == ["events"]
    again = lamina("drop", "orders", "--yes", "--data-dir", str(tmp_path))
    assert again.returncode == 1
    assert "does not exist" in one_line(again.stderr)


def test_drop_while_a_writer_holds_the_relation(tmp_path: Path) -> None:
    orders(tmp_path)
    with Store.open(tmp_path) as store:
        store.relation("orders").seal(2)  # this process now holds the writer lock
        out = lamina("drop", "orders", "--yes", "--data-dir", str(tmp_path))
        assert out.returncode == 1
        assert "orders" in one_line(out.stderr)
        assert store.relations() == ["orders"]


def test_every_command_honours_lamina_data_dir(tmp_path: Path) -> None:
    """No --data-dir: the directory comes from LAMINA_DATA_DIR (and --data-dir still wins);
    the working directory holds no data directory, so the default would fail."""
    data = tmp_path / "data"
    orders(data, rows=3)
    with Store.open(data) as store:
        store.relation("orders").seal(CLOSED)  # so that subscribe ends by itself
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {"LAMINA_DATA_DIR": str(data)}
    checks = {
        ("status", "--json"): b'"name": "orders"',
        ("relations",): b"orders",
        ("describe", "orders"): b"relation",
        ("snapshot", "orders", "--format", "jsonl"): b'"item":"item-2"',
        ("lookup", "orders", "1", "--format", "jsonl"): b'"item":"item-1"',
        ("subscribe", "orders"): b'{"_progress":18446744073709551616}',
        ("verify",): b"1 relations checked, 0 with problems",
    }
    for args, expected in checks.items():
        out = lamina(*args, env=env, cwd=cwd)
        assert out.returncode == 0, (args, out.stderr)
        assert expected in out.stdout, (args, out.stdout)
    wins = lamina("relations", "--data-dir", str(cwd), env=env, cwd=cwd)
    assert wins.returncode == 1  # --data-dir wins over the environment
    dropped = lamina("drop", "orders", "--yes", env=env, cwd=cwd)
    assert dropped.returncode == 0, dropped.stderr
    assert list(cwd.iterdir()) == []  # nothing was created where the command ran
