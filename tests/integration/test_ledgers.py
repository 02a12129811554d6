"""One incident's action must not undo another's, nor repeat it: the per-job hold ledger
(a resume waits for every incident of the job that holds it stopped) and the per-instance
request ledger (a SageMaker request another incident made and got no answer to counts as
made). The incidents are staged as an operator leaves them when it dies; the real operator
process then runs against the real API server and the loopback SageMaker endpoint."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from sdc_harness.cluster import Cluster, OperatorProcess, wait_for
from sdc_harness.fake_sagemaker import FakeSageMaker
from sdc_operator import incidents, jobs, nodes
from sdc_operator.incidents import JobRef, ResolvedSuspect
from sdc_operator.times import now_iso

from .test_containment import Job, make_job, send, verdict

CLUSTER_LABEL = {"sagemaker.amazonaws.com/cluster-name": "ml-cluster"}
REPLACE = "BatchReplaceClusterNodes"


def ago(seconds: float) -> str:
    return now_iso(datetime.now(timezone.utc) - timedelta(seconds=seconds))


def stage(
    cluster: Cluster,
    job: Job,
    *,
    step: int,
    actions: list[dict[str, Any]],
    phase: str,
    contained: str | None = None,
) -> str:
    """An incident of the window ``(step - 5, step]`` whose suspect is node 1, with
    ``actions`` recorded, in ``phase`` (and ``Contained=True`` for ``contained``). Its name."""
    meta = job.body["metadata"]
    ref = JobRef("kubeflow.org/v1", "PyTorchJob", job.namespace, job.name, meta["uid"])
    suspect = ResolvedSuspect(3, 1, job.pods[1], job.node_name(1), job.instance(1))
    status: dict[str, Any] = {}
    at = ago(120)
    for reporter in (0, 2):
        status, _ = incidents.fold_report(
            status,
            verdict(job, reporter, step=step, last_clean=step - 5),
            reporter_pod=job.pods[reporter],
            reporter_node=job.node_name(reporter),
            suspects=[suspect],
            needed=2,
            received_at=at,
        )
    status["actions"] = actions
    status["phase"] = phase
    if contained is not None:
        incidents.set_condition(status, "Contained", "True", contained, "staged", at)
    report = verdict(job, 0, step=step, last_clean=step - 5)
    name = incidents.incident_name(ref, report)
    created = cluster.custom.create_namespaced_custom_object(
        "hyperpod-sdc.dev",
        "v1alpha1",
        job.namespace,
        "sdcincidents",
        incidents.new_incident(ref, name, report),
    )
    created["status"] = status
    cluster.custom.replace_namespaced_custom_object_status(
        "hyperpod-sdc.dev", "v1alpha1", job.namespace, "sdcincidents", name, created
    )
    return name


def entry(
    action: str, target: str, result: str, message: str, at: str, **kw: Any
) -> dict[str, Any]:
    return {
        "action": action,
        "target": target,
        "result": result,
        "message": message,
        "at": at,
        **kw,
    }


def suspended_with_checkpoint(cluster: Cluster, job: Job, step: int) -> None:
    """The job stopped, with a verified checkpoint of ``step``: a resume would lift it."""
    found = cluster.get_job(job.namespace, job.name)
    patch = jobs.checkpoint_patch(found, step, f"/fsx/ckpt/step_{step}.pt")
    assert patch is not None
    patch["spec"] = {"runPolicy": {"suspend": True}}
    cluster.custom.patch_namespaced_custom_object(
        "kubeflow.org", "v1", job.namespace, "pytorchjobs", job.name, patch
    )


def quarantine(cluster: Cluster, job: Job, holder: str) -> None:
    node = cluster.get_node(job.node_name(1))
    patch = nodes.quarantine_patch(node, f"{job.namespace}/{holder}")
    cluster.core.patch_node(job.node_name(1), patch, _content_type="application/merge-patch+json")


def incident(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return next(i for i in cluster.incidents(namespace) if i["metadata"]["name"] == name)


def resume_of(found: dict[str, Any]) -> dict[str, Any] | None:
    return next(
        (a for a in found["status"].get("actions") or [] if a["action"] == "resume-job"), None
    )


def decided(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        found = resume_of(incident(cluster, namespace, name))
        return found if found is not None and found["result"] != "Pending" else None

    return wait_for(f"{name}'s resume decided", find, timeout=30)


def not_localized(cluster: Cluster, job: Job, stopped_at: str) -> str:
    """Incident I2: stopped the job, its verdict singles out no node: a person decides."""
    target = f"PyTorchJob {job.namespace}/{job.name}"
    return stage(
        cluster,
        job,
        step=25,
        actions=[
            entry("suspend-job", target, "Succeeded", "set runPolicy.suspend=true", stopped_at)
        ],
        phase="Contained",
        contained="JobStoppedNotLocalized",
    )


def test_a_resume_waits_for_the_jobs_other_holding_incident(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    """I1 quarantines its node and would resume the job from a clean checkpoint; I2 of
    the same job stopped it and singles out no node. The job stays stopped: I2's suspect
    may be any node, and the restarted job would run on it."""
    job = make_job(cluster, namespace)
    suspended_with_checkpoint(cluster, job, 5)
    target = f"PyTorchJob {namespace}/{job.name}"
    second = not_localized(cluster, job, ago(60))
    first = stage(
        cluster,
        job,
        step=15,
        actions=[entry("suspend-job", target, "Succeeded", "set runPolicy.suspend=true", ago(90))],
        phase="Detected",
    )
    op = start_operator()
    resume = decided(cluster, namespace, first)
    op.resynced(2)  # two whole resyncs
    assert (resume["result"], resume.get("message", "")[:12]) == ("Skipped", "incident(s) "), resume
    assert second in resume["message"]
    found = incident(cluster, namespace, first)
    conditions = {c["type"]: c for c in found["status"]["conditions"]}
    assert conditions["Resumed"]["reason"] == "HeldByIncident"
    assert cluster.get_job(namespace, job.name)["spec"]["runPolicy"]["suspend"] is True
    assert resume_of(incident(cluster, namespace, second)) is None


def test_a_resume_left_pending_by_a_crash_does_not_lift_another_incidents_stop(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    """I1 resumed the job; I2 stopped it again. With the operator down, I1's resume is
    back at ``Pending`` (a crash between lifting the suspension and recording it leaves
    that). The restarted leader verifies the resume: it must not lift I2's stop."""
    job = make_job(cluster, namespace)
    suspended_with_checkpoint(cluster, job, 5)
    target = f"PyTorchJob {namespace}/{job.name}"
    first_name = incidents.incident_name(
        JobRef("kubeflow.org/v1", "PyTorchJob", namespace, job.name, job.body["metadata"]["uid"]),
        verdict(job, 0, step=15, last_clean=10),
    )
    quarantine(cluster, job, first_name)
    first = stage(
        cluster,
        job,
        step=15,
        actions=[
            entry("suspend-job", target, "Succeeded", "set runPolicy.suspend=true", ago(100)),
            entry("quarantine-node", job.node_name(1), "Succeeded", "cordoned", ago(95)),
            entry(
                "resume-job",
                target,
                "Pending",
                "taking it",
                ago(90),
                intent={"job": job.body["metadata"]["uid"]},
            ),
        ],
        phase="Contained",
        contained="NodeQuarantined",
    )
    assert first == first_name
    second = not_localized(cluster, job, ago(60))
    op = start_operator()
    resume = decided(cluster, namespace, first)
    op.resynced(2)
    assert resume["result"] == "Skipped" and second in resume["message"], resume
    assert cluster.get_job(namespace, job.name)["spec"]["runPolicy"]["suspend"] is True


def test_the_clean_run_a_resume_with_no_other_holder_lifts_the_stop(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    """The same staging as above without I2 (and with I2 released after review): the
    resume is taken, so the two tests above fail on the hold and nothing else."""
    job = make_job(cluster, namespace)
    suspended_with_checkpoint(cluster, job, 5)
    target = f"PyTorchJob {namespace}/{job.name}"
    stage(
        cluster,
        job,
        step=25,
        actions=[entry("suspend-job", target, "Succeeded", "set runPolicy.suspend=true", ago(60))],
        phase="Released",
        contained="JobStoppedNotLocalized",
    )
    first = stage(
        cluster,
        job,
        step=15,
        actions=[entry("suspend-job", target, "Succeeded", "set runPolicy.suspend=true", ago(90))],
        phase="Detected",
    )
    start_operator()
    resume = decided(cluster, namespace, first)
    assert resume["result"] == "Succeeded", resume
    assert not cluster.get_job(namespace, job.name)["spec"]["runPolicy"].get("suspend")


def test_a_resume_starts_before_every_open_window_of_the_job(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    """The job was caught twice before it stopped: I1 (window from step 20) and I2
    (window from step 10) both quarantined their node. Whichever resumes the job sets
    ``HYPERPOD_SDC_RESUME_MAX_STEP=10``: a resume from step 20 would take a checkpoint
    inside I2's window. I1's own message says 10 (without the rule it says 20)."""
    job = make_job(cluster, namespace)
    suspended_with_checkpoint(cluster, job, 5)
    target = f"PyTorchJob {namespace}/{job.name}"

    def quarantined(step: int, at: float) -> str:
        return stage(
            cluster,
            job,
            step=step,
            actions=[
                entry("suspend-job", target, "Succeeded", "set runPolicy.suspend=true", ago(at)),
                entry("quarantine-node", job.node_name(1), "Succeeded", "cordoned", ago(at - 5)),
            ],
            phase="Contained",
            contained="NodeQuarantined",
        )

    second = quarantined(15, 80)
    first = quarantined(25, 90)
    quarantine(cluster, job, first)
    start_operator()
    for name in (first, second):
        resume = decided(cluster, namespace, name)
        assert resume["result"] == "Succeeded", resume
        assert "HYPERPOD_SDC_RESUME_MAX_STEP=10" in resume["message"], resume
    found = cluster.get_job(namespace, job.name)
    for replica in found["spec"]["pytorchReplicaSpecs"].values():
        for container in replica["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env") or []}
            assert env["HYPERPOD_SDC_RESUME_MAX_STEP"] == "10", container
    assert not found["spec"]["runPolicy"].get("suspend")


# -- the request ledger ------------------------------------------------------------------------


def auto_replace(cluster: Cluster, namespace: str, sagemaker: FakeSageMaker) -> dict[str, Any]:
    cluster.admit(namespace, remediationPolicy="auto-replace")
    return {
        "extra_env": sagemaker.env(),
        "remediation_policy": "auto-replace",
        # A request with no answer is verified for a minute before it is made again.
        "remediation_verify_seconds": "60",
    }


def replaces(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    return [
        a
        for i in cluster.incidents(namespace)
        for a in i["status"].get("actions") or []
        if a["action"] == "replace-node"
    ]


def remediated_both(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    def both() -> list[dict[str, Any]] | None:
        found = [
            i for i in cluster.incidents(namespace) if i["status"].get("phase") == "Remediated"
        ]
        return found if len(found) == 2 else None

    return wait_for("both incidents remediated", both, timeout=30)


def test_an_unanswered_replace_counts_as_made_for_the_nodes_second_incident(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    """A's BatchReplaceClusterNodes gets no answer (Unknown) and SageMaker does not show it
    yet; B, for the same node, must wait for A's request, not call again. Once
    DescribeClusterNode shows the replacement, both are done: one call in all."""
    job = make_job(cluster, namespace, labels=CLUSTER_LABEL)
    instance = job.instance(1)

    def not_shown_yet(operation: str, params: dict[str, Any]) -> None:
        fake.status[instance] = "Running"

    fake = FakeSageMaker(lose_answers={REPLACE: 1}, on_call=not_shown_yet)
    try:
        op = start_operator(**auto_replace(cluster, namespace, fake))
        for step in (15, 25):
            for reporter in (0, 2):
                report = verdict(job, reporter, step=step, last_clean=10)
                assert send(cluster, op, job, reporter, report)[0] == 202
        wait_for(
            "both incidents at their replace",
            lambda: len(replaces(cluster, namespace)) == 2 or None,
            timeout=30,
        )
        op.resynced(3)  # three whole resyncs, each verifying
        assert fake.count(REPLACE) == 1, fake.calls
        assert [a["result"] for a in replaces(cluster, namespace)] == ["Pending", "Pending"]
        fake.on_call = None
        fake.status[instance] = "ShuttingDown"  # SageMaker shows the replacement now
        remediated_both(cluster, namespace)
        op.resynced(2)
    finally:
        fake.stop()
    assert fake.invalid == []
    assert fake.count(REPLACE) == 1, fake.calls
    assert [a["result"] for a in replaces(cluster, namespace)] == ["Succeeded", "Succeeded"]


def test_an_unanswered_replace_counts_as_made_after_a_restart(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    sagemaker: FakeSageMaker,
) -> None:
    """As above, with the operator restarted in between (memory empty): A's ``Pending``
    replace is in its status, and B, contained and asking to replace the same node,
    reads it there."""
    job = make_job(cluster, namespace, labels=CLUSTER_LABEL)
    target = f"PyTorchJob {namespace}/{job.name}"
    node = job.node_name(1)
    contained = [
        entry("suspend-job", target, "Succeeded", "set runPolicy.suspend=true", ago(100)),
        entry("quarantine-node", node, "Succeeded", "cordoned", ago(95)),
        entry("resume-job", target, "Skipped", "no clean checkpoint", ago(94)),
    ]
    pending = entry(
        "replace-node",
        node,
        "Pending",
        "taking it",
        ago(10),
        intent={"node": node, "bootID": "", "method": "api", "instanceId": job.instance(1)},
    )
    first = stage(
        cluster,
        job,
        step=15,
        actions=[*contained, pending],
        phase="Contained",
        contained="NodeQuarantined",
    )
    stage(cluster, job, step=25, actions=contained, phase="Contained", contained="NodeQuarantined")
    quarantine(cluster, job, first)
    cluster.custom.patch_namespaced_custom_object(
        "kubeflow.org", "v1", namespace, "pytorchjobs", job.name,
        {"spec": {"runPolicy": {"suspend": True}}},
    )  # fmt: skip
    op = start_operator(**auto_replace(cluster, namespace, sagemaker))
    wait_for(
        "the second incident at its replace",
        lambda: len(replaces(cluster, namespace)) == 2 or None,
        timeout=30,
    )
    op.resynced(3)
    assert sagemaker.count(REPLACE) == 0, sagemaker.calls
    sagemaker.status[job.instance(1)] = "ShuttingDown"  # A's call had reached SageMaker
    remediated_both(cluster, namespace)
    op.resynced(2)
    assert sagemaker.count(REPLACE) == 0, sagemaker.calls
    assert [a["result"] for a in replaces(cluster, namespace)] == ["Succeeded", "Succeeded"]
