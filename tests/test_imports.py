"""The import rules of the read wing (docs/architecture.md), checked on the source: only
the public API and its shims reach into ``lamina.read``, and ``lamina.ingest`` writes and
reads through the public API alone, never through the storage modules underneath it."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "lamina"

#: modules outside lamina/read/ allowed to import it: the public API (Store, Relation),
#: the package's exports, the Spark reader's shim and the CLI's progress type
READ_IMPORTERS = {"lamina", "lamina.store", "lamina.spark", "lamina.cli.reading"}
#: what lamina.ingest must not import: the storage underneath the public API
BELOW_THE_API = ("lamina.read", "lamina.layout", "lamina.datadir", "lamina.trace",
                 "lamina.wal", "lamina.compacter.executors", "lamina.compacter.step")


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _modules() -> dict[str, set[str]]:
    return {_module(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_only_the_public_api_reaches_into_the_read_wing() -> None:
    modules = _modules()
    assert "lamina.read.snapshot" in modules  # the walk found the package
    offenders = {m: sorted(i for i in imps if _under(i, "lamina.read"))
                 for m, imps in modules.items()
                 if not _under(m, "lamina.read") and m not in READ_IMPORTERS}
    assert {m: i for m, i in offenders.items() if i} == {}


def test_ingest_uses_only_the_public_api() -> None:
    modules = _modules()
    ingest = {m: imps for m, imps in modules.items() if _under(m, "lamina.ingest")}
    assert "lamina.ingest.runner" in ingest
    offenders = {m: sorted(i for i in imps if any(_under(i, b) for b in BELOW_THE_API))
                 for m, imps in ingest.items()}
    assert {m: i for m, i in offenders.items() if i} == {}
