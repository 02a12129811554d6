"""Who is reporting: a Bearer token -> the reporting pod, proven, never taken on the
report's word.

``tokenreview`` mode (the default) asks the API server to review the pod's projected
ServiceAccount token for the operator's audience; a token bound to a pod carries the pod's
name and uid in the review's ``extra``. ``static`` mode (development only) reads tokens
from a file.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .errors import ConfigError, Refusal

__all__ = ["Authenticator", "PodIdentity", "StaticTokens", "TokenReviewer"]

POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
SA_PREFIX = "system:serviceaccount:"


@dataclass(frozen=True, slots=True)
class PodIdentity:
    namespace: str
    pod: str
    pod_uid: str | None = None
    """Set by TokenReview; the intake checks it against the pod it reads."""


class Authenticator(Protocol):
    async def authenticate(self, token: str) -> PodIdentity: ...


class Reviewer(Protocol):
    async def token_review(self, token: str, audience: str) -> dict[str, object]: ...


def _unauthenticated(message: str) -> Refusal:
    return Refusal(401, "unauthenticated", message)


class TokenReviewer:
    """TokenReview with a short cache (by the token's SHA-256, never the token)."""

    def __init__(
        self, kube: Reviewer, audience: str, cache_seconds: float, max_cached: int = 10000
    ) -> None:
        self._kube = kube
        self._audience = audience
        self._cache_seconds = cache_seconds
        self._max_cached = max_cached
        self._cache: OrderedDict[bytes, tuple[float, PodIdentity]] = OrderedDict()

    async def authenticate(self, token: str) -> PodIdentity:
        key = hashlib.sha256(token.encode()).digest()
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > now:
            return cached[1]
        status = await self._kube.token_review(token, self._audience)
        identity = self._identity(status)
        if self._cache_seconds > 0:
            self._cache[key] = (now + self._cache_seconds, identity)
            self._cache.move_to_end(key)
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return identity

    def _identity(self, status: dict[str, object]) -> PodIdentity:
        if status.get("authenticated") is not True:
            error = status.get("error") or "the API server did not authenticate it"
            raise _unauthenticated(f"token rejected: {error}")
        audiences = status.get("audiences")
        if isinstance(audiences, list) and self._audience not in audiences:
            raise _unauthenticated(f"token is not meant for audience {self._audience!r}")
        user = status.get("user")
        user = user if isinstance(user, dict) else {}
        username = str(user.get("username") or "")
        if not username.startswith(SA_PREFIX):
            raise _unauthenticated(f"{username or 'the token'} is not a ServiceAccount")
        namespace = username[len(SA_PREFIX) :].split(":", 1)[0]
        extra = user.get("extra") if isinstance(user.get("extra"), dict) else {}
        assert isinstance(extra, dict)
        pods = extra.get(POD_NAME_EXTRA) or []
        uids = extra.get(POD_UID_EXTRA) or []
        if not pods:
            raise _unauthenticated(
                "token is not bound to a pod: mount a projected ServiceAccount token "
                f"with audience {self._audience!r} (docs/operator.md)"
            )
        return PodIdentity(namespace, str(pods[0]), str(uids[0]) if uids else None)


class StaticTokens:
    """Development only: ``<token> <namespace>/<pod>`` per line of a file."""

    def __init__(self, path: str) -> None:
        self._tokens: list[tuple[bytes, PodIdentity]] = []
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise ConfigError(
                f"HYPERPOD_SDC_STATIC_TOKENS_FILE: cannot read {path}: {exc}"
            ) from exc
        for number, line in enumerate(lines, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2 or parts[1].count("/") != 1:
                raise ConfigError(
                    f"HYPERPOD_SDC_STATIC_TOKENS_FILE: {path}:{number}: expected "
                    "'<token> <namespace>/<pod>'"
                )
            namespace, pod = parts[1].split("/")
            self._tokens.append((parts[0].encode(), PodIdentity(namespace, pod)))

    async def authenticate(self, token: str) -> PodIdentity:
        given = token.encode()
        found = None
        for known, identity in self._tokens:
            if hmac.compare_digest(known, given):  # every entry compared: no timing leak
                found = identity
        if found is None:
            raise _unauthenticated("token rejected: not in the static tokens file")
        return found
