"""deploy/'s Grafana dashboard and Prometheus alert rules name only metrics a running server exports."""
import json
import re
import shutil
import subprocess
import urllib.request

import pytest
import yaml

from prism_client.client import PrismClient

from helpers import REPO_ROOT, SAMPLE_TICKET

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "prism-dashboard.json"
ALERTS = REPO_ROOT / "deploy" / "prometheus" / "prism-alerts.yml"
METRIC_NAME = re.compile(r"\b((?:nv|prism)_[a-z0-9_]+)\b")


def dashboard_expressions() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def exported_names(metrics_port: int) -> set[str]:
    with urllib.request.urlopen(f"http://localhost:{metrics_port}/metrics") as r:
        text = r.read().decode()
    return {re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_every_metric_named_is_exported(server):
    PrismClient(f"localhost:{server.options.http_port}", "http").decide(SAMPLE_TICKET, ["team"])
    exported = exported_names(server.options.metrics_port)
    named = {name for expr in dashboard_expressions() + [r["expr"] for r in alert_rules()]
             for name in METRIC_NAME.findall(re.sub(r'"[^"]*"', "", expr))}  # not label values
    assert {"prism_determinism_self_check", "prism_engine_available", "prism_queue_wait_seconds_bucket",
            "prism_rejected_requests_total", "prism_tokens_computed_total",
            "prism_shared_prefix_hit_rate"} <= named  # what an operator watches
    assert named - exported == set()


def test_alert_rules_parse():
    rules = alert_rules()
    assert {r["alert"] for r in rules} == {"PrismDeterminismSelfCheckFailed", "PrismEngineUnavailable",
                                           "PrismHighErrorRate", "PrismQueueWaitNearBound", "PrismRefusingRequests"}
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"], rule
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]
    promtool = shutil.which("promtool")  # Debian's prometheus package (make setup installs it)
    if promtool is None:
        pytest.skip("promtool not installed: only the YAML structure was checked")
    done = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert done.returncode == 0 and "SUCCESS: 5 rules found" in done.stdout, done.stdout + done.stderr


def test_dashboard_is_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["panels"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
