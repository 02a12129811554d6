"""The Helm chart and the example manifests on a real API server: created as rendered, the
ClusterRole checked by SubjectAccessReview, and the operator run under the chart's own
ServiceAccount."""

from __future__ import annotations

import base64
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from sdc_harness.cluster import ROOT, Cluster, OperatorProcess, served_here, wait_for
from tests.chart.test_chart import ALL_ON, render

from .test_containment import NOT_RESUMED, incident_in, make_job, send, verdict


def install(cluster: Cluster, values: dict[str, Any], tmp_path: Path) -> tuple[str, str]:
    """Render the chart as release ``sdc-<random>`` into a new namespace and create every
    object for real; returns (namespace, release)."""
    release = f"sdc-{secrets.token_hex(3)}"
    namespace = f"{release}-system"
    cluster.core.create_namespace({"metadata": {"name": namespace}})
    chart_values = {**values, "fullnameOverride": release}
    docs = served_here(render(chart_values, namespace=namespace))
    manifest = tmp_path / f"{release}.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    cluster.kubectl("create", "-f", str(manifest))
    # Created as rendered (the server checked it), then removed: it is cluster-wide, and
    # no operator behind it runs here (tests/integration/test_webhook.py runs one).
    cluster.kubectl("delete", "mutatingwebhookconfiguration", release)
    # the creator check too: with failurePolicy Fail and no operator, it would refuse every
    # marked pod of the other tests
    cluster.kubectl("delete", "validatingwebhookconfiguration", f"{release}-creator")
    return namespace, release


@pytest.mark.parametrize("values", [{}, ALL_ON], ids=["defaults", "all-optional-parts"])
def test_rendered_chart_is_created(
    cluster: Cluster, values: dict[str, Any], tmp_path: Path
) -> None:
    namespace, release = install(cluster, values, tmp_path)
    got = cluster.kubectl(
        "get", "deployment,service,serviceaccount,secret", "-n", namespace, "-o", "name"
    )
    assert f"mutatingwebhookconfiguration.admissionregistration.k8s.io/{release}" not in (
        cluster.kubectl("get", "mutatingwebhookconfigurations", "-o", "name")
    )  # created, then removed by install()
    for name in (
        f"deployment.apps/{release}",
        f"service/{release}",
        f"service/{release}-webhook",
        f"service/{release}-metrics",
        f"serviceaccount/{release}",
        f"secret/{release}-tls",
    ):
        assert name in got.split()
    if values:
        assert f"servicemonitor.monitoring.coreos.com/{release}" in cluster.kubectl(
            "get", "servicemonitors", "-n", namespace, "-o", "name"
        )
        assert cluster.kubectl("get", "networkpolicy", "-n", namespace, "-o", "name").split() == [
            f"networkpolicy.networking.k8s.io/{release}-{listener}"
            for listener in ("admission", "intake", "metrics")
        ]


def can(
    cluster: Cluster,
    namespace: str,
    sa: str,
    verb: str,
    group: str,
    resource: str,
    subresource: str = "",
    name: str = "",
    *,
    where: str = "ml",
) -> bool:
    """May ServiceAccount ``namespace/sa`` do this in namespace ``where``?"""
    review = client.AuthorizationV1Api(cluster.api).create_subject_access_review(
        {
            "spec": {
                "user": f"system:serviceaccount:{namespace}:{sa}",
                "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"],
                "resourceAttributes": {
                    "verb": verb,
                    "group": group,
                    "resource": resource,
                    "subresource": subresource,
                    "namespace": where,
                    "name": name,
                },
            }
        }
    )
    return bool(review.status.allowed)


def test_cluster_role_allows_what_the_operator_does_and_nothing_more(
    cluster: Cluster, tmp_path: Path
) -> None:
    namespace, release = install(cluster, {}, tmp_path)
    needed = [
        ("create", "authentication.k8s.io", "tokenreviews", ""),
        ("get", "", "pods", ""),
        ("list", "", "pods", ""),
        ("get", "", "nodes", ""),
        ("list", "", "nodes", ""),
        ("patch", "", "nodes", ""),
        ("create", "", "events", ""),
        ("get", "", "events", ""),
        ("get", "kubeflow.org", "pytorchjobs", ""),
        ("patch", "kubeflow.org", "pytorchjobs", ""),
        ("get", "sagemaker.amazonaws.com", "hyperpodpytorchjobs", ""),
        ("patch", "sagemaker.amazonaws.com", "hyperpodpytorchjobs", ""),
        ("list", "kueue.x-k8s.io", "workloads", ""),
        ("patch", "kueue.x-k8s.io", "workloads", ""),
        ("create", "hyperpod-sdc.dev", "sdcincidents", ""),
        ("watch", "hyperpod-sdc.dev", "sdcincidents", ""),
        ("delete", "hyperpod-sdc.dev", "sdcincidents", ""),
        ("update", "hyperpod-sdc.dev", "sdcincidents", "status"),
        # the webhook and the job watch
        ("list", "kubeflow.org", "pytorchjobs", ""),
        ("watch", "sagemaker.amazonaws.com", "hyperpodpytorchjobs", ""),
        ("create", "", "configmaps", ""),
        ("get", "", "configmaps", "", "hyperpod-sdc-ca"),
        ("update", "", "configmaps", "", "hyperpod-sdc-ca"),
        ("watch", "", "pods", ""),
        ("watch", "", "nodes", ""),
        ("watch", "kubeflow.org", "pytorchjobs", ""),
        ("list", "hyperpod-sdc.dev", "sdcpolicies", ""),
        ("watch", "hyperpod-sdc.dev", "sdcpolicies", ""),
        ("get", "", "namespaces", ""),
        # the confirmation pod on a quarantined node (confirmation.enabled, the default)
        ("create", "", "pods", ""),
        ("delete", "", "pods", ""),
    ]
    own = [  # in the operator's namespace only
        ("get", "coordination.k8s.io", "leases", ""),
        ("create", "coordination.k8s.io", "leases", ""),
        ("update", "coordination.k8s.io", "leases", ""),
        ("create", "", "secrets", ""),
    ]
    refused = [
        ("get", "", "secrets", ""),
        ("list", "", "secrets", ""),
        ("watch", "", "secrets", ""),
        ("delete", "", "nodes", ""),
        ("create", "", "pods", "exec"),
        ("update", "", "pods", ""),
        ("patch", "", "pods", ""),
        ("update", "", "nodes", ""),
        ("get", "", "configmaps", ""),
        ("get", "", "configmaps", "", "someone-elses"),
        ("update", "", "configmaps", "", "someone-elses"),
        ("list", "", "configmaps", ""),
        ("delete", "kubeflow.org", "pytorchjobs", ""),
        ("create", "rbac.authorization.k8s.io", "clusterrolebindings", ""),
        ("create", "hyperpod-sdc.dev", "sdcpolicies", ""),
        ("update", "hyperpod-sdc.dev", "sdcpolicies", ""),
        ("create", "coordination.k8s.io", "leases", ""),
        ("create", "", "secrets", ""),
    ]
    assert [a for a in needed if not can(cluster, namespace, release, *a)] == []
    assert [a for a in refused if can(cluster, namespace, release, *a)] == []
    assert [a for a in own if not can(cluster, namespace, release, *a, where=namespace)] == []
    key = f"{release}-attestation"
    assert can(cluster, namespace, release, "get", "", "secrets", where=namespace, name=key)
    for other in ("get", "list", "watch"):  # no other Secret of its own namespace
        assert not can(
            cluster, namespace, release, other, "", "secrets", where=namespace, name="tls"
        )


def test_operator_runs_under_the_charts_service_account(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess], tmp_path: Path
) -> None:
    """Everything the operator does in a real incident, with only the chart's RBAC."""
    release_ns, release = install(cluster, {}, tmp_path)
    kubeconfig = cluster.kubeconfig_for(release_ns, release, tmp_path / "sa-kubeconfig")
    op = start_operator(
        kubeconfig=kubeconfig,
        operator_namespace=release_ns,
        attestation_secret=f"{release}-attestation",
    )
    # The operator created its attestation key: the pods are attested with it.
    secret = cluster.core.read_namespaced_secret(f"{release}-attestation", release_ns)
    job = make_job(cluster, namespace, key=base64.b64decode(secret.data["key"]))
    for reporter in (0, 2):
        assert send(cluster, op, job, reporter, verdict(job, reporter))[0] == 202
    incident = incident_in(cluster, namespace, "Contained")
    assert [(a["action"], a["result"]) for a in incident["status"]["actions"]] == [
        ("suspend-job", "Succeeded"),
        ("quarantine-node", "Succeeded"),
        NOT_RESUMED,
    ]
    assert "Forbidden" not in op.log()

    def kept_warm() -> bool:
        """The engine's two pools asked ``/version`` (Kube.keep_warm) and were answered."""
        answered = {
            pool
            for line in op.metrics().splitlines()
            if line.startswith("hyperpod_sdc_api_requests_total{")
            and 'resource="version"' in line
            and 'code="200"' in line
            and float(line.rsplit(" ", 1)[1]) > 0
            for pool in ("engine", "containment")
            if f'client="{pool}"' in line
        }
        return answered == {"engine", "containment"}

    wait_for("the engine's pools kept warm under the chart's RBAC", kept_warm)


@pytest.mark.parametrize("example", ["pytorchjob.yaml", "hyperpodpytorchjob.yaml"])
def test_example_manifests_are_accepted(cluster: Cluster, example: str) -> None:
    try:
        cluster.core.create_namespace({"metadata": {"name": "ml"}})
    except client.ApiException as exc:
        if exc.status != 409:
            raise
    out = cluster.kubectl("create", "--dry-run=server", "-f", str(ROOT / "examples" / example))
    assert "created (server dry run)" in out
    doc = yaml.safe_load((ROOT / "examples" / example).read_text())
    assert doc["metadata"]["annotations"]["hyperpod-sdc.dev/enabled"] == "true"
