"""A stand-in for the Kubeflow training operator and the kubelet, as far as a PyTorchJob
on this machine needs them (the end-to-end demo's job).

:class:`Runner` creates the job's pods from its template, as the training operator's
ServiceAccount (:func:`training_operator`, a trusted pod creator), bound to nodes that
accept them (cordon and taints honoured: :func:`schedulable`). As the kubelet it reads
each pod back as the API server stored it (the admission webhook's additions included)
and starts the pod's worker processes from that spec (:func:`sdc_harness.kubelet.materialize`:
env, projected token, ConfigMap volumes), with what torchrun gives each worker, each
forked from a process that imported torch once (:mod:`sdc_harness.zygote`). It stops
the workers when the job is suspended (SIGTERM, SIGKILL after the grace period) and
starts new pods when it is resumed. It is also the scheduler and kubelet of the
operator's confirmation pods (:func:`sdc_harness.kubelet.start`, forked as the workers).

The job itself (its command, the env a worker or a confirmation pod gets on a given node:
an emulated broken GPU) is the caller's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config

from sdc_operator.confirmation import CONFIRMATION_LABEL

from . import kubelet, zygote
from .cluster import Cluster

TRAINING_OPERATOR = ("kubeflow", "training-operator")
"""The training operator's namespace and ServiceAccount."""
GRACE_SECONDS = 30
"""The pods' termination grace period (Kubernetes' default)."""


def schedulable(node: dict[str, Any]) -> bool:
    """As the scheduler sees it for a pod without tolerations."""
    spec = node.get("spec") or {}
    taints = [t for t in spec.get("taints") or [] if t.get("effect") in ("NoSchedule", "NoExecute")]
    return not spec.get("unschedulable") and not taints


def training_operator(cluster: Cluster, base: Path) -> client.CoreV1Api:
    """The API as the training operator's ServiceAccount, allowed to manage pods."""
    namespace, account = TRAINING_OPERATOR
    cluster.core.create_namespace({"metadata": {"name": namespace}})
    cluster.core.create_namespaced_service_account(namespace, {"metadata": {"name": account}})
    rbac = client.RbacAuthorizationV1Api(cluster.api)
    rbac.create_cluster_role(
        {
            "metadata": {"name": "demo-training-operator"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["pods"],
                    "verbs": ["create", "get", "list", "delete"],
                }
            ],
        }
    )
    rbac.create_cluster_role_binding(
        {
            "metadata": {"name": "demo-training-operator"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "demo-training-operator",
            },
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
        }
    )
    token = cluster.core.create_namespaced_service_account_token(
        account, namespace, {"spec": {"expirationSeconds": 3600}}
    ).status.token
    kubeconfig = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    kubeconfig["users"][0]["user"] = {"token": token}
    path = base / "training-operator.kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig))
    return client.CoreV1Api(config.new_client_from_config(str(path)))


def template_env(job: dict[str, Any]) -> dict[str, str]:
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    return {e["name"]: e["value"] for e in template["containers"][0].get("env", [])}


def _none(*_: Any) -> dict[str, str]:
    return {}


def _signal(pid: int, signum: int) -> None:
    """``signum`` to the worker's session (its process and any it started), or to the
    worker alone where it has no session yet: a worker forked a moment ago may not have
    called ``setsid()`` (the runner stops a start whose port was taken at once)."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(pid, signum)


@dataclass
class Runner:
    """Runs one PyTorchJob (see the module): ``replicas`` pods of ``ranks_per_pod``
    workers each, every worker ``command`` (an argv)."""

    cluster: Cluster
    trainer: client.CoreV1Api
    """The API as the training operator's ServiceAccount (:func:`training_operator`)."""
    namespace: str
    job: str
    nodes: list[str]
    work: Path
    command: list[str]
    replicas: int
    ranks_per_pod: int
    worker_env: Callable[[str, int, int], dict[str, str]] = _none
    """Extra env of the worker of (node, rank, local rank)."""
    confirmation_env: Callable[[str], dict[str, str]] = _none
    """Extra env of a confirmation pod on (node)."""
    serve_labels: tuple[str, ...] = (CONFIRMATION_LABEL,)
    """Pods with any of these labels ``true`` are run as confirmation pods."""
    on_confirmation: Callable[[dict[str, Any]], None] | None = None
    """Called with each pod labelled :data:`CONFIRMATION_LABEL` once it started."""
    wired_pods: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    procs: list[zygote.Forked] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    """Each worker's log, as ``procs``."""
    placements: list[list[str]] = field(default_factory=list)
    timeline: list[tuple[float, str, str]] = field(default_factory=list)
    stopped_for_suspend: int = 0
    running_env: dict[str, str] = field(default_factory=dict)
    confirmations: dict[str, kubelet.Started] = field(default_factory=dict)
    """Confirmation pods seen, by name."""

    def note(self, kind: str, what: str) -> None:
        at = time.monotonic() - self.started
        self.timeline.append((round(at, 2), kind, what))
        print(f"  {at:6.2f} s  {kind:<10} {what}", flush=True)

    def pods(self) -> list[str]:
        return [f"{self.job}-master-0"] + [
            f"{self.job}-worker-{i}" for i in range(self.replicas - 1)
        ]

    def start(self, job: dict[str, Any]) -> None:
        """Create the job's pods on nodes that accept them (as the training operator) and
        start their workers from the pods as the API server returns them (as the kubelet)."""
        free = [n for n in self.nodes if schedulable(self.cluster.get_node(n))]
        if len(free) < self.replicas:
            raise RuntimeError(f"only {len(free)} schedulable nodes for {self.replicas} pods")
        port = zygote.listen_port()
        placement = []
        resume = None
        for index, (pod_name, node) in enumerate(zip(self.pods(), free, strict=False)):
            pod = self.create_pod(job, pod_name, index, node)
            env = kubelet.materialize(self.cluster, pod, self.work / "pods" / pod_name)
            if "hyperpod-sdc.dev/injection" not in (pod["metadata"].get("annotations") or {}):
                raise RuntimeError(f"the webhook did not wire pod {pod_name}: {pod['metadata']}")
            self.wired_pods.append(pod)
            resume = env.get("HYPERPOD_SDC_RESUME_MAX_STEP")
            placement.append(node)
            for local in range(self.ranks_per_pod):
                rank = index * self.ranks_per_pod + local
                worker_env = {
                    "PATH": os.environ.get("PATH", ""),
                    "HOME": os.environ.get("HOME", str(self.work)),
                    "OMP_NUM_THREADS": "1",
                    **zygote.torchrun_env(
                        rank, self.replicas * self.ranks_per_pod, self.ranks_per_pod, port
                    ),
                    **env,  # the container's env, as the API server stored the pod
                    **self.worker_env(node, rank, local),
                }
                name = f"{pod_name}-{local}-{len(self.placements)}.log"
                self.logs.append(self.work / name)
                (self.work / name).write_bytes(b"")
                self.procs.append(zygote.start(self.command, worker_env, self.work / name))
        self.placements.append(placement)
        extra = f", HYPERPOD_SDC_RESUME_MAX_STEP={resume}" if resume else ""
        self.note(
            "runner",
            f"pods on {', '.join(placement)} (wired by the webhook): "
            f"{len(self.procs)} workers{extra}",
        )

    def create_pod(self, job: dict[str, Any], name: str, index: int, node: str) -> dict[str, Any]:
        """The pod the Kubeflow training operator would make from the job's template."""
        owner = job["metadata"]
        replica = "master" if index == 0 else "worker"
        template = job["spec"]["pytorchReplicaSpecs"][replica.capitalize()]["template"]
        body = {
            "metadata": {
                "name": name,
                "labels": {
                    "training.kubeflow.org/operator-name": "pytorchjob-controller",
                    "training.kubeflow.org/job-name": owner["name"],
                    "training.kubeflow.org/replica-type": replica,
                    "training.kubeflow.org/replica-index": str(max(0, index - 1)),
                },
                "ownerReferences": [
                    {
                        "apiVersion": "kubeflow.org/v1",
                        "kind": "PyTorchJob",
                        "name": owner["name"],
                        "uid": owner["uid"],
                        "controller": True,
                    }
                ],
            },
            "spec": {
                **template["spec"],
                "nodeName": node,  # the scheduler's part
                "automountServiceAccountToken": False,
            },
        }
        self.trainer.create_namespaced_pod(self.namespace, body)
        # The kubelet's part: it reports the pod running once it starts the containers.
        self.cluster.core.patch_namespaced_pod_status(
            name, self.namespace, {"status": {"phase": "Running"}}
        )
        return kubelet.read_pod(self.cluster, self.namespace, name)

    def port_taken(self) -> bool:
        """A worker failed because the port listen_port() found was taken before rank 0's
        store listened on it (rarer below the ephemeral range, but another process may still
        ask for that port in between):
        the others would wait for that store until their own timeout."""
        return any(
            proc.poll() not in (None, 0) and b"EADDRINUSE" in log.read_bytes()
            for proc, log in zip(self.procs, self.logs, strict=True)
        )

    def stop(self, grace: float = GRACE_SECONDS) -> None:
        """As the kubelet stops a pod: SIGTERM, then SIGKILL after the grace period."""
        for proc in self.procs:
            if proc.poll() is None:
                _signal(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs = []
        self.logs = []
        core = self.cluster.core
        for pod in self.pods():
            core.delete_namespaced_pod(pod, self.namespace, grace_period_seconds=0)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            names = {p.metadata.name for p in core.list_namespaced_pod(self.namespace).items}
            if not names & set(self.pods()):
                return
            time.sleep(0.1)
        raise RuntimeError("pods were not deleted")

    def serve_confirmations(self) -> None:
        """The scheduler and kubelet for confirmation pods: bind each to the node its
        required node affinity names (it tolerates the quarantine taint and the cordon),
        run its command there as a process (with :attr:`confirmation_env` of that node),
        and write its end back as the kubelet would."""
        for label in self.serve_labels:
            listed = self.cluster.core.list_namespaced_pod(
                self.namespace, label_selector=f"{label}=true", _preload_content=False
            )
            for pod in json.loads(listed.data)["items"]:
                name = pod["metadata"]["name"]
                if name not in self.confirmations:
                    self.start_confirmation(pod)
        for name, seen in self.confirmations.items():
            if seen.exit_code is not None or kubelet.finish(self.cluster, seen) is None:
                continue
            message = seen.message
            outcome = (json.loads(message) if message.startswith("{") else {}).get("outcome")
            self.note(
                "kubelet",
                f"confirmation pod {name} on {seen.node} exited {seen.exit_code} ({outcome})",
            )

    def start_confirmation(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        node = kubelet.pinned_node(pod)
        started = kubelet.start(
            self.cluster, pod, self.work / "pods" / name, self.confirmation_env(node), fork=True
        )
        self.confirmations[name] = started
        (container,) = started.pod["spec"]["containers"]
        self.note("kubelet", f"confirmation pod {name} bound to {node}: {container['args'][0]}")
        labels = pod["metadata"].get("labels") or {}
        if self.on_confirmation is not None and labels.get(CONFIRMATION_LABEL) == "true":
            self.on_confirmation(pod)

    def run(self, timeout: float, watch: Callable[[], None]) -> bool:
        """Drive the job to its end; ``watch`` is called every tick. True if it finished.

        Level-based, like the real controllers: workers run while the job is not suspended
        and their pod template is the job's current one. A suspension lifted again before
        this loop saw it still shows as a changed template (the resume step was set).
        """
        try:
            return self._run(timeout, watch)
        except BaseException:
            # Nobody waits for the workers any more: at the caller's exit multiprocessing
            # would send its daemons SIGTERM and join them, and a worker still in the
            # rendezvous never reaches the scripts' handler (the demo hung there).
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL every worker still running."""
        for proc in self.procs:
            if proc.poll() is None:
                _signal(proc.pid, signal.SIGKILL)

    def _run(self, timeout: float, watch: Callable[[], None]) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            watch()
            self.serve_confirmations()
            job = self.cluster.get_job(self.namespace, self.job)
            suspended = (job["spec"].get("runPolicy") or {}).get("suspend") is True
            current = template_env(job)
            if self.procs and (suspended or current != self.running_env):
                self.stop()
                self.stopped_for_suspend += 1
                self.note("runner", "job suspended: workers stopped, pods deleted")
            elif not suspended and not self.procs:
                self.running_env = current
                self.start(job)
            elif self.procs and self.port_taken():
                # As torchrun's restart would: nothing ran yet, so this start never was.
                # No grace period: the other ranks wait for the store in the rendezvous,
                # where the scripts' SIGTERM handler (stop between steps) is never reached.
                self.stop(grace=0)
                self.placements.pop()
                del self.wired_pods[-self.replicas :]
                self.note("runner", "rank 0's port was taken (EADDRINUSE): starting again")
            elif self.procs and all(p.poll() is not None for p in self.procs):
                codes = [p.returncode for p in self.procs]
                if any(codes):
                    self.note(
                        "runner", f"workers failed with exit codes {codes}; logs in {self.work}"
                    )
                    return False
                self.procs = []
                return True
            time.sleep(0.1)
        self.note("runner", f"gave up after {timeout:.0f} s")
        self.kill()
        return False
