"""deploy/grafana/kvgate.json and deploy/prometheus.yml against the metrics the code defines."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from common.health import HealthConditions
from deploy.local import DEFAULT_METRICS_PORT, metrics_ports
from executor.metrics import ExecutorMetrics
from gateway.metrics import GatewayMetrics
from scheduler.metrics import SchedulerMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kvgate.json"
PROMETHEUS_CONFIG = DEPLOY / "prometheus.yml"
SUFFIXES = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_count", "_sum"]}
# What the dashboard must show, by words of its panel titles.
REQUIRED_PANELS = [
    "time to first token",
    "inter-token latency",
    "throughput",
    "queue length",
    "kv cache usage",
    "batch size",
    "preemptions",
]
METRIC_NAME = re.compile(r"\bkvgate_[a-z0-9_]+")
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="make promtool")


def exposed_names(registry: CollectorRegistry) -> set[str]:
    """The sample names a registry exposes (counters as NAME_total, histograms' series)."""
    return {
        family.name + suffix for family in registry.collect() for suffix in SUFFIXES[family.type]
    }


def defined_metric_names() -> set[str]:
    registries = [GatewayMetrics().registry, SchedulerMetrics().registry]
    registries.append(ExecutorMetrics().registry)
    health = CollectorRegistry()
    HealthConditions("any", health)  # kvgate_redis_up, in every process's registry
    registries.append(health)
    return set().union(*(exposed_names(r) for r in registries))


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]


def test_every_defined_metric_is_named_kvgate() -> None:
    names = defined_metric_names()
    assert len(names) > 20, f"expected the three processes' metrics, got {sorted(names)}"
    assert all(n.startswith("kvgate_") for n in names), sorted(names)


def test_dashboard_queries_only_metrics_the_code_defines() -> None:
    defined = defined_metric_names()
    for title, expr in dashboard_exprs():
        used = set(METRIC_NAME.findall(expr))
        assert used, f"panel {title!r}: expected a kvgate_ metric in {expr!r}"
        unknown = sorted(used - defined)
        assert not unknown, f"panel {title!r} queries {unknown}, which no process defines"


def test_dashboard_is_an_importable_grafana_dashboard_with_the_required_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    panels = dashboard["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), f"panel ids must be unique, got {ids}"
    for panel in panels:
        assert {"type", "title", "gridPos", "datasource", "targets"} <= panel.keys(), panel
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), f"panel {panel['title']!r}: refIds {ref_ids}"
    titles = " | ".join(panel["title"].lower() for panel in panels)
    missing = [word for word in REQUIRED_PANELS if word not in titles]
    assert not missing, f"expected panels about {missing}; the titles are: {titles}"
    quantile_exprs = [expr for title, expr in dashboard_exprs() if "histogram_quantile" in expr]
    for metric in ("kvgate_gateway_ttft_seconds_bucket", "kvgate_gateway_itl_seconds_bucket"):
        assert any(metric in expr for expr in quantile_exprs), f"no percentiles of {metric}"


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    rules = [
        {
            "record": f"kvgate:dashboard_query:{index}",
            "expr": expr.replace("$__rate_interval", "1m"),
        }
        for index, (_, expr) in enumerate(dashboard_exprs())
    ]
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    check = subprocess.run(
        ["promtool", "check", "rules", str(rules_file)], capture_output=True, text=True
    )
    assert check.returncode == 0, f"promtool rejects a query: {check.stdout}{check.stderr}"


def scrape_targets() -> dict[str, set[str]]:
    """Targets of deploy/prometheus.yml by job name."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    return {
        job["job_name"]: {t for static in job["static_configs"] for t in static["targets"]}
        for job in config["scrape_configs"]
    }


def test_prometheus_config_scrapes_the_ports_the_launcher_uses() -> None:
    targets = scrape_targets()
    jobs = {"gateway": "kvgate-gateway", "scheduler": "kvgate-scheduler"}
    for name, port in metrics_ports(DEFAULT_METRICS_PORT, num_executors=4).items():
        job = jobs.get(name, "kvgate-executor")
        assert f"127.0.0.1:{port}" in targets[job], (
            f"make run serves {name} metrics on port {port}; job {job} scrapes {targets[job]}"
        )


@needs_promtool
def test_prometheus_config_passes_promtool() -> None:
    check = subprocess.run(
        ["promtool", "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True
    )
    assert check.returncode == 0, f"promtool check config: {check.stdout}{check.stderr}"
