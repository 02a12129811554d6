"""Pure decisions about incidents: naming, folding reports, evidence, the next action.

An incident is one ``SDCIncident`` per job, run and suspect window
``(last_clean_step, step]``. Every reporting node sends the same verdict, so reports for
one window fold into one incident, one entry per reporting node (the first
:data:`MAX_RECORDED_REPORTS`; later ones are counted). Repeated ``nondeterministic``
verdicts of a job's run fold into one incident whatever their step.

Evidence (docs/operator.md, "Evidence"): nothing is done until ``agreement_nodes``
distinct nodes named the same suspects. A node is quarantined only on a verdict that
accuses hardware, is localized and is corroborated (an independent recomputation on
another node supports it; agents older than that field are taken at their word, except
for the non-finite check, whose verdicts all come from one all-reduce). A transient or
uncorroborated verdict is recorded (``Transient``, ``AwaitingEvidence``) and stops nothing,
until the same node of the job is caught again within a window of steps (or a later
confirmation escalates it, :func:`escalate`).

The status is the incident's whole memory. :func:`next_action` reads it (and nothing
else), so an operator restarted at any point continues with the first action not yet
recorded as done. Every external action is recorded as ``Pending`` with what identifies it
(:func:`record_intent`) before it is taken, and its result after
(:func:`record_result`): a restart that finds a ``Pending`` action first finds out whether
it took effect.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from sdc_common.protocol import VerdictReport

from . import confirmation
from .names import ACTION_ANNOTATION, ACTIONS, GROUP, INCIDENT_KIND, VERSION
from .times import now_iso, parse_time

__all__ = [
    "Action",
    "JobRef",
    "MAX_RECORDED_REPORTS",
    "Rules",
    "ResolvedSuspect",
    "agreed_group",
    "agreed_reports",
    "confirmation_planned",
    "containment_summary",
    "escalate",
    "expected_snapshot",
    "fold_report",
    "incident_name",
    "is_closed",
    "job_holders",
    "resume_max_step",
    "last_activity",
    "lost_work",
    "new_incident",
    "needs_bundle_note",
    "next_action",
    "pending_actions",
    "pending_entry",
    "post_containment_actions",
    "repeat_candidates",
    "resumed_status",
    "record_action",
    "record_intent",
    "record_result",
    "set_condition",
    "snapshot_gate",
]

NOT_HARDWARE = frozenset({"training", "nondeterministic"})
"""Classifications that never accuse hardware: recorded, no action taken."""
OPEN_PHASES = frozenset(
    {None, "WaitingForAgreement", "NotHardware", "AwaitingEvidence", "Transient"}
)
"""Phases in which a new report may still change suspects and phase."""
HELD_PHASES = frozenset({"AwaitingEvidence", "Transient"})
"""Recorded, acting on nothing, until the same node is caught again (or confirmed)."""
FINAL_RESULTS = frozenset({"Succeeded", "DryRun", "Skipped"})
"""Results that end an action; ``Failed`` is retried, ``Pending`` is verified first."""
PENDING = "Pending"
MAX_RECORDED_REPORTS = 32
"""Reporting nodes recorded in ``status.reports``; later ones are only counted
(``status.reportingNodes``): agreement needs two, and the object stays small."""
MAX_RECORDED_STEPS = 20


@dataclass(frozen=True, slots=True)
class JobRef:
    api_version: str
    kind: str
    namespace: str
    name: str
    uid: str

    def as_spec(self) -> dict[str, str]:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
        }


@dataclass(frozen=True, slots=True)
class ResolvedSuspect:
    """A suspect rank with its pod and node as the API server has them (not as reported)."""

    rank: int
    local_rank: int
    pod: str
    node: str
    instance_id: str | None = None
    gpu_uuid: str | None = None

    def as_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rank": self.rank,
            "localRank": self.local_rank,
            "pod": self.pod,
            "node": self.node,
        }
        if self.instance_id:
            out["instanceId"] = self.instance_id
        if self.gpu_uuid:
            out["gpuUUID"] = self.gpu_uuid
        return out


@dataclass(frozen=True, slots=True)
class Action:
    """One containment step: ``action`` on ``target`` (``<Kind> <namespace>/<name>`` or a
    node name)."""

    action: str
    target: str


_NOT_DNS = re.compile(r"[^a-z0-9-]")


def _base(job: JobRef) -> str:
    return _NOT_DNS.sub("-", job.name.lower())[:40].strip("-") or "job"


def incident_name(job: JobRef, report: VerdictReport, generation: int = 0) -> str:
    """Deterministic, so concurrent reports for one window meet at one object:
    ``<job>-<step>-<hash>`` (at most 63 characters), the hash over the job's uid, the
    window and the run. The run is the verdict's ``run_id``; for agents without one, the
    operator's count of the job's restarts (``generation``, 0 before the first), so a
    re-detection after a resume is a new incident. A run's ``nondeterministic`` verdicts
    meet at ``<job>-nondeterministic-<hash>`` whatever their step."""
    run = report.run_id or (f"gen{generation}" if generation else "")
    if report.classification == "nondeterministic":
        digest = hashlib.sha256(f"{job.uid}/nondeterministic/{run}".encode()).hexdigest()[:8]
        return f"{_base(job)[:32].strip('-') or 'job'}-nondeterministic-{digest}"
    window = f"{job.uid}/{report.last_clean_step}/{report.step}" + (f"/{run}" if run else "")
    digest = hashlib.sha256(window.encode()).hexdigest()[:8]
    return f"{_base(job)}-{report.step}-{digest}"


def new_incident(job: JobRef, name: str, report: VerdictReport) -> dict[str, Any]:
    """The object to create; its status is written separately (status subresource)."""
    spec: dict[str, Any] = {
        "job": job.as_spec(),
        "check": report.check,
        "classification": report.classification,
        "detectionStep": report.step,
        "lastCleanStep": report.last_clean_step,
        "localized": report.localized,
        "message": report.message,
    }
    for key, value in (
        ("transient", report.transient),
        ("corroborated", report.corroborated),
        ("runId", report.run_id),
        ("bundle", report.bundle),
    ):
        if value is not None:
            spec[key] = value
    if report.evidence:
        spec["evidence"] = report.evidence
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": INCIDENT_KIND,
        "metadata": {
            "name": name,
            "namespace": job.namespace,
            # No owner reference: deleting the job must not delete the record of a fault.
            "labels": {f"{GROUP}/job": job.name[:63]},
        },
        "spec": spec,
    }


# -- agreement and evidence -------------------------------------------------------------------


def _group_key(entry: dict[str, Any]) -> tuple[str, bool, tuple[int, ...]]:
    return (
        str(entry.get("classification", "")),
        bool(entry.get("localized", False)),
        tuple(sorted(entry.get("suspectRanks") or [])),
    )


def agreed_group(
    reports: Sequence[dict[str, Any]], needed: int
) -> tuple[str, bool, tuple[int, ...]] | None:
    """The (classification, localized, suspect ranks) that at least ``needed`` distinct
    reporting nodes sent, or ``None``. Where two groups qualify, the larger wins, then the
    first reported."""
    nodes: dict[tuple[str, bool, tuple[int, ...]], set[str]] = {}
    for entry in reports:
        nodes.setdefault(_group_key(entry), set()).add(str(entry["node"]))
    best = [(len(n), key) for key, n in nodes.items() if len(n) >= needed]
    if not best:
        return None
    most = max(count for count, _ in best)
    return next(key for count, key in best if count == most)


def agreed_reports(status: dict[str, Any], needed: int) -> list[dict[str, Any]]:
    group = agreed_group(status.get("reports") or [], needed)
    if group is None:
        return []
    return [e for e in status.get("reports") or [] if _group_key(e) == group]


def _tristate(entries: Iterable[dict[str, Any]], key: str) -> bool | None:
    """True if any entry says so, else False if any says so, else None (not said)."""
    values = [e.get(key) for e in entries]
    if True in values:
        return True
    if False in values:
        return False
    return None


def evidence_hold(incident: dict[str, Any], needed: int) -> tuple[str, str] | None:
    """Why an agreed verdict that accuses hardware must not act yet, as (phase, message),
    or ``None`` when it may: transient, or not corroborated by an independent
    recomputation (the non-finite check's verdicts all come from one all-reduce, so
    without ``corroborated`` they are one piece of evidence however many nodes send them)."""
    status = incident.get("status") or {}
    if status.get("escalation"):
        return None
    agreed = agreed_reports(status, needed)
    check = str((incident.get("spec") or {}).get("check") or "")
    if _tristate(agreed, "transient") is True:
        return (
            "Transient",
            "transient: the suspect's recomputation of its own work came out right; nothing "
            "is stopped or quarantined unless the same node is caught again",
        )
    corroborated = _tristate(agreed, "corroborated")
    if corroborated is False or (corroborated is None and check == "nonfinite"):
        until = (
            "caught again"
            if repeats_are_evidence(incident)
            else "caught by a check that recomputes its work elsewhere, or a person decides "
            "(a non-finite gradient seen again on one rank may be the same bad record of "
            "its data)"
        )
        return (
            "AwaitingEvidence",
            "not corroborated: no independent recomputation on another node supports the "
            f"accusation yet; nothing is stopped or quarantined unless the same node is {until}",
        )
    return None


def repeats_are_evidence(incident: dict[str, Any]) -> bool:
    """Whether the same node caught again strengthens this held incident's case. Not for a
    non-finite verdict: the same rank's NaN twice may be one bad record of its data shard
    seen again (an epoch shorter than the window, no shuffling), which no repeat tells
    apart from a bad GPU."""
    return str((incident.get("spec") or {}).get("check") or "") != "nonfinite"


def _phase_before_containment(incident: dict[str, Any], needed: int) -> str:
    status = incident.get("status") or {}
    reports = status.get("reports") or []
    group = agreed_group(reports, needed)
    if group is None:
        if all(e.get("classification") in NOT_HARDWARE for e in reports):
            return "NotHardware"
        return "WaitingForAgreement"
    if group[0] in NOT_HARDWARE:
        return "NotHardware"
    hold = evidence_hold(incident, needed)
    return hold[0] if hold is not None else "Detected"


def fold_report(
    status: dict[str, Any],
    report: VerdictReport,
    *,
    reporter_pod: str,
    reporter_node: str,
    suspects: Sequence[ResolvedSuspect],
    needed: int,
    received_at: str,
    check: str | None = None,
    in_place: bool = False,
) -> tuple[dict[str, Any], bool]:
    """The status after ``report`` (from ``reporter_pod`` on ``reporter_node``, both
    authenticated) folds in, and whether anything changed. A second report from a node
    already recorded changes nothing (for a ``nondeterministic`` incident: unless it is of a
    step not counted yet). ``in_place``: ``status`` is the caller's own copy, changed and
    returned (a batch of reports folds into one copy, not one copy per report)."""
    if not in_place:
        status = _copy_status(status)
    reports = status.setdefault("reports", [])
    changed = False
    if report.classification == "nondeterministic":
        changed = _count_occurrence(status, report)
    if any(entry.get("node") == reporter_node for entry in reports):
        return status, changed
    status["reportingNodes"] = int(status.get("reportingNodes") or len(reports)) + 1
    if len(reports) >= MAX_RECORDED_REPORTS:
        return status, True
    entry: dict[str, Any] = {
        "node": reporter_node,
        "pod": reporter_pod,
        "rank": report.reporter.rank,
        "receivedAt": received_at,
        "classification": report.classification,
        "localized": report.localized,
        "suspectRanks": [s.rank for s in suspects],
    }
    if report.corroborated is not None:
        entry["corroborated"] = report.corroborated
    if report.transient is not None:
        entry["transient"] = report.transient
    if report.bundle:
        entry["bundle"] = report.bundle
    if report.snapshot_step is not None:
        entry["snapshotStep"] = report.snapshot_step
    reports.append(entry)
    if status.get("phase") in OPEN_PHASES:
        # Suspects and phase are frozen once containment starts (phase Detected).
        if not status.get("suspects") or agreed_group(reports, needed) == _group_key(entry):
            _set_suspects(status, suspects)
        set_condition(
            status,
            "Detected",
            "True",
            f"{report.check.capitalize()}Check",
            report.message,
            received_at,
        )
        view = {"spec": {"check": check or report.check}, "status": status}
        status["phase"] = _phase_before_containment(view, needed)
        if report.classification == "nondeterministic":
            _set_guidance(status)
    return status, True


def _count_occurrence(status: dict[str, Any], report: VerdictReport) -> bool:
    steps = list(status.get("occurrenceSteps") or [])
    if report.step in steps or report.step == status.get("firstStep"):
        return False
    status["occurrences"] = int(status.get("occurrences") or 0) + 1
    status.setdefault("firstStep", report.step)
    status["lastStep"] = max(int(status.get("lastStep") or 0), report.step)
    status["occurrenceSteps"] = sorted({*steps, report.step})[-MAX_RECORDED_STEPS:]
    _set_guidance(status)
    return True


def _set_guidance(status: dict[str, Any]) -> None:
    count = int(status.get("occurrences") or 1)
    first, last = status.get("firstStep"), status.get("lastStep")
    status["message"] = (
        f"{count} non-deterministic verdict(s) (steps {first} to {last}): the job's "
        "computation is not reproducible across processes, so the audit cannot tell a "
        "faulty GPU from noise. No node is accused and training goes on. Make it "
        "reproducible with sdc_agent.enable_determinism(), or let the agent measure the "
        "noise first with HYPERPOD_SDC_REPLAY_MODE=calibrate (docs/agent.md)"
    )


def _set_suspects(status: dict[str, Any], suspects: Sequence[ResolvedSuspect]) -> None:
    status["suspects"] = [s.as_status() for s in suspects]
    for key in ("ranks", "node", "instanceId"):
        status.pop(key, None)
    if suspects:
        status["ranks"] = ",".join(str(s.rank) for s in suspects)
        status["node"] = suspects[0].node
        if suspects[0].instance_id:
            status["instanceId"] = suspects[0].instance_id


def suspect_nodes(incident: dict[str, Any]) -> list[str]:
    nodes: list[str] = []
    for suspect in (incident.get("status") or {}).get("suspects") or []:
        node = suspect.get("node")
        if node and node not in nodes:
            nodes.append(node)
    return nodes


def repeat_candidates(
    incident: dict[str, Any], others: Iterable[dict[str, Any]], window_steps: int
) -> list[str]:
    """Names of the job's other incidents that caught one of this incident's suspect
    nodes within ``window_steps`` steps of it (its repeats)."""
    nodes = set(suspect_nodes(incident))
    spec = incident.get("spec") or {}
    uid = (spec.get("job") or {}).get("uid")
    step = int(spec.get("detectionStep") or 0)
    name = (incident.get("metadata") or {}).get("name")
    found = []
    for other in others:
        ospec = other.get("spec") or {}
        if (other.get("metadata") or {}).get("name") == name:
            continue
        if (ospec.get("job") or {}).get("uid") != uid:
            continue
        if ospec.get("classification") in NOT_HARDWARE:
            continue
        if abs(int(ospec.get("detectionStep") or 0) - step) > window_steps:
            continue
        if nodes & set(suspect_nodes(other)):
            found.append(str((other.get("metadata") or {}).get("name")))
    return sorted(found)


def escalate(
    status: dict[str, Any], reason: str, message: str, incidents: Sequence[str], at: str
) -> dict[str, Any]:
    """The status of a held (``Transient``/``AwaitingEvidence``) incident that is to be
    contained as a persistent fault after all: the same node caught again (``Repeated``).
    Phase ``Detected``: containment starts; the escalation and the incidents it rests on
    are recorded. (A confirmation never escalates: it runs on a quarantined node, and a
    held incident quarantines none; nor has it a bundle, which only a persistent,
    corroborated verdict names.)"""
    status = _copy_status(status)
    status["escalation"] = {
        "reason": reason,
        "message": message[:1024],
        "at": at,
        "incidents": list(incidents),
    }
    if incidents:
        status["relatedIncidents"] = sorted({*status.get("relatedIncidents", []), *incidents})
    if status.get("phase") in HELD_PHASES:
        status["phase"] = "Detected"
    set_condition(status, "Detected", "True", reason, message, at)
    return status


# -- actions ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rules:
    """The settings the decisions depend on (from :class:`OperatorSettings`, and for one
    namespace its ``SDCPolicy``)."""

    agreement_nodes: int = 2
    storm_suspect_nodes: int = 2
    dry_run: bool = False
    remediation_policy: str = "manual"
    backoff_seconds: float = 30.0
    confirmation: bool = True
    """Run a confirmation pod on a quarantined node whose verdict named a bundle."""
    cluster_approvals: bool = False
    """A person's decision is read from the admitting SDCPolicies (:attr:`approved`), not
    from the incident's ``hyperpod-sdc.dev/action`` (``approvals: cluster``)."""
    approved: Mapping[str, str] = field(default_factory=dict)
    """Incident uid -> the decision a cluster admin recorded on an admitting SDCPolicy."""
    snapshot_wait_seconds: float = 0.0
    """How long the stop waits for the verified snapshot the verdict announced (0: never)."""

    @classmethod
    def of(cls, settings: Any) -> Rules:
        return cls(
            snapshot_wait_seconds=settings.snapshot_wait_seconds,
            agreement_nodes=settings.agreement_nodes,
            storm_suspect_nodes=settings.storm_suspect_nodes,
            dry_run=settings.dry_run,
            remediation_policy=settings.remediation_policy,
            backoff_seconds=settings.remediation_backoff_seconds,
            confirmation=settings.confirmation,
        )


def _job_target(incident: dict[str, Any]) -> str:
    job = (incident.get("spec") or {}).get("job") or {}
    namespace = (incident.get("metadata") or {}).get("namespace", "")
    return f"{job.get('kind')} {namespace}/{job.get('name')}"


def is_storm(incident: dict[str, Any], rules: Rules) -> bool:
    """Suspects on many nodes at once point at software non-determinism, not hardware."""
    return len(suspect_nodes(incident)) > rules.storm_suspect_nodes


def planned_actions(incident: dict[str, Any], rules: Rules) -> list[Action]:
    """Containment, in order: stop the job, then quarantine each suspect node (only for an
    agreed, localized, corroborated verdict that accuses hardware, and not in a storm).
    Where the job's agents write a verified snapshot before it stops
    (:func:`expected_snapshot`), the nodes first: the stop waits for the snapshot
    (:func:`snapshot_gate`), the quarantine does not."""
    status = incident.get("status") or {}
    group = agreed_group(status.get("reports") or [], rules.agreement_nodes)
    if group is None:
        return []
    classification, localized, ranks = group
    if classification in NOT_HARDWARE or evidence_hold(incident, rules.agreement_nodes):
        return []
    stop = [Action("suspend-job", _job_target(incident))]
    quarantine = []
    if localized and ranks and not is_storm(incident, rules):
        quarantine = [Action("quarantine-node", node) for node in suspect_nodes(incident)]
    if status.get("snapshot") or expected_snapshot(incident, rules) is not None:
        # The stop waits for the snapshot (snapshot_gate); the node is taken out at once.
        return quarantine + stop
    return stop + quarantine


def done_actions(status: dict[str, Any]) -> set[Action]:
    return {
        Action(a["action"], a.get("target", ""))
        for a in status.get("actions") or []
        if a.get("result") in FINAL_RESULTS
    }


def pending_entry(status: dict[str, Any], action: Action) -> dict[str, Any] | None:
    """The ``Pending`` record of ``action``: taken, or about to be, with no result yet."""
    for entry in reversed(status.get("actions") or []):
        if (entry.get("action"), entry.get("target")) == (action.action, action.target):
            return entry if entry.get("result") == PENDING else None
    return None


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), {})


def quarantined_nodes(status: dict[str, Any]) -> list[str]:
    return [
        a["target"]
        for a in status.get("actions") or []
        if a.get("action") == "quarantine-node" and a.get("result") == "Succeeded"
    ]


def requested_remediation(incident: dict[str, Any], rules: Rules) -> list[str]:
    """What is asked for the quarantined nodes: the policy's automatic action, then what a
    person asked for with the ``hyperpod-sdc.dev/action`` annotation (under
    ``approvals: cluster``: what a cluster admin recorded on an SDCPolicy instead)."""
    asked = []
    if rules.remediation_policy in ("auto-reboot", "auto-replace"):
        asked.append(rules.remediation_policy.removeprefix("auto-"))
    meta = incident.get("metadata") or {}
    if rules.cluster_approvals:  # the tenant's annotation does not count
        annotation = rules.approved.get(str(meta.get("uid") or ""))
    else:
        annotation = (meta.get("annotations") or {}).get(ACTION_ANNOTATION)
    if annotation in ACTIONS and annotation not in asked:
        asked.append(annotation)
    return asked


def ignored_decision(incident: dict[str, Any], rules: Rules) -> str | None:
    """Why the incident's ``hyperpod-sdc.dev/action`` is ignored (``approvals: cluster``:
    only a cluster admin decides, on the SDCPolicy), or ``None``."""
    meta = incident.get("metadata") or {}
    asked = (meta.get("annotations") or {}).get(ACTION_ANNOTATION)
    if not rules.cluster_approvals or asked not in ACTIONS:
        return None
    return (
        f"{ACTION_ANNOTATION}={asked} is ignored: the SDCPolicy admitting namespace "
        f"{meta.get('namespace')} says approvals: cluster, so only a cluster admin decides, "
        f"with the annotation approve.hyperpod-sdc.dev/{meta.get('uid')}={asked} on that policy"
    )


def confirmation_planned(incident: dict[str, Any], rules: Rules) -> Action | None:
    """``confirm-node`` on the suspect node, once it is quarantined, where the verdict
    named a bundle and confirmation is on; not once the node is remediated or released
    (unless it was started already: then it is followed to its end)."""
    status = incident.get("status") or {}
    node = confirmation.confirmation_node(incident)
    if node is None or not rules.confirmation or not confirmation.bundle_of(incident):
        return None
    action = Action("confirm-node", node)
    started = any(
        (a.get("action"), a.get("target")) == ("confirm-node", node)
        for a in status.get("actions") or []
    )
    if started or status.get("phase") in ("Contained", "Resumed"):
        return action
    return None


def needs_bundle_note(incident: dict[str, Any], rules: Rules) -> bool:
    """A quarantined suspect node that cannot be confirmed for want of a bundle, not yet
    said so (condition ``Confirmed=Unknown``, reason ``NoBundle``)."""
    status = incident.get("status") or {}
    return bool(
        rules.confirmation
        and not rules.dry_run
        and status.get("phase") in ("Contained", "Resumed")
        and confirmation.confirmation_node(incident)
        and not confirmation.bundle_of(incident)
        and not status.get("confirmation")
    )


def post_containment_actions(incident: dict[str, Any], rules: Rules) -> list[Action]:
    """After containment: restart the job (only where its suspect nodes were quarantined,
    so the restarted pods cannot land there), start the confirmation run on the suspect
    node, then remediate the quarantined nodes as the policy or a person asks. Under
    ``auto-replace-confirmed`` the policy asks to replace only the node a confirmation
    reproduced the fault on (``Confirmed=True``), and only while no person has decided."""
    status = incident.get("status") or {}
    actions = []
    contained = _condition(status, "Contained")
    if contained.get("status") == "True" and contained.get("reason") == "NodeQuarantined":
        actions.append(Action("resume-job", _job_target(incident)))
    confirm = confirmation_planned(incident, rules)
    if confirm is not None:
        actions.append(confirm)
    nodes = quarantined_nodes(status)
    asked = requested_remediation(incident, rules)
    for request in asked:
        actions += [Action(f"{request}-node", node) for node in nodes]
    if rules.remediation_policy == "auto-replace-confirmed" and not asked:
        confirmed = confirmation.confirmed_node(status)
        if confirmed in nodes:
            actions.append(Action("replace-node", confirmed))
    return actions


def retry_at(status: dict[str, Any], action: Action, rules: Rules) -> datetime | None:
    """When a failed action may be tried again (back-off doubling from
    ``backoff_seconds``, at most 32 times that), or ``None`` if it never failed."""
    failures = [
        a
        for a in status.get("actions") or []
        if (a.get("action"), a.get("target")) == (action.action, action.target)
        and a.get("result") == "Failed"
    ]
    if not failures:
        return None
    delay = rules.backoff_seconds * min(2 ** (len(failures) - 1), 32)
    return parse_time(failures[-1]["at"]) + timedelta(seconds=delay)


_OPEN_FOR_ACTIONS = frozenset({"Contained", "Resumed", "Remediated"})


def _planned(incident: dict[str, Any], rules: Rules) -> list[Action]:
    phase = (incident.get("status") or {}).get("phase")
    if phase == "Detected":
        return planned_actions(incident, rules)
    if phase in _OPEN_FOR_ACTIONS:
        return post_containment_actions(incident, rules)
    return []


def next_action(
    incident: dict[str, Any], rules: Rules, now: datetime | None = None
) -> Action | None:
    """The first planned action not yet done and not waiting out a back-off, or ``None``.
    It may have a ``Pending`` record (:func:`pending_entry`): then it was started and must
    be verified before it is taken again."""
    status = incident.get("status") or {}
    done = done_actions(status)
    now = now or datetime.now(timezone.utc)
    for action in _planned(incident, rules):
        if action in done:
            continue
        due = retry_at(status, action, rules)
        if pending_entry(status, action) is not None or due is None or due <= now:
            return action
    return None


def actions_together(incident: dict[str, Any], rules: Rules, first: Action) -> list[Action]:
    """The containment actions recorded and taken together with ``first`` (the next
    action): ``first`` and the planned actions that follow it, as long as none was started
    or failed before (those are verified, or wait out their back-off, one at a time). The
    job's stop only as ``first``: where it comes after the nodes it waits for the snapshot
    (:func:`snapshot_gate`, decided for the next action only). Their intents are recorded
    in one write before any is taken, their results in one after: the same records, in
    fewer calls on the way to containment."""
    status = incident.get("status") or {}
    if status.get("phase") != "Detected" or rules.dry_run:
        return [first]
    planned = planned_actions(incident, rules)
    if first not in planned:
        return [first]
    done = done_actions(status)
    together: list[Action] = []
    for action in planned[planned.index(first) :]:
        fresh = (
            action not in done
            and pending_entry(status, action) is None
            and retry_at(status, action, rules) is None
            and (action == first or action.action != "suspend-job")
        )
        if not fresh:
            break
        together.append(action)
    return together or [first]


def pending_actions(incident: dict[str, Any], rules: Rules) -> bool:
    """Anything left to do now or after a back-off (the resync keeps driving it)."""
    status = incident.get("status") or {}
    if status.get("phase") == "Detected" or confirmation.is_running(status):
        return True
    if needs_bundle_note(incident, rules):
        return True
    done = done_actions(status)
    return any(a not in done for a in _planned(incident, rules))


def record_action(
    status: dict[str, Any],
    action: Action,
    result: str,
    message: str,
    at: str,
    reason: str | None = None,
) -> dict[str, Any]:
    """``action``'s result: completes its ``Pending`` record if it has one, else appends."""
    status = _copy_status(status)
    entry = pending_entry(status, action)
    if entry is None:
        entry = {"action": action.action, "target": action.target}
        status.setdefault("actions", []).append(entry)
    entry.update(at=at, result=result, message=message[:1024])
    if reason:
        entry["reason"] = reason
    return status


record_result = record_action


def record_intent(
    status: dict[str, Any], action: Action, intent: dict[str, Any], at: str
) -> dict[str, Any]:
    """``action`` is about to be taken: a ``Pending`` record with what identifies its effect
    later (``intent``: the node's resource version and boot id, the instance id, ...)."""
    status = _copy_status(status)
    entry = pending_entry(status, action)
    if entry is None:
        entry = {"action": action.action, "target": action.target}
        status.setdefault("actions", []).append(entry)
    entry.update(at=at, result=PENDING, message="taking it", intent=dict(intent))
    return status


def containment_summary(incident: dict[str, Any], rules: Rules) -> tuple[str, str, str, str] | None:
    """Once every containment action is done: (phase, Contained status, reason, message)."""
    status = incident.get("status") or {}
    if status.get("phase") != "Detected" or next_action(incident, rules) is not None:
        return None
    done = done_actions(status)
    if any(a not in done for a in planned_actions(incident, rules)):
        return None  # an action failed and waits out its back-off
    if rules.dry_run:
        return (
            "DryRun",
            "False",
            "DryRun",
            "dry-run: recorded the actions it would take, took none",
        )
    escalated = (status.get("escalation") or {}).get("message")
    why = f" ({escalated})" if escalated else ""
    if is_storm(incident, rules):
        nodes = suspect_nodes(incident)
        return (
            "Contained",
            "True",
            "Storm",
            f"job stopped; suspects on {len(nodes)} nodes at once ({', '.join(nodes)}) point at "
            "software non-determinism, not hardware: no node was quarantined",
        )
    planned = [a.target for a in planned_actions(incident, rules) if a.action == "quarantine-node"]
    quarantined = quarantined_nodes(status)
    if planned and set(planned) <= set(quarantined):
        return (
            "Contained",
            "True",
            "NodeQuarantined",
            f"job stopped; node(s) {', '.join(planned)} cordoned and tainted{why}",
        )
    if planned:
        skipped = [
            f"{a['target']}: {a.get('message', '')}"
            for a in status.get("actions") or []
            if a.get("action") == "quarantine-node" and a.get("result") == "Skipped"
        ]
        capped = any(a.get("reason") == "CapReached" for a in status.get("actions") or [])
        return (
            "Contained",
            "True",
            "QuarantineCapReached" if capped else "NotQuarantined",
            f"job stopped; not every suspect node was quarantined ({'; '.join(skipped)})",
        )
    return (
        "Contained",
        "True",
        "JobStoppedNotLocalized",
        "job stopped; the verdict does not single out a node, so none was quarantined",
    )


def set_condition(
    status: dict[str, Any], type_: str, value: str, reason: str, message: str, at: str
) -> None:
    conditions = status.setdefault("conditions", [])
    for condition in conditions:
        if condition.get("type") == type_:
            if condition.get("status") != value:
                condition["lastTransitionTime"] = at
            condition.update(status=value, reason=reason, message=message[:1024])
            return
    conditions.append(
        {
            "type": type_,
            "status": value,
            "reason": reason,
            "message": message[:1024],
            "lastTransitionTime": at,
        }
    )


def _copy_status(status: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(status or {})


def resumed_status(
    incident: dict[str, Any], step: int, location: str | None, at: str
) -> dict[str, Any] | None:
    """The status once the job's agents report resuming from ``step``, or ``None`` when the
    incident is not waiting for that (not restarted by the operator, or already marked)."""
    status = _copy_status(incident.get("status") or {})
    resumed = next((c for c in status.get("conditions") or [] if c.get("type") == "Resumed"), None)
    if resumed is None or resumed.get("status") != "Unknown":
        return None
    last_clean = int((incident.get("spec") or {}).get("lastCleanStep", 0))
    where = f" ({location})" if location else ""
    status["resumedFromStep"] = step
    lost = status.get("lostWork")
    if isinstance(lost, dict) and lost.get("resumeStep") != step:
        detection = int((incident.get("spec") or {}).get("detectionStep", 0))
        status["lostWork"] = lost_work(
            int(lost.get("detectionStep", detection)),
            step,
            lost.get("stepSeconds"),
            lost.get("gpus"),
        )
    if location:
        status["resumedFrom"] = location
    if step <= last_clean:
        late = late_snapshot(status, step, location, resumed=True)
        if late is not None:
            set_condition(status, *late, at)
    if step > last_clean:
        message = (
            f"the job resumed from step {step}{where}, after the last clean step {last_clean}: "
            "its weights may carry the corruption; check how the training script picks its "
            "checkpoint"
        )
        set_condition(status, "Resumed", "False", "ResumedPastWindow", message, at)
        return status
    set_condition(
        status,
        "Resumed",
        "True",
        "ResumedFromCheckpoint",
        f"the job resumed from the checkpoint of step {step}{where}",
        at,
    )
    if status.get("phase") == "Contained":
        status["phase"] = "Resumed"
    return status


# -- generations and retention -----------------------------------------------------------------


def job_stopped_at(incident: dict[str, Any]) -> str | None:
    """When this incident stopped its job (its ``suspend-job`` succeeded), or ``None``."""
    for entry in (incident.get("status") or {}).get("actions") or []:
        if entry.get("action") == "suspend-job" and entry.get("result") == "Succeeded":
            return str(entry.get("at"))
    return None


ALREADY_STOPPED = "AlreadyStopped"
"""The reason of a ``suspend-job`` that found the job stopped already (by another incident,
or a person): it stopped nothing, so it does not end the holds of earlier stops."""


def _stops(incident: dict[str, Any]) -> list[tuple[datetime, bool]]:
    """(when, whether it found the job running) of each ``suspend-job`` that succeeded."""
    found = []
    for entry in (incident.get("status") or {}).get("actions") or []:
        if entry.get("action") != "suspend-job" or entry.get("result") != "Succeeded":
            continue
        try:
            at = parse_time(str(entry.get("at")))
        except ValueError:
            continue
        already = entry.get("reason") == ALREADY_STOPPED or "already" in str(
            entry.get("message") or ""
        )
        found.append((at, not already))
    return found


def _stopping(status: dict[str, Any]) -> bool:
    """Whether the last ``suspend-job`` record of ``status`` is ``Pending``."""
    entries = [a for a in status.get("actions") or [] if a.get("action") == "suspend-job"]
    return bool(entries) and entries[-1].get("result") == PENDING


def job_holders(
    incident: dict[str, Any], others: Iterable[dict[str, Any]]
) -> list[tuple[str, bool]]:
    """The job's other incidents that hold it stopped, so that ``incident`` must not
    resume it: each as (name, whether its hold may end by itself).

    An incident holds its job from its ``suspend-job`` (from the intent, recorded
    ``Pending`` before the stop is taken) until its own ``resume-job`` succeeds. Its hold
    ends by itself where its containment is still in progress (phase ``Detected``: it may
    yet quarantine its nodes and resume the job itself); it is for a person to end where it
    stopped the job for good: contained without quarantining its nodes
    (``QuarantineCapReached``, ``NotQuarantined``, ``JobStoppedNotLocalized``, ``Storm``),
    or its own resume was refused. An incident that quarantined its nodes and has not
    decided about the resume yet does not hold (it resumes the job itself, or would let it
    run), nor does one released after review. A hold ends, too, where the job was found
    running after it (a later ``suspend-job`` of any incident of the job that stopped it
    again): a person restarted it."""
    spec = incident.get("spec") or {}
    uid = (spec.get("job") or {}).get("uid")
    name = (incident.get("metadata") or {}).get("name")
    namespace = (incident.get("metadata") or {}).get("namespace")
    family = [
        o
        for o in others
        if ((o.get("spec") or {}).get("job") or {}).get("uid") == uid
        and (o.get("metadata") or {}).get("namespace") == namespace
    ]
    restarts = [at for o in [incident, *family] for at, real in _stops(o) if real]
    holders = []
    for other in family:
        other_name = str((other.get("metadata") or {}).get("name"))
        if other_name == name:
            continue
        status = other.get("status") or {}
        if status.get("phase") == "Detected" and _stopping(status):
            # Its stop is recorded Pending (being taken, with its quarantine: the result is
            # written with theirs): it holds the job as from that intent.
            holders.append((other_name, True))
            continue
        stops = [at for at, _ in _stops(other)]
        if not stops or status.get("phase") in ("Released", "DryRun"):
            continue
        stopped = max(stops)
        if any(at > stopped for at in restarts):
            continue  # the job ran again after this stop: that hold was ended by hand
        resume = [
            a.get("result") for a in status.get("actions") or [] if a.get("action") == "resume-job"
        ]
        if "Succeeded" in resume:
            continue
        if status.get("phase") == "Detected":
            holders.append((other_name, True))
            continue
        contained = _condition(status, "Contained")
        if contained.get("reason") == "NodeQuarantined" and "Skipped" not in resume:
            continue
        holders.append((other_name, False))
    return sorted(holders)


def resume_max_step(
    incident: dict[str, Any], others: Iterable[dict[str, Any]]
) -> tuple[int, list[str]]:
    """The step the job may resume from at most when ``incident`` resumes it: the least
    last clean step over every incident of the job whose suspect window is still open, and
    the names of the others that lowered it.

    A resume from ``incident``'s own last clean step would take a checkpoint inside the
    window of another incident caught in the same run (the job caught twice before it
    stopped), and carry that corruption on. Another incident's window is open where it
    stopped the job (a ``suspend-job`` that succeeded), is neither released after review
    nor a dry run, was not ended by a person restarting the job after its stop, and did
    not resume the job itself before ``incident`` stopped it (that run, and its window,
    are behind: the job ran again from a step at or before it)."""
    spec = incident.get("spec") or {}
    uid = (spec.get("job") or {}).get("uid")
    name = (incident.get("metadata") or {}).get("name")
    namespace = (incident.get("metadata") or {}).get("namespace")
    own = int(spec.get("lastCleanStep", 0))
    windows: list[tuple[int, str]] = []
    mine = [at for at, _ in _stops(incident)]
    since = min(mine) if mine else None
    family = [
        o
        for o in others
        if ((o.get("spec") or {}).get("job") or {}).get("uid") == uid
        and (o.get("metadata") or {}).get("namespace") == namespace
        and (o.get("metadata") or {}).get("name") != name
    ]
    restarts = [at for o in [incident, *family] for at, real in _stops(o) if real]
    for other in family:
        status = other.get("status") or {}
        stops = [at for at, _ in _stops(other)]
        if not stops or status.get("phase") in ("Released", "DryRun"):
            continue
        if any(at > max(stops) for at in restarts):
            continue  # the job ran again after this stop: ended by hand
        resumed = []
        for entry in status.get("actions") or []:
            if entry.get("action") == "resume-job" and entry.get("result") == "Succeeded":
                try:
                    resumed.append(parse_time(str(entry.get("at"))))
                except ValueError:
                    continue
        if resumed and (since is None or min(resumed) <= since):
            continue  # it resumed the job before this incident stopped it: its run is past
        try:
            step = int(str((other.get("spec") or {}).get("lastCleanStep")))
        except (TypeError, ValueError):
            continue
        windows.append((step, str((other.get("metadata") or {}).get("name"))))
    least = min([own, *(step for step, _ in windows)])
    return least, sorted(n for step, n in windows if step == least and least < own)


def last_activity(incident: dict[str, Any]) -> datetime | None:
    """The newest time recorded in the incident's status (a condition, an action, a
    report), else its creation time."""
    status = incident.get("status") or {}
    stamps = [c.get("lastTransitionTime") for c in status.get("conditions") or []]
    stamps += [a.get("at") for a in status.get("actions") or []]
    stamps += [r.get("receivedAt") for r in status.get("reports") or []]
    times = []
    for stamp in stamps:
        try:
            times.append(parse_time(str(stamp)))
        except ValueError:
            continue
    if not times:
        try:
            times.append(parse_time(str((incident.get("metadata") or {}).get("creationTimestamp"))))
        except ValueError:
            return None
    return max(times)


def is_closed(incident: dict[str, Any], rules: Rules) -> bool:
    """Nothing is left to do now or later: no action pending or waiting for a person.
    (Whether it still holds a node is for the caller, who knows the nodes.)"""
    status = incident.get("status") or {}
    if any(a.get("result") == PENDING for a in status.get("actions") or []):
        return False
    phase = status.get("phase")
    if phase in (None, "Detected"):
        return phase is None and not status.get("reports")
    return not pending_actions(incident, rules)


# -- the verified snapshot and the work lost ---------------------------------------------------

SNAPSHOT_CONDITION = "Snapshot"
"""Condition saying whether the stop waited for the verified snapshot and what came of it:
``Unknown``/``Waiting``, ``True``/``SnapshotReported``, ``False``/``DeadlinePassed``."""
SNAPSHOT_REPORTED = "SnapshotReported"
SNAPSHOT_DEADLINE = "DeadlinePassed"
SNAPSHOT_LATE = "ReportedLate"
"""``True``: the snapshot came after the deadline (the stop did not wait for it) and the
job resumes from it all the same (:func:`late_snapshot`)."""


def expected_snapshot(incident: dict[str, Any], rules: Rules) -> int | None:
    """The step of the verified snapshot the job's agents announced with the agreed verdict
    (``snapshot_step``: they write it before the job stops), where the stop waits for it;
    ``None`` where none was announced, the wait is off (``snapshot_wait_seconds`` 0) or in
    dry-run (nothing is stopped)."""
    if rules.dry_run or rules.snapshot_wait_seconds <= 0:
        return None
    status = incident.get("status") or {}
    steps = [
        int(e["snapshotStep"])
        for e in agreed_reports(status, rules.agreement_nodes)
        if isinstance(e.get("snapshotStep"), int) and not isinstance(e.get("snapshotStep"), bool)
    ]
    return max(steps) if steps else None


def snapshot_gate(
    incident: dict[str, Any],
    rules: Rules,
    checkpoints: Sequence[Mapping[str, Any]],
    now: datetime,
) -> tuple[dict[str, Any] | None, float]:
    """Whether the stop of the job may go ahead, given the job's verified checkpoints
    (oldest first): ``(status to write first, or None; seconds still to wait, 0: go ahead)``.
    One transition per call: the wait starts (its start and deadline recorded in
    ``status.snapshot`` before anything waits, so a restarted operator keeps the same
    deadline), or ends, reported (a verified checkpoint at or after the snapshot's step and
    at or before the last clean step is known) or past its deadline (the resume falls back
    to the newest periodic verified checkpoint)."""
    status = incident.get("status") or {}
    recorded = status.get("snapshot")
    at = now_iso(now)
    if not recorded:
        step = expected_snapshot(incident, rules)
        if step is None:
            return None, 0.0
        wait = rules.snapshot_wait_seconds
        status = _copy_status(status)
        status["snapshot"] = {
            "step": step,
            "waitingSince": at,
            "deadline": now_iso(now + timedelta(seconds=wait)),
        }
        set_condition(
            status,
            SNAPSHOT_CONDITION,
            "Unknown",
            "Waiting",
            f"the suspect node is taken out at once; the job's stop waits up to {wait:g} s for "
            f"the verified snapshot of step {step} its healthy ranks are writing",
            at,
        )
        return status, wait
    if recorded.get("result"):
        return None, 0.0
    step = int(recorded.get("step") or 0)
    last_clean = int((incident.get("spec") or {}).get("lastCleanStep", 0))
    found = [c for c in checkpoints if step <= int(c["step"]) <= last_clean]
    if found:
        best = max(found, key=lambda c: int(c["step"]))
        status = _copy_status(status)
        status["snapshot"] = {
            **recorded,
            "result": SNAPSHOT_REPORTED,
            "at": at,
            "checkpoint": {"step": int(best["step"]), "location": str(best["location"])},
        }
        set_condition(
            status,
            SNAPSHOT_CONDITION,
            "True",
            SNAPSHOT_REPORTED,
            f"the verified snapshot of step {best['step']} was reported ({best['location']}); "
            "the job is stopped now and resumes from it",
            at,
        )
        return status, 0.0
    try:
        deadline = parse_time(str(recorded.get("deadline")))
    except ValueError:
        deadline = now  # a damaged record: no reason to hold the stop any longer
    left = (deadline - now).total_seconds()
    if left > 0:
        return None, left
    fallback = next((c for c in reversed(checkpoints) if int(c["step"]) <= last_clean), None)
    resume = (
        f"the newest periodic verified checkpoint, step {fallback['step']} ({fallback['location']})"
        if fallback is not None
        else f"the newest periodic verified checkpoint at or before step {last_clean} "
        "(none is known yet)"
    )
    status = _copy_status(status)
    status["snapshot"] = {**recorded, "result": SNAPSHOT_DEADLINE, "at": at}
    set_condition(
        status,
        SNAPSHOT_CONDITION,
        "False",
        SNAPSHOT_DEADLINE,
        f"no verified snapshot of step {step} was reported by its deadline "
        f"{recorded.get('deadline')}: the job is stopped and falls back to {resume}",
        at,
    )
    return status, 0.0


def late_snapshot(
    status: dict[str, Any], step: int, location: str | None, *, resumed: bool
) -> tuple[str, str, str, str] | None:
    """Where the stop's wait for the snapshot ended at its deadline and the job resumes from
    that snapshot after all (its report came later, before the resume picked the newest
    verified checkpoint, or the agents' ``select_checkpoint`` found it on disk): it is a
    verified checkpoint of the last clean window, and using it loses less than the periodic
    one. Records it in ``status.snapshot`` (``checkpoint``, ``reportedLate``; ``result``
    stays ``DeadlinePassed``: that is what the wait came to) and returns the ``Snapshot``
    condition that says so; ``None`` (and ``status`` untouched) otherwise. ``resumed``: the
    agents reported resuming from it (else the operator expects them to)."""
    recorded = status.get("snapshot")
    if not isinstance(recorded, dict) or recorded.get("result") != SNAPSHOT_DEADLINE:
        return None
    if step < int(recorded.get("step") or 0):
        return None  # the fall-back: what the condition already says
    checkpoint: dict[str, Any] = {"step": step}
    if location:
        checkpoint["location"] = location
    status["snapshot"] = {**recorded, "checkpoint": checkpoint, "reportedLate": True}
    where = f" ({location})" if location else ""
    return (
        SNAPSHOT_CONDITION,
        "True",
        SNAPSHOT_LATE,
        f"the verified snapshot of step {step}{where} was reported after the stop's deadline "
        f"{recorded.get('deadline')} (the job was stopped without waiting longer); the job "
        + ("resumed from it" if resumed else "resumes from it, not from the periodic checkpoint"),
    )


def lost_work(
    detection_step: int, resume_step: int, step_seconds: float | None, gpus: int | None
) -> dict[str, Any]:
    """``status.lostWork``: the steps between the resume and the detection, and where the
    step time (from the heartbeats) and the job's accelerator count are known, the GPU-hours
    they cost (steps x seconds per step x GPUs / 3600; omitted otherwise)."""
    steps = max(0, detection_step - resume_step)
    out: dict[str, Any] = {
        "detectionStep": detection_step,
        "resumeStep": resume_step,
        "steps": steps,
    }
    if step_seconds and step_seconds > 0 and gpus:
        out["gpuHours"] = steps * step_seconds * gpus / 3600.0
        out["stepSeconds"] = round(step_seconds, 6)
        out["gpus"] = gpus
    return out
