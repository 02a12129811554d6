"""Node remediation after review, and the guard rails, against the real API server; AWS
calls go to a loopback SageMaker endpoint that checks them against botocore's model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from sdc_agent.protocol import ReporterIdentity, Suspect, VerdictReport
from sdc_harness.cluster import Cluster, OperatorProcess, wait_for
from sdc_harness.fake_sagemaker import FakeSageMaker
from sdc_operator.names import INCIDENT_ANNOTATION, SUSPECT_KEY

from .test_containment import Job, incident_in, make_job, send, verdict

CLUSTER_LABEL = {"sagemaker.amazonaws.com/cluster-name": "ml-cluster"}


def annotate(cluster: Cluster, incident: dict[str, Any], action: str) -> None:
    cluster.custom.patch_namespaced_custom_object(
        "hyperpod-sdc.dev",
        "v1alpha1",
        incident["metadata"]["namespace"],
        "sdcincidents",
        incident["metadata"]["name"],
        {"metadata": {"annotations": {"hyperpod-sdc.dev/action": action}}},
    )


def phase(cluster: Cluster, namespace: str, want: str) -> dict[str, Any]:
    return wait_for(
        f"phase {want}",
        lambda: next(
            (i for i in cluster.incidents(namespace) if i["status"].get("phase") == want), None
        ),
    )


def contain(
    cluster: Cluster,
    op: OperatorProcess,
    job: Job,
    report: Callable[[int], VerdictReport] | None = None,
) -> None:
    for reporter in (0, 2):
        assert (
            send(cluster, op, job, reporter, (report or (lambda r: verdict(job, r)))(reporter))[0]
            == 202
        )


@pytest.mark.fast
def test_manual_approval_then_replace_calls_the_api_once(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    sagemaker: FakeSageMaker,
) -> None:
    job = make_job(cluster, namespace, labels=CLUSTER_LABEL)
    op = start_operator(extra_env=sagemaker.env())
    contain(cluster, op, job)
    incident = incident_in(cluster, namespace, "Contained")
    op.resynced(2)  # two whole resyncs: the manual policy waits for a person
    assert sagemaker.calls == []
    annotate(cluster, incident, "replace")
    incident = phase(cluster, namespace, "Remediated")
    remediated = next(c for c in incident["status"]["conditions"] if c["type"] == "Remediated")
    assert (remediated["status"], remediated["reason"]) == ("True", "ReplaceRequested")
    op.resynced()  # nothing is called again
    assert sagemaker.calls == [
        ("BatchReplaceClusterNodes", {"ClusterName": "ml-cluster", "NodeIds": [job.instance(1)]})
    ]
    assert incident["status"]["actions"][-1]["action"] == "replace-node"


def test_under_cluster_approvals_only_the_admins_decision_on_the_policy_counts(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    sagemaker: FakeSageMaker,
) -> None:
    cluster.admit(namespace, approvals="cluster")
    job = make_job(cluster, namespace, labels=CLUSTER_LABEL)
    op = start_operator(extra_env=sagemaker.env())
    contain(cluster, op, job)
    incident = incident_in(cluster, namespace, "Contained")
    annotate(cluster, incident, "replace")  # anyone with patch on sdcincidents: the tenant
    ignored = wait_for(
        "the tenant's decision said to be ignored",
        lambda: next(
            (e for e in cluster.events(namespace) if e["reason"] == "SDCDecisionIgnored"), None
        ),
    )
    uid = incident["metadata"]["uid"]
    assert f"approve.hyperpod-sdc.dev/{uid}=replace" in ignored["message"]
    op.resynced(2)
    assert sagemaker.calls == []
    assert [i["status"]["phase"] for i in cluster.incidents(namespace)] == ["Contained"]
    # The cluster admin's decision, on the policy that admits the namespace.
    cluster.custom.patch_cluster_custom_object(
        "hyperpod-sdc.dev",
        "v1alpha1",
        "sdcpolicies",
        f"admit-{namespace}",
        {"metadata": {"annotations": {f"approve.hyperpod-sdc.dev/{uid}": "replace"}}},
    )
    phase(cluster, namespace, "Remediated")
    assert sagemaker.calls == [
        ("BatchReplaceClusterNodes", {"ClusterName": "ml-cluster", "NodeIds": [job.instance(1)]})
    ]


def test_per_node_failure_is_retried_with_back_off(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace, labels=CLUSTER_LABEL)
    failed = {
        "Failed": [
            {
                "NodeId": job.instance(1),
                "ErrorCode": "InternalServerError",
                "Message": "try again later",
            }
        ],
    }
    sagemaker = FakeSageMaker({"BatchRebootClusterNodes": [failed]})
    cluster.admit(namespace, remediationPolicy="auto-reboot")
    try:
        op = start_operator(
            extra_env=sagemaker.env(),
            remediation_policy="auto-reboot",
            remediation_backoff_seconds="1",
        )
        contain(cluster, op, job)
        incident = phase(cluster, namespace, "Remediated")
    finally:
        sagemaker.stop()
    assert sagemaker.invalid == []
    reboots = [
        (a["result"], a["message"])
        for a in incident["status"]["actions"]
        if a["action"] == "reboot-node"
    ]
    assert [r for r, _ in reboots] == ["Failed", "Succeeded"]
    assert "InternalServerError: try again later" in reboots[0][1]
    assert [c[0] for c in sagemaker.calls] == ["BatchRebootClusterNodes"] * 2


def test_release_restores_the_node_exactly(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    suspect = job.node_name(1)
    cluster.core.patch_node(
        suspect,
        {
            "metadata": {"labels": {"team": "ml"}, "annotations": {"owner": "infra"}},
            "spec": {
                "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
            },
        },
        _content_type="application/merge-patch+json",
    )

    def shape(node: dict[str, Any]) -> tuple[Any, ...]:
        meta = node["metadata"]
        return (
            meta.get("labels"),
            meta.get("annotations"),
            node["spec"].get("taints"),
            node["spec"].get("unschedulable"),
        )

    before = shape(cluster.get_node(suspect))
    op = start_operator()
    # The job caught twice before its suspension lands (step 15, then 25): two incidents
    # quarantine one node; the node's annotation names the later one.
    for step in (15, 25):

        def report(reporter: int, step: int = step) -> VerdictReport:
            return verdict(job, reporter, step=step)

        contain(cluster, op, job, report)

    def both_contained() -> list[dict[str, Any]] | None:
        found = [
            i
            for i in cluster.incidents(namespace)
            if i["status"].get("phase") == "Contained"
            and any(c["type"] == "Resumed" for c in i["status"].get("conditions") or [])
        ]
        return found if len(found) == 2 else None

    first, second = wait_for("both incidents contained", both_contained)
    annotation = cluster.get_node(suspect)["metadata"]["annotations"][INCIDENT_ANNOTATION]
    holder, other = (
        (first, second) if annotation.endswith("/" + first["metadata"]["name"]) else (second, first)
    )
    # A person releases the incident the node names first; the other still holds it: the
    # node stays quarantined, and is named for the other now (the release used to undo the
    # other incident's quarantine: the node came back to the scheduler).
    annotate(cluster, holder, "release")
    released = wait_for(
        "the first release",
        lambda: next(
            (
                i
                for i in cluster.incidents(namespace)
                if i["metadata"]["name"] == holder["metadata"]["name"]
                and i["status"].get("phase") == "Released"
            ),
            None,
        ),
    )
    entry = next(a for a in released["status"]["actions"] if a["action"] == "release-node")
    assert entry["result"] == "Skipped" and "stays quarantined" in entry["message"], entry
    node = cluster.get_node(suspect)
    assert node["spec"].get("unschedulable") is True
    assert node["metadata"]["labels"][SUSPECT_KEY] == "true"
    other_ref = f"{namespace}/{other['metadata']['name']}"
    assert node["metadata"]["annotations"][INCIDENT_ANNOTATION] == other_ref
    # Released last, the node is given back exactly as it was.
    annotate(cluster, other, "release")
    wait_for(
        "both released",
        lambda: all(i["status"].get("phase") == "Released" for i in cluster.incidents(namespace)),
    )
    assert shape(cluster.get_node(suspect)) == before


def multi(job: Job, reporter: int, suspect_nodes: list[int]) -> VerdictReport:
    base = verdict(job, reporter)
    suspects = tuple(Suspect(n * 2 + 1, job.node_name(n), 1, job.pods[n]) for n in suspect_nodes)
    return VerdictReport(
        reporter=ReporterIdentity(reporter * 2, job.node_name(reporter), job.pods[reporter]),
        sent_at=base.sent_at,
        check="nonfinite",
        classification="rank",
        step=base.step,
        last_clean_step=base.last_clean_step,
        localized=True,
        transient=None,
        suspects=suspects,
        message=f"non-finite local gradients on {len(suspects)} ranks",
        corroborated=True,  # the suspects' micro-batches replayed finite on other nodes
    )


def untouched(cluster: Cluster, job: Job, nodes: list[int]) -> bool:
    return all(
        SUSPECT_KEY not in (cluster.get_node(job.node_name(n))["metadata"].get("labels") or {})
        for n in nodes
    )


def contained_reason(incident: dict[str, Any]) -> tuple[str, str]:
    c = next(c for c in incident["status"]["conditions"] if c["type"] == "Contained")
    return c["reason"], c["message"]


def test_cluster_wide_cap_quarantines_nothing_and_says_so(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    other = cluster.node()
    cluster.core.patch_node(
        other["metadata"]["name"],
        {"metadata": {"labels": {SUSPECT_KEY: "true"}}},
        _content_type="application/merge-patch+json",
    )
    try:
        op = start_operator(max_quarantined_nodes="1")
        contain(cluster, op, job)
        incident = incident_in(cluster, namespace, "Contained")
    finally:
        cluster.core.patch_node(
            other["metadata"]["name"],
            {"metadata": {"labels": {SUSPECT_KEY: None}}},
            _content_type="application/merge-patch+json",
        )
    reason, message = contained_reason(incident)
    assert reason == "QuarantineCapReached" and "cluster-wide cap is 1" in message
    assert untouched(cluster, job, [0, 1, 2])
    assert cluster.get_job(namespace, job.name)["spec"]["runPolicy"]["suspend"] is True
    assert not any(a["action"] == "resume-job" for a in incident["status"]["actions"])
    wait_for(
        "the cap event",
        lambda: any(e["reason"] == "SDCQuarantineCapReached" for e in cluster.events(namespace)),
    )


def test_per_job_cap(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator(max_quarantined_per_job="1", max_quarantined_nodes="100%")
    contain(cluster, op, job, lambda r: multi(job, r, [0, 1]))
    incident = incident_in(cluster, namespace, "Contained")
    assert contained_reason(incident)[0] == "QuarantineCapReached"
    results = [(a["action"], a["target"], a["result"]) for a in incident["status"]["actions"]]
    assert results == [  # all or nothing: two suspect nodes do not fit under a cap of one
        ("suspend-job", f"PyTorchJob {namespace}/train", "Succeeded"),
        ("quarantine-node", job.node_name(0), "Skipped"),
        ("quarantine-node", job.node_name(1), "Skipped"),
    ]
    assert untouched(cluster, job, [0, 1, 2])
    assert "cap per job is 1" in incident["status"]["actions"][1]["message"]


def test_storm_quarantines_nothing_and_says_so(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator()
    contain(cluster, op, job, lambda r: multi(job, r, [0, 1, 2]))
    incident = incident_in(cluster, namespace, "Contained")
    reason, message = contained_reason(incident)
    assert reason == "Storm" and "software non-determinism" in message
    assert untouched(cluster, job, [0, 1, 2])
    assert cluster.get_job(namespace, job.name)["spec"]["runPolicy"]["suspend"] is True
    wait_for(
        "the storm event",
        lambda: any(
            e["reason"] == "Contained" and "non-determinism" in e["message"]
            for e in cluster.events(namespace)
        ),
    )


def test_auto_replace_through_the_health_label(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    cluster.admit(namespace, remediationPolicy="auto-replace")
    op = start_operator(remediation_policy="auto-replace", remediation_method="label")
    contain(cluster, op, job)
    phase(cluster, namespace, "Remediated")
    labels = cluster.get_node(job.node_name(1))["metadata"]["labels"]
    assert labels["sagemaker.amazonaws.com/node-health-status"] == "UnschedulablePendingReplacement"
    assert labels[SUSPECT_KEY] == "true"  # still quarantined until HyperPod replaces it


def test_two_incidents_of_one_node_replace_it_once(
    cluster: Cluster,
    namespace: str,
    start_operator: Callable[..., OperatorProcess],
    sagemaker: FakeSageMaker,
) -> None:
    """A job caught twice before its suspension lands (the audit of step 15, then of step
    25, the same run): two incidents, one node, one BatchReplaceClusterNodes."""
    job = make_job(cluster, namespace, labels=CLUSTER_LABEL)
    cluster.admit(namespace, remediationPolicy="auto-replace")
    op = start_operator(extra_env=sagemaker.env(), remediation_policy="auto-replace")
    for step in (15, 25):

        def report(reporter: int, step: int = step) -> VerdictReport:
            return verdict(job, reporter, step=step, last_clean=10)

        contain(cluster, op, job, report)

    def remediated() -> list[dict[str, Any]] | None:
        found = [
            i for i in cluster.incidents(namespace) if i["status"].get("phase") == "Remediated"
        ]
        return found if len(found) == 2 else None

    both = wait_for("both incidents remediated", remediated)
    op.resynced(2)
    assert sagemaker.calls == [
        ("BatchReplaceClusterNodes", {"ClusterName": "ml-cluster", "NodeIds": [job.instance(1)]})
    ]
    messages = [
        a["message"] for i in both for a in i["status"]["actions"] if a["action"] == "replace-node"
    ]
    assert sum("requested already by incident" in m for m in messages) == 1, messages
