"""Who is reporting: a Bearer token -> the reporting pod, proven, never taken on the
report's word.

``tokenreview`` mode (the default) asks the API server to review the pod's projected
ServiceAccount token for the operator's audience; a token bound to a pod carries the pod's
name and uid in the review's ``extra``. ``static`` mode (development only) reads tokens
from a file.

A review costs the API server work, so :class:`TokenReviewer` spends it carefully:

1. a token that cannot be a bound ServiceAccount token (not a JWT, expired by its own
   ``exp``, for another audience by its own ``aud``) is refused without asking: the claims
   are read, not trusted, so this only turns junk away early;
2. a reviewed token is remembered by its SHA-256 (never the token): accepted ones until
   ``cache_seconds`` or their ``exp``, whichever comes first; rejected ones for
   ``negative_seconds``;
3. concurrent requests with one token share one review;
4. reviews of tokens not remembered are limited per client address
   (``reviews_per_source``), so that bogus tokens from a few addresses cannot spend the
   budget of everyone else, and cluster-wide (``reviews_per_second``): past either a report
   is answered 429 and retried by the agent.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import hmac
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .errors import ConfigError, Refusal
from .ratelimit import RateLimiter, TokenBucket

__all__ = [
    "Authenticator",
    "PodIdentity",
    "StaticTokens",
    "TokenReviewer",
    "bearer_token",
    "token_claims",
]

POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
"""Set by API servers of Kubernetes 1.30 and later (bound tokens name the pod's node)."""
SA_PREFIX = "system:serviceaccount:"
MAX_TOKEN_BYTES = 16 * 1024
"""A projected ServiceAccount token is 1 to 2 KiB."""
_TOKEN_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.")


@dataclass(frozen=True, slots=True)
class PodIdentity:
    namespace: str
    pod: str
    pod_uid: str | None = None
    """Set by TokenReview; the intake checks it against the pod it knows."""
    node: str | None = None
    """The node the token was issued on, where TokenReview says (1.30+); the intake checks
    it against the pod's node."""


class Authenticator(Protocol):
    async def authenticate(self, token: str, source: str = "") -> PodIdentity:
        """The pod ``token`` proves; ``source`` is the client's address."""
        ...


class Reviewer(Protocol):
    async def token_review(self, token: str, audience: str) -> dict[str, Any]: ...


def _unauthenticated(message: str) -> Refusal:
    return Refusal(401, "unauthenticated", message)


def bearer_token(header: str) -> str:
    """The token of an ``Authorization: Bearer <token>`` header, or a 401."""
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise _unauthenticated("Authorization: a Bearer token is required")
    if len(token) > MAX_TOKEN_BYTES:
        raise _unauthenticated(f"Authorization: the token is longer than {MAX_TOKEN_BYTES} bytes")
    return token


def _b64json(part: str) -> Any:
    padded = part + "=" * (-len(part) % 4)
    return json.loads(base64.urlsafe_b64decode(padded.encode()))


def token_claims(token: str) -> dict[str, Any]:
    """The claims of a JWT, unverified (a 401 if it is not one)."""
    encoded = token.encode()
    if not set(encoded) <= _TOKEN_CHARS or encoded.count(b".") != 2:
        raise _unauthenticated("token rejected: not a ServiceAccount token (a JWT)")
    header, payload, _ = token.split(".")
    try:
        head = _b64json(header)
        claims = _b64json(payload)
    except (ValueError, UnicodeDecodeError):
        raise _unauthenticated("token rejected: not a ServiceAccount token (a JWT)") from None
    if not isinstance(head, dict) or "alg" not in head or not isinstance(claims, dict):
        raise _unauthenticated("token rejected: not a ServiceAccount token (a JWT)")
    return claims


class TokenReviewer:
    """TokenReview behind the checks and caches of the module's docstring."""

    def __init__(
        self,
        kube: Reviewer,
        audience: str,
        cache_seconds: float,
        *,
        negative_seconds: float = 60.0,
        reviews_per_second: float = 200.0,
        burst: int = 2500,
        reviews_per_source: float = 5.0,
        source_burst: int = 50,
        max_cached: int = 100_000,
        clock: Callable[[], float] = time.time,
        metrics: Any = None,
    ) -> None:
        self._kube = kube
        self._audience = audience
        self._cache_seconds = cache_seconds
        self._negative_seconds = negative_seconds
        self._max_cached = max_cached
        self._clock = clock
        self._metrics = metrics
        self._budget = TokenBucket(reviews_per_second, burst)
        self._per_source = RateLimiter(reviews_per_source, source_burst)
        self._cache: OrderedDict[bytes, tuple[float, PodIdentity | Refusal]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._in_flight: dict[bytes, asyncio.Future[PodIdentity]] = {}
        self.reviews = 0
        """TokenReviews sent (for tests and the bench)."""

    def on(self, kube: Reviewer) -> TokenReviewer:
        """This reviewer for another thread's event loop, reviewing with ``kube`` (a
        client of that loop): the same remembered tokens and review budgets (a token
        reviewed on one loop is not reviewed again on the other); its own reviews in
        flight (a future belongs to one loop)."""
        other = copy.copy(self)
        other._kube = kube
        other._in_flight = {}
        return other

    def _count(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.token_reviews.labels(outcome).inc()

    async def authenticate(self, token: str, source: str = "") -> PodIdentity:
        key = hashlib.sha256(token.encode()).digest()
        now = self._clock()
        cached = self._cache.get(key)
        if cached is not None:
            if cached[0] > now:
                self._count("cached")
                if isinstance(cached[1], Refusal):
                    raise cached[1].again()
                return cached[1]
            with self._cache_lock:
                self._cache.pop(key, None)
        shared = self._in_flight.get(key)
        if shared is None:
            claims = token_claims(token)
            expires = claims.get("exp")
            if isinstance(expires, int | float) and expires <= now:
                raise _unauthenticated("token rejected: it expired (its exp claim)")
            audiences = claims.get("aud")
            audiences = [audiences] if isinstance(audiences, str) else audiences
            if isinstance(audiences, list) and self._audience not in audiences:
                raise _unauthenticated(f"token rejected: not meant for audience {self._audience!r}")
            # The source's own bucket first: a source past its rate spends nothing of
            # the shared budget.
            wait = self._per_source.acquire(source)
            if wait is not None:
                self._count("limited")
                raise Refusal(
                    429,
                    "rate_limited",
                    f"{source or 'this client'} sends too many tokens not seen before; try again",
                    retry_after=wait,
                )
            wait = self._budget.acquire()
            if wait is not None:
                self._count("limited")
                raise Refusal(
                    429,
                    "rate_limited",
                    "too many reports with tokens not seen before; try again",
                    retry_after=wait,
                )
            shared = asyncio.get_running_loop().create_future()
            self._in_flight[key] = shared
            task = asyncio.get_running_loop().create_task(self._review(key, token, expires))
            task.add_done_callback(lambda t: _settle(shared, t))
        else:
            self._count("shared")
        # Shielded: a client that hangs up cancels its own wait, not the others' review.
        return await asyncio.shield(shared)

    async def _review(self, key: bytes, token: str, expires: Any) -> PodIdentity:
        try:
            self.reviews += 1
            status = await self._kube.token_review(token, self._audience)
            try:
                identity = self._identity(status)
            except Refusal as refusal:
                self._count("rejected")
                self._remember(key, self._clock() + self._negative_seconds, refusal.again())
                raise
            self._count("accepted")
            until = self._clock() + self._cache_seconds
            if isinstance(expires, int | float):
                until = min(until, float(expires))
            if self._cache_seconds > 0:
                self._remember(key, until, identity)
            return identity
        finally:
            self._in_flight.pop(key, None)

    def _remember(self, key: bytes, until: float, value: PodIdentity | Refusal) -> None:
        with self._cache_lock:  # (shared with the reviewer of another loop: :meth:`on`)
            self._cache[key] = (until, value)
            self._cache.move_to_end(key)
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)

    def _identity(self, status: dict[str, Any]) -> PodIdentity:
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
        nodes = extra.get(NODE_NAME_EXTRA) or []
        return PodIdentity(
            namespace,
            str(pods[0]),
            str(uids[0]) if uids else None,
            str(nodes[0]) if nodes else None,
        )


def _settle(shared: asyncio.Future[PodIdentity], task: asyncio.Task[PodIdentity]) -> None:
    if shared.done():
        return
    if task.cancelled():
        shared.set_exception(Refusal(503, "unavailable", "the token review was interrupted"))
    elif (exc := task.exception()) is not None:
        shared.set_exception(exc)
    else:
        shared.set_result(task.result())
    # Nobody may be waiting (every client hung up): mark the exception as seen.
    if not task.cancelled() and task.exception() is not None:
        shared.exception()


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

    async def authenticate(self, token: str, source: str = "") -> PodIdentity:
        given = token.encode()
        found = None
        for known, identity in self._tokens:
            if hmac.compare_digest(known, given):  # every entry compared: no timing leak
                found = identity
        if found is None:
            raise _unauthenticated("token rejected: not in the static tokens file")
        return found
