"""Pure decisions about incidents: naming, folding reports, agreement, the next action.

An incident is one ``SDCIncident`` per job and suspect window ``(last_clean_step, step]``.
Every node's reporting rank sends the same verdict, so reports for one window fold into
one incident, one entry per reporting node. Nothing is quarantined until
``agreement_nodes`` distinct nodes named the same suspects: one broken or lying node
cannot take down another.

The status is the incident's whole memory. :func:`next_action` reads it (and nothing
else), so an operator restarted at any point continues with the first action not yet
recorded, and every action is idempotent in case it ran but was not recorded.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sdc_agent.protocol import VerdictReport

from .names import ACTION_ANNOTATION, ACTIONS, GROUP, INCIDENT_KIND, VERSION

__all__ = [
    "Action",
    "JobRef",
    "Rules",
    "ResolvedSuspect",
    "agreed_group",
    "fold_report",
    "incident_name",
    "new_incident",
    "next_action",
    "pending_actions",
    "post_containment_actions",
    "resumed_status",
    "now_iso",
    "record_action",
    "set_condition",
]

NOT_HARDWARE = frozenset({"training", "nondeterministic"})
"""Classifications that never accuse hardware: recorded, no action taken."""
# Phases in which a new report may still change suspects and phase.
_OPEN_PHASES = frozenset({None, "WaitingForAgreement", "NotHardware"})
FINAL_RESULTS = frozenset({"Succeeded", "DryRun", "Skipped"})
"""Results that end an action; ``Failed`` is retried."""


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


def now_iso(now: datetime | None = None) -> str:
    return (now or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")


_NOT_DNS = re.compile(r"[^a-z0-9-]")


def incident_name(job: JobRef, report: VerdictReport) -> str:
    """Deterministic, so concurrent reports for one window meet at one object:
    ``<job>-<step>-<hash of job uid and window>`` (at most 63 characters)."""
    window = f"{job.uid}/{report.last_clean_step}/{report.step}"
    digest = hashlib.sha256(window.encode()).hexdigest()[:8]
    base = _NOT_DNS.sub("-", job.name.lower())[:40].strip("-") or "job"
    return f"{base}-{report.step}-{digest}"


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
    if report.transient is not None:
        spec["transient"] = report.transient
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


def fold_report(
    status: dict[str, Any],
    report: VerdictReport,
    *,
    reporter_pod: str,
    reporter_node: str,
    suspects: Sequence[ResolvedSuspect],
    needed: int,
    received_at: str,
) -> tuple[dict[str, Any], bool]:
    """The status after ``report`` (from ``reporter_pod`` on ``reporter_node``, both
    authenticated) folds in, and whether anything changed. A second report from a node
    already recorded changes nothing."""
    status = _copy_status(status)
    reports = status.setdefault("reports", [])
    if any(entry.get("node") == reporter_node for entry in reports):
        return status, False
    entry = {
        "node": reporter_node,
        "pod": reporter_pod,
        "rank": report.reporter.rank,
        "receivedAt": received_at,
        "classification": report.classification,
        "localized": report.localized,
        "suspectRanks": [s.rank for s in suspects],
    }
    reports.append(entry)
    if status.get("phase") in _OPEN_PHASES:
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
        status["phase"] = _phase_before_containment(reports, needed)
    return status, True


def _set_suspects(status: dict[str, Any], suspects: Sequence[ResolvedSuspect]) -> None:
    status["suspects"] = [s.as_status() for s in suspects]
    for key in ("ranks", "node", "instanceId"):
        status.pop(key, None)
    if suspects:
        status["ranks"] = ",".join(str(s.rank) for s in suspects)
        status["node"] = suspects[0].node
        if suspects[0].instance_id:
            status["instanceId"] = suspects[0].instance_id


def _phase_before_containment(reports: Sequence[dict[str, Any]], needed: int) -> str:
    group = agreed_group(reports, needed)
    if group is None:
        if all(e.get("classification") in NOT_HARDWARE for e in reports):
            return "NotHardware"
        return "WaitingForAgreement"
    return "NotHardware" if group[0] in NOT_HARDWARE else "Detected"


@dataclass(frozen=True, slots=True)
class Rules:
    """The settings the decisions depend on (from :class:`OperatorSettings`)."""

    agreement_nodes: int = 2
    storm_suspect_nodes: int = 2
    dry_run: bool = False
    remediation_policy: str = "manual"
    backoff_seconds: float = 30.0

    @classmethod
    def of(cls, settings: Any) -> Rules:
        return cls(
            agreement_nodes=settings.agreement_nodes,
            storm_suspect_nodes=settings.storm_suspect_nodes,
            dry_run=settings.dry_run,
            remediation_policy=settings.remediation_policy,
            backoff_seconds=settings.remediation_backoff_seconds,
        )


def _job_target(incident: dict[str, Any]) -> str:
    job = (incident.get("spec") or {}).get("job") or {}
    namespace = (incident.get("metadata") or {}).get("namespace", "")
    return f"{job.get('kind')} {namespace}/{job.get('name')}"


def suspect_nodes(incident: dict[str, Any]) -> list[str]:
    nodes: list[str] = []
    for suspect in (incident.get("status") or {}).get("suspects") or []:
        node = suspect.get("node")
        if node and node not in nodes:
            nodes.append(node)
    return nodes


def is_storm(incident: dict[str, Any], rules: Rules) -> bool:
    """Suspects on many nodes at once point at software non-determinism, not hardware."""
    return len(suspect_nodes(incident)) > rules.storm_suspect_nodes


def planned_actions(incident: dict[str, Any], rules: Rules) -> list[Action]:
    """Containment, in order: stop the job, then quarantine each suspect node (only for an
    agreed, localized verdict that accuses hardware, and not in a storm)."""
    status = incident.get("status") or {}
    group = agreed_group(status.get("reports") or [], rules.agreement_nodes)
    if group is None:
        return []
    classification, localized, ranks = group
    if classification in NOT_HARDWARE:
        return []
    actions = [Action("suspend-job", _job_target(incident))]
    if localized and ranks and not is_storm(incident, rules):
        actions += [Action("quarantine-node", node) for node in suspect_nodes(incident)]
    return actions


def done_actions(status: dict[str, Any]) -> set[Action]:
    return {
        Action(a["action"], a.get("target", ""))
        for a in status.get("actions") or []
        if a.get("result") in FINAL_RESULTS
    }


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
    person asked for with the ``hyperpod-sdc.dev/action`` annotation."""
    asked = []
    if rules.remediation_policy in ("auto-reboot", "auto-replace"):
        asked.append(rules.remediation_policy.removeprefix("auto-"))
    annotation = ((incident.get("metadata") or {}).get("annotations") or {}).get(ACTION_ANNOTATION)
    if annotation in ACTIONS and annotation not in asked:
        asked.append(annotation)
    return asked


def post_containment_actions(incident: dict[str, Any], rules: Rules) -> list[Action]:
    """After containment: restart the job (only where its suspect nodes were quarantined,
    so the restarted pods cannot land there), then remediate the quarantined nodes as the
    policy or a person asks."""
    status = incident.get("status") or {}
    actions = []
    contained = _condition(status, "Contained")
    if contained.get("status") == "True" and contained.get("reason") == "NodeQuarantined":
        actions.append(Action("resume-job", _job_target(incident)))
    nodes = quarantined_nodes(status)
    for request in requested_remediation(incident, rules):
        actions += [Action(f"{request}-node", node) for node in nodes]
    return actions


def _parse_time(at: str) -> datetime:
    return datetime.strptime(at, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)


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
    return _parse_time(failures[-1]["at"]) + timedelta(seconds=delay)


_OPEN_FOR_ACTIONS = frozenset({"Contained", "Resumed", "Remediated"})


def next_action(
    incident: dict[str, Any], rules: Rules, now: datetime | None = None
) -> Action | None:
    """The first planned action not yet done and not waiting out a back-off, or ``None``."""
    status = incident.get("status") or {}
    phase = status.get("phase")
    if phase == "Detected":
        planned = planned_actions(incident, rules)
    elif phase in _OPEN_FOR_ACTIONS:
        planned = post_containment_actions(incident, rules)
    else:
        return None
    done = done_actions(status)
    now = now or datetime.now(timezone.utc)
    for action in planned:
        if action in done:
            continue
        due = retry_at(status, action, rules)
        if due is None or due <= now:
            return action
    return None


def pending_actions(incident: dict[str, Any], rules: Rules) -> bool:
    """Anything left to do now or after a back-off (the resync keeps driving it)."""
    status = incident.get("status") or {}
    phase = status.get("phase")
    if phase == "Detected":
        return True
    if phase not in _OPEN_FOR_ACTIONS:
        return False
    done = done_actions(status)
    return any(a not in done for a in post_containment_actions(incident, rules))


def record_action(
    status: dict[str, Any],
    action: Action,
    result: str,
    message: str,
    at: str,
    reason: str | None = None,
) -> dict[str, Any]:
    status = _copy_status(status)
    entry = {
        "action": action.action,
        "target": action.target,
        "at": at,
        "result": result,
        "message": message[:1024],
    }
    if reason:
        entry["reason"] = reason
    status.setdefault("actions", []).append(entry)
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
            f"job stopped; node(s) {', '.join(planned)} cordoned and tainted",
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
    if location:
        status["resumedFrom"] = location
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
