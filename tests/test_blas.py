"""lamina.blas: the command line starts OpenBLAS with one thread, unless the operator chose
a number; ``import lamina`` loads no numpy and changes no environment."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lamina import blas

# A fresh interpreter prints the variable as numpy's loader saw it and the number of its
# threads once numpy and pyarrow are loaded (/proc/self/task: OpenBLAS's spinning workers
# are threads of the process).
PROBE = """
import os, sys
{imports}
import numpy, pyarrow
print(os.environ.get("OPENBLAS_NUM_THREADS"), len(os.listdir("/proc/self/task")))
"""


def probe(imports: str, env: dict[str, str]) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    value, threads = out.split()
    return value, int(threads)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without the variable (the suite sets it: conftest.py)."""
    env = {k: v for k, v in os.environ.items() if k not in (blas.VARIABLE, "OMP_NUM_THREADS",
                                                             "GOTO_NUM_THREADS")}
    return {**env, **extra}


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS starts no worker on one core")
def test_the_command_line_loads_openblas_with_one_thread() -> None:
    """The module the console script and ``python -m lamina`` import sets the variable
    before numpy loads: one thread fewer than a process that imported numpy as it is."""
    bare_value, bare_threads = probe("", clean_env())
    cli_value, cli_threads = probe("import lamina.cli.main", clean_env())
    assert bare_value == "None"
    assert cli_value == "1"
    assert cli_threads < bare_threads, (cli_threads, bare_threads)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS starts no worker on one core")
def test_an_operators_value_wins() -> None:
    value, threads = probe("import lamina.cli.main", clean_env(OPENBLAS_NUM_THREADS="2"))
    _, one = probe("import lamina.cli.main", clean_env())
    assert value == "2"
    assert threads == one + 1


def test_importing_lamina_loads_no_numpy_and_sets_nothing() -> None:
    """A program that uses lamina as a library keeps its own BLAS threads: ``import
    lamina`` neither loads numpy nor touches the environment; the API's classes still
    resolve from the package."""
    code = ("import os, sys, lamina\n"
            "assert 'numpy' not in sys.modules, 'numpy'\n"
            "assert 'OPENBLAS_NUM_THREADS' not in os.environ, 'set'\n"
            "from lamina import Relation, Store, Progress\n"
            "import lamina.store, lamina.read.subscribe\n"
            "assert Store is lamina.store.Store and Relation is lamina.store.Relation\n"
            "assert Progress is lamina.read.subscribe.Progress\n")
    subprocess.run([sys.executable, "-c", code], env=clean_env(), timeout=60, check=True)


def test_one_thread_keeps_a_value_already_set() -> None:
    env = {"OPENBLAS_NUM_THREADS": "4"}
    blas.one_thread(env)
    assert env == {"OPENBLAS_NUM_THREADS": "4"}
    empty: dict[str, str] = {}
    blas.one_thread(empty)
    assert empty == {"OPENBLAS_NUM_THREADS": "1"}
