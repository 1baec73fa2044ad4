"""Result files and plots shared by the benchmarks.

Every benchmark writes ``bench/results/<name>.json`` through :func:`write_result`, which
adds when and where it ran (machine, load average before and after, the exact command)
and a bar chart ``bench/results/<name>.png`` through :func:`bar_chart`.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

DEFAULT_RESULTS = Path(__file__).parent / "results"
RESULTS = Path(os.environ.get("LAMINA_BENCH_RESULTS", DEFAULT_RESULTS))
"""Where results go; ``LAMINA_BENCH_RESULTS`` moves them (e.g. for a run of older code)."""
ENV_SHOWN = ("PYTHONPATH", "LAMINA_BENCH_RESULTS")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict[str, Any]:
    import pyarrow as pa

    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    return {"python": platform.python_version(), "pyarrow": pa.__version__,
            "platform": platform.platform(), "cpus": os.cpu_count(), "memory_bytes": mem}


def command(argv: Sequence[str] | None = None) -> str:
    """The command line that reproduces this run (module form)."""
    args = list(sys.argv[1:] if argv is None else argv)
    module = sys.modules["__main__"].__spec__
    name = module.name if module is not None else sys.argv[0]
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in ENV_SHOWN if os.environ.get(k)]
    return " ".join([*env, ".venv/bin/python", "-m", name, *(shlex.quote(a) for a in args)])


class Run:
    """Wall-clock and load bookkeeping of one benchmark run."""

    def __init__(self, name: str, argv: Sequence[str] | None) -> None:
        self.name = name
        self.command = command(argv)
        self.started = time.monotonic()
        self.when = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.load_before = load_average()

    def document(self, result: dict[str, Any]) -> dict[str, Any]:
        return {"benchmark": self.name, "when": self.when, "command": self.command,
                "seconds": round(time.monotonic() - self.started, 1),
                "load_average": {"before": self.load_before, "after": load_average()},
                **result, "machine": machine()}


def write_result(name: str, doc: dict[str, Any], results: Path = RESULTS) -> Path:
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
    return path


def human(v: float) -> str:
    """A short label for a bar: 3 significant digits, k/M suffixes."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:.3g}{suffix}"
    return f"{v:.3g}"


def bar_chart(name: str, title: str, groups: Sequence[tuple[str, dict[str, float]]], *,
              ylabel: str, results: Path = RESULTS, note: str = "",
              targets: Sequence[float | None] | None = None) -> Path:
    """One PNG: for every group (a measured quantity), bars of lamina and its baselines;
    ``targets[i]``, when given, is drawn across group ``i`` as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), squeeze=False)
    for ax, (label, bars) in zip(axes[0], groups, strict=True):
        names = list(bars)
        values = [bars[n] for n in names]
        colors = ["#2b6cb0" if n.startswith("lamina") else "#a0aec0" for n in names]
        ax.bar(names, values, color=colors)
        ax.set_title(label, fontsize=10)
        ax.set_ylabel(ylabel if ax is axes[0][0] else "")
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        for i, v in enumerate(values):
            ax.annotate(human(v), (i, v), ha="center", va="bottom", fontsize=8)
        target = targets[list(axes[0]).index(ax)] if targets else None
        if target is not None:
            ax.axhline(target, color="#c53030", linestyle="--", linewidth=1)
            ax.annotate(f"target {human(target)}", (len(names) - 0.5, target), ha="right",
                        va="bottom", fontsize=7, color="#c53030")
    fig.suptitle(title, fontsize=11)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, color="#4a5568")
    fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1))
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_comparison(name: str, title: str, doc: dict[str, Any]) -> Path:
    """Throughput and peak memory of lamina and its baselines (bench.procs.compare)."""
    contenders = doc["contenders"]
    groups = [("throughput (updates/s)",
               {c: float(v["updates_per_s"]) for c, v in contenders.items()}),
              ("peak RSS, whole process tree (MiB)",
               {c: v["peak_rss_bytes"]["total"] / 2**20 for c, v in contenders.items()})]
    ratios = ", ".join(f"{k} {v['ratio']}x (target {v['target']}x)"
                       for k, v in doc["ratios"].items())
    load = doc["load_average"]
    return bar_chart(name, title, groups, ylabel="",
                     note=f"lamina vs {ratios}; load average {load['before'][0]} before, "
                          f"{load['after'][0]} after")
