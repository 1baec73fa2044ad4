"""The s3:// store against a real S3 server (moto on 127.0.0.1): settings from the
environment, secrets kept out of repr, str, errors and pickles, fork safety, errors
translated at the boundary (no obstore exception escapes)."""

from __future__ import annotations

import json
import multiprocessing as mp
import pickle
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from lamina.errors import (
    ConfigError,
    LaminaError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
)
from lamina.objstore import check_conditional_put, open_store
from lamina.objstore.s3 import S3ObjectStore, S3Settings
from tests.objstore.s3server import ACCESS_KEY, SECRET_KEY, S3Server, child_env, free_port

FORK_CHILD = Path(__file__).with_name("fork_child.py")


def test_settings_from_environment(s3_bucket: str, s3_server: S3Server) -> None:
    s = S3Settings().resolved()
    assert (s.endpoint, s.access_key_id, s.secret_access_key, s.region) == (
        s3_server.endpoint, ACCESS_KEY, SECRET_KEY, "us-east-1")
    assert s.allow_http is True  # the endpoint is http://
    assert S3Settings(endpoint="https://s3.example.com").resolved().allow_http is False
    store = open_store(f"s3://{s3_bucket}/p")
    store.put("k", b"v")
    assert store.get("k") == b"v"


def test_explicit_settings_override_environment(s3_bucket: str, s3_server: S3Server,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing there
    settings = S3Settings(endpoint=s3_server.endpoint)
    store = open_store(f"s3://{s3_bucket}/p", settings)
    store.put("k", b"explicit")
    assert store.get("k") == b"explicit"


def test_secrets_never_shown(s3_bucket: str) -> None:
    secret, token = "s3cr3t-value", "t0ken-value"
    settings = S3Settings(access_key_id="AKIDEXAMPLE", secret_access_key=secret,
                          session_token=token)
    store = open_store(f"s3://{s3_bucket}/p", settings)
    for text in (repr(settings), str(settings), repr(store), str(store)):
        assert "s3cr3t-value" not in text
        assert "t0ken-value" not in text
        assert "<redacted>" in text or "S3ObjectStore" in text
    # Credentials from the environment do not travel in a pickled store; the unpickled
    # store resolves them in its own process and works.
    env_store = open_store(f"s3://{s3_bucket}/p")
    env_store.put("k", b"v")
    blob = pickle.dumps(env_store)
    assert SECRET_KEY.encode() not in blob
    assert ACCESS_KEY.encode() not in blob
    assert pickle.loads(blob).get("k") == b"v"  # noqa: S301 - our own bytes
    # An error message names the request, never the secret.
    bad = open_store(f"s3://{s3_bucket}-missing/p", S3Settings(secret_access_key=SECRET_KEY))
    with pytest.raises(StorageError) as info:
        bad.get("k")
    assert SECRET_KEY not in str(info.value)


def test_missing_bucket_is_a_storage_error_not_a_missing_object(s3_bucket: str) -> None:
    store = open_store(f"s3://{s3_bucket}-missing/p")
    for call in (lambda: store.get("k"), lambda: store.put("k", b"v"),
                 lambda: store.put_if_absent("k", b"v"), store.list,
                 lambda: store.get_range("k", 0, 3)):
        with pytest.raises(StorageError) as info:
            call()
        assert not isinstance(info.value, ObjectNotFoundError), info.value
        assert "bucket" in str(info.value)


def test_unreachable_endpoint_errors_are_translated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every operation against a port with no server fails with a lamina StorageError
    (obstore's own exceptions never escape), quickly with retries turned off."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    settings = S3Settings(endpoint=f"http://127.0.0.1:{free_port()}", max_retries=0,
                          retry_timeout_s=2, connect_timeout_s=2, timeout_s=5)
    store = open_store("s3://bucket/p", settings)
    calls: dict[str, Callable[[], object]] = {
        "get": lambda: store.get("k"), "get_range": lambda: store.get_range("k", 1, 3),
        "put": lambda: store.put("k", b"v"),
        "put_if_absent": lambda: store.put_if_absent("k", b"v"),
        "list": lambda: store.list("x"), "delete": lambda: store.delete("k"),
        "delete_prefix": lambda: store.delete_prefix("x")}
    start = time.monotonic()
    for name, call in calls.items():
        with pytest.raises(LaminaError) as info:
            call()
        assert type(info.value) is StorageError, (name, type(info.value))
        assert store.url in str(info.value), name
    assert time.monotonic() - start < 30


def _child_get(store: S3ObjectStore, conn: Connection) -> None:
    try:
        conn.send(("ok", store.get("k")))
    except StorageError as exc:
        conn.send(("refused", str(exc)))
    except BaseException as exc:
        conn.send(("other", repr(exc)))


def test_fork_after_use_is_refused_not_hung(s3_bucket: str) -> None:
    """The parent used S3; a forked child using the store gets a StorageError at once
    (obstore would hang in it forever), within the timeout."""
    store = open_store(f"s3://{s3_bucket}/p")
    store.put("k", b"v")
    recv, send = mp.Pipe(duplex=False)
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_child_get, args=(store, send))
    start = time.monotonic()
    p.start()
    p.join(20)
    alive = p.is_alive()
    if alive:
        p.kill()
        p.join()
    assert not alive, "the forked child hung"
    assert time.monotonic() - start < 20
    kind, detail = recv.recv()
    assert kind == "refused", detail
    assert "forked" in detail
    assert "spawn" in detail
    assert store.get("k") == b"v"  # the parent still works


def test_fork_before_use_child_builds_its_own_client(s3_bucket: str,
                                                     s3_server: S3Server) -> None:
    """In a fresh interpreter, like PySpark's daemon: a child forked before the parent made
    any request builds its own client and works; the parent works after it; a child forked
    after the parent's requests is refused, not hung."""
    url = f"s3://{s3_bucket}/fork"
    out = subprocess.run([sys.executable, str(FORK_CHILD), url], env=child_env(s3_server),
                         capture_output=True, timeout=90, check=True)
    result = json.loads(out.stdout.decode().strip().splitlines()[-1])
    assert result["first"] == ["ok", "child bytes"], result
    assert result["parent"] == "child bytes"
    assert result["second"][0] == "refused", result
    assert open_store(url).get("from-parent") == b"parent bytes"


def test_bad_urls_and_settings() -> None:
    for bad in ("s3://", "s3://bucket/a/../b", "s3://bucket/x?versionId=1", "s3://b/.hidden"):
        with pytest.raises(ConfigError):
            open_store(bad)


def test_real_lost_response_of_a_conditional_create(s3_bucket: str,
                                                    s3_server: S3Server) -> None:
    """Through a proxy that loses the server's answer to a conditional create: the object
    was written, and whatever obstore makes of it (its retry meets 412, or an error), the
    writer is never told it lost, ends up with its own object, and a rival still loses."""
    from tests.objstore.s3server import LossyProxy

    proxy = LossyProxy(s3_server.endpoint)
    try:
        store = open_store(f"s3://{s3_bucket}/p", S3Settings(endpoint=proxy.endpoint,
                                                             retry_timeout_s=20))
        mine = b"state 3 writer nonce 1b7c"
        proxy.lose_creates = 1
        outcomes = []
        for _attempt in range(3):
            try:
                store.put_if_absent("state/3", mine)
                outcomes.append("ok")
                break
            except StorageError as exc:
                outcomes.append(f"error: {exc}")
        assert outcomes[-1] == "ok", outcomes
        assert proxy.lost == 1
        assert store.get("state/3") == mine
        with pytest.raises(ObjectExistsError):
            store.put_if_absent("state/3", b"state 3 writer nonce 9e01")
        # obstore 0.12.1 retries the create itself: its retry meets 412 and the read-back
        # turns that into the win it was (no error ever reaches the writer).
        assert outcomes == ["ok"], outcomes
        assert proxy.creates == 3  # the lost one, obstore's retry (412), the rival's
    finally:
        proxy.close()


def test_requests_per_operation(s3_bucket: str, s3_server: S3Server) -> None:
    """The cost model of docs/object-store.md: S3 requests each operation makes."""
    from tests.objstore.s3server import LossyProxy

    proxy = LossyProxy(s3_server.endpoint)
    try:
        store = open_store(f"s3://{s3_bucket}/p", S3Settings(endpoint=proxy.endpoint))

        def count(call: Callable[[], object]) -> list[str]:
            before = len(proxy.requests)
            call()
            return [r.split(" ")[0] for r in proxy.requests[before:]]

        assert count(lambda: store.put("a/1", b"x" * 100)) == ["PUT"]
        assert count(lambda: store.put_if_absent("a/2", b"mine")) == ["PUT"]
        assert count(lambda: store.put_if_absent("a/2", b"mine")) == ["PUT", "GET"]
        assert count(lambda: store.get("a/1")) == ["GET"]
        assert count(lambda: store.get_range("a/1", 10, 20)) == ["GET"]
        assert count(lambda: store.get_range("a/1", 200, 300)) == ["GET", "HEAD"]
        assert count(lambda: store.list("a")) == ["GET"]
        assert count(lambda: store.delete("a/1")) == ["POST"]  # obstore: bulk DeleteObjects
        assert count(lambda: store.delete_prefix("a")) == ["GET", "POST"]
        assert count(lambda: check_conditional_put(store)) == ["PUT", "PUT", "GET", "GET",
                                                              "POST"]
    finally:
        proxy.close()


def test_an_s3_store_has_no_free_bytes_to_tell(s3_bucket: str) -> None:
    """A bucket has no room to run out of that the store could report: ``free_bytes`` is
    None, and a step's ``scratch_compression = "auto"`` compresses its runs there."""
    assert open_store(f"s3://{s3_bucket}/t").free_bytes("batches/x.scratch") is None
