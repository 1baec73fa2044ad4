"""``lamina ingest resync --config FILE SOURCE TABLE [--data-dir DIR] [--http HOST:PORT]``.

Resyncs one table of a source (:mod:`lamina.ingest.resync`): through the running ``lamina
ingest`` that serves the source, when one answers at the configured HTTP address
(``POST /v1/sources/<SOURCE>/resync``: its source thread does it between two sessions,
the other sources never pause); otherwise in this process, which then needs the source's
relations to itself (a ``LockedError`` means another process writes them: stop it, or
point ``--http`` at it). ``TABLE`` is the upstream name (``public.orders`` or ``orders``)
or the output relation (``shop.orders``). Prints one line saying what was done; exit 0,
1 when the resync failed (the error and what to do on stderr), 2 for bad usage.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import Any

from lamina.errors import ConfigError, LaminaError, LockedError, SourceStalledError

REQUEST_TIMEOUT_SECONDS = 6 * 3600.0
"""How long the command waits for a running ``lamina ingest`` (a large table's snapshot)."""


def run(args: argparse.Namespace) -> int:
    from lamina.ingest.resync import resolve_table
    from lamina.ingest.settings import load_settings

    settings = load_settings(args.config, overrides={"data_dir": args.data_dir,
                                                     "http": args.http})
    source = next((s for s in settings.sources if s.name == args.source), None)
    if source is None:
        raise ConfigError(f"no source named {args.source!r} in {args.config}; sources: "
                          f"{sorted(s.name for s in settings.sources)}")
    try:
        table = resolve_table(source, args.table)
        done = _through_service(settings.http_host, settings.http_port, source.name, table)
        if done is None:
            done = _here(settings, source, table)
    except SourceStalledError as exc:
        raise LaminaError(f"resync of {args.table!r} failed: {exc.error}"
                          + (f"; {exc.hint}" if exc.hint else "")) from exc
    print(f"resynced {done['table']} into {done['relation']} at binding time "
          f"{done['binding_time']} (offset {done['offset']}): {done['rows']} rows in the "
          f"snapshot, {done['inserted']} inserted, {done['retracted']} retracted"
          + ("; the relation was created again with the table's columns"
             if done["recreated"] else ""))
    return 0


def _through_service(host: str, port: int, source: str, table: str) -> dict[str, Any] | None:
    """What a running ``lamina ingest`` did, or None when none serves ``source`` there."""
    if port == 0:
        return None
    req = urllib.request.Request(
        f"http://{host}:{port}/v1/sources/{source}/resync", method="POST",
        data=json.dumps({"table": table}).encode(), headers={"Content-Type":
                                                             "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_SECONDS) as resp:  # noqa: S310 (http:// only)
            answer: dict[str, Any] = json.loads(resp.read())
            return answer
    except urllib.error.HTTPError as exc:
        with exc:  # it holds the connection: closed here, not by the garbage collector
            body = _json(exc.read())
        if exc.code == 404 and "no source" in str(body.get("error", "")):
            return None          # another ingest: this source is not served there
        if exc.code in (404, 409):
            raise SourceStalledError(str(body.get("error", exc)),
                                     hint=str(body.get("hint", ""))) from exc
        raise LaminaError(f"lamina ingest at {host}:{port} answered {exc.code}: "
                          f"{body or exc.reason}") from exc
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, ConnectionRefusedError):
            return None          # nothing listens: no lamina ingest runs there
        raise LaminaError(f"lamina ingest at {host}:{port} did not answer: {reason}") from exc


def _here(settings: Any, source: Any, table: str) -> dict[str, Any]:
    from lamina.compacter.logs import configure_logging
    from lamina.ingest.resync import resync
    from lamina.ingest.service import make_source
    from lamina.store import Store

    configure_logging("console", "warning")
    with Store.open(settings.data_dir,
                    segment_max_age_seconds=settings.segment_max_age_seconds) as store:
        try:
            return resync(store, source, make_source(source), table)
        except LockedError as exc:
            raise LaminaError(
                f"another process writes the relations of source {source.name!r} ({exc}): "
                "a `lamina ingest` serving HTTP elsewhere? pass its address with --http, "
                "or stop it and run the resync again") from exc


def _json(data: bytes) -> dict[str, Any]:
    try:
        got = json.loads(data)
    except ValueError:
        return {}
    return got if isinstance(got, dict) else {}
