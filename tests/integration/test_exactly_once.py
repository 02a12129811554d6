"""Every external action happens once, whatever happens around it: conflicting writes,
a crash at any step, many incidents at once. AWS calls go to the loopback SageMaker
endpoint, which counts them and validates them against botocore's model."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from sdc_agent.protocol import encode_report
from sdc_harness.cluster import Cluster, OperatorProcess, post, wait_for
from sdc_harness.fake_sagemaker import FakeSageMaker
from sdc_operator import incidents, nodes
from sdc_operator.incidents import Action, JobRef, ResolvedSuspect
from sdc_operator.names import SUSPECT_KEY
from sdc_operator.times import now_iso

from .test_containment import Job, make_job, send, verdict

CLUSTER_LABEL = {"sagemaker.amazonaws.com/cluster-name": "ml-cluster"}
REPLACE = "BatchReplaceClusterNodes"


def phase(cluster: Cluster, namespace: str, want: str, timeout: float = 30) -> dict[str, Any]:
    return wait_for(
        f"phase {want}",
        lambda: next(
            (i for i in cluster.incidents(namespace) if i.get("status", {}).get("phase") == want),
            None,
        ),
        timeout=timeout,
    )


def poke(cluster: Cluster, incident: dict[str, Any], value: str) -> None:
    """Another writer (a person, a tool) changes the incident: our next write conflicts."""
    cluster.custom.patch_namespaced_custom_object(
        "hyperpod-sdc.dev",
        "v1alpha1",
        incident["metadata"]["namespace"],
        "sdcincidents",
        incident["metadata"]["name"],
        {"metadata": {"annotations": {"example.com/poke": value}}},
    )


def contain(cluster: Cluster, op: OperatorProcess, job: Job) -> None:
    for reporter in (0, 2):
        assert send(cluster, op, job, reporter, verdict(job, reporter))[0] == 202


def auto_replace(cluster: Cluster, namespace: str, sagemaker: FakeSageMaker) -> dict[str, Any]:
    cluster.admit(namespace, remediationPolicy="auto-replace")
    return {
        "extra_env": sagemaker.env(),
        "remediation_policy": "auto-replace",
        "lease_seconds": "2",
    }


def test_replace_once_while_the_incident_is_annotated_every_20_ms(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    sagemaker: FakeSageMaker,
) -> None:
    job = make_job(cluster, namespace, labels=CLUSTER_LABEL)
    op = start_operator(**auto_replace(cluster, namespace, sagemaker))
    done = threading.Event()
    pokes = [0]

    def annotate() -> None:
        incident = wait_for("the incident", lambda: next(iter(cluster.incidents(namespace)), None))
        until = time.monotonic() + 3
        while time.monotonic() < until and not done.is_set():
            poke(cluster, incident, str(pokes[0]))
            pokes[0] += 1
            time.sleep(0.02)

    thread = threading.Thread(target=annotate)
    thread.start()
    contain(cluster, op, job)
    incident = phase(cluster, namespace, "Remediated")
    thread.join()
    op.resynced(2)  # two whole resyncs: nothing is called again
    assert pokes[0] > 20
    assert sagemaker.count(REPLACE) == 1, sagemaker.calls
    replaced = [a for a in incident["status"]["actions"] if a["action"] == "replace-node"]
    assert [a["result"] for a in replaced] == ["Succeeded"]


def test_a_conflict_right_after_the_call_does_not_repeat_it(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace, labels=CLUSTER_LABEL)

    def conflict(operation: str, params: dict[str, Any]) -> None:
        if operation == REPLACE:  # before the answer: the result's write is sure to conflict
            poke(cluster, cluster.incidents(namespace)[0], "after-the-call")

    fake = FakeSageMaker(on_call=conflict)
    try:
        op = start_operator(**auto_replace(cluster, namespace, fake))
        contain(cluster, op, job)
        incident = phase(cluster, namespace, "Remediated")
        op.resynced(2)
    finally:
        fake.stop()
    assert fake.invalid == []
    assert fake.count(REPLACE) == 1
    assert incident["metadata"]["annotations"]["example.com/poke"] == "after-the-call"


def test_a_call_whose_answer_is_lost_is_verified_not_repeated(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    """SageMaker replaces the node but its answer never arrives (a 500 here; a read
    timeout or a reset alike). botocore would resend the call, and a failure recorded as
    such would be retried: the operator asks DescribeClusterNode instead, and calls once."""
    job = make_job(cluster, namespace, labels=CLUSTER_LABEL)
    fake = FakeSageMaker(lose_answers={REPLACE: 1})
    try:
        op = start_operator(**auto_replace(cluster, namespace, fake))
        contain(cluster, op, job)
        incident = phase(cluster, namespace, "Remediated")
        op.resynced(2)  # two whole resyncs: nothing is called again
    finally:
        fake.stop()
    assert fake.invalid == []
    assert fake.count(REPLACE) == 1, fake.calls
    replaced = [a for a in incident["status"]["actions"] if a["action"] == "replace-node"]
    assert [a["result"] for a in replaced] == ["Succeeded"]
    assert "not calling again" in replaced[0]["message"]


def test_killed_while_the_call_is_in_flight(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace, labels=CLUSTER_LABEL)
    called, answer = threading.Event(), threading.Event()

    def hold(operation: str, params: dict[str, Any]) -> None:
        if operation == REPLACE:
            called.set()
            answer.wait(30)

    fake = FakeSageMaker(on_call=hold)
    try:
        settings = auto_replace(cluster, namespace, fake)
        op = start_operator(**settings)
        contain(cluster, op, job)
        assert called.wait(20), "BatchReplaceClusterNodes was never called"
        op.kill()  # SIGKILL while the call is in flight: its answer is never read
        answer.set()
        restarted = start_operator(**settings, remediation_verify_seconds="30")
        incident = phase(cluster, namespace, "Remediated")
        restarted.resynced(2)
    finally:
        answer.set()
        fake.stop()
    assert fake.invalid == []
    assert fake.count(REPLACE) == 1
    (replaced,) = [a for a in incident["status"]["actions"] if a["action"] == "replace-node"]
    assert replaced["result"] == "Succeeded"
    assert "already requested" in replaced["message"] and "ShuttingDown" in replaced["message"]


def stage_replace(cluster: Cluster, job: Job, replace: dict[str, Any] | None) -> dict[str, Any]:
    """An incident as an operator leaves it when it dies during a replace: contained, the
    suspect node quarantined, not resumed, and ``replace`` (a ``replace-node`` record) last."""
    meta = job.body["metadata"]
    ref = JobRef("kubeflow.org/v1", "PyTorchJob", job.namespace, job.name, meta["uid"])
    suspect = ResolvedSuspect(3, 1, job.pods[1], job.node_name(1), job.instance(1))
    status: dict[str, Any] = {}
    at = now_iso()
    for reporter in (0, 2):
        status, _ = incidents.fold_report(
            status,
            verdict(job, reporter),
            reporter_pod=job.pods[reporter],
            reporter_node=job.node_name(reporter),
            suspects=[suspect],
            needed=2,
            received_at=at,
        )
    target = f"PyTorchJob {job.namespace}/{job.name}"
    status = incidents.record_action(status, Action("suspend-job", target), "Succeeded", "done", at)
    status = incidents.record_action(
        status, Action("quarantine-node", job.node_name(1)), "Succeeded", "done", at
    )
    status["phase"] = "Contained"
    incidents.set_condition(status, "Contained", "True", "NodeQuarantined", "staged", at)
    status = incidents.record_action(status, Action("resume-job", target), "Skipped", "no", at)
    if replace is not None:
        status.setdefault("actions", []).append(
            {"action": "replace-node", "target": job.node_name(1), "at": at, **replace}
        )
    name = incidents.incident_name(ref, verdict(job, 0))
    created = cluster.custom.create_namespaced_custom_object(
        "hyperpod-sdc.dev",
        "v1alpha1",
        job.namespace,
        "sdcincidents",
        incidents.new_incident(ref, name, verdict(job, 0)),
    )
    created["status"] = status
    cluster.custom.replace_namespaced_custom_object_status(
        "hyperpod-sdc.dev", "v1alpha1", job.namespace, "sdcincidents", name, created
    )
    patch = nodes.quarantine_patch(cluster.get_node(job.node_name(1)), f"{job.namespace}/{name}")
    cluster.core.patch_node(job.node_name(1), patch, _content_type="application/merge-patch+json")
    cluster.custom.patch_namespaced_custom_object(
        "kubeflow.org", "v1", job.namespace, "pytorchjobs", job.name,
        {"spec": {"runPolicy": {"suspend": True}}},
    )  # fmt: skip
    return created


PENDING = {"result": "Pending", "message": "taking it", "intent": {"method": "api"}}


@pytest.mark.parametrize(
    ("step", "record", "shutting_down", "calls"),
    [
        # died after recording the intent, before calling: called once, after verifying
        ("intent recorded", PENDING, False, 1),
        # died after the call reached SageMaker, before recording its result: not again
        ("call made", PENDING, True, 0),
        # died after recording the result: nothing left to do
        ("result recorded", {"result": "Succeeded", "message": "accepted"}, True, 0),
    ],
)
def test_restarted_at_each_step_of_a_replace_calls_once(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    sagemaker: FakeSageMaker,
    step: str,
    record: dict[str, Any],
    shutting_down: bool,
    calls: int,
) -> None:
    job = make_job(cluster, namespace, labels=CLUSTER_LABEL)
    if shutting_down:
        sagemaker.status[job.instance(1)] = "ShuttingDown"
    stage_replace(cluster, job, record)
    op = start_operator(
        **auto_replace(cluster, namespace, sagemaker), remediation_verify_seconds="1"
    )
    incident = phase(cluster, namespace, "Remediated") if record["result"] == "Pending" else None
    op.resynced(2)  # two whole resyncs (and past the 1 s verify period)
    assert sagemaker.count(REPLACE) == calls, f"{step}: {sagemaker.calls}"
    current = cluster.incidents(namespace)[0]
    replaced = [a for a in current["status"]["actions"] if a["action"] == "replace-node"]
    assert [a["result"] for a in replaced] == ["Succeeded"], step
    if incident is not None and calls == 0:
        assert "already requested" in replaced[0]["message"]


def test_twenty_incidents_at_once_under_a_cap_of_five(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    """Twenty jobs' verdicts arrive at once: exactly five nodes are quarantined."""
    jobs = [make_job(cluster, namespace, f"job{i}") for i in range(20)]
    already = len(cluster.core.list_node(label_selector=f"{SUSPECT_KEY}=true").items)
    op = start_operator(max_quarantined_nodes=str(already + 5), rate_per_source="100000")
    posts = [
        (encode_report(verdict(job, reporter)), cluster.token(namespace, job.pods[reporter]))
        for job in jobs
        for reporter in (0, 2)
    ]
    barrier = threading.Barrier(len(posts))
    answers: list[int] = []

    def send_one(body: bytes, token: str) -> None:
        barrier.wait()
        answers.append(post(op.url, body, token)[0])

    threads = [threading.Thread(target=send_one, args=p) for p in posts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [202] * len(posts)

    def settled() -> list[dict[str, Any]] | None:
        found = cluster.incidents(namespace)
        done = [i for i in found if (i.get("status") or {}).get("phase") == "Contained"]
        return found if len(found) == 20 and len(done) == 20 else None

    found = wait_for("20 contained incidents", settled, timeout=60)
    reasons = Counter(
        next(c["reason"] for c in i["status"]["conditions"] if c["type"] == "Contained")
        for i in found
    )
    assert reasons == {"NodeQuarantined": 5, "QuarantineCapReached": 15}
    quarantined = [
        job.node_name(1)
        for job in jobs
        if SUSPECT_KEY in (cluster.get_node(job.node_name(1))["metadata"].get("labels") or {})
    ]
    assert len(quarantined) == 5
