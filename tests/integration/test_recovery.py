"""After containment: the job restarted from its last clean checkpoint, or left suspended
with the reason said, against the real API server."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from sdc_agent.protocol import CheckpointReport, ReporterIdentity, ResumeReport, encode_report

from .cluster import Cluster, OperatorProcess, post, wait_for
from .test_containment import (
    WORKLOAD,
    Job,
    make_job,
    make_queued_job,
    send,
    verdict,
    workload_active,
)

RESUME_ENV = "HYPERPOD_SDC_RESUME_MAX_STEP"


def checkpoint(
    cluster: Cluster, op: OperatorProcess, job: Job, step: int, *, verified: bool = True
) -> dict[str, Any]:
    report = CheckpointReport(
        ReporterIdentity(0, job.node_name(0), job.pods[0]),
        time.time(),
        step,
        f"/fsx/ckpt/step_{step}.pt",
        verified,
    )
    status, answer, _ = post(
        op.url, encode_report(report), cluster.token(job.namespace, job.pods[0])
    )
    assert status == 202, answer
    return answer


def resumed(
    cluster: Cluster, op: OperatorProcess, job: Job, reporter: int, step: int
) -> dict[str, Any]:
    report = ResumeReport(
        ReporterIdentity(reporter * 2, job.node_name(reporter), job.pods[reporter]),
        time.time(),
        step,
        f"/fsx/ckpt/step_{step}.pt",
    )
    status, answer, _ = post(
        op.url, encode_report(report), cluster.token(job.namespace, job.pods[reporter])
    )
    assert status == 202, answer
    return answer


def contain(cluster: Cluster, op: OperatorProcess, job: Job) -> None:
    for reporter in (0, 2):
        assert send(cluster, op, job, reporter, verdict(job, reporter))[0] == 202  # window (10, 15]


def resume_condition(cluster: Cluster, job: Job, status: str) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        for incident in cluster.incidents(job.namespace):
            for c in (incident.get("status") or {}).get("conditions") or []:
                if c["type"] == "Resumed" and c["status"] == status:
                    return incident
        return None

    return wait_for(f"condition Resumed={status}", find)


def env_of(body: dict[str, Any]) -> list[list[dict[str, str]]]:
    spec = body["spec"]
    replicas = (
        list(spec["pytorchReplicaSpecs"].values())
        if "pytorchReplicaSpecs" in spec
        else spec["replicaSpecs"]
    )
    return [
        [e for e in c.get("env", []) if e["name"] == RESUME_ENV]
        for r in replicas
        for c in r["template"]["spec"]["containers"]
    ]


@pytest.mark.fast
def test_resume_sets_the_variable_unsuspends_and_hears_back(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator()
    assert checkpoint(cluster, op, job, 5)["recorded"] is True
    assert checkpoint(cluster, op, job, 10)["recorded"] is True
    assert checkpoint(cluster, op, job, 15, verified=False)["recorded"] is False
    contain(cluster, op, job)
    incident = resume_condition(cluster, job, "Unknown")
    assert incident["status"]["phase"] == "Contained"
    assert incident["status"]["resumeCheckpoint"] == {
        "step": 10,
        "location": "/fsx/ckpt/step_10.pt",
    }
    assert [(a["action"], a["result"]) for a in incident["status"]["actions"]] == [
        ("suspend-job", "Succeeded"),
        ("quarantine-node", "Succeeded"),
        ("resume-job", "Succeeded"),
    ]
    body = cluster.get_job(namespace, job.name)
    assert body["spec"]["runPolicy"]["suspend"] is False
    assert env_of(body) == [[{"name": RESUME_ENV, "value": "10"}]] * 2
    assert {"name": "A", "value": "1"} in body["spec"]["pytorchReplicaSpecs"]["Worker"]["template"][
        "spec"
    ]["containers"][0]["env"]

    answer = resumed(cluster, op, job, 0, 10)
    assert answer["incidents"] == [incident["metadata"]["name"]]
    assert resumed(cluster, op, job, 2, 10)["incidents"] == []  # the second node changes nothing
    incident = resume_condition(cluster, job, "True")
    assert (
        incident["status"]["phase"],
        incident["status"]["resumedFromStep"],
        incident["status"]["resumedFrom"],
    ) == ("Resumed", 10, "/fsx/ckpt/step_10.pt")


def test_no_clean_checkpoint_keeps_the_job_suspended(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator()
    checkpoint(cluster, op, job, 12)  # verified, but inside the suspect window (10, 15]
    contain(cluster, op, job)
    incident = resume_condition(cluster, job, "False")
    condition = next(c for c in incident["status"]["conditions"] if c["type"] == "Resumed")
    assert condition["reason"] == "NoCleanCheckpoint"
    assert (
        "no verified checkpoint at or before step 10" in condition["message"]
        and "[12]" in condition["message"]
    )
    body = cluster.get_job(namespace, job.name)
    assert body["spec"]["runPolicy"]["suspend"] is True
    assert env_of(body) == [[{"name": RESUME_ENV, "value": "10"}]] * 2  # a restart by hand is safe
    assert incident["status"]["phase"] == "Contained"


def test_job_that_opted_out_stays_suspended(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    cluster.custom.patch_namespaced_custom_object(
        "kubeflow.org",
        "v1",
        namespace,
        "pytorchjobs",
        job.name,
        {"metadata": {"annotations": {"hyperpod-sdc.dev/auto-resume": "false"}}},
    )
    op = start_operator()
    checkpoint(cluster, op, job, 10)
    contain(cluster, op, job)
    incident = resume_condition(cluster, job, "False")
    assert (
        next(c for c in incident["status"]["conditions"] if c["type"] == "Resumed")["reason"]
        == "OptedOut"
    )
    assert cluster.get_job(namespace, job.name)["spec"]["runPolicy"]["suspend"] is True


def test_hyperpod_auto_resume_is_left_to_nobody_but_one(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    """A HyperPodPyTorchJob with HyperPod's auto-resume: stopped and quarantined, not
    restarted by hyperpod-sdc (docs/operator.md says why)."""
    job = make_job(cluster, namespace, "hp", kind="HyperPodPyTorchJob")
    cluster.custom.patch_namespaced_custom_object(
        "sagemaker.amazonaws.com",
        "v1",
        namespace,
        "hyperpodpytorchjobs",
        "hp",
        {"metadata": {"annotations": {"sagemaker.amazonaws.com/enable-job-auto-resume": "true"}}},
    )
    op = start_operator()
    checkpoint(cluster, op, job, 10)
    contain(cluster, op, job)
    incident = resume_condition(cluster, job, "False")
    assert (
        next(c for c in incident["status"]["conditions"] if c["type"] == "Resumed")["reason"]
        == "HyperPodAutoResume"
    )
    body = cluster.get_job(namespace, "hp", kind="HyperPodPyTorchJob")
    assert body["spec"]["runPolicy"]["suspend"] is True
    assert env_of(body) == [[{"name": RESUME_ENV, "value": "10"}]]
    assert body["spec"]["replicaSpecs"][0]["replicas"] == 3


def test_hyperpod_job_is_resumed(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace, "hp2", kind="HyperPodPyTorchJob")
    op = start_operator()
    checkpoint(cluster, op, job, 10)
    contain(cluster, op, job)
    resume_condition(cluster, job, "Unknown")
    body = cluster.get_job(namespace, "hp2", kind="HyperPodPyTorchJob")
    assert body["spec"]["runPolicy"]["suspend"] is False
    assert env_of(body) == [[{"name": RESUME_ENV, "value": "10"}]]


def test_resume_past_the_window_is_flagged(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator()
    checkpoint(cluster, op, job, 10)
    contain(cluster, op, job)
    resume_condition(cluster, job, "Unknown")
    resumed(cluster, op, job, 0, 14)
    incident = resume_condition(cluster, job, "False")
    assert (
        next(c for c in incident["status"]["conditions"] if c["type"] == "Resumed")["reason"]
        == "ResumedPastWindow"
    )


def test_kueue_managed_job_is_resumed_through_its_workload(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_queued_job(cluster, namespace)
    op = start_operator()
    checkpoint(cluster, op, job, 10)
    contain(cluster, op, job)
    incident = resume_condition(cluster, job, "Unknown")
    assert f"reactivated Kueue Workload {WORKLOAD}" in incident["status"]["actions"][-1]["message"]
    assert workload_active(cluster, namespace) is True
    assert (
        env_of(cluster.get_job(namespace, job.name)) == [[{"name": RESUME_ENV, "value": "10"}]] * 2
    )
