"""Which pods the training operator created: a signed annotation the webhook writes.

A pod's controller owner reference is written by whoever creates the pod, so it proves
nothing by itself: anyone who may create pods in a namespace could point one at an
opted-in job. The mutating webhook sees who creates each pod (``userInfo.username`` of
the admission request). For a pod created by a trusted creator (the training operator's
ServiceAccount) it writes::

    hyperpod-sdc.dev/created-by:  <username>
    hyperpod-sdc.dev/attestation: v2:<unix seconds>:<base64url of HMAC-SHA256(key, message)>
    message = "v2|<namespace>|<name>|<controlling owner's uid>|<username>|<unix seconds>"

and it strips both from every other creator's pod, so a copied or hand-written value does
not survive admission. The HMAC binds the annotation to the pod's namespace, name (or
``generateName`` when the name is assigned later), controlling owner, creator and the time
of admission; a pod verifies only if the API server created it within
:data:`WINDOW_SECONDS` of that time. So an attestation cannot be moved to another pod even
where the webhook did not run (it was down under ``failurePolicy: Ignore``): not to another
name, and not to a pod made later under the name of a deleted genuine one (training
operators reuse pod names). The key is the operator's (a Secret in its own namespace);
tenants never see it.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import OperatorError
from .names import GROUP

__all__ = [
    "ATTESTATION_ANNOTATION",
    "CREATED_BY_ANNOTATION",
    "KEY_BYTES",
    "WINDOW_SECONDS",
    "AttestationKey",
    "attestation_for",
    "load_key",
    "sign",
    "verify_pod",
]

log = logging.getLogger(__name__)

ATTESTATION_ANNOTATION = f"{GROUP}/attestation"
CREATED_BY_ANNOTATION = f"{GROUP}/created-by"
KEY_BYTES = 32
_VERSION = "v2"
WINDOW_SECONDS = 60
"""How far a pod's ``creationTimestamp`` may lie from the time its attestation was signed:
the webhook answers within its timeout (at most 30 s) before the API server stores the pod,
plus clock skew between the operator's node and the API server's."""


def sign(key: bytes, namespace: str, name: str, owner_uid: str, username: str, at: int) -> str:
    """The attestation value for a pod with these facts, admitted at unix time ``at``."""
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


def attestation_for(
    key: bytes, pod: Mapping[str, Any], username: str, at: int | None = None
) -> str | None:
    """What the webhook writes on ``pod`` (as submitted for creation, at unix time ``at``,
    default now), or ``None`` for a pod without a controlling owner or a name."""
    meta = pod.get("metadata") or {}
    name = meta.get("name") or meta.get("generateName")
    owner = _controller_uid(meta)
    if not name or not owner:
        return None
    when = int(time.time()) if at is None else at
    return sign(key, str(meta.get("namespace") or ""), str(name), owner, username, when)


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


def verify_pod(
    key: bytes, pod: Mapping[str, Any], trusted_creators: frozenset[str] | set[str]
) -> tuple[bool, str]:
    """``(genuine, why)``: the pod carries a valid attestation by a trusted creator for its
    own namespace, name (or generate name) and controlling owner, signed when the API server
    created it (within :data:`WINDOW_SECONDS`)."""
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
    """The key every replica signs (webhook) and verifies (intake) with, loaded once at
    start-up by :func:`load_key`."""

    value: bytes


class _Secrets(Protocol):
    async def get(self, api_version: str, plural: str, namespace: str | None, name: str) -> Any: ...

    async def create(
        self, api_version: str, plural: str, namespace: str | None, body: dict[str, Any]
    ) -> Any: ...


async def load_key(kube: _Secrets, namespace: str, secret: str) -> AttestationKey:
    """The key in the Secret ``secret`` (key ``key``) of ``namespace``; the first replica
    to find it missing creates it with :data:`KEY_BYTES` random bytes (a replica that
    loses that race reads the winner's)."""
    from .kube import is_conflict, is_not_found

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
            found = await kube.create("v1", "secrets", namespace, body)
            log.info("created the attestation key Secret %s/%s", namespace, secret)
        except Exception as exc2:
            if not is_conflict(exc2):
                raise OperatorError(
                    f"cannot create the attestation key Secret {namespace}/{secret}: {exc2}"
                ) from exc2
            found = await kube.get("v1", "secrets", namespace, secret)
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
