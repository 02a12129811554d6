"""Which pods the training operator created: a marker whose truth the API server enforces.

A pod's controller owner reference is written by whoever creates the pod, so it proves
nothing by itself: anyone who may create pods in a namespace could point one at an
opted-in job. Who creates a pod is known for certain only inside the API server
(``request.userInfo``); an admission webhook is told it in a review that anyone who can
reach the webhook can write, so nothing the webhook answers may serve as proof (a
signature it hands out, as the ``v2`` attestation was, is a capability a tenant can ask
for with a forged review).

So the proof is the API server's own refusal. The mutating webhook writes, on a pod a
trusted creator (the training operator's ServiceAccount) creates with a controlling owner::

    labels:      hyperpod-sdc.dev/attested: "true"
    annotations: hyperpod-sdc.dev/created-by: <username>

and strips both from every other pod; and a validating check that the API server runs
after every mutation, where the user is the real one, refuses (:func:`creator_refusal`):

- a pod created with the marker by anyone but a trusted creator, or naming another creator;
- an update that adds the marker, or changes the creator it names.

That check is a ``ValidatingAdmissionPolicy`` (Kubernetes 1.30 and later: inside the API
server, it cannot be unreachable or flooded) or the operator's validating webhook
(``failurePolicy: Fail``, any version: a review it does not answer refuses the pod, and
a review a tenant forges earns the tenant an ``allowed`` nobody acts on). Both select
pods by the marker label, so no pod that carries it escapes them. A marked pod in the
cluster was therefore created by a trusted creator, and the intake believes the marker on
the pod the API server stores (and on nothing a client sends). A pod made again under a
deleted genuine pod's name is a new pod: without the marker unless a trusted creator made
it, and with a new uid, which the agent's bound token must name.

The ``v2`` HMAC attestation of earlier versions is verified only where
``HYPERPOD_SDC_LEGACY_ATTESTATION_UNTIL`` says so, for pods created before that date
(:func:`verify_legacy`), so that training pods running through an upgrade keep reporting;
it is never written any more.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import OperatorError
from .names import GROUP

__all__ = [
    "ATTESTATION_ANNOTATION",
    "CREATED_BY_ANNOTATION",
    "KEY_BYTES",
    "MARKER_LABEL",
    "WINDOW_SECONDS",
    "AttestationKey",
    "creator_refusal",
    "load_key",
    "sign",
    "verify_legacy",
    "verify_pod",
]

log = logging.getLogger(__name__)

MARKER_LABEL = f"{GROUP}/attested"
"""The label (``"true"``) on a pod a trusted creator made; a label, not an annotation, so
that the validating check can select every pod that carries it."""
CREATED_BY_ANNOTATION = f"{GROUP}/created-by"
ATTESTATION_ANNOTATION = f"{GROUP}/attestation"
"""The ``v2`` HMAC of earlier versions (legacy, read only)."""
KEY_BYTES = 32
_VERSION = "v2"
WINDOW_SECONDS = 60
"""How far a pod's ``creationTimestamp`` may lie from the time its ``v2`` attestation was
signed."""


def _labels(pod: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return ((pod or {}).get("metadata") or {}).get("labels") or {}


def _creator(pod: Mapping[str, Any] | None) -> Any:
    return (((pod or {}).get("metadata") or {}).get("annotations") or {}).get(CREATED_BY_ANNOTATION)


def creator_refusal(
    operation: str,
    pod: Mapping[str, Any],
    old: Mapping[str, Any] | None,
    username: str,
    trusted: Collection[str],
) -> str | None:
    """Why the API server must refuse this write of ``pod`` (``old``: the pod before an
    update) by ``username``, or ``None``: the rule of the module's docstring, which the
    chart's ValidatingAdmissionPolicy states again in CEL."""
    if MARKER_LABEL not in _labels(pod):
        return None  # an unmarked pod claims nothing
    if operation == "CREATE":
        if username not in trusted:
            return (
                f"{MARKER_LABEL} may be set only by a trusted pod creator (the training "
                f"operator), not by {username or 'an anonymous user'}"
            )
        if _creator(pod) != username:
            return f"{CREATED_BY_ANNOTATION} must name the pod's creator, {username}"
        return None
    if operation == "UPDATE":
        if MARKER_LABEL not in _labels(old):
            return f"{MARKER_LABEL} cannot be added to an existing pod"
        if _creator(pod) != _creator(old):
            return f"{CREATED_BY_ANNOTATION} cannot be changed"
    return None


def verify_pod(pod: Mapping[str, Any], trusted_creators: Collection[str]) -> tuple[bool, str]:
    """``(genuine, why)`` for ``pod`` as the API server stores it: it carries the marker,
    naming a trusted creator."""
    meta = pod.get("metadata") or {}
    ref = f"pod {meta.get('namespace')}/{meta.get('name')}"
    username = _creator(pod)
    if (meta.get("labels") or {}).get(MARKER_LABEL) != "true" or not username:
        return False, (
            f"{ref} carries no {MARKER_LABEL}: the admission webhook did not see a trusted "
            "pod creator make it"
        )
    if username not in trusted_creators:
        return False, f"{ref} was created by {username}, not by a trusted pod creator"
    if not _controller_uid(meta):
        return False, f"{ref} has no controlling owner"
    return True, f"{ref} was created by {username}"


def sign(key: bytes, namespace: str, name: str, owner_uid: str, username: str, at: int) -> str:
    """The ``v2`` attestation value for a pod with these facts, admitted at unix time ``at``
    (what earlier versions wrote; the tests make legacy pods with it)."""
    if len(key) < 16:
        raise ValueError("attestation key: must be at least 16 bytes")
    message = "|".join((_VERSION, namespace, name, owner_uid, username, str(at))).encode()
    digest = hmac.new(key, message, hashlib.sha256).digest()
    return f"{_VERSION}:{at}:" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _controller_uid(meta: Mapping[str, Any]) -> str | None:
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid") or "")
    return None


def _signed_at(value: str) -> int | None:
    version, _, rest = value.partition(":")
    at, _, _mac = rest.partition(":")
    if version != _VERSION or not at.isdigit():
        return None
    return int(at)


def _created_at(meta: Mapping[str, Any]) -> float | None:
    stamp = meta.get("creationTimestamp")
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def verify_legacy(
    key: bytes, pod: Mapping[str, Any], trusted_creators: Collection[str], until: float
) -> tuple[bool, str]:
    """``(genuine, why)`` by the ``v2`` attestation of earlier versions, for a pod the API
    server created before unix time ``until`` (and only while it is earlier than that): a
    valid HMAC by a trusted creator for its own namespace, name (or generate name) and
    controlling owner, signed within :data:`WINDOW_SECONDS` of its creation."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    value = annotations.get(ATTESTATION_ANNOTATION)
    username = annotations.get(CREATED_BY_ANNOTATION)
    ref = f"pod {meta.get('namespace')}/{meta.get('name')}"
    if not value or not username:
        return False, (
            f"{ref} carries no {ATTESTATION_ANNOTATION}: the admission webhook did not see a "
            "trusted pod creator make it"
        )
    if username not in trusted_creators:
        return False, f"{ref} was created by {username}, not by a trusted pod creator"
    owner = _controller_uid(meta)
    if not owner:
        return False, f"{ref} has no controlling owner"
    at = _signed_at(str(value))
    if at is None:
        return False, f"{ref} carries an attestation of another format than {_VERSION}"
    created = _created_at(meta)
    if created is None:
        return False, f"{ref} has no creationTimestamp"
    if time.time() >= until or created >= until:
        return False, f"{ref} carries only a legacy {_VERSION} attestation, no longer accepted"
    if abs(created - at) > WINDOW_SECONDS:
        return False, (
            f"{ref} was created {created - at:+.0f} s from when its attestation was signed: "
            "the attestation was copied from another pod"
        )
    namespace = str(meta.get("namespace") or "")
    for name in (meta.get("name"), meta.get("generateName")):
        if name and hmac.compare_digest(
            str(value).encode(), sign(key, namespace, str(name), owner, username, at).encode()
        ):
            return True, f"{ref} was created by {username}"
    return False, f"{ref} carries an attestation that does not match it"


@dataclass(frozen=True, slots=True)
class AttestationKey:
    """The key the ``v2`` attestations of earlier versions were signed with (verified by
    :func:`verify_legacy` only), loaded once at start-up by :func:`load_key`."""

    value: bytes


class _Secrets(Protocol):
    async def get(self, api_version: str, plural: str, namespace: str | None, name: str) -> Any: ...


class _CreateOnce(Protocol):
    async def create_once(
        self, api_version: str, plural: str, namespace: str, body: dict[str, Any]
    ) -> tuple[dict[str, Any], bool]: ...


async def load_key(
    kube: _Secrets, effects: _CreateOnce, namespace: str, secret: str
) -> AttestationKey:
    """The key in the Secret ``secret`` (key ``key``) of ``namespace``; the first replica
    to find it missing creates it with :data:`KEY_BYTES` random bytes through ``effects``
    (:meth:`.effects.Effects.create_once`: a replica that loses that race reads the
    winner's)."""
    from .kube import is_not_found

    try:
        found = await kube.get("v1", "secrets", namespace, secret)
    except Exception as exc:
        if not is_not_found(exc):
            raise OperatorError(
                f"cannot read the attestation key Secret {namespace}/{secret}: {exc}"
            ) from exc
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": secret,
                "namespace": namespace,
                "labels": {"app.kubernetes.io/part-of": "hyperpod-sdc"},
            },
            "type": "Opaque",
            "data": {"key": base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode()},
        }
        try:
            found, made = await effects.create_once("v1", "secrets", namespace, body)
        except Exception as exc2:
            raise OperatorError(
                f"cannot create the attestation key Secret {namespace}/{secret}: {exc2}"
            ) from exc2
        if made:
            log.info("created the attestation key Secret %s/%s", namespace, secret)
    raw = ((found or {}).get("data") or {}).get("key") or ""
    try:
        value = base64.b64decode(raw, validate=True)
    except ValueError:
        value = b""
    if len(value) < 16:
        raise OperatorError(
            f"the attestation key Secret {namespace}/{secret} has no usable 'key' "
            f"(base64 of at least 16 bytes; {KEY_BYTES} when the operator creates it)"
        )
    return AttestationKey(value)
