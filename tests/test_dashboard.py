"""The Grafana dashboard in `examples/observability/`: what its PromQL queries, checked against
the plugin's metric registry here, and against a running server's `/metrics` in
`test_server.py` (whose server has served cache hits and written the host tier by then)."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

from vllm_hpc.runtime.telemetry import COUNTERS, LEVELS, WORKER_COUNTERS, WORKER_LEVELS

DASHBOARD = Path(__file__).parents[1] / "examples/observability/grafana-hybrid-prefix.json"

_METRIC = re.compile(r"(vllm:[A-Za-z0-9_:]+)(\{[^}]*\})?")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_LABEL_VALUES = re.compile(r"label_values\(\s*(vllm:[A-Za-z0-9_:]+)\s*,\s*([A-Za-z0-9_]+)\s*\)")


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard: its panels' targets and its variables."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            queries.append(query["query"])
    return queries


def series_used(expr: str) -> dict[str, set[str]]:
    """The metrics ``expr`` reads, each with the labels it selects or groups them by (a
    grouping applies to every metric of the expression, so the dashboard's expressions group
    only metrics that share the grouped labels)."""
    grouped = {label.strip() for group in _GROUPING.findall(expr) for label in group.split(",")}
    used: dict[str, set[str]] = defaultdict(set)
    for name, selector in _METRIC.findall(expr):
        used[name] |= set(_MATCHER.findall(selector)) | (grouped - {""})
    for name, label in _LABEL_VALUES.findall(expr):
        used[name].add(label)
    return dict(used)


def dashboard_series() -> dict[str, set[str]]:
    """Every metric the dashboard reads, with every label any of its queries uses."""
    merged: dict[str, set[str]] = defaultdict(set)
    for expr in dashboard_queries():
        for name, labels in series_used(expr).items():
            merged[name] |= labels
    return dict(merged)


def test_the_plugin_metrics_the_dashboard_reads_are_the_plugins() -> None:
    """Each `vllm:hpc_*` series the dashboard reads is one the plugin defines (a counter read
    through its `_total` sample), with no label the plugin does not give it; every panel
    queries something."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert all(panel["targets"] for panel in dashboard["panels"])
    labels = {"model_name", "engine"}
    counters = (*COUNTERS, *WORKER_COUNTERS)
    known = {f"{m.family}_total": {m.label[0]} if m.label else set() for m in counters}
    known.update({m.family: set() for m in (*LEVELS, *WORKER_LEVELS)})
    ours = {name: used for name, used in dashboard_series().items() if name.startswith("vllm:hpc_")}
    assert ours
    for name, used in ours.items():
        assert name in known, name
        assert used <= known[name] | labels, (name, used)
