"""The admission webhook on the real API server: the chart's MutatingWebhookConfiguration,
as rendered, with only ``clientConfig.service`` swapped for the operator's loopback URL, so
the API server calls ``python -m sdc_operator`` over TLS for every pod the selectors pick.

Each test's namespace carries a label that the rendered ``namespaceSelector`` matches (a
chart value), so no other test's pods are ever sent to these webhooks.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from sdc_harness.cluster import (
    ROOT,
    Cluster,
    OperatorProcess,
    await_webhooks,
    controller_reference,
    own_webhook_names,
    served_here,
    wait_for,
)
from sdc_harness.tls import issue, make_ca
from sdc_operator.attestation import ATTESTATION_ANNOTATION, CREATED_BY_ANNOTATION, MARKER_LABEL
from sdc_operator.injection import INJECTION_ANNOTATION
from sdc_operator.webhook import MAX_REVIEW_DEPTH
from tests.chart.test_chart import render

TEST_LABEL = "hyperpod-sdc-test"
POD_URL = "https://hyperpod-sdc.hyperpod-sdc.svc:443"  # what the pods are told
KUBEFLOW = {"training.kubeflow.org/operator-name": "pytorchjob-controller"}


# -- certificates: a CA and the operator's certificate for 127.0.0.1 -----------------------


# -- the webhook as the chart renders it ------------------------------------------------------


def register_webhook(
    cluster: Cluster, op: OperatorProcess, ca_cert: Path, namespace: str, **webhook: Any
) -> str:
    """Create the chart's MutatingWebhookConfiguration and its creator check (the
    ValidatingWebhookConfiguration this 1.20 API server gets) for ``op``; returns the
    name. The creator check is confined to the test's namespace here (in the chart it
    covers every namespace but kube-system and the release's), so that no other test's
    pods are sent to it."""
    name = f"sdc-test-{secrets.token_hex(3)}"
    values = {
        "fullnameOverride": name,
        "webhook": {"namespaceSelector": {"matchLabels": {TEST_LABEL: namespace}}, **webhook},
    }
    docs = render(values)
    (mutating,) = [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    (validating,) = [d for d in docs if d["kind"] == "ValidatingWebhookConfiguration"]
    bundle = base64.b64encode(ca_cert.read_bytes()).decode()
    for entry in mutating["webhooks"] + validating["webhooks"]:
        path = entry["clientConfig"]["service"]["path"]
        entry["clientConfig"] = {"url": f"{op.admission_url}{path}", "caBundle": bundle}
    for entry in validating["webhooks"]:
        entry["namespaceSelector"]["matchLabels"] = {TEST_LABEL: namespace}
    own_webhook_names([mutating, validating], namespace)
    admission = client.AdmissionregistrationV1Api(cluster.api)
    admission.create_mutating_webhook_configuration(mutating)
    admission.create_validating_webhook_configuration(validating)
    await_webhooks(cluster, [mutating, validating], {TEST_LABEL: namespace})
    return name


def delete_webhook(cluster: Cluster, name: str) -> None:
    admission = client.AdmissionregistrationV1Api(cluster.api)
    admission.delete_mutating_webhook_configuration(name)
    admission.delete_validating_webhook_configuration(f"{name}-creator")


@pytest.fixture(scope="module")
def policies(cluster: Cluster) -> None:
    """The SDCPolicy CRD (crds/, installed with the cluster)."""
    client.ApiextensionsV1Api(cluster.api).read_custom_resource_definition(
        "sdcpolicies.hyperpod-sdc.dev"
    )


def admit(cluster: Cluster, namespace: str) -> None:
    """The cluster admin's step: an SDCPolicy admitting ``namespace`` (the fixtures' own
    namespaces have one already), and the label the test's webhook configuration selects."""
    try:
        cluster.policy(f"admit-{namespace}", {"namespaces": [namespace]})
    except client.ApiException as exc:
        if exc.status != 409:
            raise
    label(cluster, namespace)


def label(cluster: Cluster, namespace: str) -> None:
    cluster.core.patch_namespace(namespace, {"metadata": {"labels": {TEST_LABEL: namespace}}})


class Setup:
    def __init__(self, cluster: Cluster, op: OperatorProcess, certs: Path, webhook: str) -> None:
        self.cluster, self.op, self.certs, self.webhook = cluster, op, certs, webhook

    def reviews(self) -> float:
        """Admission reviews the operator answered so far."""
        return sum(
            float(v)
            for v in re.findall(
                r"^hyperpod_sdc_admission_reviews_total\{.*\} (\S+)$", self.op.metrics(), re.M
            )
        )


@pytest.fixture
def setup(
    cluster: Cluster,
    namespace: str,
    policies: None,
    start_operator: Callable[..., OperatorProcess],
    tmp_path: Path,
) -> Iterator[Callable[..., Setup]]:
    """Start the operator over TLS with the webhook's settings and register the chart's
    webhook for it; everything is removed after the test."""
    registered: list[str] = []

    def start(
        trusted: str = "admin", webhook: dict[str, Any] | None = None, **settings: str
    ) -> Setup:
        ca = make_ca(tmp_path)
        key, cert = issue(tmp_path, ca)
        ca_file = tmp_path / "published-ca.crt"
        ca_file.write_bytes(ca[1].read_bytes())
        op = start_operator(
            scheme="https",
            tls_cert_file=str(cert),
            tls_key_file=str(key),
            tls_ca_file=str(ca_file),
            inject_operator_url=POD_URL,
            trusted_pod_creators=trusted,
            webhook_cache_seconds="1",
            job_sweep_seconds="1",
            **settings,
        )
        name = register_webhook(cluster, op, ca[1], namespace, **(webhook or {}))
        registered.append(name)
        return Setup(cluster, op, tmp_path, name)

    yield start
    for name in registered:
        delete_webhook(cluster, name)


def make_job(cluster: Cluster, namespace: str, name: str = "llama", **kw: Any) -> dict[str, Any]:
    return dict(cluster.job(namespace, name, **kw))


def create_pod(
    cluster: Cluster,
    namespace: str,
    name: str,
    owner: dict[str, Any] | None,
    *,
    labels: dict[str, str] | None = None,
    env: list[dict[str, Any]] | None = None,
    annotations: dict[str, str] | None = None,
    core: client.CoreV1Api | None = None,
) -> dict[str, Any]:
    """A pod as a training operator makes it (the API server's answer, as JSON)."""
    meta: dict[str, Any] = {"name": name, "labels": dict(KUBEFLOW if labels is None else labels)}
    if annotations:
        meta["annotations"] = annotations
    if owner is not None:
        meta["ownerReferences"] = [controller_reference(owner)]
    container: dict[str, Any] = {"name": "pytorch", "image": "example.com/train:1"}
    if env:
        container["env"] = env
    body = {
        "metadata": meta,
        "spec": {
            "serviceAccountName": "worker",
            "automountServiceAccountToken": False,
            "containers": [container, {"name": "sidecar", "image": "example.com/log:1"}],
        },
    }
    api = core or cluster.core
    created = api.create_namespaced_pod(namespace, body, _preload_content=False)
    return dict(json.loads(created.data))


def without_wiring(pod: dict[str, Any]) -> dict[str, Any]:
    """``pod.spec`` less what the webhook adds, to compare with an unwired twin."""
    spec = json.loads(json.dumps(pod["spec"]))
    ours = {"hyperpod-sdc-token", "hyperpod-sdc-ca"}
    ours_env = {
        "POD_NAME",
        "NODE_NAME",
        "HYPERPOD_SDC_OPERATOR_URL",
        "HYPERPOD_SDC_TOKEN_FILE",
        "HYPERPOD_SDC_CA_BUNDLE",
    }
    spec["volumes"] = [v for v in spec.get("volumes") or [] if v["name"] not in ours]
    for c in spec["containers"]:
        c["env"] = [e for e in c.get("env") or [] if e["name"] not in ours_env]
        c["volumeMounts"] = [m for m in c.get("volumeMounts") or [] if m["name"] not in ours]
    return strip_none(spec)


def strip_none(spec: dict[str, Any]) -> dict[str, Any]:
    spec = json.loads(json.dumps(spec))
    for c in spec["containers"]:
        for key in ("env", "volumeMounts"):
            if not c.get(key):
                c.pop(key, None)
    if not spec.get("volumes"):
        spec.pop("volumes", None)
    return spec


# -- the tests ----------------------------------------------------------------------------------


@pytest.mark.fast
def test_an_opted_in_jobs_pod_gets_exactly_the_wiring(
    cluster: Cluster, namespace: str, setup: Callable[..., Setup]
) -> None:
    admit(cluster, namespace)
    s = setup()
    job = make_job(cluster, namespace)
    pod = create_pod(cluster, namespace, "llama-worker-0", job)
    # its twin, not selected (no training-operator label), is what the pod would be unwired
    twin = create_pod(cluster, namespace, "llama-twin", job, labels={})
    (container, sidecar) = pod["spec"]["containers"]
    ref = {"apiVersion": "v1", "fieldPath": "metadata.name"}
    want_env = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": ref}},
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {**ref, "fieldPath": "spec.nodeName"}}},
        {"name": "HYPERPOD_SDC_OPERATOR_URL", "value": POD_URL},
        {"name": "HYPERPOD_SDC_TOKEN_FILE", "value": "/var/run/secrets/hyperpod-sdc/token"},
        {"name": "HYPERPOD_SDC_CA_BUNDLE", "value": "/etc/hyperpod-sdc/ca/ca.crt"},
    ]
    want_mounts = [
        {
            "name": "hyperpod-sdc-token",
            "mountPath": "/var/run/secrets/hyperpod-sdc",
            "readOnly": True,
        },
        {"name": "hyperpod-sdc-ca", "mountPath": "/etc/hyperpod-sdc/ca", "readOnly": True},
    ]
    for c in (container, sidecar):  # every non-init container, by default
        assert c["env"] == want_env and c["volumeMounts"] == want_mounts
    assert pod["spec"]["volumes"] == [
        {
            "name": "hyperpod-sdc-token",
            "projected": {
                "sources": [
                    {
                        "serviceAccountToken": {
                            "audience": "hyperpod-sdc",
                            "expirationSeconds": 3600,
                            "path": "token",
                        }
                    }
                ],
                "defaultMode": 420,
            },
        },
        {"name": "hyperpod-sdc-ca", "configMap": {"name": "hyperpod-sdc-ca", "defaultMode": 420}},
    ]
    assert without_wiring(pod) == strip_none(twin["spec"])  # nothing else changed
    annotations = pod["metadata"]["annotations"]
    injected = json.loads(annotations[INJECTION_ANNOTATION])
    assert injected["kept"] == [] and "pytorch/env/NODE_NAME" in injected["added"]
    # made by a trusted creator (here: the test's admin): attested
    assert annotations[CREATED_BY_ANNOTATION] == "admin"
    assert pod["metadata"]["labels"][MARKER_LABEL] == "true"
    assert ATTESTATION_ANNOTATION not in annotations  # the v2 HMAC is never written any more
    assert INJECTION_ANNOTATION not in (twin["metadata"].get("annotations") or {})
    # the CA the pods mount is published in the job's namespace
    ca = wait_for(
        "the CA ConfigMap",
        lambda: cluster.core.read_namespaced_config_map("hyperpod-sdc-ca", namespace),
    )
    assert ca.data["ca.crt"] == (s.certs / "ca.crt").read_text()
    # a HyperPodPyTorchJob's pod, selected by the label in its template
    hp = make_job(cluster, namespace, "hp", kind="HyperPodPyTorchJob")
    hp_pod = create_pod(
        cluster, namespace, "hp-pod-0", hp, labels={"hyperpod-sdc.dev/inject": "true"}
    )
    assert hp_pod["spec"]["containers"][0]["env"] == want_env
    assert "Traceback" not in s.op.log()


def test_other_pods_are_untouched_and_most_are_never_sent(
    cluster: Cluster, namespace: str, setup: Callable[..., Setup]
) -> None:
    admit(cluster, namespace)
    s = setup(trusted="system:serviceaccount:kubeflow:training-operator")
    not_in = make_job(cluster, namespace, "plain", enabled=False)
    before = s.reviews()
    sent = create_pod(cluster, namespace, "plain-worker-0", not_in)  # labelled: sent, untouched
    assert wait_for("the review", lambda: s.reviews() == before + 1)
    job = make_job(cluster, namespace, "llama")
    unlabelled = create_pod(cluster, namespace, "by-hand", job, labels={"app": "x"})
    plain = create_pod(cluster, namespace, "web", None, labels={})
    # a labelled pod after them: once its review is counted, theirs would have been too
    create_pod(cluster, namespace, "plain-worker-1", not_in)
    wait_for("the last pod's review", lambda: s.reviews() >= before + 2)
    assert s.reviews() == before + 2  # the selectors never sent the other two
    for pod in (sent, unlabelled, plain):
        assert not (pod["metadata"].get("annotations") or {}), pod["metadata"]["name"]
        assert all("env" not in c for c in pod["spec"]["containers"])
        assert all("volumeMounts" not in c for c in pod["spec"]["containers"])


def test_a_pods_own_values_are_kept(
    cluster: Cluster, namespace: str, setup: Callable[..., Setup]
) -> None:
    admit(cluster, namespace)
    setup(inject_containers="pytorch")  # the chart's webhook.containers
    job = make_job(cluster, namespace)
    own = {"name": "NODE_NAME", "value": "set-by-the-user"}
    pod = create_pod(cluster, namespace, "llama-worker-0", job, env=[own])
    container, sidecar = pod["spec"]["containers"]
    assert [e for e in container["env"] if e["name"] == "NODE_NAME"] == [own]
    assert [e["name"] for e in container["env"]] == [
        "POD_NAME",
        "HYPERPOD_SDC_OPERATOR_URL",
        "HYPERPOD_SDC_TOKEN_FILE",
        "HYPERPOD_SDC_CA_BUNDLE",
        "NODE_NAME",
    ]
    assert "env" not in sidecar  # only the named container (chart value webhook.containers)
    record = json.loads(pod["metadata"]["annotations"][INJECTION_ANNOTATION])
    assert record["kept"] == ["pytorch/env/NODE_NAME"]


def test_not_admitted_namespace_is_not_wired(
    cluster: Cluster, namespace: str, setup: Callable[..., Setup]
) -> None:
    # selected by the test's webhook, but no SDCPolicy admits it
    cluster.custom.delete_cluster_custom_object(
        "hyperpod-sdc.dev", "v1alpha1", "sdcpolicies", f"admit-{namespace}"
    )
    label(cluster, namespace)
    s = setup()
    job = make_job(cluster, namespace)
    pod = create_pod(cluster, namespace, "llama-worker-0", job)
    assert all("env" not in c for c in pod["spec"]["containers"])
    assert INJECTION_ANNOTATION not in pod["metadata"]["annotations"]
    assert pod["metadata"]["annotations"][CREATED_BY_ANNOTATION] == "admin"  # still attested
    assert "is not admitted by any SDCPolicy" in s.op.log()


def tenant_api(cluster: Cluster, namespace: str, tmp_path: Path) -> client.CoreV1Api:
    """The API as a tenant who may create, get and patch pods in ``namespace`` (its
    ServiceAccount ``worker``), and nothing else."""
    rbac = client.RbacAuthorizationV1Api(cluster.api)
    rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "pods"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["pods"],
                    "verbs": ["create", "get", "patch", "delete"],
                }
            ],
        },
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "pods"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pods"},
            "subjects": [{"kind": "ServiceAccount", "name": "worker", "namespace": namespace}],
        },
    )
    kubeconfig = cluster.kubeconfig_for(namespace, "worker", tmp_path / "tenant")
    from kubernetes import config as kube_config

    return client.CoreV1Api(kube_config.new_client_from_config(kubeconfig))


def test_attestation_only_for_the_trusted_creator(
    cluster: Cluster, namespace: str, setup: Callable[..., Setup], tmp_path: Path
) -> None:
    admit(cluster, namespace)
    setup()
    job = make_job(cluster, namespace)
    genuine = create_pod(cluster, namespace, "llama-worker-0", job)
    copied = {CREATED_BY_ANNOTATION: genuine["metadata"]["annotations"][CREATED_BY_ANNOTATION]}
    marked = {**KUBEFLOW, MARKER_LABEL: "true"}
    # a tenant who may create pods in the namespace copies the marker onto a pod of its own
    tenant = tenant_api(cluster, namespace, tmp_path)
    forged = create_pod(
        cluster, namespace, "llama-worker-1", job, labels=marked, annotations=copied, core=tenant
    )
    assert CREATED_BY_ANNOTATION not in (forged["metadata"].get("annotations") or {})
    assert MARKER_LABEL not in forged["metadata"]["labels"]
    # nor can an update put one back on
    patched = tenant.patch_namespaced_pod(
        "llama-worker-1",
        namespace,
        {"metadata": {"annotations": copied, "labels": {MARKER_LABEL: "true"}}},
    )
    assert CREATED_BY_ANNOTATION not in (patched.metadata.annotations or {})
    assert MARKER_LABEL not in patched.metadata.labels
    # and the genuine pod's own cannot be changed
    changed = tenant.patch_namespaced_pod(
        "llama-worker-0",
        namespace,
        {"metadata": {"annotations": {CREATED_BY_ANNOTATION: "someone"}}},
    )
    assert changed.metadata.annotations[CREATED_BY_ANNOTATION] == "admin"
    assert changed.metadata.labels[MARKER_LABEL] == "true"


def test_with_the_operator_down_pods_are_still_created_and_reported_unguarded(
    cluster: Cluster,
    namespace: str,
    setup: Callable[..., Setup],
    start_operator: Callable[..., OperatorProcess],
) -> None:
    admit(cluster, namespace)
    # a 2 s Lease: the operator started after the kill leads, and sweeps the job's pods,
    # within 3 s of it (9 s with the default 8 s Lease)
    s = setup(lease_seconds="2")
    job = make_job(cluster, namespace)
    s.op.kill()
    started = time.monotonic()
    pod = create_pod(cluster, namespace, "llama-worker-0", job)  # failurePolicy: Ignore
    assert time.monotonic() - started < 10
    assert all("env" not in c for c in pod["spec"]["containers"])
    # back up: the pod that missed the webhook is counted and reported on its job
    op = start_operator(
        scheme="https",
        tls_cert_file=str(s.certs / "tls.crt"),
        tls_key_file=str(s.certs / "tls.key"),
        tls_ca_file=str(s.certs / "published-ca.crt"),
        inject_operator_url=POD_URL,
        job_sweep_seconds="1",
        lease_seconds="2",
    )
    event = wait_for(
        "the SDCPodsUnguarded Event",
        lambda: [e for e in cluster.events(namespace) if e["reason"] == "SDCPodsUnguarded"],
    )[0]
    assert event["involved_object"]["name"] == "llama" and "llama-worker-0" in event["message"]
    assert event["involved_object"]["kind"] == "PyTorchJob"
    assert wait_for(
        "the metric",
        lambda: (
            f'hyperpod_sdc_unguarded_pods{{job="llama",namespace="{namespace}"}} 1.0'
            in op.metrics()
        ),
    )


def test_fail_policy_refuses_pods_while_the_operator_is_down(
    cluster: Cluster, namespace: str, setup: Callable[..., Setup]
) -> None:
    admit(cluster, namespace)
    s = setup(webhook={"failurePolicy": "Fail"})
    job = make_job(cluster, namespace)
    s.op.kill()
    with pytest.raises(client.ApiException) as refused:
        create_pod(cluster, namespace, "llama-worker-0", job)
    assert refused.value.status == 500 and "pods.hyperpod-sdc.dev" in str(refused.value.body)


def test_a_second_namespace_gets_the_ca_and_a_rotation_reaches_both(
    cluster: Cluster, namespace: str, setup: Callable[..., Setup]
) -> None:
    second = cluster.namespace()
    admit(cluster, namespace)
    admit(cluster, second)
    s = setup(namespaces=f"{namespace},{second}")
    for ns in (namespace, second):
        make_job(cluster, ns)

    def read(ns: str) -> dict[str, str]:
        return dict(cluster.core.read_namespaced_config_map("hyperpod-sdc-ca", ns).data)

    for ns in (namespace, second):
        found = wait_for(f"the CA in {ns}", partial(read, ns))
        assert found["ca.crt"] == (s.certs / "ca.crt").read_text()
    rotated = make_ca(s.certs, "ca2")[1].read_text()
    (s.certs / "published-ca.crt").write_text(rotated)
    for ns in (namespace, second):
        wait_for(f"the rotated CA in {ns}", partial(lambda n: read(n)["ca.crt"] == rotated, ns))


def test_limited_audit_is_said_on_the_job(
    cluster: Cluster, namespace: str, setup: Callable[..., Setup]
) -> None:
    admit(cluster, namespace)
    setup()
    make_job(cluster, namespace, "small", replicas=2)
    make_job(cluster, namespace, "fine", replicas=3)
    event = wait_for(
        "the SDCAuditLimited Event",
        lambda: [e for e in cluster.events(namespace) if e["reason"] == "SDCAuditLimited"],
    )
    assert [e["involved_object"]["name"] for e in event] == ["small"]
    assert "2 nodes" in event[0]["message"] and "third node" in event[0]["message"]
    # the watch writes nothing of kopf's onto the users' jobs: no finalizer, no annotation
    for name in ("small", "fine"):
        meta = cluster.get_job(namespace, name)["metadata"]
        assert not meta.get("finalizers")
        assert not [k for k in meta.get("annotations") or {} if "kopf" in k]


def post_raw(
    op: OperatorProcess, body: bytes, content_type: str = "application/json"
) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"{op.admission_url}/v1/admission/pods?timeout=5s",
        data=body,
        headers={"Content-Type": content_type},
        method="POST",
    )
    context = ssl._create_unverified_context()
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_bad_input_gets_a_clean_answer_never_a_500(
    cluster: Cluster, namespace: str, setup: Callable[..., Setup]
) -> None:
    s = setup()
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}
    service = {
        **review,
        "request": {
            "uid": "u-1",
            "kind": {"group": "", "version": "v1", "kind": "Service"},
            "operation": "CREATE",
            "namespace": namespace,
            "object": {"metadata": {"name": "x"}},
        },
    }
    cases = [
        (b"{not json", "application/json", 400),
        (b"[1, 2]", "application/json", 400),
        (json.dumps({"kind": "Pod"}).encode(), "application/json", 400),
        (json.dumps(review).encode(), "application/json", 400),  # no request.uid
        (json.dumps(service).encode(), "text/plain", 415),
        (b"{" + b" " * (5 * 1024 * 1024) + b"}", "application/json", 413),
    ]
    for body, content_type, status in cases:
        got, answer = post_raw(s.op, body, content_type)
        assert (got, set(answer)) == (status, {"error", "message"}), (body[:40], answer)
    got, answer = post_raw(s.op, json.dumps(service).encode())
    assert got == 200 and answer["response"] == {"uid": "u-1", "allowed": True}
    pod = json.loads(json.dumps(service))
    pod["request"]["kind"]["kind"] = "Pod"
    got, answer = post_raw(s.op, json.dumps(pod).encode())
    assert got == 200 and answer["response"]["allowed"] is True
    # Reviews no API server writes: a field of another type is a 400 naming it, never a
    # traceback (these were answered 200 with 60 tracebacks at ERROR), and a review nested
    # 100,000 deep is a 400 too (it was a 500: RecursionError escaped the handler).
    odd = {
        "request.kind": {"kind": "Pod"},
        "request.userInfo": {"userInfo": "system:admin"},
        "request.object.metadata": {"object": {"metadata": [{"name": "x"}]}},
        "request.object.metadata.ownerReferences": {
            "object": {"metadata": {"ownerReferences": "not a list"}}
        },
        "request.object.metadata.labels": {"object": {"metadata": {"labels": ["a"]}}},
    }
    for field, change in odd.items():
        body = json.loads(json.dumps(pod))
        body["request"].update(change)
        got, answer = post_raw(s.op, json.dumps(body).encode())
        assert (got, answer["error"]) == (400, "malformed"), (field, answer)
        assert answer["message"].startswith(field + ":"), (field, answer)
    depth = 100_000
    nested = (
        b'{"apiVersion": "admission.k8s.io/v1", "request": ' + b"[" * depth + b"]" * depth + b"}"
    )
    got, answer = post_raw(s.op, nested)
    assert (got, answer["error"]) == (400, "malformed"), answer
    # A pod's review nested 100 to 990 deep passes json.loads, but copying it for the patch
    # (copy.deepcopy) exhausted Python's stack from about 500: answered 200 with an ERROR
    # traceback. Now refused before it is read further; at the limit it is answered.
    for depth, status in ((MAX_REVIEW_DEPTH, 200), (100, 400), (800, 400), (990, 400)):
        body = json.loads(json.dumps(pod))
        # the review, request, object and spec are four levels; "x" adds the rest
        body["request"]["object"]["spec"] = {"x": "NESTED"}
        lists = depth - 4
        raw = json.dumps(body).replace('"NESTED"', "[" * lists + "]" * lists).encode()
        got, answer = post_raw(s.op, raw)
        assert got == status, (depth, answer)
        if status == 400:
            assert answer["error"] == "malformed" and "nested" in answer["message"], depth
    log = s.op.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


@pytest.mark.parametrize("example", ["pytorchjob.yaml", "hyperpodpytorchjob.yaml"])
def test_the_example_jobs_need_nothing_but_the_annotation(
    cluster: Cluster, namespace: str, setup: Callable[..., Setup], example: str
) -> None:
    """A pod made from the example's template, as its training operator makes it, is wired."""
    import yaml

    admit(cluster, namespace)
    setup()
    doc = yaml.safe_load((ROOT / "examples" / example).read_text())
    doc["metadata"]["namespace"] = namespace
    group, version = doc["apiVersion"].split("/")
    plural = doc["kind"].lower() + "s"
    job = cluster.custom.create_namespaced_custom_object(group, version, namespace, plural, doc)
    if doc["kind"] == "PyTorchJob":
        template = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
        labels = dict(KUBEFLOW)
    else:
        template = doc["spec"]["replicaSpecs"][0]["template"]
        labels = dict(template["metadata"]["labels"])
    meta = {
        "name": f"{doc['metadata']['name']}-0",
        "labels": labels,
        "ownerReferences": [
            {
                "apiVersion": doc["apiVersion"],
                "kind": doc["kind"],
                "name": doc["metadata"]["name"],
                "uid": job["metadata"]["uid"],
                "controller": True,
            }
        ],
    }
    # the test server has no ServiceAccount controller: the namespace's account, no token
    spec = {
        **template["spec"],
        "serviceAccountName": "worker",
        "automountServiceAccountToken": False,
    }
    created = cluster.core.create_namespaced_pod(
        namespace, {"metadata": meta, "spec": spec}, _preload_content=False
    )
    pod = json.loads(created.data)
    env = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    assert {"POD_NAME", "NODE_NAME", "HYPERPOD_SDC_OPERATOR_URL", "HYPERPOD_SDC_CA_BUNDLE"} <= env
    assert {v["name"] for v in pod["spec"]["volumes"]} == {
        "fsx",
        "hyperpod-sdc-token",
        "hyperpod-sdc-ca",
    }


def test_the_cert_manager_variant_is_accepted(cluster: Cluster, tmp_path: Path) -> None:
    """The chart with certManager.enabled, created on the server (cert-manager's kinds from
    a structural stand-in CRD: cert-manager itself does not run here)."""
    import yaml

    crds = client.ApiextensionsV1Api(cluster.api)
    try:
        crds.read_custom_resource_definition("certificates.cert-manager.io")
    except client.ApiException as exc:
        if exc.status != 404:
            raise
        cluster.kubectl(
            "create", "-f", str(ROOT / "scripts/sdc_harness/crds/cert-manager.io_stand-in.yaml")
        )
        for crd in ("certificates.cert-manager.io", "issuers.cert-manager.io"):
            cluster.kubectl("wait", "--for", "condition=Established", f"crd/{crd}", "--timeout=60s")
    release = f"sdc-{secrets.token_hex(3)}"
    namespace = f"{release}-system"
    cluster.core.create_namespace({"metadata": {"name": namespace}})
    docs = render(
        {"fullnameOverride": release, "certManager": {"enabled": True}}, namespace=namespace
    )
    manifest = tmp_path / "cert-manager.yaml"
    manifest.write_text(yaml.safe_dump_all(served_here(docs)))
    out = cluster.kubectl("create", "--dry-run=server", "-f", str(manifest))
    for kind in (
        "certificate.cert-manager.io",
        "issuer.cert-manager.io",
        "mutatingwebhookconfiguration.admissionregistration.k8s.io",
    ):
        assert f"{kind}/{release}" in out, out


def test_await_webhooks_refuses_a_webhook_name_another_configuration_has(
    cluster: Cluster, namespace: str
) -> None:
    """The API server counts its calls by webhook name: a name two configurations share
    (the chart's fixed names, two tests' configurations) would let the other's calls answer
    the wait; so each test's names are its own, and a shared one is an error."""

    def configuration(name: str) -> dict[str, Any]:
        entry = {
            "name": "pods.hyperpod-sdc.dev",
            "clientConfig": {"url": "https://127.0.0.1:9/creator"},
            "rules": [
                {
                    "operations": ["CREATE"],
                    "apiGroups": [""],
                    "apiVersions": ["v1"],
                    "resources": ["pods"],
                }
            ],
            "namespaceSelector": {"matchLabels": {TEST_LABEL: f"{namespace}-none"}},
            "failurePolicy": "Ignore",
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
        }
        return {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [entry],
        }

    first, second = configuration(f"{namespace}-a"), configuration(f"{namespace}-b")
    own_webhook_names([first, second], namespace)  # the same owner: the same names
    admission = client.AdmissionregistrationV1Api(cluster.api)
    admission.create_validating_webhook_configuration(first)
    try:
        admission.create_validating_webhook_configuration(second)
        try:
            with pytest.raises(
                ValueError, match=f"also in ValidatingWebhookConfiguration {namespace}-b"
            ):
                await_webhooks(cluster, [first])
        finally:
            admission.delete_validating_webhook_configuration(f"{namespace}-b")
        await_webhooks(cluster, [first], {TEST_LABEL: f"{namespace}-none"})  # its own now
    finally:
        admission.delete_validating_webhook_configuration(f"{namespace}-a")
