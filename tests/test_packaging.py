"""Packaging (pyproject.toml): the core install is what ``Store``, the readers and the
command line's reads need, and is enough for them; each extra is enough for what it is
for; the LICENSE that pyproject names exists.

"Enough" is checked without a network or a second install: a fresh interpreter runs the
path with every installed package outside the declared requirements' closure (the
requirements of the requirements, as installed) made unimportable, as if it were not
installed: what a core install (or core + one extra) would hold.

pandas (and python-dateutil) need that treatment rather than a plain ``sys.modules``
check: when installed, pyarrow itself imports them on its first ``pa.array`` (to
recognise pandas objects and parse dates), so their presence in ``sys.modules`` says
nothing about lamina; the path running without them does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pyarrow as pa
import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

EXTRAS_ONLY = ("pyspark", "pandas", "uvloop", "aiohttp", "prometheus_client", "aiofiles",
               "structlog", "pydantic", "psycopg2", "obstore", "rich")
"""Modules of the extras that the core path must never import."""

BLOCKER = """
import sys
from importlib.abc import MetaPathFinder

class Absent(MetaPathFinder):
    '''These packages are not installed, as far as this process can tell.'''

    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Absent(sys.argv[1].split(",") if sys.argv[1] else []))
STARTUP = set(sys.modules)  # what the interpreter had loaded before (site, .pth hooks)
"""

CORE_PATH = BLOCKER + """
import json, os, tempfile
import numpy as np
import pyarrow as pa
from lamina import CLOSED, Store
from lamina.cli.main import main

root = tempfile.mkdtemp()
with Store.open(root, fsync="never") as store:
    rel = store.create_relation("t", pa.schema([("id", pa.int64()), ("s", pa.string())]),
                                key=["id"])
    rel.append(pa.Table.from_arrays(
        [pa.array(np.arange(5)), pa.array(["a", "b", "c", "d", "e"]),
         pa.array(np.zeros(5, np.uint64)), pa.array(np.ones(5, np.int64))],
        names=["id", "s", "_time", "_diff"]))
    rel.seal(1)
    rel.allow_compaction(0)
    assert rel.snapshot(0).num_rows == 5
    assert sum(b.num_rows for b in rel.snapshot_reader(0)) == 5
    assert rel.lookup({"id": [3]}, 0).num_rows == 1
    rel.seal(CLOSED)  # so that subscribe ends
with Store.open(root, read_only=True) as store:
    assert store.relation("t").snapshot(0).num_rows == 5
devnull = os.open(os.devnull, os.O_WRONLY)
saved = os.dup(1)
os.dup2(devnull, 1)
for args in (["status", "--json"], ["status"], ["relations"], ["describe", "t"],
             ["verify"], ["snapshot", "t", "--format", "jsonl"],
             ["snapshot", "t", "--format", "csv"], ["lookup", "t", "3"], ["subscribe", "t"]):
    code = main([*args, "--data-dir", root])
    assert code == 0, (args, code)
sys.stdout.flush()
os.dup2(saved, 1)
print(json.dumps(sorted({m.partition(".")[0] for m in set(sys.modules) - STARTUP})))
"""


def run(script: str, absent: set[str]) -> set[str]:
    """Run ``script`` in a fresh interpreter with the top-level modules ``absent``
    unimportable; return the top-level modules it imported."""
    out = subprocess.run([sys.executable, "-c", script, ",".join(sorted(absent))],
                         capture_output=True, timeout=300, check=False, cwd=ROOT)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    return set(json.loads(out.stdout.decode().splitlines()[-1]))


def outside(allowed: set[str]) -> set[str]:
    """Every installed top-level module that no distribution in ``allowed`` (or lamina)
    provides, the standard library's aside."""
    modules: set[str] = set()
    for module, dists in metadata.packages_distributions().items():
        if module in sys.stdlib_module_names or module == "lamina":
            continue
        if not {_norm(d) for d in dists} & (allowed | {"lamina"}):
            modules.add(module)
    return modules


def closure(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` bring, with their own requirements (no extras
    of theirs), as installed here; names normalised."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = _norm(req.name)
        if name in seen or name == "lamina":
            continue
        seen.add(name)
        todo.extend(Requirement(r) for r in metadata.requires(req.name) or [])
    return seen


def own(extra: str) -> list[str]:
    """An extra's requirements, its references to other extras of lamina expanded."""
    out = []
    for r in PYPROJECT["optional-dependencies"][extra]:
        req = Requirement(r)
        if _norm(req.name) == "lamina":
            for e in req.extras:
                out += own(e)
        else:
            out.append(r)
    return out


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def distributions(modules: set[str]) -> set[str]:
    """The installed distributions that provide these top-level modules (stdlib and
    lamina's own left out; modules that no distribution lists, such as Cython's runtime
    modules, are made at run time and left out too)."""
    owners = metadata.packages_distributions()
    found: set[str] = set()
    for m in modules - set(sys.stdlib_module_names) - {"lamina"}:
        found.update(_norm(d) for d in owners.get(m, []))
    return found - {"lamina"}


def test_the_core_path_needs_only_the_core_requirements() -> None:
    """Store (open, create, append, seal, allow_compaction, snapshot, a streaming
    snapshot, a lookup, read-only) and the command line's reads run with nothing but the
    core requirements importable, so none of the extras."""
    core = closure(PYPROJECT["dependencies"])
    assert {"pyarrow", "numpy", "crc32c"} <= core
    blocked = outside(core)
    assert set(EXTRAS_ONLY) <= blocked
    imported = run(CORE_PATH, blocked)
    assert distributions(imported) <= core, distributions(imported) - core


def test_the_core_path_imports_no_extra_when_they_are_installed() -> None:
    """Everything installed (this environment): the same path imports none of the extras,
    pandas aside (pyarrow imports it when present: the module docstring)."""
    imported = run(CORE_PATH, set())
    assert not imported & (set(EXTRAS_ONLY) - {"pandas"})


EXTRA_PATHS = {
    "compacter": "import lamina.compacter.daemon, lamina.compacter.spark, "
                 "lamina.drill.driver, pyspark.sql, rich.progress",
    "ingest": "import lamina.ingest.service, lamina.ingest.files",
    "postgres": "import lamina.ingest.service, lamina.ingest.postgres.source",
    "s3": "import lamina.objstore.s3, obstore.store",
}


@pytest.mark.parametrize("extra", sorted(EXTRA_PATHS))
def test_each_extra_is_enough_for_its_part(extra: str) -> None:
    """Each part loads with only the core requirements and that extra's importable."""
    allowed = closure([*PYPROJECT["dependencies"], *own(extra)])
    script = BLOCKER + f"{EXTRA_PATHS[extra]}\nimport json\n" \
        "print(json.dumps(sorted({m.partition('.')[0] for m in set(sys.modules) - STARTUP})))\n"
    imported = run(script, outside(allowed))
    assert distributions(imported) <= allowed, distributions(imported) - allowed


def test_a_missing_extra_is_one_line_naming_it(tmp_path: Path) -> None:
    """``lamina serve`` without the compacter's packages, ``lamina status`` of a data
    directory whose traces are on S3 without obstore: one line naming the extra."""
    from lamina.datadir import TraceLocation
    from lamina.layout import TRACE_LOCATION_NAME
    from lamina.store import Store

    s3_data = tmp_path / "s3-data"
    Store.open(s3_data).close()
    (s3_data / TRACE_LOCATION_NAME).write_bytes(TraceLocation("s3://bucket/t").to_json())
    with Store.open(s3_data) as store:
        store.create_relation("r", pa.schema([("id", pa.int64())]))
    cases = [
        (["serve", "--data-dir", str(tmp_path / "d")], "pydantic,uvloop,pyspark",
         "'lamina serve' needs lamina's optional dependencies 'compacter' (pydantic is "
         "missing): pip install 'lamina[compacter]'"),
        (["status", "--data-dir", str(s3_data)], "obstore",
         "'lamina status' needs lamina's optional dependencies 's3' (obstore is missing): "
         "pip install 'lamina[s3]'"),
    ]
    for args, absent, message in cases:
        script = BLOCKER + f"from lamina.cli.main import main\nsys.exit(main({args!r}))\n"
        out = subprocess.run([sys.executable, "-c", script, absent], capture_output=True,
                             timeout=120, check=False)
        assert out.returncode == 1, out.stderr
        assert out.stderr.decode() == f"lamina: {message}\n"


def test_license_and_metadata() -> None:
    assert PYPROJECT["license"] == "Apache-2.0"
    assert PYPROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License")
    assert "Version 2.0, January 2004" in text
    assert "pydantic-settings" not in json.dumps(PYPROJECT)  # not used: not declared
