"""Helpers for tests that need an external tool (promtool, systemd-analyze).

CI installs the tools (``apt-get install -y prometheus systemd``); there a missing tool is a
failure. Elsewhere the test is skipped, so a laptop without them still runs the suite.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from prometheus_client import CollectorRegistry


def require_tool(name: str) -> str:
    """The path of executable ``name``; skip the test when it is missing, fail under CI."""
    path = shutil.which(name)
    if path is None:
        message = (f"{name} is not installed (Debian: apt-get install -y prometheus systemd "
                   "gives promtool and systemd-analyze)")
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must install it")
        pytest.skip(message)
    return path


def promtool_check_metrics(exposition: str | bytes) -> subprocess.CompletedProcess[str]:
    """Run ``promtool check metrics`` (parse + lint) on a text-format exposition.

    Returns the finished process (exit code 0 means no problem; output on stdout/stderr).
    Use it on a real scrape too: ``promtool_check_metrics(urlopen(url).read())``.
    """
    promtool = require_tool("promtool")
    text = exposition.decode() if isinstance(exposition, bytes) else exposition
    return subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60, check=False)


def exported_metric_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name ``registry`` can export, whether or not a series exists yet.

    A labelled metric has no samples until a label set is used, so names are derived from
    each family's type: counters give ``_total`` and ``_created``, histograms ``_bucket``,
    ``_sum``, ``_count`` and ``_created``, summaries ``_sum``, ``_count``, ``_created``.
    The bare family name of a counter or histogram is not a series, so it is not included.
    """
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"),
        "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
        "info": ("_info",),
    }
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names
