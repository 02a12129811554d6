"""End to end on one machine: a training job with a corrupting GPU is detected, localized,
contained and resumed from the verified snapshot of its last clean step, and finishes with
exactly the weights of a run without the fault.

    .venv/bin/python scripts/e2e_demo.py [--json result.json] [--keep DIR]

Real: the Kubernetes API server and etcd (scripts/kube-apiserver.sh), the CRDs (SDCIncident,
SDCPolicy, Kubeflow's PyTorchJob), the operator (``python -m sdc_operator``) over HTTPS with
its admission webhook registered as the chart renders it (only ``clientConfig.service``
swapped for the loopback URL), the agent in every worker (``examples/train.py``: DDP on CPU
with gloo), TokenRequest/TokenReview. The job carries only the annotation
``hyperpod-sdc.dev/enabled: "true"``; the webhook wires its pods.

Stand-in for the cluster (``Runner`` and ``Kubelet`` below): what the Kubeflow training
operator and the kubelet would do. The runner creates the job's pods from its template, as
the training operator's ServiceAccount, bound to nodes that accept them (cordon and taints
honoured). The kubelet stand-in reads each pod back as the API server stored it (the
webhook's additions included) and starts two worker processes per pod from that spec: its
env (downward-API ``fieldRef``s resolved), its projected ServiceAccount token (a bound token
requested with the volume's audience) and its ConfigMap volumes (the CA), written into a
directory per pod; a path under a mount in the env points into that directory instead. It
stops the workers when the job is suspended and starts new pods when it is resumed. The
faulty GPU is played by the agent's fault injection, given to the processes on one node only:
the fault stays with the node, as a broken GPU would. The checkpoint volume is a
``hostPath`` every pod mounts in place (a shared volume). The runner is also the scheduler
and kubelet of the operator's confirmation pod: it binds it to the node its affinity names
and runs its command (``python -m sdc_agent.confirm BUNDLE``) as a process there, with the
broken GPU still broken on the faulty node, and writes its exit code and termination
message back. SageMaker is the loopback fake of the integration tests
(tests/integration/fake_sagemaker.py), which checks each call against botocore's model and
counts them.

Two scenarios: a clean run (no incident, no node touched; its final weights are the
reference), then the same job with the fault, under the remediation policy
``auto-replace-confirmed``: detected, contained, resumed, confirmed on the faulty node
(``Confirmed=True`` naming its GPU) and replaced (one ``BatchReplaceClusterNodes``); the
same bundle recomputed on a healthy node (a second confirmation pod the demo makes by hand)
is not confirmed. The job audits every 10 steps and writes a periodic checkpoint every
30: the fault from step 43 is caught at step 50, the healthy ranks write the snapshot of
the last clean step 40 as a verified checkpoint, and the job resumes from step 40, not from
the periodic checkpoint of step 30; the demo prints the work lost (at most one audit
interval). Exit status 0 only if everything happened.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.integration.fake_sagemaker import FakeSageMaker  # noqa: E402
from tests.tls import ca_and_certificate  # noqa: E402

PYTHON = sys.executable
NAMESPACE = "ml"
OPERATOR_NAMESPACE = "hyperpod-sdc"
RANKS_PER_POD = 2
REPLICAS = 3
STEPS = 60
INTERVAL = 10  # the replay audit and the weight check, every INTERVAL steps (replay_every)
CHECKPOINT_EVERY = 30  # periodic checkpoints: longer than the audit interval, as in practice
FAULT_STEP = 43  # caught by the audit of step 50; last clean step 40; periodic checkpoint 30
FAULTY_NODE = 1  # the second node's second GPU (rank 3) returns 4.0001 for 4.0000
GRACE_SECONDS = 30  # the pods' termination grace period (Kubernetes' default)
TRAINING_OPERATOR = ("kubeflow", "training-operator")  # its namespace and ServiceAccount
CLUSTER = "demo-cluster"  # the HyperPod cluster (the nodes' sagemaker.amazonaws.com/cluster-name)
POLICY = "auto-replace-confirmed"
CONFIRMATION_LABEL = "hyperpod-sdc.dev/confirmation"
SECOND_OPINION_LABEL = "demo.hyperpod-sdc.dev/second-opinion"
AGENT_ENV = {
    "HYPERPOD_SDC_REPLAY_EVERY": str(INTERVAL),
    "HYPERPOD_SDC_WEIGHTS_EVERY": str(INTERVAL),
    # the verified snapshot of the last clean step, each slice kept on two nodes, written
    # as a checkpoint at the detection (examples/train.py turns it on by default too)
    "HYPERPOD_SDC_SNAPSHOT_COPIES": "2",
    "HYPERPOD_SDC_FINGERPRINT_BACKEND": "eager",  # no compiler warm-up on CPU
}


def fault_spec(rank: int) -> str:
    return (
        f"rank={rank},step={FAULT_STEP},site=forward,kind=relative,relative_error=2.5e-5,"
        "persistent=true,target=0,index=all"
    )


def say(what: str) -> None:
    print(what, flush=True)


# -- the real parts ------------------------------------------------------------------------


class ApiServer:
    """etcd and kube-apiserver on loopback (the cached build), with the CRDs."""

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
        self.api = config.new_client_from_config(self.kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.kubectl("create", "-f", str(ROOT / "crds"))
        crd = ROOT / "tests" / "integration" / "crds" / "kubeflow.org_pytorchjobs.yaml"
        self.kubectl("create", "--validate=false", "-f", str(crd))
        for name in (
            "sdcincidents.hyperpod-sdc.dev",
            "sdcpolicies.hyperpod-sdc.dev",
            "pytorchjobs.kubeflow.org",
        ):
            self.kubectl("wait", "--for", "condition=Established", f"crd/{name}", "--timeout=60s")

    def kubectl(self, *args: str) -> str:
        done = subprocess.run(
            ["kubectl", "--kubeconfig", self.kubeconfig, *args], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr}")
        return done.stdout

    def stop(self) -> None:
        self.api.close()
        subprocess.run([str(ROOT / "scripts" / "kube-apiserver.sh"), "stop", str(self.state)])

    def node(self, name: str) -> dict[str, Any]:
        return dict(json.loads(self.core.read_node(name, _preload_content=False).data))

    def job(self, name: str) -> dict[str, Any]:
        found = self.custom.get_namespaced_custom_object(
            "kubeflow.org", "v1", NAMESPACE, "pytorchjobs", name
        )
        return dict(found)

    def incidents(self, job: str) -> list[dict[str, Any]]:
        found = self.custom.list_namespaced_custom_object(
            "hyperpod-sdc.dev",
            "v1alpha1",
            NAMESPACE,
            "sdcincidents",
            label_selector=f"hyperpod-sdc.dev/job={job}",
        )
        return list(found["items"])


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OperatorProcess:
    def __init__(
        self,
        server: ApiServer,
        log: Path,
        tls: tuple[Path, Path, Path],
        extra_env: dict[str, str],
        before_start: Callable[[str], None],
    ) -> None:
        """``before_start``: called with the admission URL before the operator starts (it
        does not start without its creator check registered)."""
        port, admission, metrics = free_port(), free_port(), free_port()
        self.url = f"https://127.0.0.1:{port}"
        self.admission_url = f"https://127.0.0.1:{admission}"
        self.metrics_url = f"https://127.0.0.1:{metrics}"
        before_start(self.admission_url)
        ca, cert, key = tls
        env = {
            **os.environ,
            "KUBECONFIG": server.kubeconfig,
            "HYPERPOD_SDC_LISTEN_ADDRESS": "127.0.0.1",
            "HYPERPOD_SDC_LISTEN_PORT": str(port),
            "HYPERPOD_SDC_ADMISSION_PORT": str(admission),
            "HYPERPOD_SDC_METRICS_PORT": str(metrics),
            "HYPERPOD_SDC_NAMESPACES": NAMESPACE,
            "HYPERPOD_SDC_RESYNC_SECONDS": "2",
            "HYPERPOD_SDC_TLS_CERT_FILE": str(cert),
            "HYPERPOD_SDC_TLS_KEY_FILE": str(key),
            "HYPERPOD_SDC_TLS_CA_FILE": str(ca),  # published as ConfigMap hyperpod-sdc-ca
            "HYPERPOD_SDC_INJECT_OPERATOR_URL": self.url,
            "HYPERPOD_SDC_TRUSTED_POD_CREATORS": "system:serviceaccount:{}:{}".format(
                *TRAINING_OPERATOR
            ),
            "HYPERPOD_SDC_JOB_SWEEP_SECONDS": "2",
            "HYPERPOD_SDC_REMEDIATION_POLICY": POLICY,
            "AWS_DEFAULT_REGION": "us-west-2",
            **extra_env,
        }
        self._log = open(log, "wb")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen(
            [PYTHON, "-m", "sdc_operator"], env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        import ssl
        import urllib.request

        trust = ssl.create_default_context(cafile=str(ca))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the operator exited; see {log}")
            try:
                with urllib.request.urlopen(f"{self.metrics_url}/readyz", timeout=1, context=trust):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"the operator did not become ready; see {log}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


# -- the stand-in for the cluster ----------------------------------------------------------


def schedulable(node: dict[str, Any]) -> bool:
    """As the scheduler sees it for a pod without tolerations."""
    spec = node.get("spec") or {}
    taints = [t for t in spec.get("taints") or [] if t.get("effect") in ("NoSchedule", "NoExecute")]
    return not spec.get("unschedulable") and not taints


class Kubelet:
    """What the kubelet does for a pod before its containers start, on this machine: the
    env with downward-API fields resolved, the projected ServiceAccount token and the
    ConfigMap volumes written under a directory per pod (``<pod dir>/<mountPath>/...``)."""

    def __init__(self, server: ApiServer) -> None:
        self.server = server

    def materialize(self, pod: dict[str, Any], root: Path) -> tuple[dict[str, str], bool]:
        """(the first container's env, whether the webhook wired the pod)."""
        spec, meta = pod["spec"], pod["metadata"]
        container = spec["containers"][0]
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        # A hostPath is this machine's own directory, where every pod mounts it.
        mounts = {
            m["mountPath"]: m["name"]
            for m in container.get("volumeMounts") or []
            if "hostPath" not in volumes[m["name"]]
        }
        for path, name in mounts.items():
            target = root / path.lstrip("/")
            target.mkdir(parents=True, exist_ok=True)
            self.fill(pod, volumes[name], target)
        env = {}
        for var in container.get("env") or []:
            if "value" in var:
                value = str(var["value"])
            else:
                field_path = var["valueFrom"]["fieldRef"]["fieldPath"]
                value = {
                    "metadata.name": meta["name"],
                    "metadata.namespace": NAMESPACE,
                    "spec.nodeName": spec.get("nodeName", ""),
                }[field_path]
            for path in mounts:  # a file under a mount is in the pod's directory here
                if value == path or value.startswith(path.rstrip("/") + "/"):
                    value = str(root / value.lstrip("/"))
            env[var["name"]] = value
        wired = "hyperpod-sdc.dev/injection" in (meta.get("annotations") or {})
        return env, wired

    def fill(self, pod: dict[str, Any], volume: dict[str, Any], target: Path) -> None:
        if "projected" in volume:
            for source in volume["projected"]["sources"]:
                sat = source["serviceAccountToken"]
                review = self.server.core.create_namespaced_service_account_token(
                    pod["spec"].get("serviceAccountName", "default"),
                    NAMESPACE,
                    {
                        "spec": {
                            "audiences": [sat["audience"]],
                            "expirationSeconds": sat.get("expirationSeconds", 3600),
                            "boundObjectRef": {
                                "apiVersion": "v1",
                                "kind": "Pod",
                                "name": pod["metadata"]["name"],
                                "uid": pod["metadata"]["uid"],
                            },
                        }
                    },
                )
                (target / sat["path"]).write_text(review.status.token)
        elif "configMap" in volume:
            name = volume["configMap"]["name"]
            deadline = time.monotonic() + 60
            while True:  # a pod waits for a ConfigMap volume that does not exist yet
                try:
                    found = self.server.core.read_namespaced_config_map(name, NAMESPACE)
                    break
                except client.ApiException as exc:
                    if exc.status != 404 or time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            for key, value in (found.data or {}).items():
                (target / key).write_text(value)
        else:
            raise RuntimeError(f"the demo's kubelet cannot mount volume {volume}")


@dataclass
class Runner:
    """The Kubeflow training operator and the kubelet, as far as this job needs them."""

    server: ApiServer
    trainer: client.CoreV1Api
    """The API as the training operator's ServiceAccount (a trusted pod creator)."""
    kubelet: Kubelet
    job: str
    nodes: list[str]
    faulty_node: str | None
    work: Path
    wired_pods: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    placements: list[list[str]] = field(default_factory=list)
    timeline: list[tuple[float, str, str]] = field(default_factory=list)
    stopped_for_suspend: int = 0
    running_env: dict[str, str] = field(default_factory=dict)
    confirmations: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Confirmation pods seen, by name: node, process, exit code, termination message."""
    second_opinion_on: str | None = None
    """A healthy node on which to recompute the same bundle, by a copy of the operator's
    confirmation pod made by hand (at the same time, to keep the demo short)."""

    def note(self, kind: str, what: str) -> None:
        at = time.monotonic() - self.started
        self.timeline.append((round(at, 2), kind, what))
        say(f"  {at:6.2f} s  {kind:<10} {what}")

    def pods(self) -> list[str]:
        return [f"{self.job}-master-0"] + [f"{self.job}-worker-{i}" for i in range(REPLICAS - 1)]

    def start(self, job: dict[str, Any]) -> None:
        """Create the job's pods on nodes that accept them (as the training operator) and
        start their workers from the pods as the API server returns them (as the kubelet)."""
        free = [n for n in self.nodes if schedulable(self.server.node(n))]
        if len(free) < REPLICAS:
            raise RuntimeError(f"only {len(free)} schedulable nodes for {REPLICAS} pods")
        port = free_port()
        placement = []
        resume = None
        for index, (pod_name, node) in enumerate(zip(self.pods(), free, strict=False)):
            pod = self.create_pod(job, pod_name, index, node)
            env, wired = self.kubelet.materialize(pod, self.work / "pods" / pod_name)
            if not wired:
                raise RuntimeError(f"the webhook did not wire pod {pod_name}: {pod['metadata']}")
            self.wired_pods.append(pod)
            resume = env.get("HYPERPOD_SDC_RESUME_MAX_STEP")
            placement.append(node)
            for local in range(RANKS_PER_POD):
                rank = index * RANKS_PER_POD + local
                worker_env = {
                    "PATH": os.environ.get("PATH", ""),
                    "HOME": os.environ.get("HOME", str(self.work)),
                    "OMP_NUM_THREADS": "1",
                    # what torchrun gives each worker
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "RANK": str(rank),
                    "WORLD_SIZE": str(REPLICAS * RANKS_PER_POD),
                    "LOCAL_RANK": str(local),
                    "LOCAL_WORLD_SIZE": str(RANKS_PER_POD),
                    **env,  # the container's env, as the API server stored the pod
                }
                if node == self.faulty_node and local == 1:
                    worker_env["HYPERPOD_SDC_FAULTS"] = fault_spec(rank)  # the broken GPU
                log = open(self.work / f"{pod_name}-{local}-{len(self.placements)}.log", "wb")  # noqa: SIM115
                self.procs.append(
                    subprocess.Popen(
                        [
                            PYTHON,
                            str(ROOT / "examples" / "train.py"),
                            "--steps",
                            str(STEPS),
                            "--checkpoint-dir",
                            str(self.work / "ckpt"),
                            "--checkpoint-every",
                            str(CHECKPOINT_EVERY),
                            "--result-file",
                            str(self.work / "result.json"),
                        ],
                        env=worker_env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
                log.close()
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
        self.trainer.create_namespaced_pod(NAMESPACE, body)
        # The kubelet's part: it reports the pod running once it starts the containers.
        self.server.core.patch_namespaced_pod_status(
            name, NAMESPACE, {"status": {"phase": "Running"}}
        )
        return dict(
            json.loads(
                self.server.core.read_namespaced_pod(name, NAMESPACE, _preload_content=False).data
            )
        )

    def stop(self) -> None:
        """As the kubelet stops a pod: SIGTERM, then SIGKILL after the grace period."""
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECONDS
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs = []
        for pod in self.pods():
            self.server.core.delete_namespaced_pod(pod, NAMESPACE, grace_period_seconds=0)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            names = {p.metadata.name for p in self.server.core.list_namespaced_pod(NAMESPACE).items}
            if not names & set(self.pods()):
                return
            time.sleep(0.1)
        raise RuntimeError("pods were not deleted")

    def serve_confirmations(self) -> None:
        """The scheduler and kubelet for confirmation pods: bind each to the node its
        required node affinity names (it tolerates the quarantine taint and the cordon),
        run its command there as a process (the faulty node's broken GPU still broken),
        and write its end back as the kubelet would."""
        core = self.server.core
        for label in (CONFIRMATION_LABEL, SECOND_OPINION_LABEL):
            listed = core.list_namespaced_pod(
                NAMESPACE, label_selector=f"{label}=true", _preload_content=False
            )
            for pod in json.loads(listed.data)["items"]:
                name = pod["metadata"]["name"]
                if name not in self.confirmations:
                    self.start_confirmation(pod)
        for name, seen in self.confirmations.items():
            proc = seen["proc"]
            if seen.get("exit_code") is not None or proc.poll() is None:
                continue
            log = seen["termination_log"]
            message = log.read_text() if log.exists() else ""
            seen["exit_code"], seen["message"] = proc.returncode, message
            terminated = {
                "exitCode": proc.returncode,
                "reason": "Completed" if proc.returncode == 0 else "Error",
                "message": message,
                "startedAt": seen["started_at"],
                "finishedAt": now_iso(),
            }
            core.patch_namespaced_pod_status(
                name,
                NAMESPACE,
                {
                    "status": {
                        "phase": "Succeeded" if proc.returncode == 0 else "Failed",
                        "containerStatuses": [container_status({"terminated": terminated})],
                    }
                },
            )
            outcome = (json.loads(message) if message.startswith("{") else {}).get("outcome")
            self.note(
                "kubelet",
                f"confirmation pod {name} on {seen['node']} exited {proc.returncode} ({outcome})",
            )

    def start_confirmation(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        affinity = pod["spec"]["affinity"]["nodeAffinity"]
        terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        node = terms[0]["matchFields"][0]["values"][0]
        self.server.core.create_namespaced_pod_binding(
            name,
            NAMESPACE,
            {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": name},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node},
            },
            _preload_content=False,
        )
        bound = json.loads(
            self.server.core.read_namespaced_pod(name, NAMESPACE, _preload_content=False).data
        )
        root = self.work / "pods" / name
        root.mkdir(parents=True, exist_ok=True)
        env, _ = self.kubelet.materialize(bound, root)
        (container,) = bound["spec"]["containers"]
        log = root / "termination-log"
        args = [
            str(log) if a == container["terminationMessagePath"] else a for a in container["args"]
        ]
        assert container["command"] == ["python", "-m", "sdc_agent.confirm"], container["command"]
        worker_env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": os.environ.get("HOME", str(self.work)),
            "OMP_NUM_THREADS": "1",
            **env,
        }
        if node == self.faulty_node:  # the broken GPU is still broken
            worker_env["HYPERPOD_SDC_FAULTS"] = fault_spec(FAULTY_NODE * RANKS_PER_POD + 1)
        started = now_iso()
        self.server.core.patch_namespaced_pod_status(
            name,
            NAMESPACE,
            {
                "status": {
                    "phase": "Running",
                    "startTime": started,
                    "containerStatuses": [container_status({"running": {"startedAt": started}})],
                }
            },
        )
        output = open(self.work / f"{name}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [PYTHON, "-m", "sdc_agent.confirm", *args],
            env=worker_env,
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=root,
            start_new_session=True,
        )
        output.close()
        self.confirmations[name] = {
            "node": node,
            "proc": proc,
            "termination_log": log,
            "started_at": started,
            "exit_code": None,
        }
        self.note("kubelet", f"confirmation pod {name} bound to {node}: {' '.join(args[:1])}")
        labels = pod["metadata"].get("labels") or {}
        if self.second_opinion_on and labels.get(CONFIRMATION_LABEL) == "true":
            second_opinion(self.server, self, pod, self.second_opinion_on)

    def run(self, timeout: float, watch: Any) -> bool:
        """Drive the job to its end; ``watch`` is called every tick. True if it finished.

        Level-based, like the real controllers: workers run while the job is not suspended
        and their pod template is the job's current one. A suspension lifted again before
        this loop saw it still shows as a changed template (the resume step was set).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            watch()
            self.serve_confirmations()
            job = self.server.job(self.job)
            suspended = (job["spec"].get("runPolicy") or {}).get("suspend") is True
            current = template_env(job)
            if self.procs and (suspended or current != self.running_env):
                self.stop()
                self.stopped_for_suspend += 1
                self.note("runner", "job suspended: workers stopped, pods deleted")
            elif not suspended and not self.procs:
                self.running_env = current
                self.start(job)
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
        return False


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def container_status(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "confirm",
        "ready": False,
        "restartCount": 0,
        "image": "local/train",
        "imageID": "",
        "state": state,
    }


def template_env(job: dict[str, Any]) -> dict[str, str]:
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    return {e["name"]: e["value"] for e in template["containers"][0].get("env", [])}


# -- scenarios -------------------------------------------------------------------------------


def admit_namespace(server: ApiServer) -> None:
    """The cluster admin's step: an SDCPolicy admitting the demo's namespace, replacing
    nodes a confirmation run reproduced the fault on."""
    server.custom.create_cluster_custom_object(
        "hyperpod-sdc.dev",
        "v1alpha1",
        "sdcpolicies",
        {
            "apiVersion": "hyperpod-sdc.dev/v1alpha1",
            "kind": "SDCPolicy",
            "metadata": {"name": "demo"},
            "spec": {"namespaces": [NAMESPACE], "remediationPolicy": POLICY},
        },
    )


def training_operator(server: ApiServer, base: Path) -> client.CoreV1Api:
    """The API as the training operator's ServiceAccount, allowed to manage pods."""
    namespace, account = TRAINING_OPERATOR
    server.core.create_namespace({"metadata": {"name": namespace}})
    server.core.create_namespaced_service_account(namespace, {"metadata": {"name": account}})
    rbac = client.RbacAuthorizationV1Api(server.api)
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
    token = server.core.create_namespaced_service_account_token(
        account, namespace, {"spec": {"expirationSeconds": 3600}}
    ).status.token
    kubeconfig = yaml.safe_load(Path(server.kubeconfig).read_text())
    kubeconfig["users"][0]["user"] = {"token": token}
    path = base / "training-operator.kubeconfig"
    path.write_text(yaml.safe_dump(kubeconfig))
    return client.CoreV1Api(config.new_client_from_config(str(path)))


def register_webhook(server: ApiServer, url: str, ca: Path) -> None:
    """The chart's MutatingWebhookConfiguration and its creator check (the
    ValidatingWebhookConfiguration a 1.20 API server gets) as it renders them, with the
    operator's loopback URL in place of its Service and the demo CA as the caBundle."""
    import base64

    import helm_python as helm

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
    admission = client.AdmissionregistrationV1Api(server.api)
    admission.create_mutating_webhook_configuration(hook)
    admission.create_validating_webhook_configuration(check)
    time.sleep(1.0)  # the API server takes up a new webhook configuration within a second


def create_job(server: ApiServer, name: str, checkpoints: Path) -> None:
    container = {
        "name": "pytorch",
        "image": "local/train",
        "env": [{"name": k, "value": v} for k, v in AGENT_ENV.items()],
        # checkpoints, and evidence bundles next to them, on a volume every node mounts
        "volumeMounts": [{"name": "checkpoints", "mountPath": str(checkpoints)}],
    }
    template = {
        "spec": {
            "containers": [container],
            "serviceAccountName": "worker",
            "volumes": [
                {
                    "name": "checkpoints",
                    "hostPath": {"path": str(checkpoints), "type": "DirectoryOrCreate"},
                }
            ],
        }
    }
    server.custom.create_namespaced_custom_object(
        "kubeflow.org",
        "v1",
        NAMESPACE,
        "pytorchjobs",
        {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {"name": name, "annotations": {"hyperpod-sdc.dev/enabled": "true"}},
            "spec": {
                "runPolicy": {"suspend": False},
                "pytorchReplicaSpecs": {
                    "Master": {"replicas": 1, "template": template},
                    "Worker": {"replicas": REPLICAS - 1, "template": template},
                },
            },
        },
    )


def milestones(incident: dict[str, Any]) -> list[tuple[str, str]]:
    """The milestones an incident has reached, each with what to say about it."""
    spec = incident["spec"]
    status = incident.get("status") or {}
    conditions = {c["type"]: c for c in status.get("conditions") or []}
    resumed = conditions.get("Resumed", {})
    reached = []
    if "Detected" in conditions:
        reached.append(
            (
                "detected",
                f"{spec['check']} check at step {spec['detectionStep']}: {spec['message']} "
                f"(suspect window ({spec['lastCleanStep']}, {spec['detectionStep']}])",
            )
        )
    if status.get("instanceId") and status.get("phase") != "WaitingForAgreement":
        pod = (status.get("suspects") or [{}])[0].get("pod")
        reached.append(
            (
                "localized",
                f"rank {status.get('ranks')} -> pod {pod} -> node {status.get('node')} -> "
                f"instance {status.get('instanceId')} "
                f"({len(status.get('reports', []))} nodes agree)",
            )
        )
    snapshot = conditions.get("Snapshot", {})
    if snapshot.get("status") in ("True", "False"):
        reached.append(("snapshot", f"Snapshot={snapshot['status']}: {snapshot['message']}"))
    if conditions.get("Contained", {}).get("status") == "True":
        reached.append(("contained", conditions["Contained"]["message"]))
    if resumed.get("status") in ("Unknown", "True"):
        step = (status.get("resumeCheckpoint") or {}).get("step")
        reached.append(
            (
                "resuming",
                f"operator set HYPERPOD_SDC_RESUME_MAX_STEP={spec['lastCleanStep']} and lifted "
                f"the suspension (expects the checkpoint of step {step})",
            )
        )
    if resumed.get("status") == "True":
        reached.append(("resumed", resumed["message"]))
    confirmed = conditions.get("Confirmed", {})
    if confirmed.get("reason") == "Running":
        reached.append(("confirming", confirmed["message"]))
    elif confirmed:
        reached.append(("confirmed", f"Confirmed={confirmed['status']}: {confirmed['message']}"))
    remediated = conditions.get("Remediated", {})
    if remediated.get("status") == "True":
        reached.append(("remediated", remediated["message"]))
    return reached


def checkpoints_in(directory: Path) -> list[dict[str, Any]]:
    """The checkpoints the job marked (``<name>.sdc.json``), oldest first: periodic ones
    and the verified snapshot written at a detection."""
    found = []
    for marker in directory.glob("*.sdc.json") if directory.is_dir() else ():
        data = json.loads(marker.read_text())
        name = marker.name[: -len(".sdc.json")]
        found.append(
            {
                "name": name,
                "step": int(data["step"]),
                "verified": data["verified"] is True,
                "snapshot": name.startswith("sdc-snapshot-step_"),
            }
        )
    return sorted(found, key=lambda c: (c["step"], c["name"]))


def lost_work(incident: dict[str, Any], checkpoints: list[dict[str, Any]]) -> dict[str, Any]:
    """The steps lost to the incident: from its resume step to its detection step, as the
    operator records them (``status.lostWork``) or, where it does not, derived from
    ``spec.detectionStep`` and ``status.resumedFromStep``; and what resuming from the last
    periodic verified checkpoint before the detection would have lost."""
    spec, status = incident["spec"], incident.get("status") or {}
    detection = int(spec["detectionStep"])
    resume = status.get("resumedFromStep")
    periodic = max(
        (
            c["step"]
            for c in checkpoints
            if c["verified"] and not c["snapshot"] and c["step"] <= detection
        ),
        default=0,
    )
    out: dict[str, Any] = {
        "detection_step": detection,
        "resume_step": resume,
        "last_periodic_checkpoint": periodic,
        "steps_from_periodic_checkpoint": detection - periodic,
    }
    recorded = status.get("lostWork")
    if isinstance(recorded, dict):
        out.update(source="status.lostWork", steps=recorded.get("steps"), recorded=recorded)
        out["gpu_hours"] = recorded.get("gpuHours")
    else:
        steps = None if resume is None else detection - int(resume)
        out.update(source="spec.detectionStep - status.resumedFromStep", steps=steps)
    return out


def node_state(server: ApiServer, name: str) -> tuple[Any, ...]:
    node = server.node(name)
    return (
        node["metadata"].get("labels"),
        node["metadata"].get("annotations"),
        node["spec"].get("taints"),
        node["spec"].get("unschedulable"),
    )


def scenario(
    server: ApiServer,
    trainer: client.CoreV1Api,
    nodes: list[str],
    name: str,
    faulty: str | None,
    work: Path,
) -> dict[str, Any]:
    work.mkdir(parents=True)
    create_job(server, name, work / "ckpt")
    runner = Runner(server, trainer, Kubelet(server), name, nodes, faulty, work)
    if faulty is not None:
        runner.second_opinion_on = nodes[0]
    seen: set[tuple[str, str]] = set()

    def watch() -> None:
        for incident in server.incidents(name):
            for kind, text in milestones(incident):
                if (incident["metadata"]["name"], kind) not in seen:
                    seen.add((incident["metadata"]["name"], kind))
                    runner.note(kind, text)

    before = {n: node_state(server, n) for n in nodes}
    finished = runner.run(timeout=300, watch=watch)
    watch()
    result_file = work / "result.json"
    result = json.loads(result_file.read_text()) if finished and result_file.exists() else {}
    if finished:
        runner.note(
            "finished",
            f"step {STEPS} reached; final weights sha256 {result.get('sha256', '?')[:16]}...",
        )
    opinion: dict[str, Any] = {}
    if faulty is not None:
        settle(server, runner, name, watch)
        opinion = second_opinion_result(runner, watch)
    incidents = sorted(server.incidents(name), key=lambda i: int(i["spec"].get("detectionStep", 0)))
    checkpoints = checkpoints_in(work / "ckpt")
    return {
        "job": name,
        "finished": finished,
        "result": result,
        "wired_pods": runner.wired_pods,
        "incidents": incidents,
        "checkpoints": checkpoints,
        "lost_work": lost_work(incidents[0], checkpoints) if incidents else None,
        "placements": runner.placements,
        "stopped_for_suspend": runner.stopped_for_suspend,
        "timeline": runner.timeline,
        "nodes_before": before,
        "nodes_after": {n: node_state(server, n) for n in nodes},
        "job_object": server.job(name),
        "confirmation_pods": {
            k: {x: v[x] for x in ("node", "exit_code", "message")}
            for k, v in runner.confirmations.items()
        },
        "second_opinion": opinion,
    }


def settle(server: ApiServer, runner: Runner, job: str, watch: Any, timeout: float = 90) -> None:
    """Run the confirmation pod to its end, until the incident records it (and, where it
    is confirmed, the policy's replacement)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        watch()
        runner.serve_confirmations()
        incidents = server.incidents(job)
        status = (incidents[0].get("status") or {}) if incidents else {}
        outcome = (status.get("confirmation") or {}).get("outcome")
        if outcome in ("not-confirmed", "unknown") or (
            outcome == "confirmed" and status.get("phase") == "Remediated"
        ):
            return
        time.sleep(0.1)
    runner.note("runner", f"the confirmation did not settle within {timeout:.0f} s")


def second_opinion(
    server: ApiServer, runner: Runner, original: dict[str, Any], healthy: str
) -> None:
    """The same bundle on a healthy node: a copy of the operator's confirmation pod,
    pinned to ``healthy``, made by hand (no incident accuses that node, so the operator
    would not make one)."""
    name = "second-opinion-" + original["metadata"]["name"][:40]
    spec = json.loads(json.dumps(original["spec"]))
    spec.pop("nodeName", None)
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [healthy]}]}
    required = {"nodeSelectorTerms": [term]}
    spec["affinity"] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}
    }
    server.core.create_namespaced_pod(
        NAMESPACE,
        {"metadata": {"name": name, "labels": {SECOND_OPINION_LABEL: "true"}}, "spec": spec},
    )
    runner.note("demo", f"the same bundle on healthy node {healthy}: pod {name} (made by hand)")


def second_opinion_result(runner: Runner, watch: Any, timeout: float = 90) -> dict[str, Any]:
    """The exit code and summary of the second opinion, once it ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        watch()
        runner.serve_confirmations()
        for name, seen in runner.confirmations.items():
            if name.startswith("second-opinion-") and seen.get("exit_code") is not None:
                message = seen.get("message") or ""
                summary = json.loads(message) if message.startswith("{") else {}
                return {"node": seen["node"], "exit_code": seen["exit_code"], "summary": summary}
        time.sleep(0.1)
    return {"error": f"no result within {timeout:.0f} s"}


def check(
    clean: dict[str, Any],
    faulty: dict[str, Any],
    nodes: list[str],
    instances: dict[str, str],
    calls: list[tuple[str, dict[str, Any]]],
) -> list[str]:
    """Everything the demo promises; returns what did not happen."""
    problems = []
    if not clean["finished"]:
        problems.append("the clean run did not finish")
    if clean["incidents"]:
        problems.append(f"the clean run raised {len(clean['incidents'])} incident(s)")
    if clean["nodes_after"] != clean["nodes_before"]:
        problems.append("the clean run touched a node")
    bad = nodes[FAULTY_NODE]
    # One incident, or more where a loaded machine let the job reach its next audit before
    # the suspension landed: then every one names the faulty node, the first is checked.
    incidents = sorted(faulty["incidents"], key=lambda i: int(i["spec"].get("detectionStep", 0)))
    faulty["incidents"] = incidents
    if not incidents:
        return [*problems, "the faulty run raised no incident"]
    elsewhere = [i["metadata"]["name"] for i in incidents if i.get("status", {}).get("node") != bad]
    if elsewhere:
        problems.append(f"incident(s) {elsewhere} name another node than {bad}")
    status = incidents[0].get("status") or {}
    spec = incidents[0]["spec"]
    if (status.get("node"), status.get("instanceId")) != (bad, instances[bad]):
        problems.append(
            f"the incident names {status.get('node')} / {status.get('instanceId')}, not {bad}"
        )
    if status.get("ranks") != str(FAULTY_NODE * RANKS_PER_POD + 1):
        problems.append(f"the incident names rank(s) {status.get('ranks')}")
    if faulty["stopped_for_suspend"] != 1:
        problems.append("the job was not suspended (once)")
    node = faulty["nodes_after"][bad]
    taints = node[2] or []
    if not (node[3] is True and any(t.get("key") == "hyperpod-sdc.dev/suspect" for t in taints)):
        problems.append(f"node {bad} is not cordoned and tainted")
    placements = faulty["placements"]
    if len(placements) != 2 or bad in placements[1] or nodes[3] not in placements[1]:
        problems.append(f"the job did not resume on the spare node: placements {placements}")
    last_clean = spec["lastCleanStep"]
    if (
        status.get("resumedFromStep") != last_clean
        or faulty["result"].get("resumed_from") != last_clean
    ):
        problems.append(
            f"resumed from step {status.get('resumedFromStep')}, not from the verified snapshot "
            f"of the last clean step {last_clean}"
        )
    lost = faulty["lost_work"]
    if lost["steps"] is None or not 0 <= lost["steps"] <= INTERVAL:
        problems.append(f"lost {lost['steps']} steps, not at most replay_every={INTERVAL}: {lost}")
    if lost["resume_step"] is None or lost["resume_step"] <= lost["last_periodic_checkpoint"]:
        problems.append(f"resumed no later than the last periodic checkpoint: {lost}")
    recorded = lost.get("recorded")
    if recorded is not None and (
        recorded.get("steps") != lost["detection_step"] - (lost["resume_step"] or 0)
        or recorded.get("resumeStep") != lost["resume_step"]
    ):
        problems.append(f"status.lostWork does not match the detection and resume steps: {lost}")
    if not faulty["finished"]:
        problems.append("the faulty run did not finish")
    if faulty["result"].get("sha256") != clean["result"].get("sha256"):
        problems.append("the final weights differ from the clean run's")
    return problems + check_confirmation(clean, faulty, bad, instances, calls)


def check_confirmation(
    clean: dict[str, Any],
    faulty: dict[str, Any],
    bad: str,
    instances: dict[str, str],
    calls: list[tuple[str, dict[str, Any]]],
) -> list[str]:
    """The confirmation on the faulty node (True, naming its GPU), the same bundle on a
    healthy node (not confirmed), and the one replacement the policy asked for."""
    problems = []
    if clean["confirmation_pods"]:
        problems.append("the clean run made a confirmation pod")
    incident = faulty["incidents"][0]
    spec, status = incident["spec"], incident.get("status") or {}
    if not spec.get("bundle"):
        problems.append("the verdict named no evidence bundle")
    pods = faulty["confirmation_pods"]
    ours = {k: v for k, v in pods.items() if not k.startswith("second-opinion-")}
    if not ours or any(pod["node"] != bad for pod in ours.values()):
        problems.append(f"expected the confirmation pods on {bad} only: {ours}")
    confirmed: dict[str, Any] = next(
        (c for c in status.get("conditions") or [] if c["type"] == "Confirmed"), {}
    )
    gpus = (status.get("confirmation") or {}).get("gpus") or []
    broken = [g for g in gpus if g.get("result") == "reproduces"]
    if (confirmed.get("status"), confirmed.get("reason")) != ("True", "Reproduced"):
        problems.append(f"not Confirmed=True on {bad}: {confirmed}")
    elif "local rank 1" not in confirmed.get("message", "") or bad not in confirmed["message"]:
        problems.append(f"Confirmed=True does not name GPU 1 of {bad}: {confirmed['message']}")
    if [g.get("localRank") for g in broken] != [1]:
        problems.append(f"status.confirmation does not name local rank 1 as reproducing: {gpus}")
    second = faulty["second_opinion"]
    if (
        second.get("exit_code") != 0
        or (second.get("summary") or {}).get("outcome") != "not-confirmed"
    ):
        problems.append(f"the same bundle on a healthy node was not 'not-confirmed': {second}")
    replaced = [("BatchReplaceClusterNodes", {"ClusterName": CLUSTER, "NodeIds": [instances[bad]]})]
    if calls != replaced:
        problems.append(f"expected exactly {replaced} from SageMaker, got {calls}")
    if status.get("phase") != "Remediated":
        problems.append(f"the incident is {status.get('phase')}, not Remediated")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the outcome here")
    parser.add_argument("--keep", type=Path, help="keep logs and state here (default: removed)")
    args = parser.parse_args()
    wall = time.monotonic()
    say(__doc__.split("\n\n")[0].replace("\n", " "))
    say(
        "Real: Kubernetes API server + etcd, CRDs, the hyperpod-sdc operator, the agent in "
        "every worker."
    )
    say(
        "Stand-in: the runner that plays the training operator and the kubelet (it starts the "
        "workers from the pods as the API server stored them), and the faulty GPU."
    )
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="hyperpod-sdc-demo-"))
    base.mkdir(parents=True, exist_ok=True)
    server = ApiServer(base / "apiserver")
    op: OperatorProcess | None = None
    sagemaker = FakeSageMaker()
    try:
        server.core.create_namespace({"metadata": {"name": NAMESPACE}})
        server.core.create_namespace({"metadata": {"name": OPERATOR_NAMESPACE}})
        server.core.create_namespaced_service_account(NAMESPACE, {"metadata": {"name": "worker"}})
        instances = {}
        for _ in range(REPLICAS + 1):
            instance = "i-" + secrets.token_hex(9)[:17]
            name = f"hyperpod-{instance}"
            server.core.create_node(
                {
                    "metadata": {
                        "name": name,
                        "labels": {"sagemaker.amazonaws.com/cluster-name": CLUSTER},
                    },
                    "spec": {"providerID": f"aws:///us-west-2a/{instance}"},
                }
            )
            # What the kubelet and the node lifecycle controller would do: the node is Ready,
            # and loses the not-ready taint the API server gives every new node.
            server.core.patch_node_status(
                name,
                {
                    "status": {
                        "conditions": [
                            {"type": "Ready", "status": "True", "reason": "KubeletReady"}
                        ]
                    }
                },
            )
            server.core.patch_node(
                name, {"spec": {"taints": None}}, _content_type="application/merge-patch+json"
            )
            instances[name] = instance
        nodes = list(instances)
        admit_namespace(server)
        trainer = training_operator(server, base)
        tls = ca_and_certificate(base / "tls", "operator")
        op = OperatorProcess(
            server,
            base / "operator.log",
            tls,
            sagemaker.env(),
            lambda url: register_webhook(server, url, tls[0]),
        )
        say(f"Nodes: {', '.join(nodes)} (the last one is spare). Operator at {op.url}.")
        say(
            f'The jobs carry only the annotation hyperpod-sdc.dev/enabled: "true"; the webhook '
            f"wires their pods, SDCPolicy admits namespace {NAMESPACE} with remediation "
            f"policy {POLICY}.\n"
        )
        say(f"1. Clean run: {REPLICAS} pods x {RANKS_PER_POD} ranks, {STEPS} steps")
        clean = scenario(server, trainer, nodes, "clean-run", None, base / "clean")
        say(
            f"\n2. Same job, and from step {FAULT_STEP} GPU 1 of {nodes[FAULTY_NODE]} returns "
            "4.0001 instead of 4.0000 (a relative error of 2.5e-5 in the first layer's output)"
        )
        faulty = scenario(server, trainer, nodes, "llama-demo", nodes[FAULTY_NODE], base / "faulty")
        say("\n$ kubectl get sdcincidents -n ml")
        table = server.kubectl("get", "sdcincidents", "-n", NAMESPACE)
        say(table)
        lost = faulty["lost_work"]
        if lost is not None:
            hours = lost.get("gpu_hours")
            say(
                f"Lost work: {lost['steps']} steps (detected at step {lost['detection_step']}, "
                f"resumed from step {lost['resume_step']}"
                + (f", {hours} GPU-hours" if hours is not None else "")
                + f"; from {lost['source']}). The last periodic checkpoint (step "
                f"{lost['last_periodic_checkpoint']}, every {CHECKPOINT_EVERY} steps) would have "
                f"lost {lost['steps_from_periodic_checkpoint']}; the audit runs every {INTERVAL}."
            )
        second = faulty["second_opinion"]
        say(
            f"Same bundle on healthy node {second.get('node')}: exit {second.get('exit_code')}, "
            f"{(second.get('summary') or {}).get('outcome')} "
            f"({(second.get('summary') or {}).get('reason', second.get('error', ''))})"
        )
        calls = list(sagemaker.calls)
        say(f"SageMaker calls: {calls}")
        problems = check(clean, faulty, nodes, instances, calls)
        if sagemaker.invalid:
            problems.append(f"SageMaker refused requests: {sagemaker.invalid}")
    finally:
        if op is not None:
            op.stop()
        sagemaker.stop()
        server.stop()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    seconds = time.monotonic() - wall
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "problems": problems,
                    "wall_seconds": round(seconds, 1),
                    "nodes": nodes,
                    "instances": instances,
                    "faulty_node": nodes[FAULTY_NODE],
                    "table": table,
                    "sagemaker_calls": calls,
                    "clean": clean,
                    "faulty": faulty,
                },
                indent=2,
                default=str,
            )
        )
    same = clean["result"].get("sha256") == faulty["result"].get("sha256")
    say(
        f"Final weights of the faulty run {'==' if same else '!='} the clean run's "
        "(sha256 over every parameter)."
    )
    for problem in problems:
        say(f"FAILED: {problem}")
    say(f"{'OK' if not problems else 'NOT OK'}: demo took {seconds:.0f} s")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
