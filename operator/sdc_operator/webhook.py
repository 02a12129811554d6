"""The admission webhooks for pods (docs/webhook.md), on the operator's admission listener
(:mod:`.listeners`), which only the API server should reach.

``POST /v1/admission/pods``, mutating: the API server sends it the pods the chart's
``MutatingWebhookConfiguration`` selects (the training operators' pods, outside
``kube-system`` and the operator's namespace). For each:

1. the creator marker (:func:`.injection.attest`): on CREATE written for a trusted pod
   creator and stripped for anyone else; on UPDATE put back as it was at admission;
2. on CREATE, if the pod's controlling owner is a ``PyTorchJob`` or ``HyperPodPyTorchJob``
   that carries ``hyperpod-sdc.dev/enabled: "true"`` in a namespace an ``SDCPolicy`` admits,
   the agent's wiring (:func:`.injection.wire_pod`).

It never blocks pod creation by mistake: every answer to a well-formed review is
``allowed: true``; a lookup that fails or runs past the API server's timeout leaves the pod
unwired (it is then counted as unguarded, see :mod:`.jobwatch`). What it answers is worth
nothing to whoever asks: the marker it writes is one a tenant could write itself, and only
the validating check below makes it true.

``POST /v1/admission/pods/creator``, validating (``failurePolicy: Fail``), for clusters
without ValidatingAdmissionPolicy: it refuses a pod whose marker its user may not set
(:func:`.attestation.creator_refusal`). Its answer is an ``allowed`` or a refusal to the
API server; a forged review earns its sender nothing.

A body that is not an AdmissionReview gets a JSON 4xx, never a 500.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, fields
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from . import jobs
from .attestation import creator_refusal
from .caches import Caches
from .errors import ConfigError
from .injection import (
    CA_CONFIGMAP,
    DEFAULT_POD_SELECTORS,
    Wiring,
    attest,
    json_patch,
    matches_any,
    restore_attestation,
    wire_pod,
)
from .kube import Kube, is_not_found
from .names import GROUP, VERSION
from .policy import Admission, namespace_admission

__all__ = [
    "ADMISSION_PATH",
    "CREATOR_PATH",
    "MAX_REVIEW_BYTES",
    "MAX_REVIEW_DEPTH",
    "POLICY_PLURAL",
    "AdmissionLookups",
    "PodWebhook",
    "WebhookSettings",
    "WEBHOOK_ENV",
]

log = logging.getLogger(__name__)
ADMISSION_PATH = "/v1/admission/pods"
CREATOR_PATH = "/v1/admission/pods/creator"
MAX_REVIEW_BYTES = 4 * 1024 * 1024
"""A pod is at most about 1.5 MiB (etcd's limit); its AdmissionReview carries it once on
CREATE, twice on UPDATE."""
MAX_IN_FLIGHT = 256
"""Reviews answered at once; more get 503 (the API server then applies the failure policy).
With :data:`MAX_REVIEW_BYTES` and :data:`READ_SECONDS` it bounds what requests to this
unauthenticated path can hold: 1 GiB for at most 3 s each (in practice a review is a few
KiB)."""
MAX_IN_FLIGHT_PER_SOURCE = 64
"""Reviews one client address may have in flight at once: a source trickling bodies (or
flooding) holds at most a quarter of :data:`MAX_IN_FLIGHT`, and the API server's own
reviews, from its own addresses, still find room."""
MAX_IN_FLIGHT_RESERVED = 64
"""Of :data:`MAX_IN_FLIGHT`, the reviews only the API server's own addresses
(:mod:`.apiserver`) may have in flight, which :data:`MAX_IN_FLIGHT_PER_SOURCE` does not
limit: any number of other addresses together have at most 192, so slow reviews from many
tenants' pods cannot have the API server's answered 503."""
MAX_REVIEW_DEPTH = 64
"""How deeply a review's JSON may nest. A pod's deepest field (a node affinity's values, a
managed field's ``fieldsV1`` beside it) is about 20 levels below the review; what nests
deeper was not written by an API server, and copying it (``copy.deepcopy``, about two
frames a level) could exhaust Python's stack where ``json.loads`` did not."""
READ_SECONDS = 3.0
"""The API server sends a review in one go; a body still arriving after this is refused
(408), so slow clients cannot hold connections and buffers open."""
POLICY_PLURAL = "sdcpolicies"
REVIEW_API = "admission.k8s.io/v1"


@dataclass(frozen=True, kw_only=True, slots=True)
class WebhookSettings:
    """The webhook's settings, from ``HYPERPOD_SDC_*`` variables (the chart sets them)."""

    inject_operator_url: str | None = None
    """The operator's URL as the pods reach it (``HYPERPOD_SDC_OPERATOR_URL`` in them), e.g.
    ``https://hyperpod-sdc.hyperpod-sdc.svc:443``. Unset: nothing is injected (attestations
    are still written)."""
    inject_verdict_url: str | None = None
    """The intake's verdict listener as the pods reach it (``HYPERPOD_SDC_VERDICT_URL`` in
    them), e.g. ``https://hyperpod-sdc.hyperpod-sdc.svc:8444``: their agents send verdicts,
    checkpoint and resume records there. Unset: not injected (everything goes to
    ``inject_operator_url``)."""
    inject_containers: tuple[str, ...] = ()
    """Containers to wire, by name (comma-separated); empty: every non-init container."""
    inject_token_expiration_seconds: int = 3600
    """Lifetime of the projected token the pods get (600 to 86400; the kubelet renews it)."""
    tls_ca_file: str | None = None
    """PEM file of the CA that signed the operator's certificate (``ca.crt`` of its TLS
    Secret): published as ConfigMap ``hyperpod-sdc-ca`` in each namespace with an opted-in
    job and mounted in its pods. Unset: no CA is published or mounted (the agents then use
    their image's trust store)."""
    webhook_pod_selectors: tuple[dict[str, Any], ...] = DEFAULT_POD_SELECTORS
    """The label selectors of the chart's webhook entries (a JSON list), so the operator
    knows which pods the webhook is sent."""
    webhook_cache_seconds: float = 10.0
    """How long a job, a namespace's labels and the SDCPolicy list are reused."""
    job_sweep_seconds: float = 30.0
    """How often opted-in jobs are checked for unguarded pods, and the CA and the serving
    certificate for rotation."""

    def __post_init__(self) -> None:
        for name in ("inject_operator_url", "inject_verdict_url"):
            url = getattr(self, name)
            if url is not None and not re.match(r"^https?://[^/\s]+", url):
                raise ConfigError(f"{WEBHOOK_ENV[name]}: must be an http(s):// URL, got {url!r}")
        if not 600 <= self.inject_token_expiration_seconds <= 86400:
            raise ConfigError(
                f"{WEBHOOK_ENV['inject_token_expiration_seconds']}: must be 600 to 86400, "
                f"got {self.inject_token_expiration_seconds}"
            )
        for name in ("webhook_cache_seconds", "job_sweep_seconds"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{WEBHOOK_ENV[name]}: must be > 0, got {getattr(self, name)}")
        for selector in self.webhook_pod_selectors:
            if not isinstance(selector, dict) or not (
                selector.get("matchLabels") or selector.get("matchExpressions")
            ):
                raise ConfigError(
                    f"{WEBHOOK_ENV['webhook_pod_selectors']}: each selector needs matchLabels "
                    f"or matchExpressions (an empty one would select every pod), got {selector!r}"
                )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WebhookSettings:
        """Every setting above; a bad value raises :class:`ConfigError` naming the variable."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = WEBHOOK_ENV[f.name]
            raw = (env.get(name) or "").strip()
            if not raw:
                continue
            try:
                if f.name == "webhook_pod_selectors":
                    parsed = json.loads(raw)
                    if not isinstance(parsed, list) or not parsed:
                        raise ValueError("expected a non-empty JSON list of label selectors")
                    values[f.name] = tuple(parsed)
                elif f.name == "inject_containers":
                    values[f.name] = tuple(p.strip() for p in raw.split(",") if p.strip())
                elif f.name == "inject_token_expiration_seconds":
                    values[f.name] = int(raw)
                elif f.name in ("webhook_cache_seconds", "job_sweep_seconds"):
                    values[f.name] = float(raw)
                else:
                    values[f.name] = raw
            except ValueError as exc:
                raise ConfigError(f"{name}: {exc}") from None
        return cls(**values)


WEBHOOK_ENV: dict[str, str] = {
    f.name: "HYPERPOD_SDC_" + f.name.upper() for f in fields(WebhookSettings)
}


class _TTLCache:
    """A few hundred entries at most (jobs being started, namespaces), kept briefly."""

    def __init__(self, seconds: float, clock: Callable[[], float]) -> None:
        self.seconds = seconds
        self.clock = clock
        self._entries: dict[Any, tuple[float, Any]] = {}

    def get(self, key: Any) -> tuple[bool, Any]:
        entry = self._entries.get(key)
        if entry is None or entry[0] <= self.clock():
            return False, None
        return True, entry[1]

    def put(self, key: Any, value: Any) -> None:
        if len(self._entries) > 4096:
            now = self.clock()
            self._entries = {k: v for k, v in self._entries.items() if v[0] > now}
        self._entries[key] = (self.clock() + self.seconds, value)


class AdmissionLookups:
    """The job of a pod and the admission of a namespace.

    With the operator's watch-fed :class:`.caches.Caches` (as it runs), every lookup is
    served from them, so a review costs no API call whatever it names: a job the watch has
    not delivered yet is waited for, up to :data:`MISS_WAIT_SECONDS`, then taken as absent
    (the pod is admitted unwired and counted unguarded by :mod:`.jobwatch`). Without caches
    (tests, tools) they are read from the API server with a short cache."""

    def __init__(
        self,
        kube: Kube,
        cache_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        caches: Caches | None = None,
    ) -> None:
        self.kube = kube
        self.caches = caches
        self._jobs = _TTLCache(cache_seconds, clock)
        self._namespaces = _TTLCache(cache_seconds, clock)
        self._policies = _TTLCache(cache_seconds, clock)
        self._warned_no_crd = False

    async def _synced(self) -> Caches | None:
        caches = self.caches
        if caches is not None:
            while not caches.synced():
                await asyncio.sleep(0.05)
        return caches

    async def job(self, namespace: str, owner: Mapping[str, Any]) -> dict[str, Any] | None:
        """The owner job as the API server has it, or ``None`` if it does not exist."""
        caches = await self._synced()
        if caches is not None:
            give_up = time.monotonic() + MISS_WAIT_SECONDS
            while True:
                found = caches.job(owner["apiVersion"], owner["kind"], namespace, owner["name"])
                fits = found is not None and found["metadata"].get("uid") == owner.get("uid")
                if fits or time.monotonic() >= give_up:
                    return dict(found) if fits and found is not None else None
                await asyncio.sleep(0.05)
        key = (namespace, owner["apiVersion"], owner["kind"], owner["name"])
        hit, job = self._jobs.get(key)
        if not hit:
            plural = jobs.JOB_KINDS[(owner["apiVersion"], owner["kind"])]
            try:
                job = await self.kube.get_object(
                    owner["apiVersion"], plural, namespace, owner["name"]
                )
            except Exception as exc:
                if not is_not_found(exc):
                    raise
                job = None
            self._jobs.put(key, job)
        return dict(job) if job is not None else None

    async def policies(self) -> list[dict[str, Any]]:
        caches = await self._synced()
        if caches is not None:
            return list(caches.policies.values())
        hit, found = self._policies.get("all")
        if not hit:
            try:
                found = await self.kube.list_objects(f"{GROUP}/{VERSION}", POLICY_PLURAL)
            except Exception as exc:
                if not is_not_found(exc):
                    raise
                if not self._warned_no_crd:
                    log.warning(
                        "the SDCPolicy CRD is not installed: no namespace is admitted, so no "
                        "pod is wired (install crds/ or the chart)"
                    )
                    self._warned_no_crd = True
                found = []
            self._policies.put("all", found)
        return list(found)

    async def namespace_labels(self, namespace: str) -> dict[str, str]:
        caches = await self._synced()
        if caches is not None:
            return caches.namespace_labels(namespace) or {}
        hit, labels = self._namespaces.get(namespace)
        if not hit:
            ns = await self.kube.get("v1", "namespaces", None, namespace)
            labels = (ns.get("metadata") or {}).get("labels") or {}
            self._namespaces.put(namespace, labels)
        return dict(labels)

    async def admission(self, namespace: str) -> Admission:
        policies = await self.policies()
        labels = await self.namespace_labels(namespace)
        return namespace_admission(policies, namespace, labels)


MISS_WAIT_SECONDS = 1.0
"""How long a review waits for the watch to deliver a job it names (a training operator
creates a job's pods right after the job): never longer than the review's own budget."""


class _BadReview(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


def _pod_name(req: Mapping[str, Any]) -> Any:
    meta = (req.get("object") or {}).get("metadata") or {}
    return meta.get("name") or meta.get("generateName")


async def _read_body(request: web.Request) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.read(MAX_REVIEW_BYTES + 1 - size):
        size += len(chunk)
        if size > MAX_REVIEW_BYTES:
            raise _BadReview(413, "too_large", f"larger than {MAX_REVIEW_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _timeout_seconds(query: Mapping[str, str]) -> float:
    """The API server's ``?timeout=5s`` (a Go duration; seconds are what it sends)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", query.get("timeout", ""))
    if not match:
        return 10.0
    value, unit = float(match.group(1)), match.group(2)
    return value / 1000 if unit == "ms" else value * 60 if unit == "m" else value


def _deeper_than(value: Any, most: int) -> bool:
    """Whether JSON ``value`` nests more than ``most`` levels (without recursion)."""
    level: list[tuple[Any, int]] = [(value, 1)]
    while level:
        item, depth = level.pop()
        if depth > most:
            return True
        if isinstance(item, dict):
            level.extend((v, depth + 1) for v in item.values() if isinstance(v, (dict, list)))
        elif isinstance(item, list):
            level.extend((v, depth + 1) for v in item if isinstance(v, (dict, list)))
    return False


_REQUEST_SHAPE: dict[str, type | tuple[type, ...]] = {
    "kind": dict,
    "resource": dict,
    "userInfo": dict,
    "object": dict,
    "oldObject": dict,
    "operation": str,
    "namespace": str,
    "name": str,
    "subResource": str,
}
"""The types of the request fields the webhook reads, as the API server sends them (a field
may be absent or null)."""


def _check_shape(req: Mapping[str, Any]) -> None:
    """A 400 naming the first field of another type than the API server sends: such a
    review was not written by an API server, and reading it further could only fail."""
    for name, kind in _REQUEST_SHAPE.items():
        value = req.get(name)
        if value is not None and not isinstance(value, kind):
            raise _BadReview(
                400,
                "malformed",
                f"request.{name}: expected {_TYPE_NAMES[kind]}, got {type(value).__name__}",
            )
    for name in ("object", "oldObject"):
        obj = req.get(name) or {}
        for part in ("metadata", "spec"):
            if obj.get(part) is not None and not isinstance(obj[part], dict):
                raise _BadReview(
                    400,
                    "malformed",
                    f"request.{name}.{part}: expected an object, got {type(obj[part]).__name__}",
                )
        meta = obj.get("metadata") or {}
        for part in ("labels", "annotations"):
            if meta.get(part) is not None and not isinstance(meta[part], dict):
                raise _BadReview(
                    400,
                    "malformed",
                    f"request.{name}.metadata.{part}: expected an object, got "
                    f"{type(meta[part]).__name__}",
                )
        if meta.get("ownerReferences") is not None and not (
            isinstance(meta["ownerReferences"], list)
            and all(isinstance(ref, dict) for ref in meta["ownerReferences"])
        ):
            raise _BadReview(
                400,
                "malformed",
                f"request.{name}.metadata.ownerReferences: expected a list of objects",
            )


_TYPE_NAMES: dict[Any, str] = {dict: "an object", str: "a string"}


class PodWebhook:
    """Answers AdmissionReviews for pods; never raises to aiohttp."""

    def __init__(
        self,
        settings: WebhookSettings,
        lookups: AdmissionLookups,
        *,
        token_audience: str,
        trusted_creators: Callable[[], tuple[str, ...]],
        registry: CollectorRegistry,
        ca_available: Callable[[], bool] = lambda: True,
        api_server: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        self.settings = settings
        self.api_server = api_server
        self.lookups = lookups
        self.trusted_creators = trusted_creators
        self.token_audience = token_audience
        # A pod mounts the CA ConfigMap only while the operator has a CA to publish there:
        # a volume of a ConfigMap that never appears would keep the pod from starting.
        self.ca_available = ca_available
        self.in_flight = 0
        self.in_flight_unreserved = 0
        self.by_source: collections.Counter[str] = collections.Counter()
        self.reviews = Counter(
            "hyperpod_sdc_admission_reviews",
            "Pod admission reviews answered, by operation and outcome (injected, untouched: "
            "not an opted-in job's pod or not admitted, error: allowed unwired, refused: "
            "not an AdmissionReview; of the creator check: allowed, denied).",
            ["operation", "outcome"],
            registry=registry,
        )

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(ADMISSION_PATH, self.post_admission)
        app.router.add_post(CREATOR_PATH, self.post_creator)

    async def post_admission(self, request: web.Request) -> web.Response:
        return await self._serve(request, self._mutate)

    async def post_creator(self, request: web.Request) -> web.Response:
        return await self._serve(request, self._check_creator)

    async def _serve(
        self,
        request: web.Request,
        answer: Callable[[web.Request, dict[str, Any]], Awaitable[web.Response]],
    ) -> web.Response:
        source = request.remote or ""
        reserved = source in self.api_server()
        if self.in_flight >= MAX_IN_FLIGHT or (
            not reserved
            and (
                self.in_flight_unreserved >= MAX_IN_FLIGHT - MAX_IN_FLIGHT_RESERVED
                or self.by_source[source] >= MAX_IN_FLIGHT_PER_SOURCE
            )
        ):
            self.reviews.labels("", "refused").inc()
            overloaded = web.json_response(
                {"error": "overloaded", "message": "too many reviews at once"},
                status=503,
                headers={"Retry-After": "1"},
            )
            overloaded.force_close()
            return overloaded
        self.in_flight += 1
        self.in_flight_unreserved += not reserved
        self.by_source[source] += 1
        try:
            try:
                review = await self._read(request)
            except _BadReview as bad:
                self.reviews.labels("", "refused").inc()
                log.info("refused an admission request (%s): %s", bad.reason, bad.message)
                refused = web.json_response(
                    {"error": bad.reason, "message": bad.message}, status=bad.status
                )
                if bad.status in (408, 413):
                    refused.force_close()  # the rest of the body is not worth reading
                return refused
            return await answer(request, review["request"])
        finally:
            self.in_flight -= 1
            self.in_flight_unreserved -= not reserved
            self.by_source[source] -= 1
            if self.by_source[source] <= 0:
                del self.by_source[source]

    async def _check_creator(self, request: web.Request, req: dict[str, Any]) -> web.Response:
        operation = str(req.get("operation") or "")
        response: dict[str, Any] = {"uid": req["uid"], "allowed": True}
        pod, old = req.get("object"), req.get("oldObject")
        kind = req.get("kind") or {}
        if (kind.get("group"), kind.get("kind")) == ("", "Pod") and isinstance(pod, dict):
            username = str((req.get("userInfo") or {}).get("username") or "")
            why = creator_refusal(operation, pod, old, username, self.trusted_creators())
            if why is not None:
                log.info(
                    "refused %s of pod %s/%s by %s: %s",
                    operation,
                    req.get("namespace"),
                    _pod_name(req),
                    username,
                    why,
                )
                response["allowed"] = False
                response["status"] = {"code": 403, "reason": "Forbidden", "message": why}
        self.reviews.labels(operation, "allowed" if response["allowed"] else "denied").inc()
        return web.json_response(
            {"apiVersion": REVIEW_API, "kind": "AdmissionReview", "response": response}
        )

    async def _mutate(self, request: web.Request, req: dict[str, Any]) -> web.Response:
        operation = str(req.get("operation") or "")
        budget = max(0.2, 0.8 * _timeout_seconds(request.query) - 0.2)
        try:
            response, outcome = await self.review(req, budget)
        except Exception:  # a bug: allow, unwired and unpatched
            log.exception("admission of pod %s/%s failed", req.get("namespace"), _pod_name(req))
            response, outcome = {"uid": req["uid"], "allowed": True}, "error"
        self.reviews.labels(operation, outcome).inc()
        return web.json_response(
            {"apiVersion": REVIEW_API, "kind": "AdmissionReview", "response": response}
        )

    async def _read(self, request: web.Request) -> dict[str, Any]:
        if request.content_type != "application/json":
            raise _BadReview(
                415,
                "media_type",
                f"Content-Type must be application/json, got {request.content_type!r}",
            )
        if request.content_length is not None and request.content_length > MAX_REVIEW_BYTES:
            raise _BadReview(413, "too_large", f"larger than {MAX_REVIEW_BYTES} bytes")
        try:
            raw = await asyncio.wait_for(_read_body(request), READ_SECONDS)
        except asyncio.TimeoutError:
            raise _BadReview(
                408, "timeout", f"the body did not arrive within {READ_SECONDS:g} s"
            ) from None
        try:
            review = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _BadReview(400, "malformed", f"not JSON: {exc}") from None
        except RecursionError:
            raise _BadReview(400, "malformed", "nested too deeply to be a pod") from None
        if not isinstance(review, dict):
            raise _BadReview(400, "malformed", "an AdmissionReview must be a JSON object")
        if _deeper_than(review, MAX_REVIEW_DEPTH):
            raise _BadReview(
                400, "malformed", f"nested more than {MAX_REVIEW_DEPTH} deep: not a pod's review"
            )
        if (review.get("apiVersion"), review.get("kind")) != (REVIEW_API, "AdmissionReview"):
            raise _BadReview(
                400,
                "malformed",
                f"apiVersion/kind: expected {REVIEW_API} AdmissionReview, got "
                f"{review.get('apiVersion')!r} {review.get('kind')!r}",
            )
        req = review.get("request")
        if not isinstance(req, dict) or not isinstance(req.get("uid"), str) or not req["uid"]:
            raise _BadReview(400, "malformed", "request.uid: required")
        _check_shape(req)
        return review

    async def review(
        self, req: Mapping[str, Any], budget: float = 5.0
    ) -> tuple[dict[str, Any], str]:
        """The review's ``response`` and the outcome to count. The attestation is written
        or stripped whatever happens; the wiring, which needs lookups, only where they
        answer within ``budget`` seconds."""
        allow: dict[str, Any] = {"uid": req["uid"], "allowed": True}
        kind = req.get("kind") or {}
        pod = req.get("object")
        operation = req.get("operation")
        if (
            (kind.get("group"), kind.get("kind")) != ("", "Pod")
            or req.get("subResource")
            or operation not in ("CREATE", "UPDATE")
            or not isinstance(pod, dict)
        ):
            return allow, "untouched"  # not ours to change; the selectors should not send it
        namespace = str(req.get("namespace") or (pod.get("metadata") or {}).get("namespace") or "")
        pod = {**pod, "metadata": {**(pod.get("metadata") or {}), "namespace": namespace}}
        if operation == "UPDATE":
            found = req.get("oldObject")
            old: dict[str, Any] = found if isinstance(found, dict) else {}
            seen = matches_any(
                self.settings.webhook_pod_selectors,
                (old.get("metadata") or {}).get("labels") or {},
            )
            after = restore_attestation(pod, old, seen)
            outcome = "untouched"
        else:
            username = str((req.get("userInfo") or {}).get("username") or "")
            after = attest(pod, username, self.trusted_creators())
            try:
                wired = await asyncio.wait_for(self._wire(after, namespace), budget)
                outcome = "injected" if wired is not None else "untouched"
            except Exception as exc:  # a timeout or a failed lookup: attested, unwired
                log.warning(
                    "admission of pod %s/%s: %s; allowed without the agent's wiring",
                    namespace,
                    _pod_name(req),
                    f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__,
                )
                wired, outcome = None, "error"
            after = wired or after
        patch = json_patch(pod, after)
        if patch:
            allow["patchType"] = "JSONPatch"
            allow["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
        return allow, outcome

    def wiring(self) -> Wiring | None:
        if not self.settings.inject_operator_url:
            return None
        with_ca = bool(self.settings.tls_ca_file) and self.ca_available()
        return Wiring(
            operator_url=self.settings.inject_operator_url,
            verdict_url=self.settings.inject_verdict_url,
            token_audience=self.token_audience,
            token_expiration_seconds=self.settings.inject_token_expiration_seconds,
            ca_configmap=CA_CONFIGMAP if with_ca else None,
            containers=self.settings.inject_containers,
        )

    async def _wire(self, pod: dict[str, Any], namespace: str) -> dict[str, Any] | None:
        wiring = self.wiring()
        if wiring is None:
            return None
        owner = jobs.job_owner(pod)
        if owner is None:
            return None
        job = await self.lookups.job(namespace, owner)
        if job is None or (job.get("metadata") or {}).get("uid") != owner.get("uid"):
            return None
        if not jobs.is_enabled(job):
            return None
        admission = await self.lookups.admission(namespace)
        if not admission.admitted:
            log.info(
                "not wiring a pod of %s %s/%s: %s",
                owner["kind"],
                namespace,
                owner["name"],
                admission.reason,
            )
            return None
        return wire_pod(pod, wiring)
