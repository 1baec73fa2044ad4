"""Settings loading shared by the daemons: a base model with the HTTP address, and the
defaults < TOML < environment < flags merge.

A daemon's settings model derives from :class:`ServiceSettings` (frozen, unknown keys are
errors) and sets its own ``http`` default; :func:`load_toml_settings` builds it from a TOML
file (keys at the top level or under a ``[lamina]`` table), ``LAMINA_<NAME>`` environment
variables for the fields the daemon names, extra variables mapped to fields (later ones
win), then command-line overrides (``None`` values are ignored). Every problem is a
:class:`~lamina.errors.ConfigError` naming the key (``sources.1.schema.ts: ...``).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from lamina.errors import ConfigError
from lamina.objstore.s3 import S3Settings

__all__ = ["ENV_PREFIX", "S3Section", "ServiceSettings", "load_toml_settings"]

ENV_PREFIX = "LAMINA_"

_M = TypeVar("_M", bound=BaseModel)


class S3Section(BaseModel):
    """The ``[s3]`` table: explicit settings of an ``s3://`` trace. Every field left out
    comes from the standard AWS environment (``AWS_ENDPOINT_URL``, ``AWS_REGION``,
    ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``); secrets are
    never shown in a repr or a log."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    endpoint: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: SecretStr | None = None
    session_token: SecretStr | None = None
    allow_http: bool | None = None
    max_retries: int = Field(10, ge=0)
    retry_timeout_seconds: float = Field(180.0, gt=0)
    connect_timeout_seconds: float = Field(5.0, gt=0)
    timeout_seconds: float = Field(60.0, gt=0)

    def to_settings(self) -> S3Settings:
        def secret(v: SecretStr | None) -> str | None:
            return v.get_secret_value() if v is not None else None

        return S3Settings(endpoint=self.endpoint, region=self.region,
                          access_key_id=self.access_key_id,
                          secret_access_key=secret(self.secret_access_key),
                          session_token=secret(self.session_token), allow_http=self.allow_http,
                          max_retries=self.max_retries,
                          retry_timeout_s=self.retry_timeout_seconds,
                          connect_timeout_s=self.connect_timeout_seconds,
                          timeout_s=self.timeout_seconds)


class ServiceSettings(BaseModel):
    """The part every daemon's settings share: the ``HOST:PORT`` it serves HTTP on."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    http_port_zero: ClassVar[bool] = False
    """Whether port 0 (a free port picked at bind time) is accepted."""

    http: str

    @field_validator("http")
    @classmethod
    def _check_http(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        low = 0 if cls.http_port_zero else 1
        if not sep or not host or not port.isdigit() or not low <= int(port) < 65536:
            raise ValueError(f"expected HOST:PORT, got {v!r}")
        return v

    @property
    def http_host(self) -> str:
        return self.http.rpartition(":")[0].strip("[]")

    @property
    def http_port(self) -> int:
        return int(self.http.rpartition(":")[2])


def load_toml_settings(model: type[_M], config_file: str | os.PathLike[str] | None,
                       env: Mapping[str, str] | None, overrides: Mapping[str, Any] | None,
                       *, env_fields: Iterable[str] | None = None,
                       env_names: Mapping[str, str] | None = None,
                       what: str = "settings", missing_hint: str = "",
                       invalid_hint: str = "") -> _M:
    """Merge defaults, TOML, environment and flags into ``model``.

    ``env_fields``: the fields ``LAMINA_<FIELD>`` may set (default: every field of
    ``model``); ``env_names``: further variables -> field, applied after (when not empty).
    ``what`` names the settings in the ConfigError, ``missing_hint`` follows the message of
    a config file that does not exist and ``invalid_hint`` that of invalid values."""
    values: dict[str, Any] = {}
    if config_file is not None:
        try:
            with open(config_file, "rb") as f:
                doc = tomllib.load(f)
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {config_file} does not exist{missing_hint}") \
                from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {config_file} is not valid TOML: {exc}") from exc
        values.update(doc.get("lamina", doc))
    env = os.environ if env is None else env
    fields = set(model.model_fields if env_fields is None else env_fields)
    for key, raw in env.items():
        if key.startswith(ENV_PREFIX):
            name = key[len(ENV_PREFIX):].lower()
            if name in fields:
                values[name] = raw
    for var, name in (env_names or {}).items():
        if env.get(var):
            values[name] = env[var]
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                             for e in exc.errors())
        raise ConfigError(f"invalid {what}: {problems}{invalid_hint}") from exc
