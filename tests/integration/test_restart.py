"""An operator restarted in the middle of an incident finishes it, each action once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sdc_harness.cluster import Cluster, OperatorProcess
from sdc_operator import incidents, nodes
from sdc_operator.incidents import Action, JobRef, ResolvedSuspect

from .test_containment import NOT_RESUMED, Job, incident_in, make_job, send, verdict

AT = "2026-11-29T00:00:00Z"


def stage(cluster: Cluster, job: Job, actions: list[Action]) -> dict[str, Any]:
    """An incident as an operator leaves it when it dies after ``actions``: two nodes
    agreed, containment under way (phase Detected)."""
    meta = job.body["metadata"]
    ref = JobRef("kubeflow.org/v1", "PyTorchJob", job.namespace, job.name, meta["uid"])
    suspect = ResolvedSuspect(3, 1, job.pods[1], job.node_name(1), job.instance(1))
    status: dict[str, Any] = {}
    for reporter in (0, 2):
        report = verdict(job, reporter)
        status, _ = incidents.fold_report(
            status,
            report,
            reporter_pod=job.pods[reporter],
            reporter_node=job.node_name(reporter),
            suspects=[suspect],
            needed=2,
            received_at=AT,
        )
    assert status["phase"] == "Detected"
    for action in actions:
        status = incidents.record_action(status, action, "Succeeded", "done before the crash", AT)
    body = incidents.new_incident(ref, incidents.incident_name(ref, report), report)
    created = cluster.custom.create_namespaced_custom_object(
        "hyperpod-sdc.dev", "v1alpha1", job.namespace, "sdcincidents", body
    )
    created["status"] = status
    cluster.custom.replace_namespaced_custom_object_status(
        "hyperpod-sdc.dev",
        "v1alpha1",
        job.namespace,
        "sdcincidents",
        created["metadata"]["name"],
        created,
    )
    return created


def suspend(cluster: Cluster, job: Job) -> None:
    cluster.custom.patch_namespaced_custom_object(
        "kubeflow.org",
        "v1",
        job.namespace,
        "pytorchjobs",
        job.name,
        {"spec": {"runPolicy": {"suspend": True}}},
    )


def test_restart_after_the_job_was_stopped(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    suspend(cluster, job)
    stage(cluster, job, [Action("suspend-job", f"PyTorchJob {namespace}/{job.name}")])
    start_operator()
    incident = incident_in(cluster, namespace, "Contained")
    assert [a["action"] for a in incident["status"]["actions"]] == [
        "suspend-job",
        "quarantine-node",
        "resume-job",
    ]
    assert incident["status"]["actions"][0]["message"] == "done before the crash"
    assert cluster.get_job(namespace, job.name)["spec"]["runPolicy"]["suspend"] is True
    assert cluster.get_node(job.node_name(1))["spec"]["unschedulable"] is True


def test_restart_after_actions_taken_but_not_recorded(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    """The operator died after patching the job and the node, before writing the status."""
    job = make_job(cluster, namespace)
    suspend(cluster, job)
    incident = stage(cluster, job, [])
    node = cluster.get_node(job.node_name(1))
    patch = nodes.quarantine_patch(node, f"{namespace}/{incident['metadata']['name']}")
    cluster.core.patch_node(job.node_name(1), patch, _content_type="application/merge-patch+json")
    node_version = cluster.get_node(job.node_name(1))["metadata"]["resourceVersion"]
    start_operator()
    incident = incident_in(cluster, namespace, "Contained")
    actions = incident["status"]["actions"]
    assert [(a["action"], a["result"]) for a in actions] == [
        ("suspend-job", "Succeeded"),
        ("quarantine-node", "Succeeded"),
        NOT_RESUMED,
    ]
    assert "already" in actions[0]["message"] and "already" in actions[1]["message"]
    assert cluster.get_node(job.node_name(1))["metadata"]["resourceVersion"] == node_version


def test_killed_mid_incident_completes_once(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator()
    for reporter in (0, 2):
        assert send(cluster, op, job, reporter, verdict(job, reporter))[0] == 202
    op.kill()  # SIGKILL: wherever containment was, nothing is cleaned up
    start_operator()
    incident = incident_in(cluster, namespace, "Contained")
    assert [a["action"] for a in incident["status"]["actions"]] == [
        "suspend-job",
        "quarantine-node",
        "resume-job",
    ]
    assert len(cluster.incidents(namespace)) == 1
