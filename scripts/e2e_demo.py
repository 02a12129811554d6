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

Stand-in for the cluster (``sdc_harness.training.Runner`` and ``sdc_harness.kubelet``, the
harness the integration tests share): what the Kubeflow training operator and the kubelet
would do. The runner creates the job's pods from its template, as
the training operator's ServiceAccount, bound to nodes that accept them (cordon and taints
honoured). The kubelet stand-in reads each pod back as the API server stored it (the
webhook's additions included) and starts two worker processes per pod from that spec (each
forked from a process that imported torch once, ``sdc_harness.zygote``, as a warm container
would skip the imports): its
env (downward-API ``fieldRef``s resolved), its projected ServiceAccount token (a bound token
requested with the volume's audience) and its ConfigMap volumes (the CA), written into a
directory per pod; a path under a mount in the env points into that directory instead. It
stops the workers when the job is suspended and starts new pods when it is resumed. The
faulty GPU is played by the agent's fault injection, given to the processes on one node only:
the fault stays with the node, as a broken GPU would. The checkpoint volume is a
``hostPath`` every pod mounts in place (a shared volume). The runner is also the scheduler
and kubelet of the operator's confirmation pod: it binds it to the node its affinity names
and runs its command (``python -m sdc_agent.confirm BUNDLE``) as a process there (forked
from the same process as the workers), with the broken GPU still broken on the faulty
node, and writes its exit code and termination message back. SageMaker is the loopback
fake of the integration tests (scripts/sdc_harness/fake_sagemaker.py), which checks each
call against botocore's model and counts them.

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

``--layout hsdp`` runs the same job as HSDP (``examples/train_fsdp.py --layout hsdp``:
FSDP2 on a 2-D mesh, replicate 3 x shard 2, one replica per node, sharded DCP checkpoints,
the verified snapshot of every replica's shards), the same story at half the steps (30;
audits every 5, a periodic checkpoint every 15, the fault from step 23 caught at step 25,
resumed from step 20: an HSDP step costs about six times a DDP step's CPU here):
detected, contained and resumed from the snapshot as above, finished with the state
(weights and optimizer, by ``sdc_agent.checkpoint.state_digest``) of the clean HSDP run.
Not confirmed, not replaced: an evidence bundle written under FSDP2 cannot rebuild its
model yet (an FSDP2 module cannot be deep-copied: the confirmation would end ``unknown``),
so that variant runs the operator with ``confirmation`` off under the ``manual`` policy,
and the node stays quarantined for a person to decide.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kubernetes import client

from sdc_harness.cluster import Cluster, OperatorProcess, register_chart_webhooks
from sdc_harness.fake_sagemaker import FakeSageMaker
from sdc_harness.tls import ca_and_certificate
from sdc_harness.training import TRAINING_OPERATOR, Runner, training_operator
from sdc_operator.confirmation import CONFIRMATION_LABEL

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
NAMESPACE = "ml"
RANKS_PER_POD = 2
REPLICAS = 3
FAULTY_NODE = 1  # the second node's second GPU (rank 3) returns 4.0001 for 4.0000
CLUSTER = "demo-cluster"  # the HyperPod cluster (the nodes' sagemaker.amazonaws.com/cluster-name)


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """What differs between the DDP job and its HSDP variant."""

    name: str
    script: tuple[str, ...]
    """The training script and its layout arguments, under examples/."""
    policy: str
    """The remediation policy (the operator's setting and the SDCPolicy's)."""
    confirmation: bool
    """Whether the operator runs the confirmation pod (and the demo a second opinion)."""
    steps: int
    """The job's steps."""
    interval: int
    """The replay audit and the weight check, every ``interval`` steps (replay_every)."""
    checkpoint_every: int
    """Periodic checkpoints: longer than the audit interval, as in practice."""
    fault_step: int
    """The first step the broken GPU computes wrong."""


LAYOUTS = {
    # the fault from step 43 is caught by the audit of step 50; last clean step 40;
    # periodic checkpoint 30
    "ddp": Layout("ddp", ("train.py",), "auto-replace-confirmed", True, 60, 10, 30, 43),
    # the same story at half the steps (the same four clean audits before the fault): an
    # HSDP step costs about 38 ms of CPU per rank on CPU with gloo (FSDP2's and DTensor's
    # Python; Adam on DTensors), a DDP step of examples/train.py about 6 ms (cProfile of
    # each rank's main thread, 6 ranks forked); 65 steps fewer in the three runs
    "hsdp": Layout("hsdp", ("train_fsdp.py", "--layout", "hsdp"), "manual", False, 30, 5, 15, 23),
}
SECOND_OPINION_LABEL = "demo.hyperpod-sdc.dev/second-opinion"
AGENT_ENV = {
    # the verified snapshot of the last clean step, each slice kept on two nodes, written
    # as a checkpoint at the detection (examples/train.py turns it on by default too)
    "HYPERPOD_SDC_SNAPSHOT_COPIES": "2",
    "HYPERPOD_SDC_FINGERPRINT_BACKEND": "eager",  # no compiler warm-up on CPU
    # Heartbeats spread over at most 1 s, not 10 (three nodes make no storm to spread):
    # after the verdict, the snapshot's checkpoint record waits the 10 s hold plus this
    # jitter, and the operator holds the stop until that record arrives
    "HYPERPOD_SDC_HEARTBEAT_JITTER_SECONDS": "1",
}


def agent_env(layout: Layout) -> dict[str, str]:
    interval = str(layout.interval)
    return {
        "HYPERPOD_SDC_REPLAY_EVERY": interval,
        "HYPERPOD_SDC_WEIGHTS_EVERY": interval,
        **AGENT_ENV,
    }


def fault_spec(rank: int, layout: Layout) -> str:
    return (
        f"rank={rank},step={layout.fault_step},site=forward,kind=relative,relative_error=2.5e-5,"
        "persistent=true,target=0,index=all"
    )


def say(what: str) -> None:
    print(what, flush=True)


# -- the cluster: the harness's API server, operator, training operator and kubelet ---------


class Operator(OperatorProcess):
    """The operator over HTTPS, its admission webhook registered as the chart renders it
    before it starts (it does not start without its creator check registered), injecting
    its loopback URL into the pods, replacing nodes under the demo's policy."""

    shared = False

    def __init__(
        self,
        cluster: Cluster,
        log: Path,
        tls: tuple[Path, Path, Path],
        extra_env: dict[str, str],
        layout: Layout,
    ) -> None:
        self.ca, cert, key = tls
        super().__init__(
            cluster,
            NAMESPACE,
            log,
            scheme="https",
            extra_env=extra_env,
            resync_seconds="2",
            tls_cert_file=str(cert),
            tls_key_file=str(key),
            tls_ca_file=str(self.ca),  # published as ConfigMap hyperpod-sdc-ca
            trusted_pod_creators="system:serviceaccount:{}:{}".format(*TRAINING_OPERATOR),
            job_sweep_seconds="2",
            remediation_policy=layout.policy,
            confirmation=str(layout.confirmation).lower(),
        )

    def environment(self) -> dict[str, str]:
        return {"HYPERPOD_SDC_INJECT_OPERATOR_URL": self.url}

    def before_start(self) -> None:
        register_chart_webhooks(self.cluster, self.admission_url, self.ca)


def faulty_gpu(faulty: str | None, layout: Layout) -> tuple[Any, Any]:
    """The env of a worker (node, rank, local rank) and of a confirmation pod (node): on
    the faulty node, its second GPU is broken, and stays broken."""

    def worker(node: str, rank: int, local: int) -> dict[str, str]:
        broken = node == faulty and local == 1
        return {"HYPERPOD_SDC_FAULTS": fault_spec(rank, layout)} if broken else {}

    def confirmation(node: str) -> dict[str, str]:
        broken = node == faulty
        rank = FAULTY_NODE * RANKS_PER_POD + 1
        return {"HYPERPOD_SDC_FAULTS": fault_spec(rank, layout)} if broken else {}

    return worker, confirmation


# -- scenarios -------------------------------------------------------------------------------


def admit_namespace(server: Cluster, layout: Layout) -> None:
    """The cluster admin's step: an SDCPolicy admitting the demo's namespace, replacing
    nodes a confirmation run reproduced the fault on."""
    server.policy("demo", {"namespaces": [NAMESPACE], "remediationPolicy": layout.policy})


def create_job(server: Cluster, name: str, checkpoints: Path, layout: Layout) -> None:
    container = {
        "name": "pytorch",
        "image": "local/train",
        "env": [{"name": k, "value": v} for k, v in agent_env(layout).items()],
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


def node_state(server: Cluster, name: str) -> tuple[Any, ...]:
    node = server.get_node(name)
    return (
        node["metadata"].get("labels"),
        node["metadata"].get("annotations"),
        node["spec"].get("taints"),
        node["spec"].get("unschedulable"),
    )


def scenario(
    server: Cluster,
    trainer: client.CoreV1Api,
    nodes: list[str],
    name: str,
    faulty: str | None,
    work: Path,
    layout: Layout,
) -> dict[str, Any]:
    work.mkdir(parents=True)
    create_job(server, name, work / "ckpt", layout)
    worker_env, confirmation_env = faulty_gpu(faulty, layout)
    runner = Runner(
        server,
        trainer,
        NAMESPACE,
        name,
        nodes,
        work,
        command=[
            PYTHON,
            str(ROOT / "examples" / layout.script[0]),
            *layout.script[1:],
            "--steps",
            str(layout.steps),
            "--checkpoint-dir",
            str(work / "ckpt"),
            "--checkpoint-every",
            str(layout.checkpoint_every),
            "--result-file",
            str(work / "result.json"),
        ],
        replicas=REPLICAS,
        ranks_per_pod=RANKS_PER_POD,
        worker_env=worker_env,
        confirmation_env=confirmation_env,
        serve_labels=(CONFIRMATION_LABEL, SECOND_OPINION_LABEL),
    )
    if faulty is not None and layout.confirmation:
        # the same bundle on a healthy node, at the same time (to keep the demo short)
        healthy = nodes[0]
        runner.on_confirmation = lambda pod: second_opinion(server, runner, pod, healthy)
    seen: set[tuple[str, str]] = set()

    def watch() -> None:
        for incident in server.incidents(NAMESPACE, name):
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
            f"step {layout.steps} reached; final weights sha256 "
            f"{result.get('sha256', '?')[:16]}...",
        )
    opinion: dict[str, Any] = {}
    if faulty is not None and layout.confirmation:
        settle(server, runner, name, watch)
        opinion = second_opinion_result(runner, watch)
    incidents = sorted(
        server.incidents(NAMESPACE, name), key=lambda i: int(i["spec"].get("detectionStep", 0))
    )
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
        "job_object": server.get_job(NAMESPACE, name),
        "confirmation_pods": {
            k: {"node": v.node, "exit_code": v.exit_code, "message": v.message}
            for k, v in runner.confirmations.items()
        },
        "second_opinion": opinion,
    }


def settle(server: Cluster, runner: Runner, job: str, watch: Any, timeout: float = 90) -> None:
    """Run the confirmation pod to its end, until the incident records it (and, where it
    is confirmed, the policy's replacement)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        watch()
        runner.serve_confirmations()
        incidents = server.incidents(NAMESPACE, job)
        status = (incidents[0].get("status") or {}) if incidents else {}
        outcome = (status.get("confirmation") or {}).get("outcome")
        if outcome in ("not-confirmed", "unknown") or (
            outcome == "confirmed" and status.get("phase") == "Remediated"
        ):
            return
        time.sleep(0.1)
    runner.note("runner", f"the confirmation did not settle within {timeout:.0f} s")


def second_opinion(server: Cluster, runner: Runner, original: dict[str, Any], healthy: str) -> None:
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
            if name.startswith("second-opinion-") and seen.exit_code is not None:
                message = seen.message
                summary = json.loads(message) if message.startswith("{") else {}
                return {"node": seen.node, "exit_code": seen.exit_code, "summary": summary}
        time.sleep(0.1)
    return {"error": f"no result within {timeout:.0f} s"}


def check(
    clean: dict[str, Any],
    faulty: dict[str, Any],
    nodes: list[str],
    instances: dict[str, str],
    calls: list[tuple[str, dict[str, Any]]],
    layout: Layout,
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
    interval = layout.interval
    if lost["steps"] is None or not 0 <= lost["steps"] <= interval:
        problems.append(f"lost {lost['steps']} steps, not at most replay_every={interval}: {lost}")
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
    if not layout.confirmation:
        # Confirmation off, a person decides: no confirmation pod, nothing asked of SageMaker.
        if clean["confirmation_pods"] or faulty["confirmation_pods"]:
            problems.append("a confirmation pod was made with confirmation off")
        if calls:
            problems.append(f"expected no SageMaker call under the manual policy, got {calls}")
        return problems
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
    parser.add_argument(
        "--layout",
        choices=sorted(LAYOUTS),
        default="ddp",
        help="ddp: examples/train.py (DDP); hsdp: examples/train_fsdp.py --layout hsdp "
        "(replicate 3 x shard 2), not confirmed (see above)",
    )
    args = parser.parse_args()
    layout = LAYOUTS[args.layout]
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
    server = Cluster(base / "apiserver")
    op: OperatorProcess | None = None
    sagemaker = FakeSageMaker()
    try:
        server.core.create_namespace({"metadata": {"name": NAMESPACE}})
        server.core.create_namespaced_service_account(NAMESPACE, {"metadata": {"name": "worker"}})
        instances = {}
        for _ in range(REPLICAS + 1):
            node = server.node(labels={"sagemaker.amazonaws.com/cluster-name": CLUSTER}, ready=True)
            instances[node["metadata"]["name"]] = node["spec"]["providerID"].rsplit("/", 1)[1]
        nodes = list(instances)
        admit_namespace(server, layout)
        trainer = training_operator(server, base)
        tls = ca_and_certificate(base / "tls", "operator")
        op = Operator(server, base / "operator.log", tls, sagemaker.env(), layout)
        say(f"Nodes: {', '.join(nodes)} (the last one is spare). Operator at {op.url}.")
        say(
            f'The jobs carry only the annotation hyperpod-sdc.dev/enabled: "true"; the webhook '
            f"wires their pods, SDCPolicy admits namespace {NAMESPACE} with remediation "
            f"policy {layout.policy}"
            + ("" if layout.confirmation else " (confirmation off)")
            + ".\n"
        )
        shape = "" if layout.name == "ddp" else f", HSDP: replicate {REPLICAS} x shard 2"
        say(f"1. Clean run: {REPLICAS} pods x {RANKS_PER_POD} ranks{shape}, {layout.steps} steps")
        clean = scenario(server, trainer, nodes, "clean-run", None, base / "clean", layout)
        say(
            f"\n2. Same job, and from step {layout.fault_step} GPU 1 of {nodes[FAULTY_NODE]} "
            "returns 4.0001 instead of 4.0000 (a relative error of 2.5e-5 in the first layer's "
            "output)"
        )
        faulty = scenario(
            server, trainer, nodes, "llama-demo", nodes[FAULTY_NODE], base / "faulty", layout
        )
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
                f"{lost['last_periodic_checkpoint']}, every {layout.checkpoint_every} steps) would "
                f"have lost {lost['steps_from_periodic_checkpoint']}; the audit runs every "
                f"{layout.interval}."
            )
        second = faulty["second_opinion"]
        if layout.confirmation:
            say(
                f"Same bundle on healthy node {second.get('node')}: exit "
                f"{second.get('exit_code')}, {(second.get('summary') or {}).get('outcome')} "
                f"({(second.get('summary') or {}).get('reason', second.get('error', ''))})"
            )
        calls = list(sagemaker.calls)
        say(f"SageMaker calls: {calls}")
        problems = check(clean, faulty, nodes, instances, calls, layout)
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
                    "layout": layout.name,
                    "replay_every": layout.interval,
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
