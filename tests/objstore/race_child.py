"""A writer process of the put_if_absent race: ``race_child.py URL KEY PAYLOAD GO_FILE``.

Opens the store (S3 settings from the environment), waits until GO_FILE exists (so every
racer starts together), tries ``put_if_absent(KEY, PAYLOAD)`` and prints ``won`` or
``lost``."""

from __future__ import annotations

import os
import sys
import time

from lamina.errors import ObjectExistsError
from lamina.objstore import open_store


def main() -> None:
    url, key, payload, go = sys.argv[1:5]
    store = open_store(url)
    deadline = time.monotonic() + 30
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            sys.exit("the race never started")
        time.sleep(0.001)
    try:
        store.put_if_absent(key, payload.encode())
    except ObjectExistsError:
        print("lost", flush=True)
    else:
        print("won", flush=True)


if __name__ == "__main__":
    main()
