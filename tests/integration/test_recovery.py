"""After containment: the job restarted from its last clean checkpoint, or left suspended
with the reason said, against the real API server."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import pytest

from sdc_agent.protocol import (
    CheckpointReport,
    HeartbeatReport,
    ReporterIdentity,
    ResumeReport,
    encode_report,
)
from sdc_harness.cluster import Cluster, OperatorProcess, post, wait_for

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
    cluster: Cluster,
    op: OperatorProcess,
    job: Job,
    step: int,
    *,
    verified: bool = True,
    location: str | None = None,
) -> dict[str, Any]:
    report = CheckpointReport(
        ReporterIdentity(0, job.node_name(0), job.pods[0]),
        time.time(),
        step,
        location or f"/fsx/ckpt/step_{step}.pt",
        verified,
    )
    status, answer, _ = post(
        op.url, encode_report(report), cluster.token(job.namespace, job.pods[0])
    )
    assert status == 202, answer
    return answer


def resumed(
    cluster: Cluster,
    op: OperatorProcess,
    job: Job,
    reporter: int,
    step: int,
    location: str | None = None,
) -> dict[str, Any]:
    report = ResumeReport(
        ReporterIdentity(reporter * 2, job.node_name(reporter), job.pods[reporter]),
        time.time(),
        step,
        location or f"/fsx/ckpt/step_{step}.pt",
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
    # No heartbeat gave a step time: the lost work in steps only, and no wait (no snapshot).
    assert incident["status"]["lostWork"] == {"detectionStep": 15, "resumeStep": 10, "steps": 5}
    assert "snapshot" not in incident["status"]
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


SNAPSHOT_WAIT = 5.0
"""The stop's wait in the snapshot test: the snapshot's report is sent as soon as the wait
is seen recorded (0.1 s after it here, loaded), and the other job's deadline, recorded by
the operator that is killed, passes while the next one takes the Lease over or soon after
(it leads 3 to 4 s after the kill). 8 s before: the test waited 3 s longer for that
deadline."""


def heartbeat(cluster: Cluster, op: OperatorProcess, job: Job, step: int, interval: float) -> None:
    report = HeartbeatReport(
        ReporterIdentity(0, job.node_name(0), job.pods[0]),
        time.time(),
        step,
        step,
        interval_seconds=interval,
    )
    status, answer, _ = post(
        op.url, encode_report(report), cluster.token(job.namespace, job.pods[0])
    )
    assert status == 202, answer


def incident_of(cluster: Cluster, job: Job, ready: Callable[[dict[str, Any]], bool]) -> Any:
    def find() -> dict[str, Any] | None:
        for incident in cluster.incidents(job.namespace):
            if incident["spec"]["job"]["name"] == job.name and ready(incident):
                return incident
        return None

    return find


def snapshot_contain(cluster: Cluster, op: OperatorProcess, job: Job) -> None:
    """Both reporters' verdicts announce the snapshot of the last clean step (10)."""
    for reporter in (0, 2):
        report = dataclasses.replace(verdict(job, reporter), snapshot_step=10)
        assert send(cluster, op, job, reporter, report)[0] == 202


def waiting(incident: dict[str, Any]) -> bool:
    """The wait is recorded and the suspect node quarantined, the job not stopped yet."""
    status = incident.get("status") or {}
    done = {(a["action"], a.get("result")) for a in status.get("actions") or []}
    return bool(status.get("snapshot")) and ("quarantine-node", "Succeeded") in done


def condition(incident: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in incident["status"]["conditions"] if c["type"] == type_)


# timing: job snap's snapshot reported within the 5 s wait (SNAPSHOT_WAIT) recorded for it:
# 0.1 s after the wait is seen recorded here, 4.9 s margin
@pytest.mark.timing
def test_the_stop_waits_for_the_verified_snapshot_or_its_recorded_deadline(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    """Job ``late``: its snapshot never comes; the operator dies while the stop waits and
    the next one keeps the recorded deadline, stops the job after it and falls back to the
    periodic checkpoint; its snapshot is reported later all the same and its agents resume
    from it: the incident says the snapshot is used (Snapshot=True, ReportedLate). Job
    ``snap``: its node is quarantined at once, the stop waits until the snapshot's checkpoint
    report comes, the job resumes from it, and the incident records the work lost
    (GPU-hours from the heartbeats' step time x its 6 ranks), counted in the metrics once
    the agents report the step they resumed from."""
    late = make_job(cluster, namespace, "late")
    snap = make_job(cluster, namespace, "snap")
    cluster.custom.patch_namespaced_custom_object(
        "kubeflow.org", "v1", namespace, "pytorchjobs", "snap", {"spec": {"nprocPerNode": "2"}}
    )
    settings = {"snapshot_wait_seconds": str(SNAPSHOT_WAIT), "lease_seconds": "3"}
    first = start_operator(**settings)
    for job in (late, snap):
        checkpoint(cluster, first, job, 5)  # the periodic one
    snapshot_contain(cluster, first, late)
    started = wait_for("the wait recorded", incident_of(cluster, late, waiting))
    assert started["status"]["snapshot"]["step"] == 10
    assert condition(started, "Snapshot")["status"] == "Unknown"
    assert cluster.get_job(namespace, "late")["spec"]["runPolicy"]["suspend"] is False
    assert [a["action"] for a in started["status"]["actions"]] == ["quarantine-node"]
    first.kill()

    second = start_operator(**settings)
    heartbeat(cluster, second, snap, 4, 2.0)
    heartbeat(cluster, second, snap, 8, 2.0)  # 4 steps in 2 s: 0.5 s per step
    snapshot_contain(cluster, second, snap)
    wait_for("the wait recorded", incident_of(cluster, snap, waiting), timeout=30)
    assert cluster.get_job(namespace, "snap")["spec"]["runPolicy"]["suspend"] is False
    checkpoint(cluster, second, snap, 10, location="/fsx/ckpt/sdc-snapshot-step_10")

    def resumed_(incident: dict[str, Any]) -> bool:
        # Succeeded, not only recorded: the intent is written before the job is patched, and
        # resumeCheckpoint and lostWork come with the outcome.
        return any(
            a["action"] == "resume-job" and a.get("result") == "Succeeded"
            for a in (incident.get("status") or {}).get("actions", [])
        )

    done = wait_for("snap resumed", incident_of(cluster, snap, resumed_))
    status = done["status"]
    assert (status["snapshot"]["result"], condition(done, "Snapshot")["reason"]) == (
        "SnapshotReported",
        "SnapshotReported",
    )
    assert status["snapshot"]["checkpoint"] == {
        "step": 10,
        "location": "/fsx/ckpt/sdc-snapshot-step_10",
    }
    assert [(a["action"], a["result"]) for a in status["actions"]] == [
        ("quarantine-node", "Succeeded"),
        ("suspend-job", "Succeeded"),
        ("resume-job", "Succeeded"),
    ]
    assert status["snapshot"]["at"] <= status["snapshot"]["deadline"]
    assert status["resumeCheckpoint"] == {"step": 10, "location": "/fsx/ckpt/sdc-snapshot-step_10"}
    assert env_of(cluster.get_job(namespace, "snap")) == [[{"name": RESUME_ENV, "value": "10"}]] * 2
    assert status["lostWork"] == {
        "detectionStep": 15,
        "resumeStep": 10,
        "steps": 5,
        "gpuHours": pytest.approx(5 * 0.5 * 6 / 3600),
        "stepSeconds": 0.5,
        "gpus": 6,
    }

    fell_back = wait_for("late resumed", incident_of(cluster, late, resumed_), timeout=30)
    status = fell_back["status"]
    assert {k: status["snapshot"][k] for k in ("step", "waitingSince", "deadline")} == (
        started["status"]["snapshot"]
    )  # the deadline the first operator recorded, not a fresh one
    assert status["snapshot"]["result"] == "DeadlinePassed"
    late_condition = condition(fell_back, "Snapshot")
    assert (late_condition["status"], late_condition["reason"]) == ("False", "DeadlinePassed")
    assert "step 5 (/fsx/ckpt/step_5.pt)" in late_condition["message"]
    suspended_at = next(a["at"] for a in status["actions"] if a["action"] == "suspend-job")
    assert suspended_at >= status["snapshot"]["deadline"]
    assert status["resumeCheckpoint"]["step"] == 5
    # No heartbeat of this job: no step time, so no GPU-hours, only the steps.
    assert status["lostWork"] == {"detectionStep": 15, "resumeStep": 5, "steps": 10}

    # The late job's snapshot is reported after all, past the deadline and the resume, and
    # its agents resume from it (select_checkpoint finds it, verified, at the last clean
    # step): the incident says it is used, not that the job fell back.
    snapshot = "/fsx/ckpt/sdc-snapshot-step_10"
    checkpoint(cluster, second, late, 10, location=snapshot)
    for job in (late, snap):
        resumed(cluster, second, job, 0, 10, location=snapshot)

    def resumed_true(incident: dict[str, Any]) -> bool:
        return condition(incident, "Resumed")["status"] == "True"

    used = wait_for("late resumed from its snapshot", incident_of(cluster, late, resumed_true))
    status = used["status"]
    used_condition = condition(used, "Snapshot")
    assert (used_condition["status"], used_condition["reason"]) == ("True", "ReportedLate")
    assert "after the stop's deadline" in used_condition["message"]
    assert status["snapshot"]["result"] == "DeadlinePassed"  # what the wait came to
    assert status["snapshot"]["reportedLate"] is True  # the CRD keeps it
    assert status["snapshot"]["checkpoint"] == {"step": 10, "location": snapshot}
    assert status["resumedFromStep"] == 10
    assert status["lostWork"] == {"detectionStep": 15, "resumeStep": 10, "steps": 5}
    wait_for("snap resumed from its snapshot", incident_of(cluster, snap, resumed_true))

    assert second.sample('hyperpod_sdc_snapshot_waits_total{outcome="reported"}') == 1
    assert second.sample('hyperpod_sdc_snapshot_waits_total{outcome="timed_out"}') == 1
    # Counted once each, when the agents said where they resumed: 5 + 5 steps (the late
    # job's 10 from the periodic checkpoint were never lost).
    assert second.sample("hyperpod_sdc_lost_steps_count") == 2
    assert second.sample("hyperpod_sdc_lost_steps_sum") == 10
    assert second.sample("hyperpod_sdc_lost_gpu_hours_total") == pytest.approx(5 * 0.5 * 6 / 3600)


def test_one_resume_of_two_incidents_counts_the_jobs_lost_work_once(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    """The job caught twice before its suspension lands (steps 15 and 25): one restart from
    step 10 resumes both incidents, and the job lost steps 10 to 25 once: 15 steps, one
    observation, not 5 + 15 in two."""
    job = make_job(cluster, namespace)
    op = start_operator()
    checkpoint(cluster, op, job, 10)
    for step in (15, 25):
        for reporter in (0, 2):
            report = verdict(job, reporter, step=step)
            assert send(cluster, op, job, reporter, report)[0] == 202

    def both_waiting() -> list[dict[str, Any]] | None:
        found = [
            i
            for i in cluster.incidents(namespace)
            if any(
                c["type"] == "Resumed" and c["status"] == "Unknown"
                for c in (i.get("status") or {}).get("conditions") or []
            )
        ]
        return found if len(found) == 2 else None

    waiting_ = wait_for("both incidents waiting for the resume", both_waiting)
    assert sorted(i["status"]["lostWork"]["steps"] for i in waiting_) == [5, 15]
    answer = resumed(cluster, op, job, 0, 10)
    assert sorted(answer["incidents"]) == sorted(i["metadata"]["name"] for i in waiting_)
    assert op.sample("hyperpod_sdc_lost_steps_count") == 1
    assert op.sample("hyperpod_sdc_lost_steps_sum") == 15
