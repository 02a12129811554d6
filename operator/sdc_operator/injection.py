"""What the admission webhook adds to a pod, as pure functions on the pod as submitted.

A pod of an opted-in job gets, in every container that runs the training (by name, or
every non-init container), only where absent:

- env ``POD_NAME`` and ``NODE_NAME`` (downward API), ``HYPERPOD_SDC_OPERATOR_URL``,
  ``HYPERPOD_SDC_TOKEN_FILE`` and, with TLS, ``HYPERPOD_SDC_CA_BUNDLE``;
- a mount of the projected ServiceAccount token (audience ``hyperpod-sdc``, rotated by the
  kubelet) and of the CA ConfigMap the operator publishes in the pod's namespace;

and the pod gets the two volumes. A value the pod already has wins: an env variable of the
same name, a volume of the same name, a mount at the same path. The annotation
``hyperpod-sdc.dev/injection`` says what was added and what was kept. Variables come
first in ``env``, so the pod's own variables can refer to them as ``$(NODE_NAME)``.

Independently of opt-in, every pod the webhook is sent gets its creator marker
(:mod:`.attestation`): written for a trusted pod creator, stripped for anyone else (the
API server's validating check refuses a marker the webhook did not write, where the
webhook did not run).

The patch is an RFC 6902 JSON Patch computed from the pod before and after, replacing whole
lists (``env``, ``volumeMounts``, ``volumes``) and single annotations, so it applies to
exactly the object the API server sent.
"""

from __future__ import annotations

import copy
import json
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sdc_common.names import (
    CA_BUNDLE_ENV,
    DEFAULT_TOKEN_FILE,
    OPERATOR_URL_ENV,
    TOKEN_FILE_ENV,
    VERDICT_URL_ENV,
)

from .attestation import ATTESTATION_ANNOTATION, CREATED_BY_ANNOTATION, MARKER_LABEL
from .names import GROUP
from .policy import selector_matches

__all__ = [
    "CA_BUNDLE_ENV",
    "CA_CONFIGMAP",
    "CA_DIR",
    "CA_KEY",
    "CA_VOLUME",
    "DEFAULT_POD_SELECTORS",
    "INJECTION_ANNOTATION",
    "INJECT_LABEL",
    "OPERATOR_URL_ENV",
    "TOKEN_DIR",
    "TOKEN_FILE_ENV",
    "TOKEN_VOLUME",
    "Wiring",
    "attest",
    "json_patch",
    "label_selector_string",
    "matches_any",
    "restore_attestation",
    "strip_attestation",
    "wire_pod",
]


INJECTION_ANNOTATION = f"{GROUP}/injection"
"""On an injected pod: JSON ``{"added": [...], "kept": [...]}`` of ``<container>/env/<NAME>``,
``<container>/volumeMount/<name>`` and ``volume/<name>`` items."""
INJECT_LABEL = f"{GROUP}/inject"
"""A pod-template label (``"true"``) that sends a pod to the webhook where its training
operator's own labels are not known (the default selector for HyperPodPyTorchJob pods)."""

TOKEN_VOLUME = "hyperpod-sdc-token"
TOKEN_DIR, TOKEN_PATH = posixpath.split(DEFAULT_TOKEN_FILE)
"""Where the agent looks for its token without being told (``sdc_common.names``)."""
CA_VOLUME = "hyperpod-sdc-ca"
CA_CONFIGMAP = "hyperpod-sdc-ca"
CA_DIR = "/etc/hyperpod-sdc/ca"
CA_KEY = "ca.crt"
# Kubernetes' own default file mode for projected and ConfigMap volumes (0644), written out
# so the pod the API server stores is exactly the one built here.
_DEFAULT_MODE = 0o644

DEFAULT_POD_SELECTORS: tuple[dict[str, Any], ...] = (
    # Kubeflow's training operator (v1.5 and later) labels every PyTorchJob pod so.
    {"matchLabels": {"training.kubeflow.org/operator-name": "pytorchjob-controller"}},
    # HyperPod's training operator documents no pod labels: its pod templates carry ours.
    {"matchLabels": {INJECT_LABEL: "true"}},
)
"""Label selectors of the pods the webhook is sent (one webhook entry each in the chart)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Wiring:
    """What an opted-in job's pods are given."""

    operator_url: str
    """``HYPERPOD_SDC_OPERATOR_URL`` for the agents, e.g. ``https://hyperpod-sdc.hyperpod-sdc.svc:443``."""
    verdict_url: str | None = None
    """``HYPERPOD_SDC_VERDICT_URL``: the intake's verdict listener, where the agents send
    every report but heartbeats; ``None`` sets none (they send everything to
    ``operator_url``)."""
    token_audience: str
    """Audience of the projected token (the operator's TokenReview audience)."""
    token_expiration_seconds: int = 3600
    """Lifetime of the projected token; the kubelet renews it at 80 %."""
    ca_configmap: str | None = CA_CONFIGMAP
    """The CA ConfigMap to mount; ``None`` (no TLS) mounts none and sets no CA variable."""
    containers: tuple[str, ...] = ()
    """Names of the containers to wire; empty: every non-init container."""


@dataclass(slots=True)
class _Record:
    added: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)


def _env_additions(wiring: Wiring) -> list[dict[str, Any]]:
    def field_ref(path: str) -> dict[str, Any]:
        return {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}

    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": field_ref("metadata.name")},
        {"name": "NODE_NAME", "valueFrom": field_ref("spec.nodeName")},
        {"name": OPERATOR_URL_ENV, "value": wiring.operator_url},
        {"name": TOKEN_FILE_ENV, "value": f"{TOKEN_DIR}/{TOKEN_PATH}"},
    ]
    if wiring.verdict_url:
        env.append({"name": VERDICT_URL_ENV, "value": wiring.verdict_url})
    if wiring.ca_configmap:
        env.append({"name": CA_BUNDLE_ENV, "value": f"{CA_DIR}/{CA_KEY}"})
    return env


def _volumes(wiring: Wiring) -> list[dict[str, Any]]:
    token = {
        "serviceAccountToken": {
            "audience": wiring.token_audience,
            "expirationSeconds": wiring.token_expiration_seconds,
            "path": TOKEN_PATH,
        }
    }
    volumes: list[dict[str, Any]] = [
        {"name": TOKEN_VOLUME, "projected": {"sources": [token], "defaultMode": _DEFAULT_MODE}}
    ]
    if wiring.ca_configmap:
        volumes.append(
            {
                "name": CA_VOLUME,
                # Not optional: a pod waits for its namespace's CA rather than start unable
                # to report (the operator publishes it when the job appears).
                "configMap": {"name": wiring.ca_configmap, "defaultMode": _DEFAULT_MODE},
            }
        )
    return volumes


def _mounts(wiring: Wiring) -> list[dict[str, Any]]:
    mounts = [{"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}]
    if wiring.ca_configmap:
        mounts.append({"name": CA_VOLUME, "mountPath": CA_DIR, "readOnly": True})
    return mounts


def _wire_container(
    container: dict[str, Any], wiring: Wiring, record: _Record, mounted: set[str]
) -> None:
    name = str(container.get("name") or "")
    env = list(container.get("env") or [])
    have = {e.get("name") for e in env if isinstance(e, Mapping)}
    first = []
    for var in _env_additions(wiring):
        item = f"{name}/env/{var['name']}"
        if var["name"] in have:
            record.kept.append(item)
        else:
            first.append(var)
            record.added.append(item)
    if first:
        container["env"] = first + env
    mounts = list(container.get("volumeMounts") or [])
    paths = {m.get("mountPath") for m in mounts if isinstance(m, Mapping)}
    names = {m.get("name") for m in mounts if isinstance(m, Mapping)}
    for mount in _mounts(wiring):
        item = f"{name}/volumeMount/{mount['name']}"
        if mount["name"] in names:
            record.kept.append(item)
            mounted.add(mount["name"])
        elif mount["mountPath"] in paths:
            record.kept.append(item)  # the pod's own volume is mounted there
        else:
            mounts.append(mount)
            record.added.append(item)
            mounted.add(mount["name"])
    container["volumeMounts"] = mounts


def wire_pod(pod: Mapping[str, Any], wiring: Wiring) -> dict[str, Any]:
    """A copy of ``pod`` with the agent's wiring added where absent, and the injection
    annotation saying what was added and kept."""
    out = copy.deepcopy(dict(pod))
    spec = out.setdefault("spec", {})
    record = _Record()
    mounted: set[str] = set()
    containers = [c for c in spec.get("containers") or [] if isinstance(c, dict)]
    chosen = [c for c in containers if not wiring.containers or c.get("name") in wiring.containers]
    for container in chosen:
        _wire_container(container, wiring, record, mounted)
    if mounted:
        volumes = list(spec.get("volumes") or [])
        have = {v.get("name") for v in volumes if isinstance(v, Mapping)}
        for volume in [v for v in _volumes(wiring) if v["name"] in mounted]:
            item = f"volume/{volume['name']}"
            if volume["name"] in have:
                record.kept.append(item)
            else:
                volumes.append(volume)
                record.added.append(item)
        spec["volumes"] = volumes
    meta = out.setdefault("metadata", {})
    annotations = dict(meta.get("annotations") or {})
    if not record.added and INJECTION_ANNOTATION in annotations:
        return out  # wired already (a second webhook entry selected it too): say it once
    annotations[INJECTION_ANNOTATION] = json.dumps(
        {"added": record.added, "kept": record.kept}, separators=(",", ":")
    )
    meta["annotations"] = annotations
    return out


def _set_annotation(pod: dict[str, Any], key: str, value: str | None) -> None:
    meta = pod.setdefault("metadata", {})
    annotations = dict(meta.get("annotations") or {})
    if value is None:
        annotations.pop(key, None)
    else:
        annotations[key] = value
    meta["annotations"] = annotations


def _set_label(pod: dict[str, Any], key: str, value: str | None) -> None:
    meta = pod.setdefault("metadata", {})
    labels = dict(meta.get("labels") or {})
    if value is None:
        labels.pop(key, None)
    else:
        labels[key] = value
    meta["labels"] = labels


def strip_attestation(pod: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``pod`` without the creator marker (label and annotation) and without a
    legacy ``v2`` attestation."""
    out = copy.deepcopy(dict(pod))
    for key in (CREATED_BY_ANNOTATION, ATTESTATION_ANNOTATION):
        _set_annotation(out, key, None)
    if MARKER_LABEL in ((out.get("metadata") or {}).get("labels") or {}):
        _set_label(out, MARKER_LABEL, None)
    return out


def _has_controller(pod: Mapping[str, Any]) -> bool:
    refs = (pod.get("metadata") or {}).get("ownerReferences") or []
    return any(isinstance(r, Mapping) and r.get("controller") for r in refs)


def attest(pod: Mapping[str, Any], username: str, trusted: Sequence[str]) -> dict[str, Any]:
    """A copy of ``pod`` (being created by ``username``) with the creator marker written if
    the creator is trusted and the pod has a controlling owner, else with none."""
    out = strip_attestation(pod)
    if username in trusted and _has_controller(out):
        _set_label(out, MARKER_LABEL, "true")
        _set_annotation(out, CREATED_BY_ANNOTATION, username)
    return out


def restore_attestation(
    pod: Mapping[str, Any], old: Mapping[str, Any], old_was_seen: bool
) -> dict[str, Any]:
    """A copy of ``pod`` (an update of ``old``) whose marker is the one ``old`` had at
    admission: an update never writes one. A pod the webhook never saw created (its labels
    did not select it then) keeps none, so relabelling does not launder a copied value."""
    out = strip_attestation(pod)
    if not old_was_seen:
        return out
    meta = old.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    for key in (CREATED_BY_ANNOTATION, ATTESTATION_ANNOTATION):
        if key in annotations:
            _set_annotation(out, key, str(annotations[key]))
    if MARKER_LABEL in (meta.get("labels") or {}):
        _set_label(out, MARKER_LABEL, str(meta["labels"][MARKER_LABEL]))
    return out


def matches_any(selectors: Sequence[Mapping[str, Any]], labels: Mapping[str, str]) -> bool:
    """``labels`` match one of the webhook's pod selectors: such a pod is sent to it."""
    return any(selector_matches(s, labels) for s in selectors)


def label_selector_string(selector: Mapping[str, Any]) -> str:
    """A LabelSelector in the ``?labelSelector=`` syntax of list calls."""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expression in selector.get("matchExpressions") or []:
        key, op = expression["key"], expression["operator"]
        values = ",".join(sorted(expression.get("values") or []))
        parts.append(
            {
                "In": f"{key} in ({values})",
                "NotIn": f"{key} notin ({values})",
                "Exists": key,
                "DoesNotExist": f"!{key}",
            }[op]
        )
    return ",".join(parts)


def _pointer(*parts: str | int) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _list_ops(before: Any, after: Any, path: str) -> list[dict[str, Any]]:
    if before == after:
        return []
    if after is None:
        return [{"op": "remove", "path": path}]
    return [{"op": "add" if before is None else "replace", "path": path, "value": after}]


def json_patch(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The JSON Patch that turns ``before`` into ``after``, for the parts this module
    changes: labels and annotations (one by one), ``spec.volumes``, and each container's
    ``env`` and ``volumeMounts``. Containers are never added, removed or reordered."""
    ops: list[dict[str, Any]] = []
    old_meta, new_meta = before.get("metadata") or {}, after.get("metadata") or {}
    for part in ("labels", "annotations"):
        old_map, new_map = old_meta.get(part), new_meta.get(part) or {}
        if old_map is None and new_map:
            ops.append({"op": "add", "path": f"/metadata/{part}", "value": dict(new_map)})
        elif old_map is not None:
            for k in sorted(set(old_map) | set(new_map)):
                path = _pointer("metadata", part, k)
                ops += _list_ops(old_map.get(k), new_map.get(k), path)
    old_spec, new_spec = before.get("spec") or {}, after.get("spec") or {}
    ops += _list_ops(old_spec.get("volumes"), new_spec.get("volumes"), "/spec/volumes")
    old_containers = old_spec.get("containers") or []
    for i, container in enumerate(new_spec.get("containers") or []):
        was = old_containers[i] if i < len(old_containers) else {}
        for key in ("env", "volumeMounts"):
            ops += _list_ops(
                was.get(key), container.get(key), _pointer("spec", "containers", i, key)
            )
    return ops
