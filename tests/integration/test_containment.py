"""The operator against a real API server: a verdict from two nodes -> a contained incident."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sdc_agent.protocol import ReporterIdentity, Suspect, VerdictReport, encode_report
from sdc_agent.reporter import Reporter, ReporterConfig
from sdc_harness.cluster import Cluster, OperatorProcess, post, wait_for
from sdc_operator.names import INCIDENT_ANNOTATION, SUSPECT_KEY

RANKS_PER_NODE = 2


@dataclass
class Job:
    namespace: str
    name: str
    body: dict[str, Any]
    nodes: list[dict[str, Any]]
    pods: list[str]

    def node_name(self, i: int) -> str:
        return str(self.nodes[i]["metadata"]["name"])

    def instance(self, i: int) -> str:
        return str(self.nodes[i]["spec"]["providerID"].rsplit("/", 1)[-1])


def make_job(
    cluster: Cluster,
    namespace: str,
    name: str = "train",
    *,
    enabled: bool = True,
    n: int = 3,
    kind: str = "PyTorchJob",
    job_labels: dict[str, str] | None = None,
    key: bytes | None = None,
    **node_kw: Any,
) -> Job:
    """A job of ``n`` pods on ``n`` new nodes, named and attested as the training operator
    would (``key``: the attestation key, default the cluster's)."""
    nodes = [cluster.node(**node_kw) for _ in range(n)]
    body = cluster.job(namespace, name, enabled=enabled, replicas=n, kind=kind, labels=job_labels)
    pods = [f"{name}-master-0"] + [f"{name}-worker-{i}" for i in range(n - 1)]
    for pod, node in zip(pods, nodes, strict=True):
        cluster.pod(namespace, pod, node["metadata"]["name"], body, key=key)
    return Job(namespace, name, body, nodes, pods)


def verdict(
    job: Job,
    reporter: int,
    suspect_node: int = 1,
    *,
    step: int = 15,
    last_clean: int = 10,
    classification: str = "rank",
    sent_at: float | None = None,
) -> VerdictReport:
    """The verdict every node sends when ``suspect_node``'s second GPU is wrong."""
    suspect_rank = suspect_node * RANKS_PER_NODE + 1
    return VerdictReport(
        reporter=ReporterIdentity(
            reporter * RANKS_PER_NODE, job.node_name(reporter), job.pods[reporter]
        ),
        sent_at=time.time() if sent_at is None else sent_at,
        check="replay",
        classification=classification,
        step=step,
        last_clean_step=last_clean,
        localized=True,
        transient=False,
        suspects=(
            Suspect(
                suspect_rank,
                job.node_name(suspect_node),
                1,
                job.pods[suspect_node],
                "GPU-5d6e0c1a-0000-0000-0000-000000000001",
            ),
        ),
        message=f"rank(s) {suspect_rank} computed wrong results (persistent)",
        evidence={"mismatches": []},
    )


def send(
    cluster: Cluster,
    op: OperatorProcess,
    job: Job,
    reporter: int,
    report: VerdictReport | bytes | str,
) -> tuple[int, dict[str, Any], dict[str, str]]:
    token = cluster.token(job.namespace, job.pods[reporter])
    body = encode_report(report) if isinstance(report, VerdictReport) else report
    return post(op.url, body, token)


def incident_in(
    cluster: Cluster, namespace: str, phase: str, timeout: float = 20
) -> dict[str, Any]:
    """The namespace's incident once it is in ``phase``; for ``Contained``, once the
    operator has also decided about restarting the job (condition ``Resumed`` present)."""

    def settled(incident: dict[str, Any]) -> bool:
        status = incident.get("status") or {}
        if status.get("phase") != phase:
            return False
        if phase != "Contained":
            return True
        conditions = {c["type"]: c for c in status.get("conditions") or []}
        return "Resumed" in conditions or conditions["Contained"]["reason"] != "NodeQuarantined"

    def find() -> dict[str, Any] | None:
        found = [i for i in cluster.incidents(namespace) if settled(i)]
        return found[0] if found else None

    return wait_for(f"an incident in phase {phase}", find, timeout=timeout)


NOT_RESUMED = ("resume-job", "Skipped")
"""No verified checkpoint was reported in these tests: the job stays suspended."""


@pytest.mark.fast
def test_verdict_from_two_nodes_reporters_is_contained(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess], tmp_path: Path
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator()
    started = time.monotonic()
    reporters = []
    for reporter in (0, 2):  # the real agent reporter, with its token file
        token_file = tmp_path / f"token-{reporter}"
        token_file.write_text(cluster.token(namespace, job.pods[reporter]))
        r = Reporter(ReporterConfig(operator_url=op.url, token_file=str(token_file)))
        r.submit(verdict(job, reporter))
        reporters.append(r)
    for r in reporters:
        assert r.flush(timeout=20)
        assert (r.delivered, r.refused) == (1, 0)
        r.close()

    incident = incident_in(cluster, namespace, "Contained")
    contained_after = time.monotonic() - started
    status = incident["status"]
    assert incident["spec"]["job"]["name"] == "train"
    assert incident["spec"]["job"]["uid"] == job.body["metadata"]["uid"]
    assert (incident["spec"]["detectionStep"], incident["spec"]["lastCleanStep"]) == (15, 10)
    assert status["node"] == job.node_name(1)
    assert status["instanceId"] == job.instance(1)
    assert status["ranks"] == "3"
    assert status["suspects"] == [
        {
            "rank": 3,
            "localRank": 1,
            "pod": job.pods[1],
            "node": job.node_name(1),
            "instanceId": job.instance(1),
            "gpuUUID": "GPU-5d6e0c1a-0000-0000-0000-000000000001",
        }
    ]
    assert sorted(r["node"] for r in status["reports"]) == sorted(
        [job.node_name(0), job.node_name(2)]
    )
    assert [(a["action"], a["result"]) for a in status["actions"]] == [
        ("suspend-job", "Succeeded"),
        ("quarantine-node", "Succeeded"),
        NOT_RESUMED,
    ]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Detected"]["status"] == "True"
    assert conditions["Contained"]["status"] == "True"
    assert contained_after < 15, f"contained after {contained_after:.1f} s"

    assert cluster.get_job(namespace, "train")["spec"]["runPolicy"]["suspend"] is True
    node = cluster.get_node(job.node_name(1))
    assert node["spec"]["unschedulable"] is True
    assert {"key": SUSPECT_KEY, "value": "true", "effect": "NoSchedule"} in node["spec"]["taints"]
    assert node["metadata"]["labels"][SUSPECT_KEY] == "true"
    assert (
        node["metadata"]["annotations"][INCIDENT_ANNOTATION]
        == f"{namespace}/{incident['metadata']['name']}"
    )
    for other in (0, 2):  # healthy nodes untouched
        healthy = cluster.get_node(job.node_name(other))
        assert not healthy["spec"].get("unschedulable")
        assert SUSPECT_KEY not in (healthy["metadata"].get("labels") or {})

    def events() -> set[tuple[str, str]] | None:
        got = {
            (e["involved_object"]["kind"], e["reason"])
            for e in cluster.events(namespace) + cluster.events("default")
        }
        want = {
            ("PyTorchJob", "SDCJobSuspended"),
            ("Node", "SDCNodeQuarantined"),
            ("SDCIncident", "Detected"),
            ("SDCIncident", "Contained"),
        }
        return got if want <= got else None

    wait_for("the events on job, node and incident", events)

    table = cluster.kubectl("get", "sdcincidents", "-n", namespace)
    header, row = table.splitlines()[:2]
    assert header.split() == [
        "NAME",
        "JOB",
        "CHECK",
        "NODE",
        "INSTANCE",
        "RANK",
        "STEP",
        "PHASE",
        "CONFIRMED",
        "AGE",
    ]
    assert row.split()[1:8] == [
        "train",
        "replay",
        job.node_name(1),
        job.instance(1),
        "3",
        "15",
        "Contained",
    ]

    metrics = op.metrics()
    assert 'hyperpod_sdc_reports_total{kind="verdict",verdict="rank"} 2.0' in metrics
    assert "hyperpod_sdc_report_to_contained_seconds_count 1.0" in metrics


WORKLOAD = "pytorchjob-queued-1a2b3"


def make_queued_job(cluster: Cluster, namespace: str) -> Job:
    """A job Kueue manages: its queue label, and the Workload Kueue made for it."""
    job = make_job(cluster, namespace, "queued", job_labels={"kueue.x-k8s.io/queue-name": "team-a"})
    meta = job.body["metadata"]
    owner = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
    }
    workload = {
        "apiVersion": "kueue.x-k8s.io/v1beta1",
        "kind": "Workload",
        "metadata": {"name": WORKLOAD, "ownerReferences": [owner]},
        "spec": {"queueName": "team-a"},
    }
    cluster.custom.create_namespaced_custom_object(
        "kueue.x-k8s.io", "v1beta1", namespace, "workloads", workload
    )
    return job


def workload_active(cluster: Cluster, namespace: str) -> bool:
    got = cluster.custom.get_namespaced_custom_object(
        "kueue.x-k8s.io", "v1beta1", namespace, "workloads", WORKLOAD
    )
    return bool(got["spec"]["active"])


def test_kueue_managed_job_is_stopped_through_its_workload(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_queued_job(cluster, namespace)
    op = start_operator()
    for reporter in (0, 2):
        assert send(cluster, op, job, reporter, verdict(job, reporter))[0] == 202
    incident = incident_in(cluster, namespace, "Contained")
    assert f"deactivated Kueue Workload {WORKLOAD}" in incident["status"]["actions"][0]["message"]
    assert workload_active(cluster, namespace) is False
    # Kueue, not the operator, suspends the job once its Workload is inactive
    assert cluster.get_job(namespace, "queued")["spec"]["runPolicy"]["suspend"] is False


def test_hyperpod_pytorchjob_is_contained_the_same_way(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace, "hp", kind="HyperPodPyTorchJob")
    op = start_operator()
    for reporter in (0, 2):
        assert send(cluster, op, job, reporter, verdict(job, reporter))[0] == 202
    incident = incident_in(cluster, namespace, "Contained")
    assert incident["spec"]["job"]["kind"] == "HyperPodPyTorchJob"
    assert incident["status"]["actions"][0]["target"] == f"HyperPodPyTorchJob {namespace}/hp"
    hp = cluster.get_job(namespace, "hp", kind="HyperPodPyTorchJob")
    assert hp["spec"]["runPolicy"]["suspend"] is True
    assert cluster.get_node(job.node_name(1))["spec"]["unschedulable"] is True
