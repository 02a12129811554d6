"""The pure half of the evidence rules, incident identity and exactly-once records."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from typing import Any

import pytest

from sdc_operator import incidents, nodes, times
from sdc_operator.incidents import MAX_RECORDED_REPORTS, Action, Rules

from .test_incidents import AT, JOB, R, incident, report, suspects


def fold_all(status: dict[str, Any], *nodes_: str, **changes: Any) -> dict[str, Any]:
    for node in nodes_:
        status, _ = incidents.fold_report(
            status,
            dataclasses.replace(report(node), **changes),
            reporter_pod=f"pod-{node}",
            reporter_node=node,
            suspects=suspects(3),
            needed=2,
            received_at=AT,
            check=changes.get("check"),
        )
    return status


# -- identity ----------------------------------------------------------------------------------


def test_a_later_run_or_generation_is_a_new_incident_a_duplicate_is_not() -> None:
    first = incidents.incident_name(JOB, report("a"))
    assert incidents.incident_name(JOB, report("a"), 0) == first  # names before runs unchanged
    assert incidents.incident_name(JOB, report("a"), 1) != first
    with_run = dataclasses.replace(report("a"), run_id="run-2")
    assert incidents.incident_name(JOB, with_run) != first
    assert incidents.incident_name(JOB, with_run) == incidents.incident_name(
        JOB,
        dataclasses.replace(report("b"), run_id="run-2"),
        5,  # the run id wins
    )


def test_non_deterministic_verdicts_meet_at_one_name_whatever_the_step() -> None:
    def nondet(step: int, run: str | None = None) -> Any:
        return dataclasses.replace(
            report("a", step=step, last_clean=step - 1),
            classification="nondeterministic",
            run_id=run,
        )

    name = incidents.incident_name(JOB, nondet(10))
    assert name == incidents.incident_name(JOB, nondet(500))
    assert "nondeterministic" in name and len(name) <= 63
    assert incidents.incident_name(JOB, nondet(10, "r2")) != name


# -- evidence ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "phase"),
    [
        ({}, "Detected"),  # a replay verdict from an agent that does not say: taken at its word
        ({"corroborated": True}, "Detected"),
        ({"corroborated": False}, "AwaitingEvidence"),
        ({"transient": True}, "Transient"),
        ({"transient": True, "corroborated": True}, "Transient"),
        ({"check": "nonfinite"}, "AwaitingEvidence"),  # one all-reduce: one piece of evidence
        ({"check": "nonfinite", "corroborated": True}, "Detected"),
    ],
)
def test_what_an_agreed_verdict_may_do(changes: dict[str, Any], phase: str) -> None:
    status = fold_all({}, "a", "c", **changes)
    assert status["phase"] == phase
    view = {
        **incident(status),
        "spec": {"job": JOB.as_spec(), "check": changes.get("check", "replay")},
    }
    planned = incidents.planned_actions(view, R)
    assert bool(planned) == (phase == "Detected")


def test_a_held_incident_escalated_is_contained_and_says_why() -> None:
    status = fold_all({}, "a", "c", transient=True)
    assert incidents.planned_actions(incident(status), R) == []
    status = incidents.escalate(status, "Repeated", "caught twice", ["job-15-abc"], AT)
    assert status["phase"] == "Detected"
    assert status["relatedIncidents"] == ["job-15-abc"]
    assert [a.action for a in incidents.planned_actions(incident(status), R)] == [
        "suspend-job",
        "quarantine-node",
    ]
    assert next(c for c in status["conditions"] if c["type"] == "Detected")["reason"] == "Repeated"


def _other(
    name: str, step: int, node: str = "b", uid: str = "uid-1", cls: str = "rank"
) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {"job": {"uid": uid}, "detectionStep": step, "classification": cls},
        "status": {"suspects": [{"rank": 3, "node": node}]},
    }


def test_repeats_are_the_same_node_of_the_same_job_within_the_window() -> None:
    held = {
        "metadata": {"name": "me"},
        "spec": {"job": {"uid": "uid-1"}, "detectionStep": 1200},
        "status": {"suspects": [{"rank": 3, "node": "b"}]},
    }
    others = [
        _other("me", 1200),  # itself
        _other("near", 300),  # 900 steps before: a repeat
        _other("far", 100),  # 1100 steps: too long ago
        _other("other-node", 1190, node="x"),
        _other("other-job", 1190, uid="uid-2"),
        _other("software", 1195, cls="nondeterministic"),
    ]
    assert incidents.repeat_candidates(held, others, 1000) == ["near"]


def test_non_deterministic_occurrences_count_steps_not_reporters() -> None:
    status: dict[str, Any] = {}
    for step in (10, 10, 20, 30, 30):
        for node in "ab":
            status, _ = incidents.fold_report(
                status,
                dataclasses.replace(
                    report(node, step=step, last_clean=step - 1),
                    classification="nondeterministic",
                    suspects=(),
                ),
                reporter_pod=f"pod-{node}",
                reporter_node=node,
                suspects=[],
                needed=2,
                received_at=AT,
            )
    assert (status["occurrences"], status["firstStep"], status["lastStep"]) == (3, 10, 30)
    assert status["phase"] == "NotHardware"
    assert "enable_determinism" in status["message"] and "calibrate" in status["message"]
    assert incidents.planned_actions(incident(status), R) == []


def test_reports_past_the_first_32_nodes_are_counted_not_recorded() -> None:
    status = fold_all({}, *[f"n{i}" for i in range(40)])
    assert len(status["reports"]) == MAX_RECORDED_REPORTS
    assert status["reportingNodes"] == 40


# -- exactly once ------------------------------------------------------------------------------


def test_an_intent_is_pending_until_its_result_completes_it() -> None:
    status = fold_all({}, "a", "c")
    suspend = Action("suspend-job", "PyTorchJob ml/llama-pretrain")
    status = incidents.record_intent(status, suspend, {"job": "uid-1"}, AT)
    entry = incidents.pending_entry(status, suspend)
    assert (
        entry is not None and entry["result"] == "Pending" and entry["intent"] == {"job": "uid-1"}
    )
    assert incidents.next_action(incident(status), R) == suspend  # to be verified, not skipped
    assert incidents.pending_actions(incident(status), R)
    status = incidents.record_action(status, suspend, "Succeeded", "done", AT)
    assert [a["result"] for a in status["actions"]] == ["Succeeded"]  # completed, not appended
    assert status["actions"][0]["intent"] == {"job": "uid-1"}
    assert incidents.pending_entry(status, suspend) is None
    assert incidents.next_action(incident(status), R) == Action("quarantine-node", "b")


def test_a_pending_remediation_is_verified_even_during_its_back_off() -> None:
    status = fold_all({}, "a", "c")
    replace = Action("replace-node", "b")
    for action in incidents.planned_actions(incident(status), R):
        status = incidents.record_action(status, action, "Succeeded", "ok", AT)
    status["phase"] = "Contained"
    incidents.set_condition(status, "Contained", "True", "NodeQuarantined", "m", AT)
    rules = Rules(remediation_policy="auto-replace", backoff_seconds=3600)
    status = incidents.record_action(
        status, Action("resume-job", "PyTorchJob ml/llama-pretrain"), "Skipped", "no", AT
    )
    status = incidents.record_action(status, replace, "Failed", "boom", AT)
    soon = datetime(2026, 11, 29, 0, 1, tzinfo=timezone.utc)
    assert incidents.next_action(incident(status), rules, soon) is None  # backing off
    status = incidents.record_intent(status, replace, {"instanceId": "i-1"}, AT)
    assert incidents.next_action(incident(status), rules, soon) == replace


def test_closed_and_last_activity() -> None:
    status = fold_all({}, "a", "c", classification="training")
    assert incidents.is_closed(incident(status), R)
    assert incidents.last_activity(incident(status)) == datetime(2026, 11, 29, tzinfo=timezone.utc)
    detected = fold_all({}, "a", "c")
    assert not incidents.is_closed(incident(detected), R)


# -- node writes -------------------------------------------------------------------------------


NODE: dict[str, Any] = {
    "metadata": {"name": "n", "resourceVersion": "41", "labels": {}, "annotations": {}},
    "spec": {"taints": [{"key": "other", "effect": "NoSchedule"}]},
}


def test_node_patches_carry_the_version_they_were_computed_from() -> None:
    patch = nodes.quarantine_patch(NODE, "ml/x")
    assert patch is not None and patch["metadata"]["resourceVersion"] == "41"
    assert patch["spec"]["taints"][0] == {"key": "other", "effect": "NoSchedule"}
    quarantined = {
        "metadata": {
            "name": "n",
            "resourceVersion": "42",
            "labels": {"hyperpod-sdc.dev/suspect": "true"},
            "annotations": {"hyperpod-sdc.dev/incident": "ml/x"},
        },
        "spec": {"unschedulable": True, "taints": [*NODE["spec"]["taints"], nodes.SUSPECT_TAINT]},
    }
    release = nodes.release_patch(quarantined)
    assert release is not None and release["metadata"]["resourceVersion"] == "42"
    assert release["spec"] == {
        "taints": [{"key": "other", "effect": "NoSchedule"}],
        "unschedulable": None,
    }


def test_release_keeps_a_cordon_someone_else_set_last() -> None:
    node: dict[str, Any] = {
        "metadata": {
            "name": "n",
            "labels": {"hyperpod-sdc.dev/suspect": "true"},
            "annotations": {"hyperpod-sdc.dev/incident": "ml/x"},
            "managedFields": [
                {"manager": "hyperpod-sdc", "fieldsV1": {"f:spec": {"f:taints": {}}}},
                {"manager": "kubectl-cordon", "fieldsV1": {"f:spec": {"f:unschedulable": {}}}},
            ],
        },
        "spec": {"unschedulable": True, "taints": [nodes.SUSPECT_TAINT]},
    }
    assert nodes.cordoned_by_others(node)
    patch = nodes.release_patch(node)
    assert patch is not None and "unschedulable" not in patch["spec"]
    node["metadata"]["managedFields"][1]["manager"] = "hyperpod-sdc"
    patch = nodes.release_patch(node)
    assert patch is not None and patch["spec"]["unschedulable"] is None
    uncordoned = {**node, "spec": {"taints": [nodes.SUSPECT_TAINT]}}
    patch = nodes.release_patch(uncordoned)
    assert patch is not None and "unschedulable" not in patch["spec"]  # never re-cordon


def test_a_pod_made_in_the_second_of_the_stop_is_the_stopped_runs_and_the_resume_waits_it_out() -> (
    None
):
    """Creation times and the stop's time are in whole seconds. A verdict from a pod of the
    stopped run made in the second of the stop (a fault caught within a second of the
    pods' start, as in the integration tests) opened a second incident, which would stop
    the job again; the next run's pods are told apart because the resume waits for that
    second to pass."""
    import asyncio
    import time

    from sdc_operator.actions import _past_the_second_of
    from sdc_operator.engine import IncidentEngine
    from sdc_operator.metrics import Metrics
    from sdc_operator.settings import OperatorSettings

    from .test_resync import Caches

    verdict = report("a")
    stopped = {
        "metadata": {"name": incidents.incident_name(JOB, verdict, 0)},
        "status": {
            "actions": [
                {"action": "suspend-job", "result": "Succeeded", "at": "2026-12-06T09:09:54Z"}
            ]
        },
    }
    caches: Any = Caches()
    caches.incidents.items = [stopped]
    nothing: Any = None
    engine = IncidentEngine(
        OperatorSettings(), Metrics(), caches, records=nothing, containment=nothing
    )
    assert engine.generation(JOB, verdict, "2026-12-06T09:09:53Z") == 0
    assert engine.generation(JOB, verdict, "2026-12-06T09:09:54Z") == 0  # was 1
    assert engine.generation(JOB, verdict, "2026-12-06T09:09:55Z") == 1

    now = times.now_iso()
    asyncio.run(_past_the_second_of(now))
    assert times.now_iso() > now
    began = time.monotonic()
    asyncio.run(_past_the_second_of("2026-12-06T09:09:54Z"))  # long past: no wait
    assert time.monotonic() - began < 0.05
