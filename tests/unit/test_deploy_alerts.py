"""deploy/prometheus: the alert rules pass promtool's check and unit tests, every Prometheus
config passes promtool, and the Grafana dashboard has a panel on what each alert watches."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from tests.helpers import REPO
from tests.unit.test_dashboards import defined_metric_names

DEPLOY = REPO / "deploy"
RULES = DEPLOY / "prometheus" / "alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "alerts_test.yml"
DASHBOARD = DEPLOY / "grafana" / "kvgate.json"
METRIC = re.compile(r"\bkvgate_[a-z0-9_]+|\bkvgate:[a-z0-9_:]+")
EXPECTED_ALERTS = {
    "KvgateTtftP99OverSlo",
    "KvgateQueueGrowing",
    "KvgateNoExecutorAlive",
    "KvgateKvCacheFull",
    "KvgateRedisUnreachable",
    "KvgateKvMovesFallingBack",
}
pytestmark = pytest.mark.skipif(shutil.which("promtool") is None, reason="make promtool")


def promtool(*args: str) -> None:
    result = subprocess.run(["promtool", *args], capture_output=True, text=True, cwd=DEPLOY)
    assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}{result.stderr}"


def rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_the_rules_pass_promtool_check_and_their_unit_tests() -> None:
    promtool("check", "rules", str(RULES))
    promtool("test", "rules", str(RULE_TESTS))
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    assert alerts == EXPECTED_ALERTS, alerts
    assert tested == alerts, f"alerts without a unit test: {alerts - tested}"


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus/compose.yml"])
def test_every_prometheus_config_passes_promtool_with_the_rules(config: str) -> None:
    promtool("check", "config", config)
    rule_files = yaml.safe_load((DEPLOY / config).read_text())["rule_files"]
    assert any((DEPLOY / config).parent.joinpath(f).resolve() == RULES for f in rule_files)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_alert_links_to_what_to_do_in_the_operations_guide() -> None:
    guide = REPO / "docs" / "operations.md"
    anchors = {
        github_anchor(line.lstrip("#"))
        for line in guide.read_text().splitlines()
        if line.startswith("#")
    }
    for rule in rules():
        if "alert" in rule:
            path, _, anchor = rule["annotations"]["runbook"].partition("#")
            assert REPO / path == guide and anchor in anchors, (rule["alert"], anchor)


def test_the_rules_use_only_metrics_the_processes_define() -> None:
    defined = defined_metric_names()
    for rule in rules():
        used = {m for m in METRIC.findall(rule["expr"]) if not m.startswith("kvgate:")}
        assert used <= defined, f"{rule}: {sorted(used - defined)} are defined by no process"


def test_the_dashboard_shows_what_each_alert_watches() -> None:
    recorded = {rule["record"]: rule["expr"] for rule in rules() if "record" in rule}
    dashboard = json.loads(DASHBOARD.read_text())
    panels = {
        panel["title"]: set(METRIC.findall(" ".join(t["expr"] for t in panel["targets"])))
        for panel in dashboard["panels"]
    }
    for rule in rules():
        if "alert" not in rule:
            continue
        watched = set()
        for name in METRIC.findall(rule["expr"]):
            watched |= set(METRIC.findall(recorded[name])) if name in recorded else {name}
        showing = [title for title, metrics in panels.items() if watched <= metrics]
        assert showing, f"no panel shows {sorted(watched)}, which {rule['alert']} watches"
