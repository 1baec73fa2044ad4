"""``s3://bucket/prefix`` object store over ``obstore`` (Rust's ``object_store``).

How each operation keeps the :mod:`lamina.objstore.base` contract:

- ``put``: one PutObject (multipart above 5 MiB, still atomic: S3 publishes a multipart
  upload whole when it completes).
- ``create``: PutObject with ``If-None-Match: *`` (``obstore.put(..., mode="create")``, a
  single request); a 412 comes back as "already exists". Servers that ignore the header
  would silently overwrite: :func:`lamina.objstore.probe.check_conditional_put` refuses them
  at start-up.
- A lost response: obstore retries a request whose response it did not get; a create that
  did reach the server then returns 412 to the writer that won. ``put_if_absent`` (in
  :class:`~lamina.objstore.base.ObjectStore`) resolves it by reading the object back and
  comparing it with the bytes it put (callers put a writer nonce in the payload).
- ``get_range``: a ranged GET; a range starting at or past the end of the object (S3
  answers 416) is ``b""``, after a HEAD confirmed the object exists.
- ``list``: ListObjectsV2 under ``prefix/`` with size and ``LastModified``.
- ``delete``: obstore sends a one-key DeleteObjects (``POST ?delete``), idempotent on S3;
  ``delete_prefix``: a listing, then DeleteObjects of up to 1000 keys each.

Settings and credentials (:class:`S3Settings`), each field explicit or from the standard
environment: ``AWS_ENDPOINT_URL`` (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT``),
``AWS_REGION`` (``AWS_DEFAULT_REGION``), ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``. Plain ``http://`` is allowed when the endpoint says ``http://``.
Secrets never appear in ``repr``/``str`` of a settings object or a store, nor in error
messages; a pickled store carries its URL and the explicit settings *without* the
credentials, so Spark executors resolve credentials from their own environment (the
daemon passes explicit ones as ``spark.executorEnv.AWS_*``, which Spark redacts in its UI
and logs).

Fork safety: obstore's HTTP client hangs forever in a process forked from one that already
made a request with it (checked with obstore 0.12.1: even a client built anew in the child
hangs). So the client is built lazily, per process (the building pid is kept and the
client rebuilt after a fork), and a process whose parent made requests before forking gets
a :class:`~lamina.errors.StorageError` at once instead of a hang. PySpark forks its Python
workers from a daemon that never touches the store, so each worker builds its own client;
a process that must fork after using S3 uses the ``spawn`` or ``forkserver`` start method.
"""

from __future__ import annotations

import builtins
import errno
import os
import re
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn
from urllib.parse import urlsplit

from lamina.errors import (
    ConfigError,
    InvalidArgumentError,
    LaminaError,
    ObjectNotFoundError,
    StorageError,
)
from lamina.objstore.base import ObjectMeta, ObjectStore, check_key, check_prefix

if TYPE_CHECKING:
    from obstore.store import S3Store

_SECRET_FIELDS = ("secret_access_key", "session_token")
_DELETE_BATCH = 1000
_S3_CODE = re.compile(r"<Code>([^<]{1,64})</Code>")

_requests_made_by_pid: int | None = None
"""The pid of the process that made obstore requests (None: none yet). A different pid
means this process was forked after its parent used obstore's HTTP client."""


@dataclass(frozen=True, repr=False)
class S3Settings:
    """Explicit S3 settings; a field left None comes from the environment (module
    docstring). ``allow_http`` None means: allowed iff the endpoint is ``http://``."""

    endpoint: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    allow_http: bool | None = None
    max_retries: int = 10
    retry_timeout_s: float = 180.0
    connect_timeout_s: float = 5.0
    timeout_s: float = 60.0

    def __repr__(self) -> str:
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _SECRET_FIELDS and value is not None:
                shown.append(f"{f.name}='<redacted>'")
            else:
                shown.append(f"{f.name}={value!r}")
        return f"S3Settings({', '.join(shown)})"

    __str__ = __repr__

    def resolved(self) -> S3Settings:
        """These settings with every unset field filled from the environment (read now,
        in this process)."""
        env = os.environ

        def first(*names: str) -> str | None:
            for n in names:
                if env.get(n):
                    return env[n]
            return None

        endpoint = self.endpoint or first("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL",
                                          "AWS_ENDPOINT")
        return replace(
            self,
            endpoint=endpoint,
            region=self.region or first("AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1",
            access_key_id=self.access_key_id or first("AWS_ACCESS_KEY_ID"),
            secret_access_key=self.secret_access_key or first("AWS_SECRET_ACCESS_KEY"),
            session_token=self.session_token or first("AWS_SESSION_TOKEN"),
            allow_http=(self.allow_http if self.allow_http is not None
                        else bool(endpoint and endpoint.startswith("http://"))),
        )


class S3ObjectStore(ObjectStore):
    """Objects under ``s3://bucket/prefix``; the obstore client is built lazily per process."""

    def __init__(self, bucket: str, prefix: str = "", settings: S3Settings | None = None
                 ) -> None:
        if not bucket or "/" in bucket:
            raise ConfigError(f"S3 bucket name {bucket!r} is invalid; use s3://bucket/prefix")
        self.bucket = bucket
        self.prefix = check_prefix(prefix) if prefix else ""
        self.settings = settings or S3Settings()
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._client: S3Store | None = None
        self._pid = 0

    @classmethod
    def from_url(cls, url: str, settings: S3Settings | None = None) -> S3ObjectStore:
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
            raise ConfigError(f"{url!r} is not an S3 trace URL; use s3://bucket/prefix")
        if "@" in parts.netloc:
            raise ConfigError("an S3 trace URL must not carry credentials; set "
                              "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the settings file")
        try:
            return cls(parts.netloc, parts.path.strip("/"), settings)
        except InvalidArgumentError as exc:
            raise ConfigError(f"{url!r}: the prefix is not a valid key prefix: {exc}") from exc

    # --- pickling: the URL and explicit settings travel, never a client ------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None
        state["_pid"] = 0
        # credentials never travel in a pickle (a Spark task's closure): the receiving
        # process takes them from its environment (the daemon sets spark.executorEnv.*)
        state["settings"] = replace(self.settings, access_key_id=None,
                                    secret_access_key=None, session_token=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # --- the client ----------------------------------------------------------------------
    def _store(self) -> S3Store:
        global _requests_made_by_pid  # noqa: PLW0603 - a per-process fact, by design
        pid = os.getpid()
        if _requests_made_by_pid is not None and _requests_made_by_pid != pid:
            raise StorageError(
                errno.EDEADLK,
                f"{self.url}: this process was forked from one that already used the S3 "
                "client, and obstore's client hangs after such a fork; start it with the "
                "'spawn' or 'forkserver' method, or keep S3 out of the parent until it forks")
        if self._client is None or self._pid != pid:
            self._client = self._build()
            self._pid = pid
        _requests_made_by_pid = pid
        return self._client

    def _build(self) -> S3Store:
        from obstore.store import S3Store

        s = self.settings.resolved()
        config: dict[str, Any] = {"region": s.region}
        if s.endpoint:
            config["endpoint"] = s.endpoint
        if s.access_key_id:
            config["access_key_id"] = s.access_key_id
        if s.secret_access_key:
            config["secret_access_key"] = s.secret_access_key
        if s.session_token:
            config["session_token"] = s.session_token
        try:
            return S3Store(
                self.bucket, prefix=self.prefix or None, config=config,  # type: ignore[arg-type]
                client_options={"allow_http": bool(s.allow_http),
                                "connect_timeout": timedelta(seconds=s.connect_timeout_s),
                                "timeout": timedelta(seconds=s.timeout_s)},
                retry_config={"max_retries": s.max_retries,
                              "retry_timeout": timedelta(seconds=s.retry_timeout_s)})
        except Exception as exc:
            raise ConfigError(f"{self.url}: the S3 client could not be configured: "
                              f"{_first_line(exc)} (check the endpoint, region and "
                              "credentials settings)") from exc

    def _fail(self, op: str, key: str, exc: Exception) -> NoReturn:
        """Raise ``exc`` translated into a lamina error (the boundary)."""
        from obstore import exceptions as ox

        if isinstance(exc, LaminaError):
            raise exc
        msg = _first_line(exc)
        where = f"{self.url}: {op} of {key!r}" if key else f"{self.url}: {op}"
        code = _S3_CODE.search(str(exc))
        if code and code.group(1) == "NoSuchBucket":
            raise StorageError(errno.ENOENT, f"{where} failed: bucket {self.bucket!r} does "
                               "not exist (create it, or fix the trace URL)") from exc
        if code:
            msg = f"{msg} [S3 error {code.group(1)}]"
        if isinstance(exc, FileNotFoundError | ox.NotFoundError):
            err = ObjectNotFoundError(errno.ENOENT, f"{where}: no such object (it was never "
                                      "written or was deleted)")
            raise err from exc
        if isinstance(exc, ox.PermissionDeniedError | ox.UnauthenticatedError):
            raise StorageError(errno.EACCES, f"{where} was refused: {msg} (check "
                               "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the settings "
                               "file, and the bucket policy)") from exc
        if isinstance(exc, ox.UnknownConfigurationKeyError):
            raise ConfigError(f"{where}: {msg} (fix the S3 settings)") from exc
        raise StorageError(errno.EIO, f"{where} failed: {msg} (check the endpoint, the "
                           "network and the server's health; the call may be retried)"
                           ) from exc

    # --- operations ----------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        import obstore

        check_key(key)
        try:
            return obstore.get(self._store(), key).bytes().to_bytes()
        except Exception as exc:
            self._fail("get", key, exc)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        import obstore

        check_key(key)
        if not 0 <= start <= end:
            raise InvalidArgumentError(f"byte range [{start}, {end}) of {key!r} is not "
                                       "0 <= start <= end")
        try:
            if start == end:
                obstore.head(self._store(), key)
                return b""
            return obstore.get_range(self._store(), key, start=start, end=end).to_bytes()
        except Exception as exc:
            if isinstance(exc, FileNotFoundError | LaminaError):
                self._fail("ranged get", key, exc)
            first = exc
        # S3 answers 416 for a range starting past the end: b"" if the object exists.
        try:
            size = int(obstore.head(self._store(), key)["size"])
        except Exception as exc:
            self._fail("ranged get", key, exc)
        if start >= size:
            return b""
        self._fail("ranged get", key, first)

    def size(self, key: str) -> int:
        import obstore

        check_key(key)
        try:
            return int(obstore.head(self._store(), key)["size"])
        except Exception as exc:
            self._fail("head", key, exc)

    def put(self, key: str, data: bytes) -> None:
        import obstore

        check_key(key)
        try:
            obstore.put(self._store(), key, bytes(data), mode="overwrite")
        except Exception as exc:
            self._fail("put", key, exc)

    def create(self, key: str, data: bytes) -> bool:
        import obstore
        from obstore import exceptions as ox

        check_key(key)
        try:
            obstore.put(self._store(), key, bytes(data), mode="create", use_multipart=False)
        except (ox.AlreadyExistsError, ox.PreconditionError):
            return False
        except Exception as exc:
            self._fail("conditional create", key, exc)
        return True

    def list(self, prefix: str = "") -> list[ObjectMeta]:
        import obstore

        prefix = check_prefix(prefix)
        out: list[ObjectMeta] = []
        try:
            for chunk in obstore.list(self._store(), prefix or None, chunk_size=1000):
                out.extend(ObjectMeta(m["path"], int(m["size"]),
                                      m["last_modified"].timestamp()) for m in chunk)
        except Exception as exc:
            self._fail("list", prefix, exc)
        out.sort(key=lambda m: m.key)
        return out

    def children(self, prefix: str = "") -> builtins.list[str]:
        import obstore

        prefix = check_prefix(prefix)
        try:
            found = obstore.list_with_delimiter(self._store(), prefix or None)
        except Exception as exc:
            self._fail("list", prefix, exc)
        return sorted(p.rsplit("/", 1)[-1] for p in found["common_prefixes"])

    def delete(self, key: str) -> None:
        import obstore

        check_key(key)
        try:
            obstore.delete(self._store(), key)
        except Exception as exc:
            if isinstance(exc, FileNotFoundError) and "<Code>NoSuchBucket<" not in str(exc):
                return  # S3 deletes are idempotent; other servers may say 404
            self._fail("delete", key, exc)

    def delete_prefix(self, prefix: str) -> None:
        import obstore

        keys = [m.key for m in self.list(prefix)]
        for i in range(0, len(keys), _DELETE_BATCH):
            try:
                obstore.delete(self._store(), keys[i:i + _DELETE_BATCH])
            except Exception as exc:
                self._fail("delete", prefix, exc)

    def child(self, prefix: str) -> S3ObjectStore:
        prefix = check_prefix(prefix)
        joined = "/".join(p for p in (self.prefix, prefix) if p)
        return S3ObjectStore(self.bucket, joined, self.settings)

    def __repr__(self) -> str:
        return f"S3ObjectStore({self.url!r}, {self.settings!r})"


def _first_line(exc: BaseException) -> str:
    """The first line of an obstore message (the rest is a debug dump), at most 300
    characters: it names the request and the server's status, never credentials."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    line = line.split("<?xml", 1)[0].rstrip(" :")  # the S3 error body: its code is kept
    return line if len(line) <= 300 else line[:297] + "..."
