"""End to end on one machine: a training job with a corrupting GPU is detected, localized,
contained and resumed from a clean checkpoint, and finishes with exactly the weights of a
run without the fault.

    .venv/bin/python scripts/e2e_demo.py [--json result.json] [--keep DIR]

Real: the Kubernetes API server and etcd (scripts/kube-apiserver.sh), the SDCIncident CRD and
Kubeflow's PyTorchJob CRD, the operator (``python -m sdc_operator``), the agent in every
worker (``examples/train.py``: DDP on CPU with gloo), TokenRequest/TokenReview.

Stand-in for the cluster (``Runner`` below, a few dozen lines): what the Kubeflow training
operator and the kubelet would do. It binds the job's pods to nodes that accept them
(cordon and taints honoured), starts two worker processes per pod with ``POD_NAME``,
``NODE_NAME``, a bound ServiceAccount token and the operator's URL, stops them when the job
is suspended and starts them again, with the job's new environment, when it is resumed. The
faulty GPU is played by the agent's fault injection, given to the processes on one node only:
the fault stays with the node, as a broken GPU would.

Two scenarios: a clean run (no incident, no node touched; its final weights are the
reference), then the same job with the fault. Exit status 0 only if everything happened.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, config

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
NAMESPACE = "ml"
OPERATOR_NAMESPACE = "hyperpod-sdc"
TRAINING_OPERATOR = "system:serviceaccount:kubeflow:training-operator"
RANKS_PER_POD = 2
REPLICAS = 3
STEPS = 60
INTERVAL = 10  # replay audit, weight check and checkpoints, every INTERVAL steps
FAULT_STEP = 23
FAULTY_NODE = 1  # the second node's second GPU (rank 3) returns 4.0001 for 4.0000
AGENT_ENV = {
    "HYPERPOD_SDC_REPLAY_EVERY": str(INTERVAL),
    "HYPERPOD_SDC_WEIGHTS_EVERY": str(INTERVAL),
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
    def __init__(self, server: ApiServer, log: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "KUBECONFIG": server.kubeconfig,
            "HYPERPOD_SDC_LISTEN_ADDRESS": "127.0.0.1",
            "HYPERPOD_SDC_LISTEN_PORT": str(port),
            "HYPERPOD_SDC_NAMESPACES": NAMESPACE,
            "HYPERPOD_SDC_RESYNC_SECONDS": "2",
        }
        self._log = open(log, "wb")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen(
            [PYTHON, "-m", "sdc_operator"], env=env, stdout=self._log, stderr=subprocess.STDOUT
        )
        import urllib.request

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the operator exited; see {log}")
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", timeout=1):
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


def attestation(server: ApiServer, pod: str, owner_uid: str) -> dict[str, str]:
    """What the operator's admission webhook writes on a pod the training operator
    creates (signed with the key the operator keeps in its namespace)."""
    import base64

    from sdc_operator.attestation import ATTESTATION_ANNOTATION, CREATED_BY_ANNOTATION, sign

    secret = server.core.read_namespaced_secret("hyperpod-sdc-attestation", OPERATOR_NAMESPACE)
    key = base64.b64decode(secret.data["key"])
    return {
        CREATED_BY_ANNOTATION: TRAINING_OPERATOR,
        ATTESTATION_ANNOTATION: sign(key, NAMESPACE, pod, owner_uid, TRAINING_OPERATOR),
    }


def schedulable(node: dict[str, Any]) -> bool:
    """As the scheduler sees it for a pod without tolerations."""
    spec = node.get("spec") or {}
    taints = [t for t in spec.get("taints") or [] if t.get("effect") in ("NoSchedule", "NoExecute")]
    return not spec.get("unschedulable") and not taints


@dataclass
class Runner:
    """The Kubeflow training operator and the kubelet, as far as this job needs them."""

    server: ApiServer
    job: str
    nodes: list[str]
    faulty_node: str | None
    operator_url: str
    work: Path
    started: float = field(default_factory=time.monotonic)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    placements: list[list[str]] = field(default_factory=list)
    timeline: list[tuple[float, str, str]] = field(default_factory=list)
    stopped_for_suspend: int = 0
    running_env: dict[str, str] = field(default_factory=dict)

    def note(self, kind: str, what: str) -> None:
        at = time.monotonic() - self.started
        self.timeline.append((round(at, 2), kind, what))
        say(f"  {at:6.2f} s  {kind:<10} {what}")

    def pods(self) -> list[str]:
        return [f"{self.job}-master-0"] + [f"{self.job}-worker-{i}" for i in range(REPLICAS - 1)]

    def start(self, job: dict[str, Any]) -> None:
        """Bind each pod to a node that accepts it and start its workers."""
        free = [n for n in self.nodes if schedulable(self.server.node(n))]
        if len(free) < REPLICAS:
            raise RuntimeError(f"only {len(free)} schedulable nodes for {REPLICAS} pods")
        owner = job["metadata"]
        container_env = template_env(job)
        port = free_port()
        tokens = self.work / "tokens"
        tokens.mkdir(exist_ok=True)
        placement = []
        for index, (pod, node) in enumerate(zip(self.pods(), free, strict=False)):
            self.server.core.create_namespaced_pod(
                NAMESPACE,
                {
                    "metadata": {
                        "name": pod,
                        "annotations": attestation(self.server, pod, owner["uid"]),
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
                        "nodeName": node,
                        "serviceAccountName": "worker",
                        "automountServiceAccountToken": False,
                        "containers": [{"name": "pytorch", "image": "local/train"}],
                    },
                },
            )
            uid = self.server.core.read_namespaced_pod(pod, NAMESPACE).metadata.uid
            review = self.server.core.create_namespaced_service_account_token(
                "worker",
                NAMESPACE,
                {
                    "spec": {
                        "audiences": ["hyperpod-sdc"],
                        "expirationSeconds": 3600,
                        "boundObjectRef": {
                            "apiVersion": "v1",
                            "kind": "Pod",
                            "name": pod,
                            "uid": uid,
                        },
                    }
                },
            )
            token_file = tokens / pod
            token_file.write_text(review.status.token)  # the kubelet projects it
            placement.append(node)
            for local in range(RANKS_PER_POD):
                rank = index * RANKS_PER_POD + local
                env = {
                    "PATH": os.environ.get("PATH", ""),
                    "HOME": os.environ.get("HOME", str(self.work)),
                    "OMP_NUM_THREADS": "1",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "RANK": str(rank),
                    "WORLD_SIZE": str(REPLICAS * RANKS_PER_POD),
                    "LOCAL_RANK": str(local),
                    "LOCAL_WORLD_SIZE": str(RANKS_PER_POD),
                    "POD_NAME": pod,
                    "NODE_NAME": node,
                    "HYPERPOD_SDC_OPERATOR_URL": self.operator_url,
                    "HYPERPOD_SDC_TOKEN_FILE": str(token_file),
                    **container_env,
                }
                if node == self.faulty_node and local == 1:
                    env["HYPERPOD_SDC_FAULTS"] = fault_spec(rank)  # the broken GPU
                log = open(self.work / f"{pod}-{local}-{len(self.placements)}.log", "wb")  # noqa: SIM115
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
                            str(INTERVAL),
                            "--result-file",
                            str(self.work / "result.json"),
                        ],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
                log.close()
        self.placements.append(placement)
        resume = container_env.get("HYPERPOD_SDC_RESUME_MAX_STEP")
        extra = f", HYPERPOD_SDC_RESUME_MAX_STEP={resume}" if resume else ""
        self.note("runner", f"pods on {', '.join(placement)}: {len(self.procs)} workers{extra}")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
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

    def run(self, timeout: float, watch: Any) -> bool:
        """Drive the job to its end; ``watch`` is called every tick. True if it finished.

        Level-based, like the real controllers: workers run while the job is not suspended
        and their pod template is the job's current one. A suspension lifted again before
        this loop saw it still shows as a changed template (the resume step was set).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            watch()
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


def template_env(job: dict[str, Any]) -> dict[str, str]:
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    return {e["name"]: e["value"] for e in template["containers"][0].get("env", [])}


# -- scenarios -------------------------------------------------------------------------------


def create_job(server: ApiServer, name: str) -> None:
    container = {
        "name": "pytorch",
        "image": "local/train",
        "env": [{"name": k, "value": v} for k, v in AGENT_ENV.items()],
    }
    template = {"spec": {"containers": [container], "serviceAccountName": "worker"}}
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
    return reached


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
    op: OperatorProcess,
    nodes: list[str],
    name: str,
    faulty: str | None,
    work: Path,
) -> dict[str, Any]:
    work.mkdir(parents=True)
    create_job(server, name)
    runner = Runner(server, name, nodes, faulty, op.url, work)
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
    return {
        "job": name,
        "finished": finished,
        "result": result,
        "incidents": server.incidents(name),
        "placements": runner.placements,
        "stopped_for_suspend": runner.stopped_for_suspend,
        "timeline": runner.timeline,
        "nodes_before": before,
        "nodes_after": {n: node_state(server, n) for n in nodes},
        "job_object": server.job(name),
    }


def check(
    clean: dict[str, Any], faulty: dict[str, Any], nodes: list[str], instances: dict[str, str]
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
    incidents = faulty["incidents"]
    if len(incidents) != 1:
        return [*problems, f"expected one incident for the faulty run, found {len(incidents)}"]
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
    expected = last_clean - last_clean % INTERVAL
    if (
        status.get("resumedFromStep") != expected
        or faulty["result"].get("resumed_from") != expected
    ):
        problems.append(
            f"resumed from step {status.get('resumedFromStep')}, not from the newest checkpoint "
            f"at or before the last clean step {last_clean} ({expected})"
        )
    if not faulty["finished"]:
        problems.append("the faulty run did not finish")
    if faulty["result"].get("sha256") != clean["result"].get("sha256"):
        problems.append("the final weights differ from the clean run's")
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
        "Stand-in: the runner that plays the training operator and the kubelet, and the faulty GPU."
    )
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="hyperpod-sdc-demo-"))
    base.mkdir(parents=True, exist_ok=True)
    server = ApiServer(base / "apiserver")
    op: OperatorProcess | None = None
    try:
        server.core.create_namespace({"metadata": {"name": NAMESPACE}})
        server.core.create_namespace({"metadata": {"name": OPERATOR_NAMESPACE}})
        server.core.create_namespaced_service_account(NAMESPACE, {"metadata": {"name": "worker"}})
        # The cluster admin admits the namespace (kubectl apply of an SDCPolicy).
        server.custom.create_cluster_custom_object(
            "hyperpod-sdc.dev",
            "v1alpha1",
            "sdcpolicies",
            {
                "apiVersion": "hyperpod-sdc.dev/v1alpha1",
                "kind": "SDCPolicy",
                "metadata": {"name": "ml-team"},
                "spec": {"namespaces": [NAMESPACE], "remediationPolicy": "manual"},
            },
        )
        instances = {}
        for _ in range(REPLICAS + 1):
            instance = "i-" + secrets.token_hex(9)[:17]
            name = f"hyperpod-{instance}"
            server.core.create_node(
                {
                    "metadata": {"name": name},
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
        op = OperatorProcess(server, base / "operator.log")
        say(f"Nodes: {', '.join(nodes)} (the last one is spare). Operator at {op.url}.\n")
        say(f"1. Clean run: {REPLICAS} pods x {RANKS_PER_POD} ranks, {STEPS} steps")
        clean = scenario(server, op, nodes, "clean-run", None, base / "clean")
        say(
            f"\n2. Same job, and from step {FAULT_STEP} GPU 1 of {nodes[FAULTY_NODE]} returns "
            "4.0001 instead of 4.0000 (a relative error of 2.5e-5 in the first layer's output)"
        )
        faulty = scenario(server, op, nodes, "llama-demo", nodes[FAULTY_NODE], base / "faulty")
        say("\n$ kubectl get sdcincidents -n ml")
        table = server.kubectl("get", "sdcincidents", "-n", NAMESPACE)
        say(table)
        problems = check(clean, faulty, nodes, instances)
    finally:
        if op is not None:
            op.stop()
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
