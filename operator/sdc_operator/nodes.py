"""Pure decisions about nodes: which EC2 instance a node is, and how to quarantine it.

Never ``node.kubernetes.io/out-of-service``: it force-detaches the volumes of a node that
is still running.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from typing import Any

from .names import (
    FIELD_MANAGER,
    HYPERPOD_HEALTH_LABEL,
    INCIDENT_ANNOTATION,
    PRIOR_CORDON_ANNOTATION,
    SUSPECT_KEY,
)

__all__ = [
    "FIELD_MANAGER",
    "cordoned_by_others",
    "health_label_patch",
    "holders",
    "hand_over_patch",
    "instance_id_from_node_name",
    "instance_id_from_provider_id",
    "is_quarantined_for",
    "quarantine_patch",
    "release_patch",
]

_INSTANCE = re.compile(r"^i-[0-9a-f]{8}(?:[0-9a-f]{9})?$")
SUSPECT_TAINT = {"key": SUSPECT_KEY, "value": "true", "effect": "NoSchedule"}


def instance_id_from_provider_id(provider_id: str | None) -> str | None:
    """``aws:///us-west-2a/i-0123456789abcdef0`` -> ``i-0123456789abcdef0``; else ``None``."""
    if not provider_id or not provider_id.startswith("aws://"):
        return None
    candidate = provider_id.rstrip("/").rsplit("/", 1)[-1]
    return candidate if _INSTANCE.match(candidate) else None


def instance_id_from_node_name(name: str | None) -> str | None:
    """HyperPod names nodes ``hyperpod-i-0123456789abcdef0``; else ``None``."""
    if not name or not name.startswith("hyperpod-"):
        return None
    candidate = name[len("hyperpod-") :]
    return candidate if _INSTANCE.match(candidate) else None


def quarantine_patch(node: dict[str, Any], incident: str) -> dict[str, Any] | None:
    """The merge patch that cordons, taints, labels and annotates ``node`` for
    ``incident`` (``<namespace>/<name>``), or ``None`` when it already is: idempotent.

    The taint list is replaced whole (a merge patch cannot append), so the patch carries
    the node's other taints as read, and the read's ``resourceVersion`` as a precondition:
    if anyone changed the node since (another controller's taint, a cordon), the API
    server refuses the patch (409) and the caller reads the node again. A node that was
    cordoned already is annotated so, and :func:`release_patch` leaves it cordoned.
    """
    spec = node.get("spec") or {}
    meta = node.get("metadata") or {}
    taints = copy.deepcopy(spec.get("taints") or [])
    has_taint = any(t.get("key") == SUSPECT_KEY and t.get("effect") == "NoSchedule" for t in taints)
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    labelled = labels.get(SUSPECT_KEY) == "true"
    annotated = annotations.get(INCIDENT_ANNOTATION) == incident
    if spec.get("unschedulable") is True and has_taint and labelled and annotated:
        return None
    if not has_taint:
        taints.append(dict(SUSPECT_TAINT))
    new_annotations: dict[str, Any] = {INCIDENT_ANNOTATION: incident}
    if spec.get("unschedulable") is True and not (labelled or INCIDENT_ANNOTATION in annotations):
        new_annotations[PRIOR_CORDON_ANNOTATION] = "true"
    patch_meta: dict[str, Any] = {"labels": {SUSPECT_KEY: "true"}, "annotations": new_annotations}
    if meta.get("resourceVersion"):
        patch_meta["resourceVersion"] = meta["resourceVersion"]
    return {"metadata": patch_meta, "spec": {"unschedulable": True, "taints": taints}}


def is_quarantined_for(node: dict[str, Any], incident: str) -> bool:
    """Cordoned, tainted, labelled and annotated for ``incident``: a quarantine that took
    effect (what a restart checks before quarantining again)."""
    return quarantine_patch(node, incident) is None


def cordoned_by_others(node: dict[str, Any]) -> bool:
    """Someone other than the operator set ``spec.unschedulable`` last (the node's
    ``managedFields``): a cordon that a release must keep."""
    for entry in (node.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") == FIELD_MANAGER:
            continue
        fields = ((entry.get("fieldsV1") or {}).get("f:spec")) or {}
        if "f:unschedulable" in fields:
            return True
    return False


def release_patch(node: dict[str, Any]) -> dict[str, Any] | None:
    """Undo :func:`quarantine_patch` (after review found a false alarm), or ``None``: only
    what the operator added goes (its taint, label and annotations; other taints stay, as
    read, under the read's ``resourceVersion``), and the node is uncordoned only if it was
    not cordoned before the quarantine and nobody else cordoned it since."""
    spec = node.get("spec") or {}
    meta = node.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    taints = [t for t in spec.get("taints") or [] if t.get("key") != SUSPECT_KEY]
    quarantined = (
        len(taints) != len(spec.get("taints") or [])
        or SUSPECT_KEY in (meta.get("labels") or {})
        or INCIDENT_ANNOTATION in annotations
    )
    if not quarantined:
        return None
    keep_cordon = annotations.get(PRIOR_CORDON_ANNOTATION) == "true" or cordoned_by_others(node)
    patch_meta: dict[str, Any] = {
        "labels": {SUSPECT_KEY: None},
        "annotations": {INCIDENT_ANNOTATION: None, PRIOR_CORDON_ANNOTATION: None},
    }
    if meta.get("resourceVersion"):
        patch_meta["resourceVersion"] = meta["resourceVersion"]
    patch_spec: dict[str, Any] = {"taints": taints or None}
    if spec.get("unschedulable") is True and not keep_cordon:
        patch_spec["unschedulable"] = None
    return {"metadata": patch_meta, "spec": patch_spec}


def holders(node_name: str, incident: str, others: Iterable[dict[str, Any]]) -> list[str]:
    """The other incidents (``<namespace>/<name>``) that still hold ``node_name``
    quarantined: each quarantined it (``quarantine-node`` succeeded) and has neither been
    released after review nor given the node up (a ``release-node`` with a result). A
    release by one of them must leave the node quarantined for the rest: the node's
    annotation names one incident only (the last to quarantine it), and which incident a
    person releases first is theirs to choose."""
    held = []
    for other in others:
        meta = other.get("metadata") or {}
        ref = f"{meta.get('namespace')}/{meta.get('name')}"
        if ref == incident or meta.get("deletionTimestamp"):
            continue
        status = other.get("status") or {}
        if status.get("phase") == "Released":
            continue
        quarantined = released = False
        for entry in status.get("actions") or []:
            if entry.get("target") != node_name:
                continue
            if entry.get("action") == "quarantine-node" and entry.get("result") == "Succeeded":
                quarantined = True
            if entry.get("action") == "release-node" and entry.get("result") not in (
                None,
                "Pending",
                "Failed",
            ):
                released = True
        if quarantined and not released:
            held.append(ref)
    return sorted(held)


def hand_over_patch(node: dict[str, Any], incident: str) -> dict[str, Any] | None:
    """Name ``incident`` as the node's holder (the annotation), the quarantine kept as it
    is, under the read's ``resourceVersion``; ``None`` where it is named already."""
    meta = node.get("metadata") or {}
    if (meta.get("annotations") or {}).get(INCIDENT_ANNOTATION) == incident:
        return None
    patch_meta: dict[str, Any] = {"annotations": {INCIDENT_ANNOTATION: incident}}
    if meta.get("resourceVersion"):
        patch_meta["resourceVersion"] = meta["resourceVersion"]
    return {"metadata": patch_meta}


HEALTH_LABEL_VALUES = {
    "reboot": "UnschedulablePendingReboot",
    "replace": "UnschedulablePendingReplacement",
}


def health_label_patch(node: dict[str, Any], action: str) -> dict[str, Any] | None:
    """Ask HyperPod to reboot or replace the node through its health-status label, or
    ``None`` if it already carries that value."""
    value = HEALTH_LABEL_VALUES[action]
    if ((node.get("metadata") or {}).get("labels") or {}).get(HYPERPOD_HEALTH_LABEL) == value:
        return None
    return {"metadata": {"labels": {HYPERPOD_HEALTH_LABEL: value}}}
