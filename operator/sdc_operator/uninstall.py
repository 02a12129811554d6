"""What an uninstall leaves behind, and the clean-up before it (``kubectl sdc uninstall``,
run by the chart's pre-delete hook; docs/operator.md, "Uninstall").

Once the operator is gone nothing releases a quarantined node or restarts a suspended job,
so the clean-up decides each one and says so:

- **Quarantined nodes** stay quarantined by default: each is suspected of computing wrong
  results, and releasing it unreviewed would hand it back to the scheduler unguarded. Each
  one left is listed with its incident, why, and the exact commands that release it
  (only our taint, label and annotations; a cordon someone else set stays).
  ``--release-nodes`` releases them instead, with the operator's own release patch.
- **Suspended jobs** stay suspended: nothing is resumed by the clean-up. Each one an
  incident stopped is listed with the command that resumes it, and the step to resume at
  or before.
- **Our objects in tenant namespaces** go: the CA ConfigMaps (label
  ``app.kubernetes.io/managed-by=hyperpod-sdc-operator``) and confirmation pods
  (label ``hyperpod-sdc.dev/confirmation=true``), whose results nobody would read.
- **Incidents and the CRDs** stay: they are the audit trail of hardware actions. Helm
  installs ``crds/`` once and never deletes them; deleting the CRD deletes every incident.

This module is the pure half (what to do, what to say); :mod:`.cli` talks to the API.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .jobs import JOB_KINDS, is_suspended
from .names import GROUP, INCIDENT_ANNOTATION, PRIOR_CORDON_ANNOTATION, SUSPECT_KEY
from .nodes import cordoned_by_others, release_patch

__all__ = [
    "CONFIRMATION_SELECTOR",
    "MANAGED_SELECTOR",
    "LeftJob",
    "LeftNode",
    "Plan",
    "plan",
    "release_commands",
    "render_plan",
]

MANAGED_SELECTOR = "app.kubernetes.io/managed-by=hyperpod-sdc-operator"
"""The operator's ConfigMaps in tenant namespaces (the CA bundle)."""
CONFIRMATION_SELECTOR = f"{GROUP}/confirmation=true"
_CLOSED = frozenset({"Released", "Remediated", "NotHardware", "DryRun"})
"""Incident phases in which the job is no longer held by the incident."""


@dataclass(frozen=True, slots=True)
class LeftNode:
    name: str
    incident: str
    """``<namespace>/<name>`` from the node's annotation; empty where it has none."""
    why: str
    release: tuple[str, ...]
    """kubectl commands that release it by hand."""


@dataclass(frozen=True, slots=True)
class LeftJob:
    namespace: str
    kind: str
    name: str
    incident: str
    why: str
    resume: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    nodes: tuple[LeftNode, ...]
    """Nodes quarantined by us (left so, or released with ``--release-nodes``)."""
    jobs: tuple[LeftJob, ...]
    """Jobs an incident suspended: left suspended."""
    configmaps: tuple[tuple[str, str], ...]
    """(namespace, name) of our ConfigMaps: deleted."""
    pods: tuple[tuple[str, str], ...]
    """(namespace, name) of confirmation pods: deleted."""
    incidents: int
    """Incidents kept."""

    def as_json(self, released: bool) -> dict[str, Any]:
        return {
            "nodes": [
                {
                    "name": n.name,
                    "incident": n.incident,
                    "why": n.why,
                    "released": released,
                    "release": list(n.release),
                }
                for n in self.nodes
            ],
            "jobs": [
                {
                    "namespace": j.namespace,
                    "kind": j.kind,
                    "name": j.name,
                    "incident": j.incident,
                    "why": j.why,
                    "resume": list(j.resume),
                }
                for j in self.jobs
            ],
            "deleted": {
                "configmaps": [f"{ns}/{name}" for ns, name in self.configmaps],
                "pods": [f"{ns}/{name}" for ns, name in self.pods],
            },
            "incidents_kept": self.incidents,
        }


def release_commands(node: Mapping[str, Any]) -> tuple[str, ...]:
    """The kubectl commands that undo our quarantine of ``node`` as the operator's release
    would: our taint, label and annotations go; the cordon goes only where we set it."""
    name = shlex.quote(str(node["metadata"]["name"]))
    spec = node.get("spec") or {}
    meta = node.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    out = []
    if any(t.get("key") == SUSPECT_KEY for t in spec.get("taints") or []):
        out.append(f"kubectl taint node {name} {SUSPECT_KEY}-")
    if SUSPECT_KEY in (meta.get("labels") or {}):
        out.append(f"kubectl label node {name} {SUSPECT_KEY}-")
    ours = [key for key in (INCIDENT_ANNOTATION, PRIOR_CORDON_ANNOTATION) if key in annotations]
    if ours:
        out.append(f"kubectl annotate node {name} " + " ".join(f"{key}-" for key in ours))
    keep_cordon = annotations.get(PRIOR_CORDON_ANNOTATION) == "true" or cordoned_by_others(
        dict(node)
    )
    if spec.get("unschedulable") is True and not keep_cordon:
        out.append(f"kubectl uncordon {name}")
    return tuple(out)


def _key(incident: Mapping[str, Any]) -> str:
    meta = incident.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"


def plan(
    nodes: Iterable[Mapping[str, Any]],
    incidents: Iterable[Mapping[str, Any]],
    jobs: Mapping[tuple[str, str, str], Mapping[str, Any]],
    configmaps: Iterable[tuple[str, str]] = (),
    pods: Iterable[tuple[str, str]] = (),
) -> Plan:
    """What the clean-up does and leaves, from what the API server has: every node, every
    incident, the incidents' jobs by (namespace, kind, name) (absent: deleted)."""
    by_key = {_key(i): i for i in incidents}
    left_nodes = []
    for node in sorted(nodes, key=lambda n: str(n["metadata"]["name"])):
        if release_patch(dict(node)) is None:
            continue  # not quarantined by us
        ref = str(
            ((node.get("metadata") or {}).get("annotations") or {}).get(INCIDENT_ANNOTATION) or ""
        )
        incident = by_key.get(ref)
        if incident is None:
            why = (
                f"quarantined for incident {ref}, which no longer exists"
                if ref
                else "carries our taint or label without an incident"
            )
        else:
            phase = (incident.get("status") or {}).get("phase") or "Detected"
            why = (
                f"quarantined for incident {ref} (phase {phase}): suspected of silent data "
                f"corruption; review it (kubectl sdc describe {ref}) before releasing it"
            )
        left_nodes.append(LeftNode(str(node["metadata"]["name"]), ref, why, release_commands(node)))
    left_jobs = []
    for key, incident in sorted(by_key.items()):
        status = incident.get("status") or {}
        if status.get("phase") in _CLOSED:
            continue
        job_ref = (incident.get("spec") or {}).get("job") or {}
        namespace = str((incident.get("metadata") or {}).get("namespace"))
        kind, name = str(job_ref.get("kind") or ""), str(job_ref.get("name") or "")
        job = jobs.get((namespace, kind, name))
        if job is None or not is_suspended(dict(job)):
            continue
        plural = JOB_KINDS.get((str(job_ref.get("apiVersion")), kind), kind.lower() + "s")
        group = str(job_ref.get("apiVersion") or "").split("/")[0]
        clean = (incident.get("spec") or {}).get("lastCleanStep")
        patch = json.dumps({"spec": {"runPolicy": {"suspend": False}}}, separators=(",", ":"))
        left_jobs.append(
            LeftJob(
                namespace,
                kind,
                name,
                key,
                f"suspended by incident {key} (phase {status.get('phase')}); resume it from a "
                f"checkpoint at or before step {clean}, the last clean step",
                (
                    f"kubectl patch {plural}.{group} {shlex.quote(name)} -n "
                    f"{shlex.quote(namespace)} --type merge -p {shlex.quote(patch)}",
                ),
            )
        )
    return Plan(
        tuple(left_nodes),
        tuple(left_jobs),
        tuple(sorted(configmaps)),
        tuple(sorted(pods)),
        len(by_key),
    )


def render_plan(p: Plan, *, released: bool, dry_run: bool) -> str:
    """What a person reads in the hook's log (and ``kubectl sdc uninstall``'s output)."""
    verb = "would" if dry_run else "did"
    lines = []
    if p.nodes:
        if released:
            lines.append("nodes to release:" if dry_run else "nodes released:")
        else:
            lines.append("nodes LEFT QUARANTINED (each suspected of silent data corruption):")
        for n in p.nodes:
            lines.append(f"  {n.name}: {n.why}")
            if not released:
                lines.append("    release it by hand with:")
                lines += [f"      {c}" for c in n.release]
    else:
        lines.append("nodes: none quarantined by hyperpod-sdc")
    if p.jobs:
        lines.append("jobs LEFT SUSPENDED (nothing is resumed by the clean-up):")
        for j in p.jobs:
            lines.append(f"  {j.namespace}/{j.name} ({j.kind}): {j.why}")
            lines += [f"      {c}" for c in j.resume]
    else:
        lines.append("jobs: none suspended by an open incident")
    lines.append(
        f"{verb} delete {len(p.configmaps)} ConfigMap(s) and {len(p.pods)} confirmation pod(s) "
        "in tenant namespaces"
    )
    lines.append(
        f"kept {p.incidents} SDCIncident(s) and the CRDs (the audit trail; Helm never deletes "
        "crds/): kubectl get sdcincidents -A"
    )
    return "\n".join(lines) + "\n"
