"""Is the creator check installed? Looked for once at start-up.

The intake believes the creator marker (:mod:`.attestation`) on a stored pod only because
the API server refuses it from anyone but a trusted creator. That refusal is not the
operator's: it is a ``ValidatingAdmissionPolicy`` or a ``ValidatingWebhookConfiguration``
that the chart installs (``webhook.creatorCheck``). Where neither is there (the webhook
disabled, a policy deleted, an install by hand that left it out), any user who may create
pods in an admitted namespace can write the marker on its own pod, and that pod's verdicts
quarantine nodes. So the operator does not start without one, and says which it looked for
and what it found.

A check counts where it covers every write that can add the marker: ``CREATE`` and
``UPDATE`` of ``pods`` and of ``pods/status`` (a status update can change a pod's labels on
the API servers before 1.25ish), and fails closed (``failurePolicy: Fail``). The
operator's service account needs ``list`` on those admission kinds (the chart's
ClusterRole).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from .attestation import MARKER_LABEL
from .errors import ApiError, ConfigError
from .kube import Kube, is_not_found
from .webhook import CREATOR_PATH

__all__ = ["policy_problem", "verify_installed", "webhook_problem"]

log = logging.getLogger(__name__)

ADMISSION_API = "admissionregistration.k8s.io/v1"
_NEEDED = {(op, res) for op in ("CREATE", "UPDATE") for res in ("pods", "pods/status")}


def _covered(rules: Iterable[Mapping[str, Any]]) -> set[tuple[str, str]]:
    """The (operation, resource) pairs of :data:`_NEEDED` that ``rules`` send."""
    found: set[tuple[str, str]] = set()
    for rule in rules:
        groups = rule.get("apiGroups") or []
        versions = rule.get("apiVersions") or []
        if not ({"", "*"} & set(groups)) or not ({"v1", "*"} & set(versions)):
            continue
        operations = set(rule.get("operations") or [])
        resources = set(rule.get("resources") or [])
        for op, res in _NEEDED:
            if op not in operations and "*" not in operations:
                continue
            if res in resources or "*" in resources or (res != "pods" and "pods/*" in resources):
                found.add((op, res))
    return found


def _missing(found: set[tuple[str, str]]) -> str:
    return ", ".join(f"{op} {res}" for op, res in sorted(_NEEDED - found))


def webhook_problem(configurations: Iterable[Mapping[str, Any]]) -> str | None:
    """Why no ``ValidatingWebhookConfiguration`` here is the creator check, or ``None``."""
    seen = []
    for config in configurations:
        name = str((config.get("metadata") or {}).get("name"))
        for hook in config.get("webhooks") or []:
            client = hook.get("clientConfig") or {}
            path = str((client.get("service") or {}).get("path") or client.get("url") or "")
            if not path.endswith(CREATOR_PATH):
                continue
            found = _covered(hook.get("rules") or [])
            if hook.get("failurePolicy", "Fail") != "Fail":
                seen.append(f"{name}/{hook.get('name')} has failurePolicy {hook['failurePolicy']}")
            elif found != _NEEDED:
                seen.append(f"{name}/{hook.get('name')} does not send {_missing(found)}")
            else:
                return None
    if seen:
        return "; ".join(seen)
    return f"no ValidatingWebhookConfiguration sends pods to {CREATOR_PATH}"


def policy_problem(
    policies: Iterable[Mapping[str, Any]], bindings: Iterable[Mapping[str, Any]]
) -> str | None:
    """Why no ``ValidatingAdmissionPolicy`` here (with a ``Deny`` binding) is the creator
    check, or ``None``."""
    denied = {
        str((b.get("spec") or {}).get("policyName"))
        for b in bindings
        if "Deny" in ((b.get("spec") or {}).get("validationActions") or [])
    }
    seen = []
    for policy in policies:
        name = str((policy.get("metadata") or {}).get("name"))
        spec = policy.get("spec") or {}
        rules = (spec.get("matchConstraints") or {}).get("resourceRules") or []
        said = " ".join(
            str(v.get("expression") or "")
            for v in [*(spec.get("variables") or []), *(spec.get("validations") or [])]
        )
        if MARKER_LABEL not in said:
            continue
        found = _covered(rules)
        if spec.get("failurePolicy", "Fail") != "Fail":
            seen.append(f"{name} has failurePolicy {spec['failurePolicy']}")
        elif found != _NEEDED:
            seen.append(f"{name} does not match {_missing(found)}")
        elif name not in denied:
            seen.append(f"{name} has no binding with validationActions [Deny]")
        else:
            return None
    if seen:
        return "; ".join(seen)
    return f"no ValidatingAdmissionPolicy validates {MARKER_LABEL}"


async def _list(kube: Kube, plural: str) -> list[dict[str, Any]] | None:
    """The objects, or ``None`` where this API server does not serve the kind."""
    try:
        return await kube.list_objects(ADMISSION_API, plural)
    except ApiError as exc:
        if is_not_found(exc):
            return None
        if exc.status == 403:
            raise ConfigError(
                f"creator_check: cannot list {plural} ({exc}); the operator's ClusterRole "
                "needs list on them (the chart grants it), or set "
                "HYPERPOD_SDC_CREATOR_CHECK=unchecked where other admission control keeps the "
                "marker true"
            ) from exc
        raise


async def verify_installed(kube: Kube, mode: str) -> str:
    """What keeps the marker true, or :class:`ConfigError` naming the setting and what was
    found. ``mode``: ``policy``, ``webhook`` or ``any`` (``unchecked`` looks for nothing)."""
    if mode == "unchecked":
        log.warning(
            "HYPERPOD_SDC_CREATOR_CHECK=unchecked: not looking for the creator check; the "
            "creator marker is believed as the API server stores it"
        )
        return "unchecked"
    problems = []
    if mode in ("policy", "any"):
        policies = await _list(kube, "validatingadmissionpolicies")
        if policies is None:
            problems.append(
                "this API server serves no ValidatingAdmissionPolicy (Kubernetes 1.30+)"
            )
        else:
            bindings = await _list(kube, "validatingadmissionpolicybindings") or []
            why = policy_problem(policies, bindings)
            if why is None:
                return "policy"
            problems.append(why)
    if mode in ("webhook", "any"):
        why = webhook_problem(await _list(kube, "validatingwebhookconfigurations") or [])
        if why is None:
            return "webhook"
        problems.append(why)
    raise ConfigError(
        f"creator_check ({mode}): the creator check is not installed: {'; '.join(problems)}. "
        f"Without it anyone who may create pods can set {MARKER_LABEL} on its own pod and "
        "have its verdicts quarantine nodes. Install the chart with webhook.enabled=true "
        "(webhook.creatorCheck), or set HYPERPOD_SDC_REQUIRE_ATTESTATION=false (weaker: "
        "docs/operator.md, Threat model)"
    )
