"""The conditional-put probe: passes on stores that honour a conditional create (file://
and the real S3 server), refuses one that ignores If-None-Match, and leaves no probe key."""

from __future__ import annotations

import pytest

from lamina.errors import ConfigError
from lamina.objstore import ObjectStore, check_conditional_put
from lamina.objstore.probe import PROBE_PREFIX
from lamina.testing.unreliable import UnreliableStore


def test_probe_passes_on_real_stores(store: ObjectStore) -> None:
    store.put("state/1", b"unrelated")
    check_conditional_put(store)
    assert [m.key for m in store.list()] == ["state/1"]


def test_probe_refuses_a_store_that_ignores_if_none_match(store: ObjectStore) -> None:
    ignoring = UnreliableStore(store, ignore_conditional=True)
    with pytest.raises(ConfigError, match="ignores conditional creates"):
        check_conditional_put(ignoring)
    assert store.list(PROBE_PREFIX) == []
    # What the probe protects against: two writers both "win" the same version.
    ignoring.put_if_absent("state/2", b"writer A")
    ignoring.put_if_absent("state/2", b"writer B")
    assert store.get("state/2") == b"writer B"
