"""The fork-safety scenario in a fresh interpreter: ``fork_child.py URL``.

Like PySpark's daemon: the parent opens the store but makes no request, forks a child that
uses it (it must build its own client and work); the parent then uses the store itself,
and forks a second child, which must be refused at once (obstore hangs in a child forked
after its parent made requests), not hang. Prints one JSON line of what happened."""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
from multiprocessing.connection import Connection

from lamina.errors import StorageError
from lamina.objstore import ObjectStore, open_store


def child(store: ObjectStore, conn: Connection) -> None:
    try:
        store.put("from-child", b"child bytes")
        conn.send(("ok", store.get("from-child").decode()))
    except StorageError as exc:
        conn.send(("refused", str(exc)))
    except BaseException as exc:
        conn.send(("other", repr(exc)))


def run_child(ctx: mp.context.BaseContext, store: ObjectStore) -> list[str]:
    recv, send = mp.Pipe(duplex=False)
    p = ctx.Process(target=child, args=(store, send))  # type: ignore[attr-defined]
    p.start()
    p.join(20)
    if p.is_alive():
        p.kill()
        p.join()
        return ["hung", ""]
    return list(recv.recv()) if recv.poll(1) else ["no answer", str(p.exitcode)]


def main() -> None:
    store = open_store(sys.argv[1])
    ctx = mp.get_context("fork")
    first = run_child(ctx, store)
    parent = store.get("from-child").decode()
    store.put("from-parent", b"parent bytes")
    second = run_child(ctx, store)
    print(json.dumps({"first": first, "parent": parent, "second": second}), flush=True)


if __name__ == "__main__":
    main()
