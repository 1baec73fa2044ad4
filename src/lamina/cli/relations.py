"""``lamina relations``, ``lamina describe`` and ``lamina drop``: the relations of a data
directory, one in detail, and removing one (only with ``--yes``).

``relations --json`` prints an array of objects with exactly the keys of
:data:`SUMMARY_KEYS`; ``describe --json`` one object with :data:`DETAIL_KEYS` (the summary's,
the relation's id and creation time, where its trace lives, and the keys of ``lamina
status``). A frontier is an integer, ``2**64`` for the empty (closed) one; a value that
cannot be read (a damaged relation: ``lamina verify`` says what) is ``null``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any

from lamina.cli.datadir import open_store
from lamina.cli.output import count, print_table
from lamina.datadir import DataDir
from lamina.errors import ConfigError, CorruptionError
from lamina.frontier import fmt
from lamina.schema import RelationMeta
from lamina.status import KEYS as STATUS_KEYS
from lamina.status import relation_status
from lamina.wal.reader import frontiers

SUMMARY_KEYS = ("name", "key", "columns", "upper", "since")
DETAIL_KEYS = (*SUMMARY_KEYS, "relation_id", "created_at", "trace_url", "quarantine_reason",
               *(k for k in STATUS_KEYS if k not in SUMMARY_KEYS))


def _summary(layout: DataDir, name: str, meta: RelationMeta | None = None) -> dict[str, Any]:
    out: dict[str, Any] = dict.fromkeys(SUMMARY_KEYS)
    out["name"] = name
    try:
        meta = meta or layout.read_meta(name)
    except CorruptionError:
        return out
    out["key"] = list(meta.key)
    out["columns"] = [{"name": f.name, "type": str(f.type), "nullable": f.nullable}
                      for f in meta.schema]
    with contextlib.suppress(CorruptionError, FileNotFoundError):
        out["upper"], out["since"] = frontiers(layout.wal_dir(name), name)
    return out


def _frontier(v: int | None) -> str:
    return "?" if v is None else fmt(v)


def _key(key: list[str] | None) -> str:
    return "?" if key is None else ", ".join(key) or "-"


def _columns(cols: list[dict[str, Any]] | None) -> str:
    if cols is None:
        return "? (unreadable relation.json: run lamina verify)"
    return ", ".join(f"{c['name']} {c['type']}" + ("" if c["nullable"] else " not null")
                     for c in cols)


def relations(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        rows = [_summary(store.layout, name) for name in store.relations()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print_table(["name", "key", "upper", "since", "columns"],
                [[r["name"], _key(r["key"]), _frontier(r["upper"]), _frontier(r["since"]),
                  _columns(r["columns"])]
                 for r in rows])
    return 0


def describe(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        layout = store.layout
        meta = layout.read_meta(args.relation)  # RelationNotFoundError names the others
        doc = _summary(layout, args.relation, meta)
        doc.update(relation_id=meta.relation_id, created_at=meta.created_at,
                   trace_url=layout.trace_url(),
                   quarantine_reason=layout.quarantine_reason(args.relation))
        status = relation_status(layout, args.relation)
        doc.update((k, v) for k, v in status.items() if k not in SUMMARY_KEYS)
    doc = {k: doc[k] for k in DETAIL_KEYS}
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    levels = " ".join(f"L{k}:{n}" for k, n in doc["batches_by_level"].items()) or "none"
    lines = [
        ("relation", doc["name"]),
        ("id", f"{doc['relation_id']} (created {doc['created_at']})"),
        ("key", _key(doc["key"])),
        ("columns", _columns(doc["columns"])),
        ("upper", _frontier(doc["upper"])),
        ("since", _frontier(doc["since"])),
        ("trace", f"{doc['trace_url']}: upper {_frontier(doc['trace_upper'])}, batches "
                  f"{levels}, {count(doc['trace_bytes'] or 0, 'bytes')}"),
        ("wal backlog", f"{doc['wal_segments_pending']} finished segments, "
                        f"{count(doc['wal_bytes_pending'] or 0, 'bytes')} not yet converted"),
        ("quarantined", f"yes: {doc['quarantine_reason']}" if doc["quarantine_reason"]
         else "yes (unreadable files: run lamina verify)" if doc["quarantined"] else "no"),
    ]
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"{k.ljust(width)}  {v}")
    return 0


def drop(args: argparse.Namespace) -> int:
    if not args.yes:
        raise ConfigError(f"'lamina drop {args.relation}' deletes relation "
                          f"{args.relation!r} and every update in it for good; nothing was "
                          "dropped: run it again with --yes to confirm")
    with open_store(args, write=True) as store:
        store.drop_relation(args.relation)
        where = store.layout.root
    print(f"dropped relation {args.relation!r} from {where}; the compacter removes its "
          "trace")
    return 0
