"""Which namespaces may use the operator: the cluster admin's ``SDCPolicy`` objects.

A job's own annotation (``hyperpod-sdc.dev/enabled``) is a tenant's word; only a cluster
admin writes an ``SDCPolicy`` (cluster-scoped), so only a policy decides whether a
namespace's reports are heard and how boldly its nodes may be remediated::

    apiVersion: hyperpod-sdc.dev/v1alpha1
    kind: SDCPolicy
    metadata: {name: ml-teams}
    spec:
      namespaces: [ml, research]                     # exact names, and/or
      namespaceSelector: {matchLabels: {team: ml}}   # a label selector
      remediationPolicy: manual  # manual | auto-replace-confirmed | auto-reboot | auto-replace
      dryRun: false                                  # observe only
      approvals: namespace   # namespace | cluster: who decides a quarantined node's fate

With ``approvals: cluster`` a person's decision about a quarantined node (replace, reboot,
release) is read only from an annotation on an admitting policy,
``approve.hyperpod-sdc.dev/<incident uid>: replace``, which only a cluster admin can write;
the incident's own ``hyperpod-sdc.dev/action`` (which anyone with ``patch`` on the
namespace's ``sdcincidents`` can write) is ignored. The incident's uid binds the approval to
one incident: a later incident on the same node needs its own.

A namespace is admitted when any policy admits it. Where several do, the most cautious
remediation policy wins and dry-run wins over acting: one admin's caution is never
overruled by another's boldness. Pure: works on the objects as the API server returns them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "APPROVAL_PREFIX",
    "POLICY_CAUTION",
    "Admission",
    "namespace_admission",
    "selector_matches",
]

APPROVAL_PREFIX = "approve.hyperpod-sdc.dev/"
"""An SDCPolicy annotation ``approve.hyperpod-sdc.dev/<incident uid>: <decision>``: a cluster
admin's decision for that incident (read where the policy says ``approvals: cluster``)."""

POLICY_CAUTION: tuple[str, ...] = (
    "manual",
    "auto-replace-confirmed",
    "auto-reboot",
    "auto-replace",
)
"""Remediation policies from the most cautious to the boldest. ``auto-replace-confirmed``
comes right after ``manual``: it acts on its own only where a confirmation run on the node
reproduced the fault, and asks a person everywhere else, so it acts on fewer nodes than
``auto-reboot`` (every quarantined node, if only with a reboot)."""


@dataclass(frozen=True, slots=True)
class Admission:
    admitted: bool
    remediation_policy: str
    """The most cautious policy among those that admit the namespace (meaningful when
    admitted)."""
    dry_run: bool
    policies: tuple[str, ...]
    """Names of the policies that admit the namespace."""
    reason: str
    """Why, in words (for a 403 message or an Event)."""
    cluster_approvals: bool = False
    """A person's decision about a quarantined node is read only from the admitting
    policies' :data:`APPROVAL_PREFIX` annotations (any admitting policy says
    ``approvals: cluster``, or a value this code does not know)."""
    approved: Mapping[str, str] = field(default_factory=dict)
    """Incident uid -> the decision the admitting policies record for it."""


def selector_matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A Kubernetes label selector (``matchLabels``, ``matchExpressions``) against ``labels``.

    An empty selector matches everything, as in Kubernetes; an operator this code does not
    know matches nothing (never admit by accident).
    """
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key = expression.get("key")
        operator = expression.get("operator")
        values = set(expression.get("values") or [])
        if operator == "In":
            ok = key in labels and labels[key] in values
        elif operator == "NotIn":
            ok = key not in labels or labels[key] not in values
        elif operator == "Exists":
            ok = key in labels
        elif operator == "DoesNotExist":
            ok = key not in labels
        else:
            return False
        if not ok:
            return False
    return True


def _admits(spec: Mapping[str, Any], namespace: str, labels: Mapping[str, str]) -> bool:
    if namespace in (spec.get("namespaces") or []):
        return True
    selector = spec.get("namespaceSelector")
    # A policy without a selector admits only the namespaces it names: an empty policy
    # must not admit the whole cluster.
    return isinstance(selector, Mapping) and selector_matches(selector, labels)


def namespace_admission(
    policies: Sequence[Mapping[str, Any]], namespace: str, namespace_labels: Mapping[str, str]
) -> Admission:
    """Whether ``namespace`` (with ``namespace_labels``) may use the operator, and how."""
    admitting = []
    for policy in policies:
        spec = policy.get("spec") or {}
        if _admits(spec, namespace, namespace_labels):
            admitting.append(policy)
    if not admitting:
        reason = (
            f"namespace {namespace} is not admitted by any SDCPolicy "
            f"({len(policies)} found); a cluster admin must list it in one"
        )
        return Admission(False, POLICY_CAUTION[0], False, (), reason)
    names = tuple(sorted(str((p.get("metadata") or {}).get("name", "")) for p in admitting))
    chosen = [str((p.get("spec") or {}).get("remediationPolicy") or "manual") for p in admitting]
    # Unknown values count as the most cautious: a typo never makes a policy bolder.
    rank = [POLICY_CAUTION.index(c) if c in POLICY_CAUTION else 0 for c in chosen]
    remediation = POLICY_CAUTION[min(rank)]
    dry_run = any((p.get("spec") or {}).get("dryRun") is True for p in admitting)
    reason = f"namespace {namespace} is admitted by SDCPolicy {', '.join(names)}"
    # A value other than "namespace" counts as "cluster": a typo never lets tenants decide.
    cluster = any(
        (p.get("spec") or {}).get("approvals", "namespace") != "namespace" for p in admitting
    )
    approved: dict[str, str] = {}
    for policy in sorted(admitting, key=lambda p: str((p.get("metadata") or {}).get("name"))):
        for key, value in ((policy.get("metadata") or {}).get("annotations") or {}).items():
            if key.startswith(APPROVAL_PREFIX):
                approved.setdefault(key.removeprefix(APPROVAL_PREFIX), str(value))
    return Admission(True, remediation, dry_run, names, reason, cluster, approved)
