"""The start-up probe: does this store honour conditional creates?

The trace state's compare-and-set is :meth:`ObjectStore.put_if_absent`; on S3 that is a
PutObject with ``If-None-Match: *``. Some S3-compatible servers (older MinIO, Ceph RGW and
others) ignore the header and overwrite, which would let two compacters both "win" a state
version and silently lose one's work. :func:`check_conditional_put` creates a probe key,
then tries to create it again with different bytes: the second create must be refused and
the first object must be intact. Otherwise it raises :class:`~lamina.errors.ConfigError`
and lamina refuses to run on the store. The probe key is deleted either way; it lives
under ``_lamina-probe/``, outside every name of :class:`lamina.layout.TraceLayout`.
"""

from __future__ import annotations

import uuid

from lamina.errors import ConfigError, ObjectExistsError
from lamina.objstore.base import ObjectStore

PROBE_PREFIX = "_lamina-probe"


def check_conditional_put(store: ObjectStore) -> None:
    """Raise :class:`ConfigError` unless ``store`` refuses a second create of a key."""
    nonce = uuid.uuid4().hex
    key = f"{PROBE_PREFIX}/{nonce}"
    first = f"lamina conditional-put probe {nonce} first".encode()
    second = f"lamina conditional-put probe {nonce} second".encode()
    try:
        store.put_if_absent(key, first)
        try:
            store.put_if_absent(key, second)
        except ObjectExistsError:
            kept = store.get(key)
            if kept != first:
                raise ConfigError(
                    f"{store.url} refused a second conditional create but replaced the "
                    "object anyway; its conditional puts cannot serve as the trace "
                    "state's compare-and-set (use a store that honours If-None-Match)"
                    ) from None
            return
        raise ConfigError(
            f"{store.url} ignores conditional creates (If-None-Match: *): a second create "
            "of the same key succeeded, so two compacters could both publish the same "
            "trace state version; lamina refuses to run on it (upgrade the server, or use "
            "AWS S3 or another store that honours If-None-Match)")
    finally:
        store.delete(key)
