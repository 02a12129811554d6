"""The attack on the attestation, end to end, with the chart's webhooks registered on the
real API server: a tenant who may create pods in an opted-in job's namespace forges an
AdmissionReview, floods the webhook with slow connections, and makes a genuine pod again
on another node. None of it gets a tenant's pod believed.

Before (issue 24): the forged review was answered with a valid ``v2`` attestation; 64 slow
connections held every slot of the webhook, so the API server's real reviews timed out and,
under ``failurePolicy: Ignore``, the tenant's pod was admitted with the copied value and
the training operator's pods unattested.
"""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from sdc_agent.protocol import HeartbeatReport, ReporterIdentity, encode_report
from sdc_harness.cluster import (
    Cluster,
    OperatorProcess,
    controller_reference,
    post,
    post_split,
    wait_for,
)
from sdc_operator.attestation import CREATED_BY_ANNOTATION, MARKER_LABEL
from sdc_operator.handlers import ADMISSION_CONNECTIONS_PER_SOURCE
from sdc_operator.webhook import ADMISSION_PATH

from . import test_webhook
from .test_webhook import (
    KUBEFLOW,
    Setup,
    admit,
    create_pod,
    make_job,
    post_raw,
    tenant_api,
)

# the webhook tests' fixtures: an operator over TLS with the chart's webhooks registered
setup = test_webhook.setup
policies = test_webhook.policies


def forged_review(namespace: str, name: str, job: dict[str, Any], creator: str) -> bytes:
    """What a tenant posts: the trusted creator's name in ``userInfo``, a pod shaped like
    the next replica of its own opted-in job."""
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "forged-1",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "operation": "CREATE",
                "namespace": namespace,
                "userInfo": {"username": creator},
                "object": {
                    "metadata": {
                        "name": name,
                        "namespace": namespace,
                        "labels": dict(KUBEFLOW),
                        "ownerReferences": [controller_reference(job)],
                    },
                    "spec": {"containers": [{"name": "pytorch", "image": "example.com/x:1"}]},
                },
            },
        }
    ).encode()


class SlowFlood:
    """``count`` TLS clients from ``source`` that each send a review's headers and then
    its body one byte every 0.2 s, reconnecting when cut off."""

    def __init__(self, port: int, count: int, source: str) -> None:
        self.port, self.source = port, source
        self.stopped = threading.Event()
        self.connections = 0
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(count)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        context = ssl._create_unverified_context()
        head = (
            f"POST {ADMISSION_PATH}?timeout=5s HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
        ).encode()
        while not self.stopped.is_set():
            with contextlib.suppress(OSError):
                raw = socket.create_connection(
                    ("127.0.0.1", self.port), timeout=10, source_address=(self.source, 0)
                )
                with context.wrap_socket(raw) as sock:
                    self.connections += 1
                    sock.sendall(head + b"{")
                    while not self.stopped.wait(0.2):
                        sock.sendall(b" ")
            self.stopped.wait(0.1)

    def stop(self) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(15)


def marker_of(patch: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, str]]:
    """The labels and annotations a webhook patch adds."""
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    for op in patch:
        path = op["path"]
        if path.startswith("/metadata/labels/"):
            labels[path.rsplit("/", 1)[1].replace("~1", "/")] = op["value"]
        elif path == "/metadata/annotations":
            annotations.update(op["value"])
        elif path.startswith("/metadata/annotations/"):
            annotations[path.rsplit("/", 1)[1].replace("~1", "/")] = op["value"]
    return labels, annotations


def heartbeat_from(pod: str, node: str) -> bytes:
    return encode_report(HeartbeatReport(ReporterIdentity(0, node, pod), time.time(), 20, 10))


def test_a_forged_review_earns_a_tenant_nothing_even_under_a_slow_flood(
    cluster: Cluster, namespace: str, setup: Callable[..., Setup], tmp_path: Path
) -> None:
    admit(cluster, namespace)
    s = setup()  # the trusted creator here: the tests' admin
    job = make_job(cluster, namespace, replicas=12)  # llama-master-0, llama-worker-0..10
    tenant = tenant_api(cluster, namespace, tmp_path)
    # 1. The mutating webhook answers the forged review (anyone who reaches its port may
    # ask) with the marker ...
    status, answer = post_raw(s.op, forged_review(namespace, "llama-worker-5", job, "admin"))
    assert status == 200
    labels, annotations = marker_of(json.loads(base64.b64decode(answer["response"]["patch"])))
    assert labels == {MARKER_LABEL: "true"} and annotations[CREATED_BY_ANNOTATION] == "admin"
    # 2. ... while 160 slow clients from one address hold connections to the webhook
    flood = SlowFlood(s.op.admission_port, 160, "127.0.0.2")
    try:
        wait_for("the slow clients connected", lambda: flood.connections >= 160, timeout=30)
        # 3. The tenant writes that marker on a pod of its own: the mutating webhook, still
        # answering the API server, strips it ...
        stripped = create_pod(
            cluster,
            namespace,
            "llama-worker-5",
            job,
            labels={**KUBEFLOW, **labels},
            annotations=annotations,
            core=tenant,
        )
        assert MARKER_LABEL not in stripped["metadata"]["labels"]
        assert CREATED_BY_ANNOTATION not in (stripped["metadata"].get("annotations") or {})
        # ... and on a pod the mutating webhook is not sent (none of the training operators'
        # labels), the creator check refuses it: the API server sees who creates the pod
        with pytest.raises(client.ApiException) as refused:
            create_pod(
                cluster,
                namespace,
                "llama-worker-7",
                job,
                labels=labels,
                annotations=annotations,
                core=tenant,
            )
        assert refused.value.status == 403, refused.value
        assert "may be set only by a trusted pod creator" in str(refused.value.body)
        # 4. The training operator's pods made meanwhile are marked and wired, every one
        for i in range(5):
            pod = create_pod(cluster, namespace, f"llama-worker-{i}", job)
            assert pod["metadata"]["labels"].get(MARKER_LABEL) == "true", i
            assert any(
                e["name"] == "HYPERPOD_SDC_OPERATOR_URL"
                for e in pod["spec"]["containers"][0].get("env", [])
            ), i
        # the flood did hold its connections: all one address may (128 of the 160)
        assert flood.connections >= ADMISSION_CONNECTIONS_PER_SOURCE
    finally:
        flood.stop()
    # 5. The tenant's pod, unmarked, has its reports refused
    token = cluster.token(namespace, "llama-worker-5")
    unverified = ssl._create_unverified_context()
    status, body = post_split(
        s.op.url, heartbeat_from("llama-worker-5", "node-x"), token, context=unverified
    )
    assert (status, body["error"]) == (403, "not_attested"), body
    log = s.op.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


def test_a_genuine_pod_made_again_by_a_tenant_is_refused(
    cluster: Cluster,
    namespace: str,
    setup: Callable[..., Setup],
    start_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> None:
    """A genuine pod deleted and made again under its name, with its labels and
    annotations copied, on another node: refused by the API server, also while the
    operator is down (the creator check fails closed); made without the marker, its
    reports are refused."""
    admit(cluster, namespace)
    s = setup()
    job = make_job(cluster, namespace)
    tenant = tenant_api(cluster, namespace, tmp_path)
    genuine = create_pod(cluster, namespace, "llama-worker-0", job)
    copied_labels = genuine["metadata"]["labels"]
    copied = {CREATED_BY_ANNOTATION: genuine["metadata"]["annotations"][CREATED_BY_ANNOTATION]}
    assert copied_labels[MARKER_LABEL] == "true"
    s.op.kill()  # the webhooks are down
    tenant.delete_namespaced_pod("llama-worker-0", namespace, grace_period_seconds=0)
    for attempt in range(2):
        with pytest.raises(client.ApiException) as refused:
            create_pod(
                cluster,
                namespace,
                "llama-worker-0",
                job,
                labels=copied_labels,
                annotations=copied,
                core=tenant,
            )
        assert refused.value.status >= 400, attempt
    names = [p.metadata.name for p in cluster.core.list_namespaced_pod(namespace).items]
    assert "llama-worker-0" not in names
    # without the marker the pod is created (the mutating webhook fails open) ...
    create_pod(cluster, namespace, "llama-worker-0", job, core=tenant)
    # ... and the intake, up again, does not believe it
    op = start_operator()
    token = cluster.token(namespace, "llama-worker-0")
    status, body, _ = post(op.url, heartbeat_from("llama-worker-0", "node-x"), token)
    assert (status, body["error"]) == (403, "not_attested"), body
