"""Static checks of the deployment files, plus promtool and systemd-analyze where installed.

The Dockerfile and the compose file cannot be built or run here (no Docker engine): they
are checked for the properties the daemon relies on. Prometheus rules, the Prometheus
config and the systemd unit are checked by their own tools (CI installs them; see
tests/deploy/tools.py for skip-or-fail).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest

from lamina.compacter.metrics import Metrics
from lamina.compacter.settings import Settings, load_settings
from lamina.ingest.metrics import IngestMetrics
from lamina.ingest.settings import IngestSettings
from lamina.ingest.settings import load_settings as load_ingest_settings
from tests.deploy.tools import exported_metric_names, promtool_check_metrics, require_tool

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "lamina-compacter.service"
COMPOSE = DEPLOY / "docker-compose.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "lamina.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ALERT_TESTS = DEPLOY / "prometheus" / "alerts_test.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
DOCKERFILE = ROOT / "Dockerfile"

# Series Prometheus makes itself, not the daemon.
PROMETHEUS_SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
DEFAULTS = load_settings(env={})
PROMQL_NAME = re.compile(r"\b((?:lamina|process|python)_[a-zA-Z0-9_]+)")


def load_yaml(path: Path) -> Any:
    with path.open() as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Names the compacter or the ingest service exports (one dashboard, one rule file)."""
    return (exported_metric_names(Metrics().registry)
            | exported_metric_names(IngestMetrics().registry))


def metric_names_in(expr: str) -> set[str]:
    """Metric names a PromQL expression uses (ours: lamina_*, process_*, python_*; plus up).

    Label values and legend templates are stripped first, so only selectors count."""
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    names = set(PROMQL_NAME.findall(without_strings))
    if re.search(r"\bup\b", without_strings):
        names.add("up")
    return names


# --- metrics ----------------------------------------------------------------------------

def test_fresh_metrics_pass_promtool_check_metrics() -> None:
    result = promtool_check_metrics(Metrics().exposition())
    assert result.returncode == 0, result.stdout + result.stderr


# --- systemd ----------------------------------------------------------------------------

def unit_directives(path: Path) -> dict[str, dict[str, list[str]]]:
    """``{section: {key: [values...]}}``; systemd allows repeated keys (Environment=)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"directive outside a section: {line}"
        assert not line.endswith("\\"), "keep directives on one line"
        key, sep, value = line.partition("=")
        assert sep, f"not a directive: {line}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_unit_has_required_directives() -> None:
    unit = unit_directives(UNIT)
    svc = {k: v[-1] for k, v in unit["Service"].items()}
    required = {
        "Type": "notify", "NotifyAccess": "main", "WatchdogSec": "30",
        "Restart": "on-failure", "TimeoutStopSec": "45", "KillSignal": "SIGTERM",
        "KillMode": "mixed", "User": "lamina", "Group": "lamina", "NoNewPrivileges": "yes",
        "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
        "ReadWritePaths": "/var/lib/lamina", "StateDirectory": "lamina",
        "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "ExecStart": "/opt/lamina/.venv/bin/lamina serve --config /etc/lamina/compacter.toml",
    }
    wrong = {k: (svc.get(k), v) for k, v in required.items() if svc.get(k) != v}
    assert not wrong, f"(found, wanted): {wrong}"
    assert "LAMINA_DATA_DIR=/var/lib/lamina" in unit["Service"]["Environment"]
    # The JVM's JIT needs W+X memory: this must never be switched on.
    assert "MemoryDenyWriteExecute" not in unit["Service"]
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    # The stop timeout leaves room for the daemon's own shutdown grace.
    assert int(svc["TimeoutStopSec"]) > DEFAULTS.shutdown_grace_seconds + 10


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    """``systemd-analyze verify`` on the unit file as shipped, unchanged.

    verify refuses a unit whose ExecStart binary is missing, and /opt/lamina is not
    installed here. Instead of editing a copy, verify under ``--root``: an alternate root
    holding the unit in etc/systemd/system, the distribution's units (for
    multi-user.target and friends) and an executable stub at /opt/lamina/.venv/bin/lamina.
    Unknown keys and bad values are only warnings (exit code 0), so stderr is checked too.
    """
    _verify_unit(UNIT, tmp_path)


def _verify_unit(unit_path: Path, tmp_path: Path) -> None:
    analyze = require_tool("systemd-analyze")
    root = tmp_path / "root"
    stub = root / "opt/lamina/.venv/bin/lamina"
    stub.parent.mkdir(parents=True)
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    shutil.copy(unit_path, units / unit_path.name)
    for system_units in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")):
        if system_units.is_dir():
            shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
            break
    result = subprocess.run([analyze, "verify", f"--root={root}", unit_path.name],
                            capture_output=True, text=True, timeout=120, check=False)
    ours = [line for line in (result.stdout + result.stderr).splitlines()
            if unit_path.name in line or unit_path.stem in line]
    assert result.returncode == 0, result.stdout + result.stderr
    assert not ours, "\n".join(ours)


def test_example_config_sets_every_key_and_loads() -> None:
    path = DEPLOY / "systemd" / "compacter.toml"
    with path.open("rb") as f:
        doc = tomllib.load(f)
    assert set(doc) == set(Settings.model_fields), "example config and Settings differ"
    settings = load_settings(path, env={})
    assert settings.data_dir == Path("/var/lib/lamina")
    assert settings.http_host == "127.0.0.1"
    # The unit's stop timeout covers the configured grace.
    timeout_stop = int(unit_directives(UNIT)["Service"]["TimeoutStopSec"][-1])
    assert settings.shutdown_grace_seconds + 10 <= timeout_stop


# --- Docker -----------------------------------------------------------------------------

def dockerfile_instructions() -> Iterator[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    logical = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not logical and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        op, _, args = logical.partition(" ")
        yield op.upper(), args.strip()
        logical = ""


def test_dockerfile() -> None:
    ins = list(dockerfile_instructions())
    ops = [op for op, _ in ins]
    args = {op: [a for o, a in ins if o == op] for op in ops}
    text = DOCKERFILE.read_text()
    assert ops.count("FROM") == 2, "multi-stage: builder and runtime"
    assert "ARG PYTHON_IMAGE=python:3.11-slim-bookworm" in text
    assert "AS builder" in args["FROM"][0]
    # every extra: the daemon, PostgreSQL ingestion, s3:// traces (pyproject.toml)
    assert any("pip install '.[compacter,postgres,s3]'" in a for a in args["RUN"])
    assert any("openjdk-17-jre-headless" in a and "tini" in a for a in args["RUN"])
    assert any("useradd" in a and "lamina" in a for a in args["RUN"])
    assert args["USER"] == ["lamina"]
    assert args["VOLUME"] == ["/var/lib/lamina"]
    assert args["EXPOSE"] == ["9740"]
    env = " ".join(args["ENV"])
    assert "LAMINA_DATA_DIR=/var/lib/lamina" in env
    assert "LAMINA_HTTP=0.0.0.0:9740" in env
    [healthcheck] = args["HEALTHCHECK"]
    assert "http://127.0.0.1:9740/healthz" in healthcheck
    assert "urllib" in healthcheck
    # Exec form (JSON arrays), so SIGTERM reaches the daemon through tini, not a shell.
    [entrypoint] = args["ENTRYPOINT"]
    [cmd] = args["CMD"]
    assert json.loads(entrypoint) == ["/usr/bin/tini", "--", "lamina"]
    assert json.loads(cmd) == ["serve"]
    # The compose file runs spark-class out of the image's SPARK_HOME.
    spark_home = re.search(r"SPARK_HOME=(\S+)", env)
    assert spark_home
    assert spark_home.group(1) == "/opt/venv/lib/python3.11/site-packages/pyspark"


def test_dockerignore_keeps_what_the_build_needs() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "lamina-data"} <= ignored
    # pyproject.toml names README.md as the readme and LICENSE; src/ is the package.
    assert not {"src", "pyproject.toml", "README.md", "LICENSE"} & ignored
    # Everything the builder stage COPYs exists.
    for copied in ("pyproject.toml", "README.md", "LICENSE", "src"):
        assert (ROOT / copied).exists(), copied


def test_compose_file() -> None:
    doc = load_yaml(COMPOSE)
    services = doc["services"]
    assert {"compacter", "spark-master", "spark-worker", "prometheus", "grafana"} <= set(
        services)
    compacter, master, worker = (services[n] for n in
                                 ("compacter", "spark-master", "spark-worker"))
    assert compacter["environment"]["LAMINA_SPARK_MASTER"] == "spark://spark-master:7077"
    assert compacter["build"]["context"] == ".."
    assert (COMPOSE.parent / compacter["build"]["context"] / "Dockerfile").is_file()
    # Same data volume at the same path in the driver and the executors.
    data_mount = "lamina-data:/var/lib/lamina"
    assert data_mount in compacter["volumes"]
    assert data_mount in worker["volumes"]
    assert "lamina-data" in doc["volumes"]
    assert compacter["environment"]["LAMINA_DATA_DIR"] == "/var/lib/lamina"
    # Master and worker come from the compacter's image, started with spark-class.
    for svc in (master, worker):
        assert svc["build"] == compacter["build"]
        assert svc["entrypoint"][-1].endswith("/pyspark/bin/spark-class")
    assert master["command"][0] == "org.apache.spark.deploy.master.Master"
    assert "7077" in master["command"]
    assert worker["command"][0] == "org.apache.spark.deploy.worker.Worker"
    assert worker["command"][-1] == "spark://spark-master:7077"
    # Shutdown grace: Docker's default 10 s would cut the daemon's 30 s short.
    grace = compacter["stop_grace_period"]
    assert grace.endswith("s")
    assert int(grace[:-1]) >= DEFAULTS.shutdown_grace_seconds + 10
    # Mounted config directories exist.
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE.parent / source).is_dir(), volume
    # Published ports stay on loopback.
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)


# --- Prometheus and Grafana --------------------------------------------------------------

def test_prometheus_config_scrapes_the_daemon() -> None:
    doc = load_yaml(PROMETHEUS)
    for rule_file in doc["rule_files"]:
        assert (PROMETHEUS.parent / rule_file).is_file(), rule_file
    [job] = [j for j in doc["scrape_configs"] if j["job_name"] == "lamina-compacter"]
    [target] = job["static_configs"][0]["targets"]
    assert target.endswith(f":{DEFAULTS.http_port}")
    assert job.get("metrics_path", "/metrics") == "/metrics"


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml(ALERTS)["groups"] for rule in group["rules"]]


def test_alerts_cover_the_failure_modes(exported: set[str]) -> None:
    rules = {r["alert"]: r for r in alert_rules()}
    wanted = {
        "LaminaCompacterDown": "up",
        "LaminaRelationQuarantined": "lamina_relation_quarantined",
        "LaminaJobFailures": "lamina_jobs_total",
        "LaminaFrontierLagGrowing": "lamina_frontier_lag",
        "LaminaWalBacklog": "lamina_wal_pending_bytes",
    }
    for alert, metric in wanted.items():
        assert alert in rules, alert
        assert metric in metric_names_in(rules[alert]["expr"]), alert
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in {"warning", "critical"}, name
        assert rule["annotations"]["summary"], name
        assert rule["annotations"]["description"], name
        unknown = metric_names_in(rule["expr"]) - exported - PROMETHEUS_SYNTHETIC
        assert not unknown, f"{name} uses metrics Metrics does not export: {unknown}"
    assert 'outcome="failure"' in rules["LaminaJobFailures"]["expr"]


def test_alerts_are_documented() -> None:
    doc = (ROOT / "docs" / "operations.md").read_text()
    for rule in alert_rules():
        assert rule["alert"] in doc, f"{rule['alert']} has no runbook entry"


def test_dashboard_uses_only_exported_metrics(exported: set[str]) -> None:
    dash = json.loads(DASHBOARD.read_text())
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    used: set[str] = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used |= metric_names_in(target["expr"])
    unknown = used - exported - PROMETHEUS_SYNTHETIC
    assert not unknown, f"dashboard uses metrics Metrics does not export: {unknown}"
    # The key metrics each have a panel.
    for key in ("lamina_jobs_total", "lamina_job_duration_seconds_bucket",
                "lamina_wal_pending_bytes", "lamina_frontier_lag", "lamina_trace_batches",
                "lamina_trace_bytes", "lamina_relation_quarantined", "lamina_recovery_seconds"):
        assert key in used, key
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    assert "histogram_quantile(0.5," in exprs
    assert "histogram_quantile(0.99," in exprs


def test_grafana_provisioning_matches_the_dashboard() -> None:
    [ds] = load_yaml(DEPLOY / "grafana/provisioning/datasources/prometheus.yml")["datasources"]
    assert ds["type"] == "prometheus"
    assert ds["url"] == "http://prometheus:9090"
    [provider] = load_yaml(DEPLOY / "grafana/provisioning/dashboards/lamina.yml")["providers"]
    compose = load_yaml(COMPOSE)
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"])
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    dash = json.loads(DASHBOARD.read_text())
    [var] = [v for v in dash["templating"]["list"] if v["name"] == "datasource"]
    assert var["current"]["value"] == ds["uid"]


def test_promtool_check_rules() -> None:
    promtool = require_tool("promtool")
    result = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_config() -> None:
    promtool = require_tool("promtool")
    result = subprocess.run([promtool, "check", "config", str(PROMETHEUS)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_alert_unit_tests() -> None:
    """Each alert fires on the series that should trip it and not on healthy look-alikes."""
    promtool = require_tool("promtool")
    result = subprocess.run([promtool, "test", "rules", str(ALERT_TESTS)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


# --- lamina ingest ------------------------------------------------------------------------

INGEST_UNIT = DEPLOY / "systemd" / "lamina-ingest.service"
INGEST_DEFAULTS = IngestSettings.model_validate(
    {"sources": [{"name": "s", "kind": "files", "path": "/x", "format": "jsonl",
                  "schema": {"id": "int64"}}]})


def test_fresh_ingest_metrics_pass_promtool_check_metrics() -> None:
    metrics = IngestMetrics()
    metrics.register_source("s", lambda: 0.0)
    metrics.register_output("s", "s", lambda: 0)
    metrics.set_output_state("s", "s", "running")
    result = promtool_check_metrics(generate_latest(metrics.registry))
    assert result.returncode == 0, result.stdout + result.stderr


def test_ingest_unit_has_required_directives() -> None:
    unit = unit_directives(INGEST_UNIT)
    svc = {k: v[-1] for k, v in unit["Service"].items()}
    required = {
        "Type": "notify", "NotifyAccess": "main", "WatchdogSec": "30",
        "Restart": "on-failure", "KillSignal": "SIGTERM", "User": "lamina",
        "Group": "lamina", "NoNewPrivileges": "yes", "ProtectSystem": "strict",
        "ReadWritePaths": "/var/lib/lamina",
        "ExecStart": "/opt/lamina/.venv/bin/lamina ingest --config /etc/lamina/ingest.toml",
    }
    wrong = {k: (svc.get(k), v) for k, v in required.items() if svc.get(k) != v}
    assert not wrong, f"(found, wanted): {wrong}"
    assert int(svc["TimeoutStopSec"]) >= INGEST_DEFAULTS.shutdown_grace_seconds + 10
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_ingest_unit_systemd_analyze_verify(tmp_path: Path) -> None:
    _verify_unit(INGEST_UNIT, tmp_path)


@pytest.mark.parametrize("path", [DEPLOY / "systemd" / "ingest.toml",
                                  DEPLOY / "ingest" / "ingest.toml"])
def test_example_ingest_configs_load(path: Path) -> None:
    settings = load_ingest_settings(path, env={})
    assert settings.http_host == "127.0.0.1"
    assert {s.kind for s in settings.sources} <= {"files", "postgres"}
    if path.parent.name == "systemd":
        with path.open("rb") as f:
            doc = tomllib.load(f)
        assert set(doc) == set(IngestSettings.model_fields), "example and settings differ"
        assert {s.kind for s in settings.sources} == {"files", "postgres"}


def test_compose_runs_ingest_beside_the_compacter() -> None:
    doc = load_yaml(COMPOSE)
    ingest = doc["services"]["ingest"]
    assert ingest["build"] == doc["services"]["compacter"]["build"]
    assert ingest["command"][:2] == ["ingest", "--config"]
    assert "lamina-data:/var/lib/lamina" in ingest["volumes"]
    assert ingest["environment"]["LAMINA_INGEST_HTTP"].endswith(":9741")
    config_dir = next(v.split(":")[0] for v in ingest["volumes"] if v.endswith("/etc/lamina:ro"))
    assert (COMPOSE.parent / config_dir / "ingest.toml").is_file()
    assert "9741" in " ".join(ingest["healthcheck"]["test"])
    grace = ingest["stop_grace_period"]
    assert int(grace[:-1]) >= INGEST_DEFAULTS.shutdown_grace_seconds + 10


def test_prometheus_scrapes_ingest() -> None:
    doc = load_yaml(PROMETHEUS)
    [job] = [j for j in doc["scrape_configs"] if j["job_name"] == "lamina-ingest"]
    [target] = job["static_configs"][0]["targets"]
    assert target.endswith(f":{INGEST_DEFAULTS.http_port}")


def test_ingest_alerts_and_panels_cover_stalls_and_lag() -> None:
    rules = {r["alert"]: r for r in alert_rules()}
    wanted = {
        "LaminaIngestDown": "up",
        "LaminaSourceStalled": "lamina_source_state",
        "LaminaSourceOutputStalled": "lamina_source_output_state",
        "LaminaSourceLagging": "lamina_source_lag_seconds",
        "LaminaSourceBacklogGrowing": "lamina_source_lag_offsets",
    }
    for alert, metric in wanted.items():
        assert metric in metric_names_in(rules[alert]["expr"]), alert
    dash = json.loads(DASHBOARD.read_text())
    used: set[str] = set()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            used |= metric_names_in(target["expr"])
    for key in ("lamina_source_state", "lamina_source_output_state",
                "lamina_source_lag_seconds", "lamina_source_lag_offsets",
                "lamina_source_changes_total", "lamina_source_transactions_total",
                "lamina_source_bindings_total", "lamina_source_resume_frontier"):
        assert key in used, key
