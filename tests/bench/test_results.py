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


def test_the_documented_peers_table_is_the_one_the_results_render() -> None:
    """The side-by-side table with Delta Lake (between its own markers) is exactly
    ``peers.table()`` of the committed bench/results/peers.json: re-render with
    ``python -m bench.peers --table``."""
    from bench import peers

    content = peers.DOC.read_text()
    block = content.split(peers.BEGIN, 1)[1].split(peers.END, 1)[0].strip("\n")
    assert block == peers.table(DEFAULT_RESULTS), \
        "docs/performance.md is stale: run python -m bench.peers --table"


def test_every_peers_cell_passed_the_correctness_gate() -> None:
    """Every recorded cell of the Delta comparison passed its gate (all contenders' latest
    snapshots hash to the stream's live rows) and records the load average of each round."""
    doc = json.loads((DEFAULT_RESULTS / "peers.json").read_text())
    assert doc["cells"]
    for name, cell in doc["cells"].items():
        assert cell["gate"] == "passed", name
        assert len(cell["load_average_per_round"]) == cell["rounds"] + 1, name
        finished = [s for s in cell["contenders"].values() if s["finished"]]
        assert finished, name
        assert all(s["checksums"] == [cell["expected"]["checksum"]] for s in finished), name


def test_round_ratios_pair_the_contenders_of_each_round() -> None:
    """The spread shown next to a ratio of medians pairs each round's two contenders (they
    ran back to back), not the fastest of one with the slowest of the other."""
    lamina, base = {"seconds": [2.0, 4.0, 3.0]}, {"seconds": [3.0, 5.0, 6.0]}
    assert run.round_ratios(lamina, base) == " (rounds 1.25 to 2.00)"
    assert run.round_ratios({"seconds": [2.0]}, {"seconds": [3.0]}) == ""
