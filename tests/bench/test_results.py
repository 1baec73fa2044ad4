"""The committed benchmark results and docs/performance.md agree.

``make bench`` writes bench/results/<name>.json and renders their table into
docs/performance.md; a hand edit of either, or a result committed without re-rendering,
would make the document claim figures no run produced. These checks keep them in step
(without running the benchmarks, which take minutes of Spark).
"""

from __future__ import annotations

import json

import pytest
from bench.report import DEFAULT_RESULTS

from bench import run


def test_the_documented_table_is_the_one_the_results_render() -> None:
    """The block between the markers of docs/performance.md is exactly ``table()`` of the
    committed results: re-render with ``python -m bench.run --table``."""
    content = run.DOC.read_text()
    block = content.split(run.BEGIN, 1)[1].split(run.END, 1)[0].strip("\n")
    assert block == run.table(), "docs/performance.md is stale: run python -m bench.run --table"


@pytest.mark.parametrize("name", run.BENCHMARKS)
def test_every_result_says_how_to_reproduce_it(name: str) -> None:
    """Each benchmark has a committed result naming its command, when it ran, the load
    average around it and the machine."""
    doc = json.loads((DEFAULT_RESULTS / f"{name}.json").read_text())
    assert doc["benchmark"] == name
    assert doc["command"].startswith(".venv/bin/python -m bench.")
    assert doc["when"].endswith("Z")
    assert len(doc["load_average"]["before"]) == 3
    assert doc["machine"]["cpus"] >= 1
    assert (DEFAULT_RESULTS / f"{name}.png").stat().st_size > 0
