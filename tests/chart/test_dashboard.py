"""The chart's Grafana dashboard and PrometheusRule: rendered, off by default, every query
naming only metrics (and labels) that the operator or the DCGM exporter exports, and the
alert rules checked and unit-tested with promtool."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sdc_operator.metrics import Metrics

from .test_chart import CHART, ROOT, by_kind, render

ON = {"grafana": {"dashboards": {"enabled": True}}, "prometheusRule": {"enabled": True}}

PLANNED_OPERATOR_METRICS: dict[str, set[str]] = {}
"""Metrics a panel may name before the operator exports them (none now: the confirmation
counter, hyperpod_sdc_confirmations_total{outcome}, is exported)."""

# NVIDIA dcgm-exporter's etc/default-counters.csv (github.com/NVIDIA/dcgm-exporter, file at
# commit 00d6d344ea4a39112b211b9ff5af3d97e0bb51c2): the counters it exports by default...
DCGM_DEFAULT = {
    "DCGM_FI_DEV_SM_CLOCK",
    "DCGM_FI_DEV_MEM_CLOCK",
    "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "DCGM_FI_DEV_PCIE_TX_THROUGHPUT",
    "DCGM_FI_DEV_PCIE_RX_THROUGHPUT",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_MEM_COPY_UTIL",
    "DCGM_FI_DEV_ENC_UTIL",
    "DCGM_FI_DEV_DEC_UTIL",
    "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE",
}
# ... and those the same file lists commented out (exported once enabled). A panel may use
# these only if its description says they are not in the default counters.
DCGM_OPTIONAL = {
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
    "DCGM_FI_DEV_RETIRED_SBE",
    "DCGM_FI_DEV_RETIRED_DBE",
    "DCGM_FI_DEV_RETIRED_PENDING",
    "DCGM_FI_DEV_POWER_VIOLATION",
    "DCGM_FI_DEV_THERMAL_VIOLATION",
}
# The labels dcgm-exporter puts on every series (entity labels, and the pod mapping on
# Kubernetes).
DCGM_LABELS = {"gpu", "UUID", "device", "modelName", "Hostname", "pod", "namespace", "container"}

FUNCTIONS = {
    "sum",
    "max",
    "min",
    "avg",
    "count",
    "rate",
    "irate",
    "increase",
    "changes",
    "histogram_quantile",
    "label_values",
    "topk",
    "abs",
}
KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
}


def operator_metrics() -> dict[str, set[str]]:
    """Every series name the leader's /metrics exposes, with its labels (each labelled
    metric touched once, so its series appear in the exposition; the leader-owned gauges
    appear on the leader only)."""
    metrics = Metrics()
    metrics.lead(True)
    for value in vars(metrics).values():
        names = getattr(value, "_labelnames", None)
        if names:
            value.labels(*["x"] * len(names))
    exported: dict[str, set[str]] = {}
    text = generate_latest(metrics.registry).decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)
    return exported


def test_the_confirmation_counter_is_exported() -> None:
    assert operator_metrics()["hyperpod_sdc_confirmations_total"] == {"outcome"}


def known_metrics(node_label: str) -> dict[str, set[str]]:
    dcgm = {name: DCGM_LABELS | {node_label} for name in DCGM_DEFAULT | DCGM_OPTIONAL}
    return {**operator_metrics(), **PLANNED_OPERATOR_METRICS, **dcgm}


def parse(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """(metric -> label names in its selector, label names in by/without clauses) of a
    PromQL expression; raises on identifiers that are neither."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    s = re.sub(r"\[[^\]]*\]", "", s)  # range selectors
    s = re.sub(r"\$\{?\w+\}?", "", s)  # Grafana variables
    grouping: set[str] = set()
    for match in re.finditer(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", s):
        grouping.update(x.strip() for x in match.group(1).split(",") if x.strip())
    s = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", s)
    selectors: dict[str, set[str]] = {}
    for match in re.finditer(r"\b([A-Za-z_:][\w:]*)\s*\{([^}]*)\}", s):
        labels = set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", match.group(2)))
        selectors.setdefault(match.group(1), set()).update(labels)
    s = re.sub(r"\{[^}]*\}", " ", s)
    for match in re.finditer(r"\b([A-Za-z_:][\w:]*)\b(\s*\()?", s):
        word, call = match.group(1), match.group(2)
        if call:
            assert word in FUNCTIONS, f"unknown function {word!r} in {expr!r}"
        elif word not in KEYWORDS:
            selectors.setdefault(word, set())
    return selectors, grouping


def check_query(
    expr: str, known: dict[str, set[str]], allow_optional: bool, legend: str = ""
) -> None:
    selectors, grouping = parse(expr)
    assert selectors, f"no metric in {expr!r}"
    labels: set[str] = set()
    for metric, used in selectors.items():
        assert metric in known, f"{metric!r} is exported by neither the operator nor dcgm-exporter"
        if metric in DCGM_OPTIONAL:
            assert allow_optional, f"{metric} is not in dcgm-exporter's default counters"
        assert used <= known[metric], f"{metric} has no label(s) {used - known[metric]}"
        labels |= known[metric]
        if metric.endswith("_bucket"):
            labels.add("le")
    assert grouping <= labels, f"grouping by unknown label(s) {grouping - labels} in {expr!r}"
    in_legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
    assert in_legend <= labels, f"legend {legend!r} names label(s) no series has"


def dashboard(values: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    (cm,) = [
        d
        for d in by_kind(render(values or ON), "ConfigMap")
        if d["metadata"]["name"].endswith("-dashboard")
    ]
    return cm, json.loads(cm["data"]["hyperpod-sdc.json"])


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in board["panels"]:
        out.append(p)
        out += p.get("panels") or []
    return out


def test_both_are_off_by_default() -> None:
    docs = render()
    assert not [
        d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")
    ]
    assert not by_kind(docs, "PrometheusRule")


def test_the_dashboard_is_a_configmap_grafanas_sidecar_loads() -> None:
    cm, board = dashboard()
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "hyperpod-sdc"
    assert board["uid"] == "hyperpod-sdc" and board["title"].startswith("hyperpod-sdc")
    custom = {
        "grafana": {
            "dashboards": {
                "enabled": True,
                "label": "dashboards.example.com/load",
                "labelValue": "yes",
                "namespace": "monitoring",
                "annotations": {"grafana_folder": "GPUs"},
                "dcgmNodeLabel": "kubernetes_node",
            }
        }
    }
    cm, board = dashboard(custom)
    assert cm["metadata"]["labels"]["dashboards.example.com/load"] == "yes"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "GPUs"}
    text = json.dumps(board)
    assert "__DCGM_NODE_LABEL__" not in text and 'kubernetes_node=\\"$node\\"' in text


def test_the_panels_cover_what_a_reviewer_needs_and_do_not_overlap() -> None:
    _, board = dashboard()
    exprs = " ".join(t["expr"] for p in panels(board) for t in p.get("targets") or [])
    for metric in (
        "hyperpod_sdc_incidents_total",  # incidents over time
        "hyperpod_sdc_report_to_contained_seconds_bucket",  # time to contain
        "hyperpod_sdc_check_cost_ratio",  # check cost per step
        "hyperpod_sdc_heartbeats_total",  # agents' heartbeats
        "hyperpod_sdc_reporting_nodes",
        "hyperpod_sdc_silent_jobs",
        "DCGM_FI_DEV_GPU_TEMP",  # the suspect node's GPUs: temperature, power, clocks,
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_SM_CLOCK",
        "DCGM_FI_DEV_XID_ERRORS",  # XID, ECC
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    ):
        assert metric in exprs, metric
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["node"]["definition"] == "label_values(DCGM_FI_DEV_GPU_TEMP, Hostname)"
    assert 'Hostname="$node"' in exprs
    (incidents,) = [a for a in board["annotations"]["list"] if a.get("expr")]
    assert "hyperpod_sdc_incidents_total" in incidents["expr"]  # marks detections on every graph
    cells: set[tuple[int, int]] = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
    assert len({p["id"] for p in panels(board)}) == len(panels(board))
    assert all(
        p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for p in panels(board)
        if p["type"] != "row"
    )


def test_every_query_names_only_metrics_that_are_exported() -> None:
    for node_label in ("Hostname", "kubernetes_node"):
        values = {**ON, "grafana": {"dashboards": {"enabled": True, "dcgmNodeLabel": node_label}}}
        _, board = dashboard(values)
        known = known_metrics(node_label)
        checked = 0
        for p in panels(board):
            optional = "Not in dcgm-exporter's default counters" in p.get("description", "")
            for target in p.get("targets") or []:
                check_query(target["expr"], known, optional, target.get("legendFormat", ""))
                checked += 1
        for annotation in board["annotations"]["list"]:
            if annotation.get("expr"):
                check_query(annotation["expr"], known, False)
                checked += 1
        for variable in board["templating"]["list"]:
            match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable.get("definition", ""))
            if match:
                metric, label = match.groups()
                assert label in known[metric], f"{metric} has no label {label}"
                checked += 1
        assert checked >= 25


def test_the_checker_catches_what_it_must() -> None:
    known = known_metrics("Hostname")
    for bad in (
        "rate(hyperpod_sdc_incident_total[5m])",  # a typo
        "up",  # a metric neither exports
        'hyperpod_sdc_check_cost_ratio{pod="x"}',  # a label it lacks
        "sum by (node) (hyperpod_sdc_reporting_nodes)",
        "hyperpod_sdc_agents_silent",  # the brief's name; the operator exports silent_jobs
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",  # optional, not flagged as such
        "predict_linear(hyperpod_sdc_quarantined_nodes[1h], 60)",  # an unknown function
    ):
        with pytest.raises(AssertionError):
            check_query(bad, known, False)
    with pytest.raises(AssertionError, match="legend"):
        check_query("sum by (phase) (hyperpod_sdc_held_incidents_total)", known, False, "{{node}}")
    check_query("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", known, True)
    assert "hyperpod_sdc_actions_total" in known and "hyperpod_sdc_actions_created" in known
    assert known["hyperpod_sdc_incidents_total"] == {"check", "classification"}


def test_the_service_monitor_keeps_the_jobs_own_labels() -> None:
    (monitor,) = by_kind(render({"serviceMonitor": {"enabled": True}}), "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True


def rule_object(values: dict[str, Any] | None = None) -> dict[str, Any]:
    (rule,) = by_kind(render(values or ON), "PrometheusRule")
    return rule


def test_alert_rules_match_the_crd_and_name_only_exported_metrics() -> None:
    crd = yaml.safe_load(
        (
            ROOT / "scripts" / "sdc_harness" / "crds" / "monitoring.coreos.com_prometheusrules.yaml"
        ).read_text()
    )
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema = json.loads(json.dumps(schema).replace('"x-kubernetes-int-or-string": true, ', ""))
    rule = rule_object(
        {
            **ON,
            "prometheusRule": {
                "enabled": True,
                "labels": {"release": "kps"},
                "alertLabels": {"team": "ml"},
            },
        }
    )
    jsonschema.validate(rule, schema)
    assert rule["metadata"]["labels"]["release"] == "kps"
    rules = rule["spec"]["groups"][0]["rules"]
    assert [r["alert"] for r in rules] == [
        "HyperPodSDCIncidentOpened",
        "HyperPodSDCJobNotResumed",
        "HyperPodSDCNodeAwaitingReview",
        "HyperPodSDCAgentsSilent",
    ]
    known = known_metrics("Hostname")
    for r in rules:
        check_query(r["expr"], known, False)
        assert r["labels"]["team"] == "ml" and r["labels"]["severity"] in ("critical", "warning")
        assert r["annotations"]["summary"] and r["annotations"]["description"]
    assert [r.get("for") for r in rules] == [None, None, "4h", "10m"]
    with pytest.raises(Exception, match="jobNotResumedMinutes"):
        render({"prometheusRule": {"enabled": True, "jobNotResumedMinutes": 0}})


def test_lint_is_clean_with_both_on() -> None:
    import helm_python as helm

    report = helm.lint(str(CHART), ON, strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


def promtool() -> str:
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        pytest.skip("promtool comes from Debian's prometheus package: no apt-get here")
    done = subprocess.run(
        [str(ROOT / "scripts" / "promtool.sh")], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"scripts/promtool.sh failed:\n{done.stderr}"
    return done.stdout.strip()


# Input series for promtool's rule unit tests (one sample a minute) and the alerts expected.
UNIT_TESTS: list[dict[str, Any]] = [
    {
        "interval": "1m",
        "input_series": [
            {
                "series": 'hyperpod_sdc_incidents_total{check="replay",classification="rank"}',
                "values": "0 0 0 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1",
            },
            {
                # not hardware: never an alert
                "series": "hyperpod_sdc_incidents_total"
                '{check="nonfinite",classification="training"}',
                "values": "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19",
            },
        ],
        "alert_rule_test": [
            {"eval_time": "2m", "alertname": "HyperPodSDCIncidentOpened", "exp_alerts": []},
            {
                "eval_time": "5m",
                "alertname": "HyperPodSDCIncidentOpened",
                "exp_alerts": [{"labels": {"check": "replay", "classification": "rank"}}],
            },
            {"eval_time": "19m", "alertname": "HyperPodSDCIncidentOpened", "exp_alerts": []},
        ],
    },
    {
        "interval": "1m",
        "input_series": [
            {
                "series": 'hyperpod_sdc_actions_total{action="resume-job",result="Skipped"}',
                "values": "0x5 1x60",
            },
            {
                "series": 'hyperpod_sdc_actions_total{action="resume-job",result="Succeeded"}',
                "values": "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
            },
        ],
        "alert_rule_test": [
            {"eval_time": "4m", "alertname": "HyperPodSDCJobNotResumed", "exp_alerts": []},
            {
                "eval_time": "10m",
                "alertname": "HyperPodSDCJobNotResumed",
                "exp_alerts": [{"labels": {}}],
            },
            {"eval_time": "40m", "alertname": "HyperPodSDCJobNotResumed", "exp_alerts": []},
        ],
    },
    {
        "interval": "1m",
        "input_series": [{"series": "hyperpod_sdc_quarantined_nodes", "values": "1x300 0x30"}],
        "alert_rule_test": [
            {"eval_time": "3h", "alertname": "HyperPodSDCNodeAwaitingReview", "exp_alerts": []},
            {
                "eval_time": "4h10m",
                "alertname": "HyperPodSDCNodeAwaitingReview",
                "exp_alerts": [{"labels": {}}],
            },
            {"eval_time": "5h30m", "alertname": "HyperPodSDCNodeAwaitingReview", "exp_alerts": []},
        ],
    },
    {
        "interval": "1m",
        "input_series": [
            {"series": "hyperpod_sdc_silent_jobs", "values": "0x5 1x20"},
        ],
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": "HyperPodSDCAgentsSilent", "exp_alerts": []},
            {
                "eval_time": "17m",
                "alertname": "HyperPodSDCAgentsSilent",
                "exp_alerts": [{"labels": {}, "value": "1"}],
            },
        ],
    },
]


def _expand(template: str, labels: dict[str, str], value: str = "") -> str:
    text = re.sub(r"\{\{\s*\$value\s*\}\}", value, template)
    return re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), text)


def test_alert_rules_pass_promtool(tmp_path: Path) -> None:
    tool = promtool()
    rules = rule_object()["spec"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules, sort_keys=False))
    done = subprocess.run(
        [tool, "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 4 rules found" in done.stdout
    by_name = {r["alert"]: r for r in rules["groups"][0]["rules"]}
    tests = json.loads(json.dumps(UNIT_TESTS))
    for case in tests:
        for check in case["alert_rule_test"]:
            rule = by_name[check["alertname"]]
            expanded = []
            for alert in check["exp_alerts"]:
                labels = {**alert["labels"], **rule["labels"], "alertname": rule["alert"]}
                labels.pop("alertname")
                value = alert.get("value", "")
                annotations = {k: _expand(v, labels, value) for k, v in rule["annotations"].items()}
                expanded.append({"exp_labels": labels, "exp_annotations": annotations})
            check["exp_alerts"] = expanded
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests})
    )
    done = subprocess.run(
        [tool, "test", "rules", str(tmp_path / "tests.yaml")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # The same tests fail when a rule is wrong: promtool really evaluates them.
    broken = yaml.safe_load((tmp_path / "rules.yaml").read_text())
    broken["groups"][0]["rules"][1]["for"] = "60m"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(broken, sort_keys=False))
    done = subprocess.run(
        [tool, "test", "rules", str(tmp_path / "tests.yaml")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode != 0 and "HyperPodSDCJobNotResumed" in done.stdout + done.stderr
