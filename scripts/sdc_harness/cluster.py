"""A real Kubernetes API server on loopback (scripts/kube-apiserver.sh) and the operator
as a real process, for the integration tests and the end-to-end demo.

There is no scheduler and no kubelet: the tests create pods with ``spec.nodeName`` set,
as the scheduler would, and nothing runs in them (``sdc_harness.kubelet`` runs the pods
that must run). Everything the operator sees and does goes through the real API server:
TokenRequest, TokenReview, CRDs, patches, Events.
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import functools
import json
import os
import secrets
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client, config

from sdc_operator.attestation import (
    ATTESTATION_ANNOTATION,
    CREATED_BY_ANNOTATION,
    MARKER_LABEL,
    sign,
)

from . import operator_zygote, tls

ROOT = Path(__file__).resolve().parents[2]
CRDS = Path(__file__).resolve().parent / "crds"
"""Other projects' CRDs the cluster installs beside ours (crds/README.md)."""
# Kubeflow training-operator v1.9.0's CRD (Apache-2.0), copied unchanged.
PYTORCHJOB_CRD = CRDS / "kubeflow.org_pytorchjobs.yaml"
WORKLOAD_CRD = CRDS / "kueue.x-k8s.io_workloads.yaml"
HYPERPOD_CRD = CRDS / "sagemaker.amazonaws.com_hyperpodpytorchjobs.yaml"
SERVICEMONITOR_CRD = CRDS / "monitoring.coreos.com_servicemonitors.yaml"
JOB_API = {
    "PyTorchJob": ("kubeflow.org", "v1", "pytorchjobs"),
    "HyperPodPyTorchJob": ("sagemaker.amazonaws.com", "v1", "hyperpodpytorchjobs"),
}
KUBECTL = os.environ.get("KUBECTL", "kubectl")
WEBHOOK_LABELS = {
    "PyTorchJob": {"training.kubeflow.org/operator-name": "pytorchjob-controller"},
    "HyperPodPyTorchJob": {"hyperpod-sdc.dev/inject": "true"},
}
"""The labels by which the chart's webhook entries select each job kind's pods."""
T = TypeVar("T")
OPERATOR_NAMESPACE = "hyperpod-sdc"
ATTESTATION_SECRET = "hyperpod-sdc-attestation"
TRAINING_OPERATOR = "system:serviceaccount:kubeflow:training-operator"
"""The user the admission webhook would have seen create the tests' pods."""


def served_here(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rendered manifests as this 1.20 test server takes them: Helm, asking no live server,
    renders policy/v1 PodDisruptionBudgets, which 1.20 serves only as v1beta1."""
    for doc in docs:
        if doc.get("kind") == "PodDisruptionBudget":
            doc["apiVersion"] = "policy/v1beta1"
    return docs


def controller_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    """The ownerReference a controller puts on what it makes from ``owner`` (an object as
    the API server returns it)."""
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
    }


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on loopback that nobody listens on right now (each
    socket is held until all are picked: one at a time, the kernel may hand out the same
    port twice)."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            s = held.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports.append(int(s.getsockname()[1]))
        return ports


class Fatal(AssertionError):
    """Raised by a function :func:`wait_for` polls: no use waiting longer (the process
    being waited for exited)."""


def wait_for(what: str, fn: Callable[[], T | None], timeout: float = 20.0) -> T:
    """Poll ``fn`` until it returns something truthy (or raises :class:`Fatal`)."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = fn()
            if value:
                return value
        except Fatal:
            raise
        except Exception as exc:  # retried until the deadline
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last error: {last})")


class Cluster:
    """A started API server with the CRDs installed; ``state`` holds its files."""

    def __init__(self, state: Path) -> None:
        self.state = state
        out = subprocess.run(
            [str(ROOT / "scripts" / "kube-apiserver.sh"), "start", str(state)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
        self.kubeconfig = values["KUBECONFIG"]
        self.server = values["SERVER"]
        self.api = config.new_client_from_config(self.kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        try:
            # create, not apply: the PyTorchJob CRD is too large for apply's annotation.
            # Two kubectl processes, not one per file and CRD: each costs about a second on
            # a loaded machine, and every test process starts a cluster.
            third_party = (WORKLOAD_CRD, HYPERPOD_CRD, SERVICEMONITOR_CRD)
            self.kubectl("create", "-f", str(ROOT / "crds"), *(f"-f={p}" for p in third_party))
            self.kubectl("create", "--validate=false", "-f", str(PYTORCHJOB_CRD))
            # (not `kubectl wait` on all six: this kubectl fails on a CRD that has no
            # conditions yet instead of waiting)
            crds = client.ApiextensionsV1Api(self.api)

            def established(name: str) -> bool:
                conditions = crds.read_custom_resource_definition(name).status.conditions
                return any(c.type == "Established" and c.status == "True" for c in conditions or ())

            for crd in (
                "sdcincidents.hyperpod-sdc.dev",
                "sdcpolicies.hyperpod-sdc.dev",
                "pytorchjobs.kubeflow.org",
                "workloads.kueue.x-k8s.io",
                "hyperpodpytorchjobs.sagemaker.amazonaws.com",
                "servicemonitors.monitoring.coreos.com",
            ):
                wait_for(f"the CRD {crd} Established", functools.partial(established, crd), 60)
            self.key = secrets.token_bytes(32)
            self.core.create_namespace({"metadata": {"name": OPERATOR_NAMESPACE}})
            self.core.create_namespaced_secret(
                OPERATOR_NAMESPACE,
                {
                    "metadata": {"name": ATTESTATION_SECRET},
                    "data": {"key": base64.b64encode(self.key).decode()},
                },
            )
        except BaseException:
            self.stop()
            raise

    def kubeconfig_for(self, namespace: str, service_account: str, path: Path) -> str:
        """A kubeconfig that acts as the ServiceAccount (a token from TokenRequest)."""
        review = self.core.create_namespaced_service_account_token(
            service_account, namespace, {"spec": {"expirationSeconds": 3600}}
        )
        admin = Path(self.kubeconfig).read_text()
        token = admin.split("token: ", 1)[1].split("}", 1)[0].strip().strip('"')
        path.write_text(admin.replace(token, review.status.token))
        return str(path)

    def kubectl(self, *args: str) -> str:
        done = subprocess.run(
            [KUBECTL, "--kubeconfig", self.kubeconfig, *args], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{done.stderr}")
        return done.stdout

    def stop(self) -> None:
        self.api.close()
        subprocess.run([str(ROOT / "scripts" / "kube-apiserver.sh"), "stop", str(self.state)])

    # -- objects ---------------------------------------------------------------------------

    def namespace(self, *, admitted: bool = True) -> str:
        """A new namespace with a ServiceAccount ``worker``, admitted by an ``SDCPolicy``
        of its own unless ``admitted`` is false."""
        name = f"t-{secrets.token_hex(4)}"
        self.core.create_namespace({"metadata": {"name": name}})
        self.core.create_namespaced_service_account(name, {"metadata": {"name": "worker"}})
        if admitted:
            self.policy(f"admit-{name}", {"namespaces": [name]})
        return name

    def admit(self, namespace: str, **spec: Any) -> None:
        """Change the namespace's own policy (``remediationPolicy="auto-replace"``, ...)."""
        self.custom.patch_cluster_custom_object(
            "hyperpod-sdc.dev", "v1alpha1", "sdcpolicies", f"admit-{namespace}", {"spec": spec}
        )

    def policy(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        body = {
            "apiVersion": "hyperpod-sdc.dev/v1alpha1",
            "kind": "SDCPolicy",
            "metadata": {"name": name},
            "spec": spec,
        }
        return self.custom.create_cluster_custom_object(
            "hyperpod-sdc.dev", "v1alpha1", "sdcpolicies", body
        )

    def node(
        self,
        *,
        hyperpod: bool = True,
        provider_id: bool = True,
        labels: dict[str, str] | None = None,
        ready: bool = False,
    ) -> dict[str, Any]:
        """A new node with an instance id of its own; ``ready``: as the kubelet and the
        node lifecycle controller would make it, Ready and without the not-ready taint the
        API server gives every new node (the tests' pods are bound without a scheduler)."""
        instance = "i-" + secrets.token_hex(9)[:17]
        name = (
            f"hyperpod-{instance}"
            if hyperpod
            else f"ip-10-0-{secrets.randbelow(250)}-{secrets.randbelow(250)}.ec2.internal"
        )
        spec: dict[str, Any] = {}
        if provider_id:
            spec["providerID"] = f"aws:///us-west-2a/{instance}"
        body = {"metadata": {"name": name, "labels": labels or {}}, "spec": spec}
        self.core.create_node(body)
        if ready:
            ready_condition = {"type": "Ready", "status": "True", "reason": "KubeletReady"}
            self.core.patch_node_status(name, {"status": {"conditions": [ready_condition]}})
            self.core.patch_node(
                name, {"spec": {"taints": None}}, _content_type="application/merge-patch+json"
            )
        return self.get_node(name)

    def get_node(self, name: str) -> dict[str, Any]:
        return json.loads(self.core.read_node(name, _preload_content=False).data)

    def job(
        self,
        namespace: str,
        name: str,
        *,
        enabled: bool = True,
        replicas: int = 3,
        labels: dict[str, str] | None = None,
        kind: str = "PyTorchJob",
    ) -> dict[str, Any]:
        container = {
            "name": "pytorch",
            "image": "example.com/train:1",
            "env": [{"name": "A", "value": "1"}],
        }
        template = {"spec": {"containers": [container], "serviceAccountName": "worker"}}
        group, version, plural = JOB_API[kind]
        spec: dict[str, Any] = {"runPolicy": {"suspend": False}}
        if kind == "PyTorchJob":
            spec["pytorchReplicaSpecs"] = {
                "Master": {"replicas": 1, "template": template},
                "Worker": {"replicas": replicas - 1, "template": template},
            }
        else:
            spec["replicaSpecs"] = [{"name": "pods", "replicas": replicas, "template": template}]
        body = {
            "apiVersion": f"{group}/{version}",
            "kind": kind,
            "metadata": {
                "name": name,
                "annotations": {"hyperpod-sdc.dev/enabled": "true" if enabled else "false"},
                "labels": labels or {},
            },
            "spec": spec,
        }
        return self.custom.create_namespaced_custom_object(group, version, namespace, plural, body)

    def get_job(self, namespace: str, name: str, kind: str = "PyTorchJob") -> dict[str, Any]:
        group, version, plural = JOB_API[kind]
        return self.custom.get_namespaced_custom_object(group, version, namespace, plural, name)

    def pod(
        self,
        namespace: str,
        name: str,
        node: str,
        owner: dict[str, Any] | None,
        *,
        attested: bool = True,
        annotations: dict[str, str] | None = None,
        key: bytes | None = None,
        running: bool = True,
        legacy: bool = False,
    ) -> dict[str, Any]:
        """A pod bound to ``node`` (as the scheduler would) and, if ``running``, with the
        phase the kubelet then reports. ``attested``: with the creator marker the admission
        webhook writes on a pod the training operator made (the tests create pods as the
        admin, with no creator check registered; tests/integration/test_webhook.py runs the
        check); ``legacy``: with the ``v2`` HMAC attestation of earlier versions instead,
        signed with this cluster's test key."""
        meta: dict[str, Any] = {"name": name, "annotations": dict(annotations or {})}
        if owner is not None:
            meta["ownerReferences"] = [controller_reference(owner)]
            if attested:
                # What the training operator puts on its pods, which selects them for the
                # admission webhook; then what the webhook writes.
                meta["labels"] = dict(WEBHOOK_LABELS[owner["kind"]])
                meta["annotations"][CREATED_BY_ANNOTATION] = TRAINING_OPERATOR
                if legacy:
                    meta["annotations"][ATTESTATION_ANNOTATION] = sign(
                        key or self.key,
                        namespace,
                        name,
                        owner["metadata"]["uid"],
                        TRAINING_OPERATOR,
                        int(time.time()),
                    )
                else:
                    meta["labels"][MARKER_LABEL] = "true"
        body = {
            "metadata": meta,
            "spec": {
                "nodeName": node,
                "serviceAccountName": "worker",
                "automountServiceAccountToken": False,
                "containers": [{"name": "pytorch", "image": "example.com/train:1"}],
            },
        }
        created = self.core.create_namespaced_pod(namespace, body)
        if running:  # what the kubelet reports once the containers start
            self.core.patch_namespaced_pod_status(
                created.metadata.name, namespace, {"status": {"phase": "Running"}}
            )
        return {"metadata": {"name": created.metadata.name, "uid": created.metadata.uid}}

    def token(self, namespace: str, pod: str, audience: str = "hyperpod-sdc") -> str:
        uid = self.core.read_namespaced_pod(pod, namespace).metadata.uid
        body = {
            "spec": {
                "audiences": [audience],
                "expirationSeconds": 3600,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid},
            }
        }
        review = self.core.create_namespaced_service_account_token("worker", namespace, body)
        return str(review.status.token)

    def incidents(self, namespace: str, job: str | None = None) -> list[dict[str, Any]]:
        """The namespace's incidents (of ``job`` only, if given)."""
        selector = f"hyperpod-sdc.dev/job={job}" if job is not None else ""
        found = self.custom.list_namespaced_custom_object(
            "hyperpod-sdc.dev", "v1alpha1", namespace, "sdcincidents", label_selector=selector
        )
        return list(found["items"])

    def events(self, namespace: str) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.core.list_namespaced_event(namespace).items]


def server_time(cluster: Cluster) -> datetime:
    """The API server's clock, to the second it stamps creation times with (the ``Date``
    of its answer)."""
    response = cluster.api.call_api(
        "/version", "GET", auth_settings=["BearerToken"], _preload_content=False
    )
    response = response[0] if isinstance(response, tuple) else response
    return email.utils.parsedate_to_datetime(response.headers["Date"])


SHARED = {
    # One election per test: a replica a test killed must not hold the next one's.
    "HYPERPOD_SDC_LEASE_NAME": "leader-{namespace}",
    # The tests share one API server and leave quarantined nodes behind: only the tests of
    # the cap itself set one.
    "HYPERPOD_SDC_MAX_QUARANTINED_NODES": "100%",
    # The tests mark their pods as the training operator would, and register the creator
    # check only where they test it (test_forged_review, test_creator_check).
    "HYPERPOD_SDC_CREATOR_CHECK": "unchecked",
    # Every test's agents post from 127.0.0.1, where in a cluster each pod has an address
    # of its own: only the tests of the per-source bound set one.
    "HYPERPOD_SDC_CONNECTIONS_PER_SOURCE": "100000",
}
"""The operator's settings where many tests share one API server and one source address."""


def shared_settings(namespace: str) -> dict[str, str]:
    return {name: value.format(namespace=namespace) for name, value in SHARED.items()}


class OperatorProcess:
    """``python -m sdc_operator`` against the cluster, watching one namespace."""

    shared = True
    """The API server is shared with other tests' operators (:data:`SHARED`); a subclass
    whose operator has it to itself (the demo's) sets it false."""
    forked = False
    """Forked from the operator zygote (:mod:`sdc_harness.operator_zygote`: its third-party
    imports done once) where it can be (this project's operator, with this process's
    ``PYTHONPATH``), rather than started as ``python -m``: :class:`ForkedOperatorProcess`."""

    def __init__(
        self,
        cluster: Cluster,
        namespace: str,
        log_path: Path,
        scheme: str = "http",
        kubeconfig: str | None = None,
        extra_env: dict[str, str] | None = None,
        module: str = "sdc_operator",
        **settings: str,
    ) -> None:
        """``module``: what ``python -m`` runs (a stand-in for another release's operator);
        ``settings``: ``HYPERPOD_SDC_<NAME>`` values (``dry_run="true"``)."""
        self.cluster = cluster
        self.port, self.verdict_port, self.admission_port, self.metrics_port = free_ports(4)
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        """The tenants' intake (``/v1/reports`` only)."""
        self.verdict_url = f"{scheme}://127.0.0.1:{self.verdict_port}"
        """The intake's verdict listener (``/v1/reports``, every report but heartbeats)."""
        self.admission_url = f"{scheme}://127.0.0.1:{self.admission_port}"
        """The admission webhook's listener (the API server's)."""
        self.metrics_url = f"{scheme}://127.0.0.1:{self.metrics_port}"
        """``/metrics``, ``/healthz``, ``/readyz``."""
        # readiness and metrics are read over plain TLS without verification (test plumbing)
        self._context = ssl._create_unverified_context() if scheme == "https" else None
        env = {
            **os.environ,
            "KUBECONFIG": kubeconfig or cluster.kubeconfig,
            "HYPERPOD_SDC_LISTEN_ADDRESS": "127.0.0.1",
            "HYPERPOD_SDC_LISTEN_PORT": str(self.port),
            "HYPERPOD_SDC_VERDICT_PORT": str(self.verdict_port),
            "HYPERPOD_SDC_ADMISSION_PORT": str(self.admission_port),
            "HYPERPOD_SDC_METRICS_PORT": str(self.metrics_port),
            "HYPERPOD_SDC_NAMESPACES": namespace,
            "HYPERPOD_SDC_RESYNC_SECONDS": "1",
            "HYPERPOD_SDC_OPERATOR_NAMESPACE": OPERATOR_NAMESPACE,
            **(shared_settings(namespace) if self.shared else {}),
            "AWS_DEFAULT_REGION": "us-west-2",
            **self.environment(),
            **{f"HYPERPOD_SDC_{k.upper()}": v for k, v in settings.items()},
            **(extra_env or {}),
        }
        self.log_path = log_path
        self.before_start()
        self._log = open(log_path, "ab")  # noqa: SIM115  (closed in stop)
        self.proc: subprocess.Popen[bytes] | operator_zygote.Forked
        if self.forked and operator_zygote.forkable(module, env):
            self.proc = operator_zygote.start(env, log_path, module)
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module],
                env=env,
                stdout=self._log,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_for("the operator's intake", self._ready, timeout=60)
        except BaseException:
            self.stop()  # nobody else will: its log file must not be left open
            raise

    def environment(self) -> dict[str, str]:
        """More of the process's env, once the ports are chosen (a subclass's; settings
        and ``extra_env`` override it)."""
        return {}

    def before_start(self) -> None:
        """Called once the ports are chosen, before the process starts (a subclass
        registers what must exist before the operator starts)."""

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise Fatal(f"the operator exited with {self.proc.returncode}:\n{self.log()}")
        try:
            with urllib.request.urlopen(
                f"{self.metrics_url}/readyz", timeout=1, context=self._context
            ) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        with urllib.request.urlopen(
            f"{self.metrics_url}/metrics", timeout=5, context=self._context
        ) as response:
            return str(response.read().decode())

    def sample(self, name: str) -> float:
        """The sum of a metric's samples in ``/metrics`` (0 while it has none)."""
        total = 0.0
        for line in self.metrics().splitlines():
            if line.startswith((f"{name} ", f"{name}{{")):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def resynced(self, passes: int = 1, timeout: float = 30.0) -> None:
        """Wait until ``passes`` whole resync passes of the leader began and ended after
        now: each unfinished incident driven as far as it goes, so what a test then finds
        not done was not going to be done (``hyperpod_sdc_resyncs_total``; counted passes
        never overlap, so the first increment may be a pass already under way and is not
        counted). Instead of sleeping a fixed time before asserting that nothing happened."""
        start = self.sample("hyperpod_sdc_resyncs_total")
        wait_for(
            f"{passes} resync pass(es) of the operator",
            lambda: self.sample("hyperpod_sdc_resyncs_total") >= start + passes + 1,
            timeout,
        )

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class ForkedOperatorProcess(OperatorProcess):
    """The tests' operator: the same process, forked from the operator zygote."""

    forked = True


def register_chart_webhooks(cluster: Cluster, url: str, ca: Path) -> None:
    """The chart's MutatingWebhookConfiguration and its creator check (the
    ValidatingWebhookConfiguration a 1.20 API server gets) as it renders them by default,
    with ``url`` (the operator's admission listener) in place of its Service and ``ca``
    as the caBundle."""
    import helm_python as helm
    import yaml

    chart = helm.Chart.load(str(ROOT / "charts" / "hyperpod-sdc"))
    rendered = chart.render({}, name="hyperpod-sdc", namespace="hyperpod-sdc", is_install=True)
    docs = [
        d
        for path, text in rendered.items()
        if path.endswith(".yaml")
        for d in yaml.safe_load_all(text)
        if d
    ]
    (hook,) = [d for d in docs if d.get("kind") == "MutatingWebhookConfiguration"]
    (check,) = [d for d in docs if d.get("kind") == "ValidatingWebhookConfiguration"]
    for entry in hook["webhooks"] + check["webhooks"]:
        path = entry["clientConfig"]["service"]["path"]
        entry["clientConfig"] = {
            "url": f"{url}{path}",
            "caBundle": base64.b64encode(ca.read_bytes()).decode(),
        }
    admission = client.AdmissionregistrationV1Api(cluster.api)
    admission.create_mutating_webhook_configuration(hook)
    admission.create_validating_webhook_configuration(check)
    await_webhooks(cluster, [hook, check])


def webhook_calls(cluster: Cluster) -> dict[str, float]:
    """The API server's own count of its calls to each admission webhook, by the webhook's
    name (``apiserver_admission_webhook_admission_duration_seconds``; a failed or refused
    call counts too)."""
    response = cluster.api.call_api(
        "/metrics", "GET", auth_settings=["BearerToken"], _preload_content=False
    )
    response = response[0] if isinstance(response, tuple) else response
    calls: dict[str, float] = {}
    prefix = "apiserver_admission_webhook_admission_duration_seconds_count{"
    for line in response.data.decode().splitlines():
        if line.startswith(prefix):
            name = line.split('name="', 1)[1].split('"', 1)[0]
            calls[name] = calls.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return calls


def _selected_labels(selector: Mapping[str, Any]) -> dict[str, str]:
    """Labels that a label selector (matchLabels; matchExpressions In or Exists) selects."""
    labels = dict(selector.get("matchLabels") or {})
    for expression in selector.get("matchExpressions") or ():
        if expression["operator"] in ("In", "Exists"):
            labels[expression["key"]] = (expression.get("values") or ["true"])[0]
    return labels


def own_webhook_names(configurations: list[dict[str, Any]], owner: str) -> None:
    """Prefix each webhook entry's name (the chart's are fixed: ``pods.hyperpod-sdc.dev``)
    with ``owner``, a DNS label no other test's configurations use (the test's namespace):
    the API server counts its calls by that name, and :func:`await_webhooks` waits on it."""
    for configuration in configurations:
        for entry in configuration["webhooks"]:
            entry["name"] = f"{owner}.{entry['name']}"


def _shared_webhook_names(cluster: Cluster, configurations: list[dict[str, Any]]) -> list[str]:
    """The entries of ``configurations`` whose names another configuration on the API
    server has too (another test's, whose calls would count as theirs)."""
    ours = {
        entry["name"]: (configuration["kind"], configuration["metadata"]["name"])
        for configuration in configurations
        for entry in configuration["webhooks"]
    }
    admission = client.AdmissionregistrationV1Api(cluster.api)
    shared = []
    for kind, listing in (
        ("MutatingWebhookConfiguration", admission.list_mutating_webhook_configuration),
        ("ValidatingWebhookConfiguration", admission.list_validating_webhook_configuration),
    ):
        for item in listing().items:
            for hook in item.webhooks or ():
                if hook.name in ours and ours[hook.name] != (kind, item.metadata.name):
                    shared.append(f"{hook.name} (also in {kind} {item.metadata.name})")
    return shared


def await_webhooks(
    cluster: Cluster,
    configurations: list[dict[str, Any]],
    namespace_labels: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> None:
    """Wait until the API server calls every webhook of the ``configurations`` just
    created (it takes a new configuration up from a watch, within about a second, later on a
    loaded machine), instead of sleeping: a dry-run pod per webhook, with the labels its
    object selector selects, in a namespace of its own labeled ``namespace_labels`` (which
    the webhooks' namespace selectors must select), created again until the API server's
    count of calls (:func:`webhook_calls`) has grown for each. A dry run stores nothing; the
    chart's webhooks declare no side effects, so they are called for it. Each webhook's
    name must be this configuration's alone (:func:`own_webhook_names`): a ValueError
    names any another configuration has, whose calls would raise the count first."""
    shared = _shared_webhook_names(cluster, configurations)
    if shared:
        raise ValueError(f"await_webhooks: webhook names not this configuration's: {shared}")
    probe_namespace = cluster.namespace(admitted=False)
    if namespace_labels:
        cluster.core.patch_namespace(probe_namespace, {"metadata": {"labels": namespace_labels}})
    entries = [entry for configuration in configurations for entry in configuration["webhooks"]]
    before = webhook_calls(cluster)

    def probe() -> bool:
        for i, entry in enumerate(entries):
            body = {
                "metadata": {
                    "name": f"webhook-probe-{i}",
                    "labels": _selected_labels(entry.get("objectSelector") or {}),
                },
                "spec": {
                    "serviceAccountName": "worker",
                    "automountServiceAccountToken": False,
                    "containers": [{"name": "probe", "image": "example.com/probe:1"}],
                },
            }
            # refused by a webhook, or failing to reach it: it was called all the same
            with contextlib.suppress(client.ApiException):
                cluster.core.create_namespaced_pod(probe_namespace, body, dry_run="All")
        calls = webhook_calls(cluster)
        return all(calls.get(e["name"], 0.0) > before.get(e["name"], 0.0) for e in entries)

    wait_for("the API server calling the new webhooks", probe, timeout)


def post(
    url: str, body: bytes | str, token: str | None, content_type: str = "application/json"
) -> tuple[int, dict[str, Any], dict[str, str]]:
    data = body.encode() if isinstance(body, str) else body
    headers = {"Content-Type": content_type}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(f"{url}/v1/reports", data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}"), dict(exc.headers)


def post_split(
    url: str,
    body: bytes,
    token: str,
    *,
    pieces: int = 2,
    delay: float = 0.01,
    context: ssl.SSLContext | None = None,
) -> tuple[int, dict[str, Any]]:
    """POST a report the way a slow or busy network delivers it: the headers, then the
    body in ``pieces`` writes ``delay`` seconds apart (separate TCP segments, and separate
    TLS records over HTTPS)."""
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    head = (
        f"POST /v1/reports HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
        f"Content-Type: application/json\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    raw = socket.create_connection((parts.hostname, parts.port), timeout=30)
    sock: socket.socket = (
        context.wrap_socket(raw, server_hostname=parts.hostname) if context else raw
    )
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(head)
        size = -(-len(body) // pieces)
        for start in range(0, len(body), size):
            time.sleep(delay)
            sock.sendall(body[start : start + size])
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    _, _, payload = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), json.loads(payload or b"{}")


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """(key, certificate) for the operator's HTTPS intake on 127.0.0.1, an ECDSA P-256
    key as the chart's (:mod:`sdc_harness.tls`)."""
    key, cert = directory / "tls.key", directory / "tls.crt"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            *tls.new_key("ec"),
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=hyperpod-sdc",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return key, cert
