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
from datetime import datetime, timezone
from typing import Any

from sdc_agent.protocol import VerdictReport

from .names import GROUP, INCIDENT_KIND, VERSION

__all__ = [
    "Action",
    "JobRef",
    "ResolvedSuspect",
    "agreed_group",
    "fold_report",
    "incident_name",
    "new_incident",
    "next_action",
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


def planned_actions(incident: dict[str, Any], needed: int) -> list[Action]:
    """Containment, in order: stop the job, then quarantine each suspect node (only for an
    agreed, localized verdict that accuses hardware)."""
    spec = incident.get("spec") or {}
    status = incident.get("status") or {}
    group = agreed_group(status.get("reports") or [], needed)
    if group is None:
        return []
    classification, localized, ranks = group
    if classification in NOT_HARDWARE:
        return []
    job = spec.get("job") or {}
    namespace = (incident.get("metadata") or {}).get("namespace", "")
    actions = [Action("suspend-job", f"{job.get('kind')} {namespace}/{job.get('name')}")]
    if localized and ranks:
        nodes: list[str] = []
        for suspect in status.get("suspects") or []:
            node = suspect.get("node")
            if node and node not in nodes:
                nodes.append(node)
        actions += [Action("quarantine-node", node) for node in nodes]
    return actions


def done_actions(status: dict[str, Any]) -> set[Action]:
    return {
        Action(a["action"], a.get("target", ""))
        for a in status.get("actions") or []
        if a.get("result") in FINAL_RESULTS
    }


def post_containment_actions(incident: dict[str, Any]) -> list[Action]:
    """After containment: restart the job (only where its suspect node was quarantined,
    so the restarted pods cannot land there)."""
    status = incident.get("status") or {}
    contained: dict[str, Any] = next(
        (c for c in status.get("conditions") or [] if c.get("type") == "Contained"), {}
    )
    if contained.get("status") != "True" or contained.get("reason") != "NodeQuarantined":
        return []
    job = (incident.get("spec") or {}).get("job") or {}
    namespace = (incident.get("metadata") or {}).get("namespace", "")
    return [Action("resume-job", f"{job.get('kind')} {namespace}/{job.get('name')}")]


def next_action(incident: dict[str, Any], needed: int) -> Action | None:
    """The first planned action not yet recorded as done, or ``None``."""
    status = incident.get("status") or {}
    phase = status.get("phase")
    if phase == "Detected":
        planned = planned_actions(incident, needed)
    elif phase in ("Contained", "Resumed"):
        planned = post_containment_actions(incident)
    else:
        return None
    done = done_actions(status)
    return next((a for a in planned if a not in done), None)


def record_action(
    status: dict[str, Any], action: Action, result: str, message: str, at: str
) -> dict[str, Any]:
    status = _copy_status(status)
    status.setdefault("actions", []).append(
        {
            "action": action.action,
            "target": action.target,
            "at": at,
            "result": result,
            "message": message,
        }
    )
    return status


def containment_summary(
    incident: dict[str, Any], needed: int, dry_run: bool
) -> tuple[str, str, str, str] | None:
    """Once every planned action is done: (phase, Contained status, reason, message)."""
    status = incident.get("status") or {}
    if status.get("phase") != "Detected" or next_action(incident, needed) is not None:
        return None
    actions = planned_actions(incident, needed)
    nodes = [a.target for a in actions if a.action == "quarantine-node"]
    if dry_run:
        return (
            "DryRun",
            "False",
            "DryRun",
            "dry-run: recorded the actions it would take, took none",
        )
    if nodes:
        return (
            "Contained",
            "True",
            "NodeQuarantined",
            f"job stopped; node(s) {', '.join(nodes)} cordoned and tainted",
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
