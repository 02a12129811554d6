"""The chart's dashboard ConfigMap and PrometheusRule created on the real API server (the
PrometheusRule against a stand-in of its CRD that types the rule groups as the real one
does): what the chart renders is what a cluster accepts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

from sdc_harness.cluster import KUBECTL, ROOT, Cluster, wait_for
from tests.chart.test_dashboard import ON

from .test_install import install

CRD_NAME = "prometheusrules.monitoring.coreos.com"
PROMETHEUSRULE_CRD = (
    ROOT / "scripts" / "sdc_harness" / "crds" / "monitoring.coreos.com_prometheusrules.yaml"
)


def ensure_crd(cluster: Cluster) -> None:
    found = subprocess.run(
        [KUBECTL, "--kubeconfig", cluster.kubeconfig, "get", "crd", CRD_NAME],
        capture_output=True,
    )
    if found.returncode != 0:
        cluster.kubectl("create", "-f", str(PROMETHEUSRULE_CRD))
    cluster.kubectl("wait", "--for", "condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")


def test_dashboard_and_alert_rules_are_created(cluster: Cluster, tmp_path: Path) -> None:
    ensure_crd(cluster)
    namespace, release = install(cluster, ON, tmp_path)
    cm = json.loads(
        cluster.kubectl("get", "configmap", f"{release}-dashboard", "-n", namespace, "-o", "json")
    )
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["hyperpod-sdc.json"])["uid"] == "hyperpod-sdc"
    rule = wait_for(
        "the PrometheusRule",
        lambda: json.loads(
            cluster.kubectl("get", "prometheusrules", release, "-n", namespace, "-o", "json")
        ),
    )
    alerts = [r["alert"] for r in rule["spec"]["groups"][0]["rules"]]
    assert alerts == [
        "HyperPodSDCIncidentOpened",
        "HyperPodSDCJobNotResumed",
        "HyperPodSDCNodeAwaitingReview",
        "HyperPodSDCAgentsSilent",
    ]
    # Nothing was pruned: the server kept every field the chart wrote.
    rendered = next(
        d
        for d in yaml.safe_load_all((tmp_path / f"{release}.yaml").read_text())
        if d and d["kind"] == "PrometheusRule"
    )
    assert rule["spec"] == rendered["spec"]
    # A rule the real CRD refuses (a duration that is not one) is refused here too.
    bad = tmp_path / "bad.yaml"
    broken = dict(rule)
    broken["metadata"] = {"name": "broken", "namespace": namespace}
    broken["spec"] = {
        "groups": [{"name": "x", "rules": [{"alert": "A", "expr": "1", "for": "ten minutes"}]}]
    }
    bad.write_text(yaml.safe_dump(broken))
    done = subprocess.run(
        [KUBECTL, "--kubeconfig", cluster.kubeconfig, "create", "-f", str(bad)],
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "for" in done.stderr
