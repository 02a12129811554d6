"""The creator check, which makes the marker true, must be there and must cover every write
that can add the marker, on the real (1.20) API server.

- A status update writes a pod's labels on this API server, so a creator check that sees
  only ``pods`` lets anyone who may update ``pods/status`` mark a pod; the chart's check
  sees ``pods/status`` too, and refuses it.
- The operator does not start where no creator check covers it (``creator_check``), and
  says what it found; it starts once the chart's check is registered.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from sdc_harness.cluster import Cluster, OperatorProcess, await_webhooks, own_webhook_names
from sdc_harness.tls import issue, make_ca
from sdc_operator.attestation import CREATED_BY_ANNOTATION, MARKER_LABEL
from tests.chart.test_chart import render

from .test_webhook import TEST_LABEL, label

TRUSTED = "system:serviceaccount:kubeflow:training-operator"


def creator_check(cluster: Cluster, namespace: str, url: str, ca: Path, name: str) -> dict:
    """The chart's creator check (its ValidatingWebhookConfiguration) for ``url``,
    confined to the test's namespace; created, and returned."""
    docs = render({"fullnameOverride": name})
    (check,) = [d for d in docs if d["kind"] == "ValidatingWebhookConfiguration"]
    for entry in check["webhooks"]:
        path = entry["clientConfig"]["service"]["path"]
        entry["clientConfig"] = {
            "url": f"{url}{path}",
            "caBundle": base64.b64encode(ca.read_bytes()).decode(),
        }
        entry["namespaceSelector"] = {"matchLabels": {TEST_LABEL: namespace}}
    own_webhook_names([check], namespace)
    return check


def register(cluster: Cluster, check: dict[str, Any]) -> Callable[[], None]:
    admission = client.AdmissionregistrationV1Api(cluster.api)
    admission.create_validating_webhook_configuration(check)
    namespace = check["webhooks"][0]["namespaceSelector"]["matchLabels"][TEST_LABEL]
    await_webhooks(cluster, [check], {TEST_LABEL: namespace})
    name = check["metadata"]["name"]
    return lambda: admission.delete_validating_webhook_configuration(name)


def plain_pod(cluster: Cluster, namespace: str, name: str) -> None:
    body = {
        "metadata": {"name": name},
        "spec": {
            "serviceAccountName": "worker",
            "automountServiceAccountToken": False,
            "containers": [{"name": "c", "image": "example.com/x:1"}],
        },
    }
    cluster.core.create_namespaced_pod(namespace, body)


def mark_through_status(cluster: Cluster, namespace: str, name: str) -> dict[str, str]:
    """What a user who may patch ``pods/status`` tries: the marker, naming the trusted
    creator, written through the status subresource. The pod's labels after."""
    patch = {
        "metadata": {
            "labels": {MARKER_LABEL: "true"},
            "annotations": {CREATED_BY_ANNOTATION: TRUSTED},
        }
    }
    cluster.core.patch_namespaced_pod_status(name, namespace, patch)
    return dict(cluster.core.read_namespaced_pod(name, namespace).metadata.labels or {})


def test_the_creator_check_covers_status_updates_and_the_operator_needs_it(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    label(cluster, namespace)
    ca = make_ca(tmp_path)
    key, cert = issue(tmp_path, ca)
    tls = {"scheme": "https", "tls_cert_file": str(cert), "tls_key_file": str(key)}
    settings: dict[str, Any] = {**tls, "trusted_pod_creators": TRUSTED, "creator_check": "webhook"}
    cleanups: list[Callable[[], None]] = []
    try:
        # The check as the chart had it (pods only): a status update marks the pod.
        old = creator_check(cluster, namespace, "https://127.0.0.1:9", ca[1], "old-check")
        for entry in old["webhooks"]:
            for rule in entry["rules"]:
                rule["resources"] = ["pods"]
        cleanups.append(register(cluster, old))
        plain_pod(cluster, namespace, "before")
        assert mark_through_status(cluster, namespace, "before").get(MARKER_LABEL) == "true"

        # ... and the operator refuses to start on it, saying why.
        with pytest.raises(AssertionError) as exited:
            start_operator(**settings)
        said = str(exited.value)
        assert "the creator check is not installed" in said, said
        assert "does not send CREATE pods/status, UPDATE pods/status" in said, said
        cleanups.pop()()

        # The chart's check, registered before the operator starts: it starts, and the
        # same status update is refused.
        class Registered(OperatorProcess):
            def before_start(self) -> None:
                check = creator_check(cluster, namespace, self.admission_url, ca[1], "chart")
                cleanups.append(register(cluster, check))

        op = Registered(cluster, namespace, tmp_path / "registered.log", **settings)
        cleanups.insert(0, op.stop)
        assert "creator check: webhook" in op.log()
        plain_pod(cluster, namespace, "after")
        with pytest.raises(client.ApiException) as refused:
            mark_through_status(cluster, namespace, "after")
        assert refused.value.status == 403
        assert "cannot be added to an existing pod" in str(refused.value.body)
        labels = cluster.core.read_namespaced_pod("after", namespace).metadata.labels or {}
        assert MARKER_LABEL not in labels
    finally:
        for cleanup in cleanups:
            cleanup()
