"""The incident engine's pure decisions: names, folding, agreement, the next action."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from sdc_agent.protocol import ReporterIdentity, Suspect, VerdictReport
from sdc_operator import incidents
from sdc_operator.incidents import Action, JobRef, ResolvedSuspect, Rules
from sdc_operator.times import parse_time

JOB = JobRef("kubeflow.org/v1", "PyTorchJob", "ml", "llama-pretrain", "uid-1")
AT = "2026-11-29T00:00:00Z"
R = Rules()


def report(
    node: str,
    *,
    ranks: tuple[int, ...] = (3,),
    classification: str = "rank",
    step: int = 15,
    last_clean: int = 10,
    localized: bool = True,
) -> VerdictReport:
    return VerdictReport(
        reporter=ReporterIdentity(0, node, f"pod-{node}"),
        sent_at=1.0,
        check="replay",
        classification=classification,
        step=step,
        last_clean_step=last_clean,
        localized=localized,
        transient=False,
        suspects=tuple(Suspect(r, "b", 1) for r in ranks),
        message="m",
    )


def suspects(*ranks: int, node: str = "b") -> list[ResolvedSuspect]:
    return [ResolvedSuspect(r, 1, f"pod-{node}", node, "i-0123456789abcdef0") for r in ranks]


def fold(
    status: dict[str, Any], node: str, *, ranks: tuple[int, ...] = (3,), needed: int = 2, **kw: Any
) -> dict[str, Any]:
    out, _ = incidents.fold_report(
        status,
        report(node, ranks=ranks, **kw),
        reporter_pod=f"pod-{node}",
        reporter_node=node,
        suspects=suspects(*ranks),
        needed=needed,
        received_at=AT,
    )
    return out


def incident(status: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ml", "name": "x"},
        "spec": {"job": JOB.as_spec()},
        "status": status,
    }


def test_name_is_stable_per_window_and_a_dns_label() -> None:
    a = incidents.incident_name(JOB, report("a"))
    assert a == incidents.incident_name(JOB, report("b"))
    assert a != incidents.incident_name(JOB, report("a", step=16))
    assert a != incidents.incident_name(JOB, report("a", last_clean=5))
    other = JobRef("kubeflow.org/v1", "PyTorchJob", "ml", "llama-pretrain", "uid-2")
    assert a != incidents.incident_name(other, report("a"))
    long = JobRef("kubeflow.org/v1", "PyTorchJob", "ml", "x" * 63, "u")
    name = incidents.incident_name(long, report("a", step=10**9))
    assert len(name) <= 63 and name.startswith("x" * 40 + "-1000000000-")


def test_one_node_waits_two_agreeing_nodes_detect() -> None:
    status = fold({}, "a")
    assert status["phase"] == "WaitingForAgreement"
    assert incidents.next_action(incident(status), R) is None
    status = fold(status, "a")  # the same node again changes nothing
    assert len(status["reports"]) == 1
    status = fold(status, "c", ranks=(5,))  # disagrees
    assert status["phase"] == "WaitingForAgreement"
    status = fold(status, "d")
    assert status["phase"] == "Detected"
    assert (status["ranks"], status["node"], status["instanceId"]) == (
        "3",
        "b",
        "i-0123456789abcdef0",
    )
    assert incidents.next_action(incident(status), R) == Action(
        "suspend-job", "PyTorchJob ml/llama-pretrain"
    )


def test_a_batch_folds_into_one_copy_in_place_and_a_single_fold_leaves_its_input() -> None:
    first = fold({}, "a")
    kept = copy.deepcopy(first)
    second = fold(first, "c")
    assert first == kept and second is not first  # the default: a new status
    mine = copy.deepcopy(first)
    for node in ("c", "d"):
        out, changed = incidents.fold_report(
            mine,
            report(node),
            reporter_pod=f"pod-{node}",
            reporter_node=node,
            suspects=suspects(3),
            needed=2,
            received_at=AT,
            in_place=True,
        )
        assert out is mine and changed
    assert [e["node"] for e in mine["reports"]] == ["a", "c", "d"]
    assert mine["phase"] == "Detected" and first == kept


def test_suspects_freeze_once_containment_starts() -> None:
    status = fold(fold({}, "a"), "c")
    assert status["phase"] == "Detected"
    for node in ("d", "e", "f"):
        status = fold(status, node, ranks=(7,))
    assert status["ranks"] == "3"
    assert incidents.agreed_group(status["reports"], 2) == ("rank", True, (7,))  # larger now
    assert [a.target for a in incidents.planned_actions(incident(status), R)][1:] == ["b"]


def test_agreement_of_one_node_when_configured() -> None:
    assert fold({}, "a", needed=1)["phase"] == "Detected"


@pytest.mark.parametrize("classification", ["training", "nondeterministic"])
def test_software_verdicts_take_no_action(classification: str) -> None:
    status = fold(
        fold({}, "a", ranks=(), classification=classification),
        "c",
        ranks=(),
        classification=classification,
    )
    assert status["phase"] == "NotHardware"
    assert incidents.planned_actions(incident(status), R) == []


def test_unlocalized_verdict_stops_the_job_and_quarantines_nothing() -> None:
    status = fold(fold({}, "a", ranks=(1, 3), localized=False), "c", ranks=(1, 3), localized=False)
    assert incidents.planned_actions(incident(status), R) == [
        Action("suspend-job", "PyTorchJob ml/llama-pretrain")
    ]
    status = incidents.record_action(
        status, Action("suspend-job", "PyTorchJob ml/llama-pretrain"), "Succeeded", "", AT
    )
    assert incidents.containment_summary(incident(status), R) == (
        "Contained",
        "True",
        "JobStoppedNotLocalized",
        "job stopped; the verdict does not single out a node, so none was quarantined",
    )


def test_actions_in_order_once_each_then_contained() -> None:
    status = fold(fold({}, "a"), "c")
    taken = []
    while (action := incidents.next_action(incident(status), R)) is not None:
        taken.append(action)
        status = incidents.record_action(status, action, "Succeeded", "ok", AT)
        assert len(taken) < 5
    assert taken == [
        Action("suspend-job", "PyTorchJob ml/llama-pretrain"),
        Action("quarantine-node", "b"),
    ]
    phase, contained, reason, _ = incidents.containment_summary(incident(status), R) or (
        "",
        "",
        "",
        "",
    )
    assert (phase, contained, reason) == ("Contained", "True", "NodeQuarantined")
    status = incidents.record_action(
        status, taken[0], "Failed", "", AT
    )  # a failure recorded later does not undo
    assert incidents.next_action(incident(status), R) is None


def test_failed_or_skipped_action_is_retried() -> None:
    status = fold(fold({}, "a"), "c")
    action = incidents.next_action(incident(status), R)
    assert action is not None
    status = incidents.record_action(status, action, "Failed", "boom", AT)
    assert incidents.next_action(incident(status), R) == action


def test_conditions_keep_transition_time_unless_status_changes() -> None:
    status: dict[str, Any] = {}
    incidents.set_condition(status, "Contained", "False", "Waiting", "m", "t1")
    incidents.set_condition(status, "Contained", "False", "Waiting", "m2", "t2")
    assert status["conditions"] == [
        {
            "type": "Contained",
            "status": "False",
            "reason": "Waiting",
            "message": "m2",
            "lastTransitionTime": "t1",
        }
    ]
    incidents.set_condition(status, "Contained", "True", "Done", "m3", "t3")
    assert status["conditions"][0]["lastTransitionTime"] == "t3"


def test_new_incident_has_no_owner_reference() -> None:
    body = incidents.new_incident(JOB, "x", report("a"))
    assert "ownerReferences" not in body["metadata"]
    assert body["spec"]["job"] == {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "name": "llama-pretrain",
        "uid": "uid-1",
    }


def contained(status: dict[str, Any], rules: Rules = R) -> dict[str, Any]:
    """Take every containment action successfully and write the summary, as the engine does."""
    while (action := incidents.next_action(incident(status), rules)) is not None:
        status = incidents.record_action(status, action, "Succeeded", "ok", AT)
    summary = incidents.containment_summary(incident(status), rules)
    assert summary is not None
    status["phase"] = summary[0]
    incidents.set_condition(status, "Contained", summary[1], summary[2], summary[3], AT)
    return status


def test_storm_stops_the_job_and_quarantines_nothing() -> None:
    status = fold(fold({}, "a", ranks=(1, 3, 5)), "c", ranks=(1, 3, 5))
    spread = [ResolvedSuspect(r, 1, f"p{r}", f"node-{r}") for r in (1, 3, 5)]
    status["suspects"] = [s.as_status() for s in spread]
    assert incidents.planned_actions(incident(status), R) == [
        Action("suspend-job", "PyTorchJob ml/llama-pretrain")
    ]
    status = contained(status)
    reason = next(c for c in status["conditions"] if c["type"] == "Contained")["reason"]
    assert reason == "Storm"
    assert incidents.next_action(incident(status), R) is None  # no resume, no remediation
    assert incidents.planned_actions(incident(status), Rules(storm_suspect_nodes=3))[1:] == [
        Action("quarantine-node", f"node-{r}") for r in (1, 3, 5)
    ]


def test_cap_skip_is_said_and_blocks_the_resume() -> None:
    status = fold(fold({}, "a"), "c")
    status = incidents.record_action(
        status, Action("suspend-job", "PyTorchJob ml/llama-pretrain"), "Succeeded", "", AT
    )
    status = incidents.record_action(
        status, Action("quarantine-node", "b"), "Skipped", "cap of 1 reached", AT, "CapReached"
    )
    summary = incidents.containment_summary(incident(status), R)
    assert (
        summary is not None
        and summary[2] == "QuarantineCapReached"
        and "cap of 1 reached" in summary[3]
    )


def test_resume_then_remediation_by_annotation_or_policy() -> None:
    status = contained(fold(fold({}, "a"), "c"))
    job = "PyTorchJob ml/llama-pretrain"
    assert incidents.next_action(incident(status), R) == Action("resume-job", job)
    status = incidents.record_action(status, Action("resume-job", job), "Succeeded", "", AT)
    assert incidents.next_action(incident(status), R) is None  # manual: waits for a person
    reviewed = incident(status)
    reviewed["metadata"]["annotations"] = {"hyperpod-sdc.dev/action": "replace"}
    assert incidents.next_action(reviewed, R) == Action("replace-node", "b")
    reviewed["metadata"]["annotations"] = {"hyperpod-sdc.dev/action": "format-disk"}
    assert incidents.next_action(reviewed, R) is None  # not an action
    auto = Rules(remediation_policy="auto-reboot")
    assert incidents.next_action(incident(status), auto) == Action("reboot-node", "b")
    assert incidents.pending_actions(incident(status), auto)
    # Without a bundle the one thing left is to say so (Confirmed=Unknown, NoBundle) ...
    assert incidents.needs_bundle_note(incident(status), R)
    assert incidents.pending_actions(incident(status), R)
    status["confirmation"] = {"outcome": "unknown", "node": "b"}
    # ... after which nothing is left until a person decides.
    assert not incidents.pending_actions(incident(status), R)


def test_failed_remediation_backs_off_doubling() -> None:
    from datetime import datetime, timedelta, timezone

    status = contained(fold(fold({}, "a"), "c"))
    status = incidents.record_action(
        status, Action("resume-job", "PyTorchJob ml/llama-pretrain"), "Skipped", "", AT
    )
    rules = Rules(remediation_policy="auto-replace", backoff_seconds=10)
    action = Action("replace-node", "b")
    t0 = datetime(2026, 11, 29, tzinfo=timezone.utc)
    assert incidents.next_action(incident(status), rules, t0) == action
    status = incidents.record_action(status, action, "Failed", "InternalServerError", AT)
    assert incidents.next_action(incident(status), rules, t0 + timedelta(seconds=9)) is None
    assert incidents.pending_actions(incident(status), rules)
    assert incidents.next_action(incident(status), rules, t0 + timedelta(seconds=10)) == action
    status = incidents.record_action(status, action, "Failed", "again", AT)
    assert incidents.next_action(incident(status), rules, t0 + timedelta(seconds=19)) is None
    assert incidents.next_action(incident(status), rules, t0 + timedelta(seconds=20)) == action
    status = incidents.record_action(status, action, "Succeeded", "ok", AT)
    assert incidents.next_action(incident(status), rules, t0 + timedelta(days=1)) is None


# -- the per-job hold ledger -------------------------------------------------------------------


def _holder(
    name: str,
    phase: str,
    *,
    stopped: str = "2026-11-29T00:00:10Z",
    message: str = "set runPolicy.suspend=true",
    contained: str | None = None,
    resume: str | None = None,
    uid: str = "job-uid",
) -> dict[str, Any]:
    actions = [{"action": "suspend-job", "result": "Succeeded", "at": stopped, "message": message}]
    if resume is not None:
        actions.append({"action": "resume-job", "result": resume, "at": stopped, "message": ""})
    status: dict[str, Any] = {"phase": phase, "actions": actions}
    if contained is not None:
        status["conditions"] = [{"type": "Contained", "status": "True", "reason": contained}]
    return {
        "metadata": {"namespace": "ml", "name": name},
        "spec": {"job": {"uid": uid}},
        "status": status,
    }


def test_job_holders_wait_for_containment_and_leave_a_stop_for_good_to_a_person() -> None:
    me = _holder("i1", "Contained", stopped="2026-11-29T00:00:05Z", contained="NodeQuarantined")
    others = [
        me,
        _holder("containing", "Detected"),
        _holder("not-localized", "Contained", contained="JobStoppedNotLocalized"),
        _holder("capped", "Contained", contained="QuarantineCapReached"),
        _holder("refused", "Contained", contained="NodeQuarantined", resume="Skipped"),
        # not holding: quarantined its node (resumes itself), resumed it, released after
        # review, another job's
        _holder("quarantined", "Contained", contained="NodeQuarantined"),
        _holder("resumed", "Resumed", contained="NodeQuarantined", resume="Succeeded"),
        _holder("released", "Released", contained="JobStoppedNotLocalized"),
        _holder("other-job", "Detected", uid="another"),
    ]
    assert incidents.job_holders(me, others) == [
        ("capped", False),
        ("containing", True),
        ("not-localized", False),
        ("refused", False),
    ]


def test_a_stop_being_taken_holds_the_job_from_its_intent() -> None:
    """The stop and the quarantine are recorded ``Pending`` together and their results
    written together: meanwhile the job is held (before, another incident of the job could
    resume it before this one's suspect node was cordoned)."""
    me = _holder("i1", "Contained", stopped="2026-11-29T00:00:05Z", contained="NodeQuarantined")
    taking = _holder("taking", "Detected")
    taking["status"]["actions"] = [
        {"action": "suspend-job", "result": "Pending", "at": "2026-11-29T00:00:10Z"},
        {
            "action": "quarantine-node",
            "target": "n2",
            "result": "Pending",
            "at": "2026-11-29T00:00:10Z",
        },
    ]
    assert incidents.job_holders(me, [me, taking]) == [("taking", True)]
    taking["status"]["phase"] = "DryRun"
    assert incidents.job_holders(me, [me, taking]) == []


def test_a_job_found_running_after_a_stop_ends_that_stops_hold() -> None:
    """A person restarted the job after ``old`` stopped it for good: ``new`` found it
    running and stopped it again, so ``old`` holds it no more. A stop that found the job
    stopped already (``already``) ends nothing."""
    old = _holder("old", "Contained", contained="JobStoppedNotLocalized")
    new = _holder("new", "Contained", stopped="2026-11-29T00:05:00Z", contained="NodeQuarantined")
    assert incidents.job_holders(new, [old, new]) == []
    late = _holder(
        "new",
        "Contained",
        stopped="2026-11-29T00:05:00Z",
        message="runPolicy.suspend was already true",
        contained="NodeQuarantined",
    )
    assert incidents.job_holders(late, [old, late]) == [("old", False)]


def _window(holder: dict[str, Any], last_clean: int) -> dict[str, Any]:
    holder["spec"]["lastCleanStep"] = last_clean
    return holder


def test_a_resume_starts_at_or_before_every_open_window_of_the_job() -> None:
    """The job was caught twice before it stopped: ``i1`` (window from step 40) resumes
    it, while ``i2``'s window starts at step 20. A resume from step 40 would take a
    checkpoint inside ``i2``'s window: the step is 20, and ``i2`` is named."""
    me = _window(_holder("i1", "Contained", contained="NodeQuarantined"), 40)
    quarantined = _window(_holder("i2", "Contained", contained="NodeQuarantined"), 20)
    later = _window(_holder("i3", "Contained", contained="NodeQuarantined"), 60)
    assert incidents.resume_max_step(me, [me, quarantined, later]) == (20, ["i2"])
    # the clean run: alone, or with windows that are closed, its own step
    assert incidents.resume_max_step(me, [me, later]) == (40, [])
    closed = [
        _window(_holder("released", "Released", contained="NodeQuarantined"), 10),
        _window(_holder("dry", "DryRun"), 10),
        _window(_holder("other-job", "Contained", uid="another"), 10),
        # resumed the job before i1 stopped it (at 00:00:10): that run is behind
        _window(
            _holder("earlier-run", "Resumed", stopped="2026-11-29T00:00:01Z", resume="Succeeded"),
            10,
        ),
    ]
    assert incidents.resume_max_step(me, [me, *closed]) == (40, [])
    # resumed while i1 already held the job (the same run): its window still counts
    same_run = _window(
        _holder("same-run", "Resumed", stopped="2026-11-29T00:00:20Z", resume="Succeeded"), 10
    )
    assert incidents.resume_max_step(me, [me, same_run]) == (10, ["same-run"])


# -- the verified snapshot and the work lost ----------------------------------------------------

WAIT = Rules(snapshot_wait_seconds=30.0)
T0 = parse_time(AT)


def snapshot_incident(snapshot_step: int | None = 10) -> dict[str, Any]:
    status: dict[str, Any] = {}
    for node in ("a", "c"):
        status, _ = incidents.fold_report(
            status,
            dataclasses.replace(report(node), snapshot_step=snapshot_step),
            reporter_pod=f"pod-{node}",
            reporter_node=node,
            suspects=suspects(3),
            needed=2,
            received_at=AT,
        )
    found = incident(status)
    found["spec"].update(detectionStep=15, lastCleanStep=10)
    return found


def test_a_snapshot_announced_quarantines_first_and_the_stop_waits() -> None:
    found = snapshot_incident()
    assert incidents.expected_snapshot(found, WAIT) == 10
    assert incidents.planned_actions(found, WAIT) == [
        Action("quarantine-node", "b"),
        Action("suspend-job", "PyTorchJob ml/llama-pretrain"),
    ]
    # Off (0 s), in dry-run, or not announced: no wait, the stop first as always.
    for rules, inc in (
        (R, found),
        (Rules(snapshot_wait_seconds=30.0, dry_run=True), found),
        (WAIT, snapshot_incident(None)),
    ):
        assert incidents.expected_snapshot(inc, rules) is None
        assert incidents.snapshot_gate(inc, rules, [], T0) == (None, 0.0)
        assert incidents.planned_actions(inc, rules)[0].action == "suspend-job"


def test_the_wait_records_its_deadline_first_and_ends_once_when_reported() -> None:
    found = snapshot_incident()
    started, wait = incidents.snapshot_gate(found, WAIT, [], T0)
    assert started is not None and wait == 30.0
    assert started["snapshot"] == {
        "step": 10,
        "waitingSince": AT,
        "deadline": "2026-11-29T00:00:30Z",
    }
    condition = next(c for c in started["conditions"] if c["type"] == "Snapshot")
    assert (condition["status"], condition["reason"]) == ("Unknown", "Waiting")
    found["status"] = started
    later = T0 + incidents.timedelta(seconds=10)
    # A periodic checkpoint older than the snapshot, or one inside the window, does not end it.
    old = [{"step": 5, "location": "/ck/5"}, {"step": 12, "location": "/ck/12"}]
    assert incidents.snapshot_gate(found, WAIT, old, later) == (None, 20.0)
    # The snapshot's report does; the deadline (from the status, not a fresh one) is kept.
    snap = [*old, {"step": 10, "location": "/ck/sdc-snapshot-step_10"}]
    done, wait = incidents.snapshot_gate(found, WAIT, sorted(snap, key=lambda c: c["step"]), later)
    assert done is not None and wait == 0.0
    assert done["snapshot"]["result"] == "SnapshotReported"
    assert done["snapshot"]["checkpoint"] == {"step": 10, "location": "/ck/sdc-snapshot-step_10"}
    assert done["snapshot"]["deadline"] == "2026-11-29T00:00:30Z"
    condition = next(c for c in done["conditions"] if c["type"] == "Snapshot")
    assert (condition["status"], condition["reason"]) == ("True", "SnapshotReported")
    found["status"] = done
    assert incidents.snapshot_gate(found, WAIT, [], later) == (None, 0.0)  # exactly once
    # The order stays the same once the wait is recorded, whatever the rules say now.
    assert incidents.planned_actions(found, R)[0] == Action("quarantine-node", "b")


def test_past_the_recorded_deadline_the_stop_goes_on_and_says_what_it_falls_back_to() -> None:
    found = snapshot_incident()
    started, _ = incidents.snapshot_gate(found, WAIT, [], T0)
    assert started is not None
    found["status"] = started
    # A restarted operator with another setting keeps the recorded deadline.
    other = Rules(snapshot_wait_seconds=600.0)
    assert incidents.snapshot_gate(found, other, [], T0 + incidents.timedelta(seconds=29)) == (
        None,
        1.0,
    )
    periodic = [{"step": 5, "location": "/ck/5"}, {"step": 12, "location": "/ck/12"}]
    late, wait = incidents.snapshot_gate(
        found, other, periodic, T0 + incidents.timedelta(seconds=30)
    )
    assert late is not None and wait == 0.0
    assert late["snapshot"]["result"] == "DeadlinePassed"
    condition = next(c for c in late["conditions"] if c["type"] == "Snapshot")
    assert (condition["status"], condition["reason"]) == ("False", "DeadlinePassed")
    assert "step 5 (/ck/5)" in condition["message"]
    found["status"] = {**started}
    none_known, _ = incidents.snapshot_gate(found, WAIT, [], T0 + incidents.timedelta(seconds=31))
    assert none_known is not None
    assert "none is known yet" in next(
        c["message"] for c in none_known["conditions"] if c["type"] == "Snapshot"
    )


def test_lost_work_counts_steps_and_estimates_gpu_hours_where_it_can() -> None:
    assert incidents.lost_work(15, 10, 0.5, 6) == {
        "detectionStep": 15,
        "resumeStep": 10,
        "steps": 5,
        "gpuHours": pytest.approx(5 * 0.5 * 6 / 3600),
        "stepSeconds": 0.5,
        "gpus": 6,
    }
    assert incidents.lost_work(15, 10, None, 6) == {
        "detectionStep": 15,
        "resumeStep": 10,
        "steps": 5,
    }
    assert "gpuHours" not in incidents.lost_work(15, 10, 0.5, None)


def test_the_agents_resume_report_corrects_the_lost_work() -> None:
    found = snapshot_incident()
    found["status"].update(
        phase="Contained",
        conditions=[{"type": "Resumed", "status": "Unknown", "reason": "Restarting"}],
        lostWork=incidents.lost_work(15, 10, 0.5, 6),
    )
    after = incidents.resumed_status(found, 5, "/ck/5", AT)
    assert after is not None
    assert after["lostWork"]["resumeStep"] == 5 and after["lostWork"]["steps"] == 10
    assert after["lostWork"]["gpuHours"] == pytest.approx(10 * 0.5 * 6 / 3600)


def test_a_snapshot_reported_after_the_deadline_is_used_and_the_incident_says_so() -> None:
    found = snapshot_incident()
    started, _ = incidents.snapshot_gate(found, WAIT, [], T0)
    assert started is not None
    found["status"] = started
    periodic = [{"step": 5, "location": "/ck/5"}]
    late, _ = incidents.snapshot_gate(found, WAIT, periodic, T0 + incidents.timedelta(seconds=30))
    assert late is not None
    # The resume falls back as the condition says: nothing changes.
    fallback = copy.deepcopy(late)
    assert incidents.late_snapshot(fallback, 5, "/ck/5", resumed=False) is None
    assert fallback == late
    # The snapshot came after all (before the resume, or found on disk by the agents).
    used = copy.deepcopy(late)
    condition = incidents.late_snapshot(used, 10, "/ck/snap-10", resumed=False)
    assert condition is not None
    assert condition[:3] == ("Snapshot", "True", "ReportedLate")
    assert "resumes from it" in condition[3] and late["snapshot"]["deadline"] in condition[3]
    assert used["snapshot"] == {
        **late["snapshot"],
        "checkpoint": {"step": 10, "location": "/ck/snap-10"},
        "reportedLate": True,
    }
    assert used["snapshot"]["result"] == "DeadlinePassed"  # what the wait came to
    # The agents' resume report from it says so too, and corrects the lost work.
    late.update(
        phase="Contained",
        lostWork=incidents.lost_work(15, 5, 0.5, 6),
    )
    late["conditions"].append({"type": "Resumed", "status": "Unknown", "reason": "Restarting"})
    found["status"] = late
    after = incidents.resumed_status(found, 10, "/ck/snap-10", AT)
    assert after is not None
    snapshot = next(c for c in after["conditions"] if c["type"] == "Snapshot")
    assert (snapshot["status"], snapshot["reason"]) == ("True", "ReportedLate")
    assert "resumed from it" in snapshot["message"]
    assert after["snapshot"]["reportedLate"] is True
    assert after["lostWork"]["resumeStep"] == 10 and after["lostWork"]["steps"] == 5
