"""The shipped Grafana dashboard and Prometheus alert rules are well formed. That every series
they query is one the gateway exports is checked against a live scrape in
tests/gateway/test_metrics.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "tandem-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
DURATION = re.compile(r"([0-9]+(ms|s|m|h|d|w|y))+")


def balanced(expr: str) -> bool:
    closing = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    for ch in re.sub(r'"[^"]*"', '""', expr):  # brackets inside label values do not count
        if ch in "([{":
            stack.append(ch)
        elif ch in closing and (not stack or stack.pop() != closing[ch]):
            return False
    return not stack


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def test_dashboard_panels_are_distinct_and_do_not_overlap() -> None:
    panels = dashboard()["panels"]
    assert len(panels) >= 12
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert g["x"] + g["w"] <= 24 and not cells & mine, p["title"]
        cells |= mine


def test_every_dashboard_query_reads_the_chosen_model_from_the_data_source_variable() -> None:
    data = dashboard()
    variables = {v["name"] for v in data["templating"]["list"]}
    assert {"DS_PROMETHEUS", "model_name", "worker"} <= variables
    for panel in data["panels"]:
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(set(refs)) == len(refs), panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}"
            assert balanced(expr), expr
            selectors = re.findall(r"tandem:[a-zA-Z0-9_:]+(\{[^}]*\})?", expr)
            assert selectors and all('model_name="$model_name"' in s for s in selectors), expr


def test_alert_rules_are_complete() -> None:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    names = [r["alert"] for r in rules]
    assert len(set(names)) == len(names) >= 6
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert "tandem:" in rule["expr"] and balanced(rule["expr"]), rule["alert"]
        assert DURATION.fullmatch(str(rule.get("for", "0s"))), rule["alert"]
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    for wanted in ("TandemHighTimeToFirstTokenP99", "TandemKVCacheNearlyFull",
                   "TandemKVTransferFailures", "TandemWorkerUnhealthy", "TandemHighErrorRate"):  # fmt: skip
        assert wanted in names
    kv = next(r for r in rules if r["alert"] == "TandemKVCacheNearlyFull")
    assert kv["expr"].strip() == "tandem:kv_cache_usage_perc > 0.95" and kv["for"] == "5m"
