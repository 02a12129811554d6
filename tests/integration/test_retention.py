"""Retention against the real API server: closed incidents and those of deleted jobs go
once old; one in progress, or holding a quarantined node, never."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from sdc_harness.cluster import Cluster
from sdc_operator import incidents, nodes, retention, times
from sdc_operator.caches import Caches
from sdc_operator.incidents import Action, JobRef, ResolvedSuspect, Rules
from sdc_operator.kube import Endpoint, Kube
from sdc_operator.metrics import Metrics

from .test_containment import Job, make_job, verdict

OLD = "2020-01-01T00:00:00Z"


def stage(cluster: Cluster, job: Job, name: str, status: dict[str, Any], uid: str = "") -> str:
    ref = JobRef(
        "kubeflow.org/v1", "PyTorchJob", job.namespace, job.name, uid or job.body["metadata"]["uid"]
    )
    body = incidents.new_incident(ref, name, verdict(job, 0))
    created = cluster.custom.create_namespaced_custom_object(
        "hyperpod-sdc.dev", "v1alpha1", job.namespace, "sdcincidents", body
    )
    created["status"] = status
    cluster.custom.replace_namespaced_custom_object_status(
        "hyperpod-sdc.dev", "v1alpha1", job.namespace, "sdcincidents", name, created
    )
    return name


def agreed(job: Job, at: str, **changes: Any) -> dict[str, Any]:
    suspect = ResolvedSuspect(3, 1, job.pods[1], job.node_name(1))
    status: dict[str, Any] = {}
    for reporter in (0, 2):
        report = verdict(job, reporter)
        report = dataclasses.replace(report, **changes)
        status, _ = incidents.fold_report(
            status,
            report,
            reporter_pod=job.pods[reporter],
            reporter_node=job.node_name(reporter),
            suspects=[suspect],
            needed=2,
            received_at=at,
        )
    return status


def contained(job: Job, at: str) -> dict[str, Any]:
    status = agreed(job, at)
    target = f"PyTorchJob {job.namespace}/{job.name}"
    status = incidents.record_action(status, Action("suspend-job", target), "Succeeded", "done", at)
    status = incidents.record_action(
        status, Action("quarantine-node", job.node_name(1)), "Succeeded", "done", at
    )
    status["phase"] = "Contained"
    incidents.set_condition(status, "Contained", "True", "NodeQuarantined", "staged", at)
    return incidents.record_action(status, Action("resume-job", target), "Skipped", "no", at)


def test_retention_deletes_closed_and_orphaned_incidents_only(
    cluster: Cluster, namespace: str
) -> None:
    """The sweep the leader runs every 10 minutes, run here in-process against the real
    API server (a running leader would act on the open incidents and freshen them)."""
    job = make_job(cluster, namespace)
    holder = make_job(cluster, namespace, "holder")
    failed = {
        "action": "replace-node",
        "target": job.node_name(1),
        "at": OLD,
        "result": "Failed",
        "message": "InternalServerError",
    }
    pending = {**failed, "result": "Pending", "message": "taking it"}
    staged = {
        "closed-old": (job, agreed(job, OLD, classification="training"), ""),
        "closed-new": (job, agreed(job, times.now_iso(), classification="training"), ""),
        "in-progress-old": (job, agreed(job, OLD), ""),
        "holds-a-node-old": (holder, contained(holder, OLD), ""),
        "pending-action-old": (job, {**contained(job, OLD), "actions": [pending]}, "gone-uid"),
        # a replace that keeps failing, for a job deleted since: nothing left to do for it
        "deleted-job-old": (job, {**contained(job, OLD), "actions": [failed]}, "gone-uid"),
        "retrying-old": (job, {**contained(job, OLD), "actions": [failed]}, ""),
    }
    for name, (owner, status, uid) in staged.items():
        stage(cluster, owner, name, status, uid)
    node = holder.node_name(1)
    patch = nodes.quarantine_patch(cluster.get_node(node), f"{namespace}/holds-a-node-old")
    cluster.core.patch_node(node, patch, _content_type="application/merge-patch+json")
    rules = Rules(remediation_policy="auto-replace")

    async def sweep() -> list[str]:
        kube = Kube(Endpoint.load(cluster.kubeconfig), name="test")
        caches = Caches(kube, [namespace])
        caches.start()
        try:
            while not caches.synced():
                await asyncio.sleep(0.05)
            return await retention.sweep(caches, kube, 30, lambda _: rules, Metrics())
        finally:
            await caches.stop()
            await kube.close()

    deleted = asyncio.run(sweep())
    assert sorted(deleted) == [f"{namespace}/closed-old", f"{namespace}/deleted-job-old"]
    assert {i["metadata"]["name"] for i in cluster.incidents(namespace)} == set(staged) - {
        "closed-old",
        "deleted-job-old",
    }
