"""The operator's evidence rules (issue 13) and incident identity, against the real API
server: a transient or uncorroborated verdict stops nothing until the same node is caught
again; non-deterministic verdicts fold into one incident; a re-detection after a resume
is a new incident that stops the job again."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from sdc_harness.cluster import Cluster, OperatorProcess, server_time, wait_for
from sdc_operator.incidents import job_stopped_at
from sdc_operator.names import SUSPECT_KEY
from sdc_operator.times import parse_time

from .test_containment import Job, make_job, send, verdict
from .test_intake import snapshot
from .test_recovery import checkpoint


def incidents_by_phase(cluster: Cluster, namespace: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for incident in cluster.incidents(namespace):
        out.setdefault((incident.get("status") or {}).get("phase", ""), []).append(incident)
    return out


def quarantined(cluster: Cluster, node: str) -> bool:
    return SUSPECT_KEY in (cluster.get_node(node)["metadata"].get("labels") or {})


def report_twice(cluster: Cluster, op: OperatorProcess, job: Job, **changes: Any) -> list[str]:
    phases = []
    for reporter in (0, 2):
        report = dataclasses.replace(verdict(job, reporter), **changes)
        status, answer, _ = send(cluster, op, job, reporter, report)
        assert status == 202, answer
        phases.append(answer["phase"])
    return phases


def test_a_transient_fault_quarantines_nothing_until_the_node_is_caught_again(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator()
    before = snapshot(cluster, job)
    assert report_twice(cluster, op, job, transient=True) == ["WaitingForAgreement", "Transient"]
    op.resynced(2)  # two whole resyncs: still nothing done
    assert snapshot(cluster, job)[1:] == before[1:]
    (first,) = cluster.incidents(namespace)
    assert first["status"]["phase"] == "Transient" and not first["status"].get("actions")
    wait_for(
        "the Warning event",
        lambda: any(e["reason"] == "SDCTransientFault" for e in cluster.events(namespace)),
    )
    assert 'hyperpod_sdc_held_incidents_total{phase="Transient"} 1.0' in op.metrics()

    # the same node again, 25 steps later: contained as a persistent fault
    report_twice(cluster, op, job, transient=True, step=40, last_clean_step=35)
    second = wait_for(
        "the repeat contained",
        lambda: next(
            (i for i in cluster.incidents(namespace) if i["spec"]["detectionStep"] == 40
             and i["status"].get("phase") == "Contained"),
            None,
        ),
    )  # fmt: skip
    assert second["status"]["escalation"]["reason"] == "Repeated"
    assert second["status"]["relatedIncidents"] == [first["metadata"]["name"]]
    assert quarantined(cluster, job.node_name(1))
    assert cluster.get_job(namespace, job.name)["spec"]["runPolicy"]["suspend"] is True


def test_a_repeat_outside_the_window_is_still_transient(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator(repeat_window_steps="1000")
    report_twice(cluster, op, job, transient=True)
    report_twice(cluster, op, job, transient=True, step=1500, last_clean_step=1490)
    op.resynced(2)
    assert sorted(incidents_by_phase(cluster, namespace)) == ["Transient"]
    assert len(cluster.incidents(namespace)) == 2
    assert not quarantined(cluster, job.node_name(1))


def test_uncorroborated_verdicts_wait_for_evidence(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    """Non-finite verdicts from every node come from one all-reduce: one piece of evidence
    however many nodes send it. A replay verdict the agent says is uncorroborated waits too,
    and is contained when the same node is caught again within the window; a non-finite
    one is not (the same rank's NaN again may be the same bad record of its data)."""
    nonfinite, replay = make_job(cluster, namespace, "nf"), make_job(cluster, namespace, "rp")
    op = start_operator()
    before = [snapshot(cluster, j) for j in (nonfinite, replay)]
    assert report_twice(cluster, op, nonfinite, check="nonfinite")[1] == "AwaitingEvidence"
    status, answer, _ = send(
        cluster, op, nonfinite, 1, dataclasses.replace(verdict(nonfinite, 1), check="nonfinite")
    )
    assert (status, answer["phase"]) == (202, "AwaitingEvidence")  # a third node adds nothing
    assert report_twice(cluster, op, replay, corroborated=False)[1] == "AwaitingEvidence"
    op.resynced(2)
    assert [snapshot(cluster, j)[1:] for j in (nonfinite, replay)] == [b[1:] for b in before]
    assert sorted(incidents_by_phase(cluster, namespace)) == ["AwaitingEvidence"]
    report_twice(cluster, op, nonfinite, check="nonfinite", step=30, last_clean_step=20)
    report_twice(cluster, op, replay, corroborated=False, step=30, last_clean_step=20)
    wait_for("the replay repeat quarantined", lambda: quarantined(cluster, replay.node_name(1)))
    op.resynced(2)
    assert not quarantined(cluster, nonfinite.node_name(1))
    held = [
        i
        for i in cluster.incidents(namespace)
        if i["spec"]["check"] == "nonfinite" and i["status"]["phase"] == "AwaitingEvidence"
    ]
    assert len(held) == 2, [i["status"]["phase"] for i in cluster.incidents(namespace)]
    wait_for(
        "the Event saying why",
        lambda: any(
            e["reason"] == "SDCAwaitingEvidence" and "bad record of its data" in e["message"]
            for e in cluster.events(namespace)
        ),
    )


def test_non_deterministic_verdicts_fold_into_one_incident_with_guidance(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace)
    op = start_operator()
    before = snapshot(cluster, job)
    for step in (10, 20, 30, 40, 50):
        for reporter in (0, 1, 2):
            report = dataclasses.replace(
                verdict(job, reporter, step=step, last_clean=step - 10),
                classification="nondeterministic",
                localized=False,
                suspects=(),
                message="the replay differs by a few ulps on several ranks",
            )
            status, answer, _ = send(cluster, op, job, reporter, report)
            assert (status, answer["phase"]) == (202, "NotHardware"), answer
    (incident,) = cluster.incidents(namespace)
    status = incident["status"]
    assert status["occurrences"] == 5
    assert (status["firstStep"], status["lastStep"]) == (10, 50)
    assert "enable_determinism" in status["message"] and "calibrate" in status["message"]
    assert not status.get("actions")
    assert snapshot(cluster, job)[1:] == before[1:]


def test_a_second_detection_after_a_resume_is_a_new_incident_that_stops_the_job_again(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess]
) -> None:
    job = make_job(cluster, namespace, n=4)
    op = start_operator()
    checkpoint(cluster, op, job, 5)
    for reporter in (0, 2):
        assert send(cluster, op, job, reporter, verdict(job, reporter))[0] == 202
    first = wait_for(
        "the job resumed",
        lambda: next(
            (i for i in cluster.incidents(namespace)
             if any(a["action"] == "resume-job" and a["result"] == "Succeeded"
                    for a in i["status"].get("actions") or [])),
            None,
        ),
    )  # fmt: skip
    assert cluster.get_job(namespace, job.name)["spec"]["runPolicy"]["suspend"] is False
    # the training operator recreates the pods (new uids), off the quarantined node
    # creation times are in whole seconds, and a pod made in the second of the stop is the
    # stopped run's: the operator resumed once that second had passed (a training operator
    # makes the pods after the resume), so the new pods are visibly newer
    stopped = parse_time(str(job_stopped_at(first)))
    assert server_time(cluster) > stopped
    for pod in job.pods:
        cluster.core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)
    wait_for("the old pods gone", lambda: not cluster.core.list_namespaced_pod(namespace).items)
    placed = [job.nodes[0], job.nodes[3], job.nodes[2], job.nodes[3]]
    restarted = Job(namespace, job.name, job.body, placed[:3], job.pods[:3])
    for pod, node in zip(restarted.pods, restarted.nodes, strict=True):
        cluster.pod(namespace, pod, node["metadata"]["name"], job.body)
    # the fault comes back in the same window (the job resumed from step 5, before 10)
    for reporter in (0, 2):
        status, answer, _ = send(cluster, op, restarted, reporter, verdict(restarted, reporter))
        assert status == 202, answer
        assert answer["incident"] != f"{namespace}/{first['metadata']['name']}"
    second = wait_for(
        "the second incident contained",
        lambda: next(
            (i for i in cluster.incidents(namespace)
             if i["metadata"]["name"] != first["metadata"]["name"]
             and i["status"].get("phase") == "Contained"),
            None,
        ),
    )  # fmt: skip
    assert len(cluster.incidents(namespace)) == 2
    stopped = second["status"]["actions"][0]
    assert (stopped["action"], stopped["result"], stopped["message"]) == (
        "suspend-job",
        "Succeeded",
        "set runPolicy.suspend=true",
    )  # stopped again (and, with a clean checkpoint, resumed again after)
    assert second["status"]["node"] == restarted.node_name(1)
    assert quarantined(cluster, restarted.node_name(1))
