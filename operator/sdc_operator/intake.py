"""The intake: ``POST /v1/reports`` (docs/protocol.md) on the tenants' listener, and
``/metrics``, ``/healthz``, ``/readyz`` on the monitoring one (:mod:`.listeners`).

A report is checked in this order, cheapest first, and the first failure answers a 4xx
(or 503) with ``{"error": <reason>, "message": <what to fix>}``, counts under that reason in
``hyperpod_sdc_refusals_total``, is logged at INFO at most, and changes nothing:

1. the operator is ready (its caches listed), not overloaded (503);
2. media type and size (415, 413), the client address's rate (429), a Bearer token of a
   plausible shape (401): no API call so far;
3. the body, whole, within ``body_timeout_seconds`` (408); then its lane: a heartbeat is
   shed (429 with ``Retry-After``) while a verdict is in flight, or arrived in the last
   5 s, or while ``max_heartbeats_in_flight`` heartbeats are (verdicts first);
4. the token -> the reporting pod (TokenReview, cached; 401), which must still exist (403);
5. the pod's namespace is admitted by an ``SDCPolicy`` (403 ``namespace_not_admitted``);
6. the pod's controlling owner -> an opted-in job (403), the pod fits that job and was
   attested by the admission webhook as a training operator's (403);
7. the job's rate (429 with ``Retry-After``);
8. the protocol (400 not JSON, 422 against the schema, or a version it does not accept),
   the reporter against the pod (403), age and clock (422);
9. for a verdict, each suspect must be an attested pod of the same job, on the node it
   names (422).

Pods, jobs, nodes, namespaces and policies come from watch-fed caches (:mod:`.caches`);
a pod or job the watch has not delivered yet is read once (one read at a time per object).
A heartbeat, and a verdict already recorded, cost no API call.

The verdict port (``verdict_port``) serves the same ``POST /v1/reports`` with an intake of its
own on another thread's event loop (:meth:`Intake.for_verdicts`): the same checks in the
same order, sharing the rate limiters, the reports in flight and their lanes; there a
heartbeat is refused (421 ``misdirected``).

Every answer on the tenants' listener names the protocol versions accepted
(``Hyperpod-Sdc-Protocol: 1, 2``); an accepted report's answer lists the fields this
operator ignored (``"ignored"``, protocol 2: fields of a newer agent).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sdc_common.errors import ProtocolError
from sdc_common.protocol import (
    ACCEPTED_VERSIONS,
    PROTOCOL_HEADER,
    CheckpointReport,
    HeartbeatReport,
    ResumeReport,
    Suspect,
    VerdictReport,
    parse_report,
)

from . import jobs
from .attestation import ATTESTATION_ANNOTATION, AttestationKey, verify_legacy, verify_pod
from .auth import Authenticator, PodIdentity, bearer_token
from .caches import Caches
from .engine import IncidentEngine
from .errors import ApiError, Refusal
from .gate import InFlight, PriorityGate
from .heartbeats import Heartbeats
from .incidents import JobRef, ResolvedSuspect
from .injection import matches_any
from .kube import Kube, is_not_found
from .localize import InstanceResolver
from .metrics import Metrics
from .ratelimit import RateLimiter
from .settings import OperatorSettings

__all__ = ["REPORTS_PATH", "Intake", "IntakeRunner", "read_body"]

log = logging.getLogger(__name__)
REPORTS_PATH = "/v1/reports"
MAX_HEADER_BYTES = 32 * 1024
"""A header line longer than this is refused (431) before any handler runs."""


class _Throttled:
    """At most one INFO line per refusal reason every ``every`` seconds, with a count of
    those not logged: a flood of bad requests must not become a flood of log lines."""

    def __init__(self, every: float = 10.0) -> None:
        self.every = every
        self._last: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def info(self, reason: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(reason, -1e9) < self.every:
            self._quiet[reason] = self._quiet.get(reason, 0) + 1
            return
        quiet = self._quiet.pop(reason, 0)
        self._last[reason] = now
        suffix = f" (and {quiet} more like it in the last {self.every:g} s)" if quiet else ""
        log.info(message + suffix, *args)


_refusals_log = _Throttled()


def _json(status: int, error: str, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": error, "message": message}, status=status, headers=headers)


class _Handler(RequestHandler):
    """aiohttp's connection handler, with its own refusals (a header line over the limit,
    a request that is not HTTP) answered as JSON and logged at INFO, not as plain text
    with an ERROR and a traceback; and a shorter timeout for a new connection's first
    request (``first_request_seconds``) than between requests."""

    first_request_seconds: float | None = None

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            return super().handle_error(request, status, exc, message)
        text = str(getattr(exc, "message", None) or message or exc or "bad request")
        error = "headers_too_large" if "Got more than" in text or "too long" in text else "bad_http"
        code = 431 if error == "headers_too_large" else status
        _refusals_log.info(error, "refused a request from %s (%s): %s", request.remote, error, text)
        response = _json(code, error, f"the request is not acceptable HTTP: {text[:200]}")
        response.force_close()
        return response

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # aiohttp gives a new connection its keep-alive timeout (the idle timeout between
        # requests) for its first request as well: the first request gets the shorter
        # header timeout, so that connections opened and left silent do not hold slots.
        first = getattr(self, "first_request_seconds", None)
        if first is not None and self._keepalive_handle is not None:
            self._keepalive_handle.cancel()
            close_at = self._loop.time() + first
            self._next_keepalive_close_time = close_at
            self._keepalive_handle = self._loop.call_at(close_at, self._process_keepalive)


class _Server(web.Server):
    first_request_seconds: float | None = None

    def __call__(self) -> RequestHandler:
        handler = _Handler(self, loop=self._loop, **self._kwargs)
        handler.first_request_seconds = self.first_request_seconds
        return handler


class IntakeRunner(web.AppRunner):
    """An :class:`aiohttp.web.AppRunner` whose connections use :class:`_Handler`: a new
    connection has ``first_request_seconds`` for its first request's headers, then
    ``keepalive_timeout`` between requests."""

    def __init__(
        self, app: web.Application, *, first_request_seconds: float | None = None, **kw: Any
    ) -> None:
        super().__init__(app, **kw)
        self.first_request_seconds = first_request_seconds

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server
        assert isinstance(server, _Server)
        server.first_request_seconds = self.first_request_seconds
        return server


class Intake:
    def __init__(
        self,
        settings: OperatorSettings,
        caches: Caches,
        authenticator: Authenticator,
        engine: IncidentEngine,
        resolver: InstanceResolver,
        heartbeats: Heartbeats,
        metrics: Metrics,
        key: AttestationKey | None,
        lookups: Kube,
        clock: Callable[[], float] = time.time,
        *,
        verdicts_only: bool = False,
    ) -> None:
        self.settings = settings
        self.caches = caches
        self.authenticator = authenticator
        self.engine = engine
        self.resolver = resolver
        self.heartbeats = heartbeats
        self.metrics = metrics
        self.key = key
        self.lookups = lookups
        self.clock = clock
        self.limiter = RateLimiter(settings.rate_per_job, settings.rate_burst)
        self.sources = RateLimiter(settings.rate_per_source, settings.rate_source_burst)
        self.trusted = frozenset(settings.trusted_pod_creators)
        self.legacy_until = settings.legacy_until()
        self.pod_selectors: tuple[dict[str, Any], ...] = ()
        """The admission webhook's pod selectors (set by the operator); empty: not checked."""
        self.ready: Callable[[], bool] = lambda: True
        self.verdicts_only = verdicts_only
        """The verdict listener's intake (:meth:`for_verdicts`): heartbeats are refused."""
        self.in_flight = InFlight()
        """Reports in flight, by lane (shared with :meth:`for_verdicts`'s intake)."""
        # read when scraped: set from the two listeners' threads, the gauge could be left
        # at a count one of them computed before the other's change
        metrics.in_flight.set_function(lambda: self.in_flight.reports)
        self.gate = PriorityGate(REPORTS_CHECKED_AT_ONCE)
        """Reports whose checks run at once; verdicts wait ahead of anything else."""
        self._reads: dict[tuple[str, ...], asyncio.Future[dict[str, Any] | None]] = {}

    def for_verdicts(self, lookups: Kube, authenticator: Authenticator) -> Intake:
        """The intake of the verdict listener (``verdict_port``), to serve on another
        thread's event loop: the same checks, limits and state (the rate limiters, the
        reports in flight, the caches, the engine), with that loop's own API client,
        ``authenticator`` (:meth:`.auth.TokenReviewer.on`: the same reviews, remembered
        once), checks gate and shared reads; heartbeats are refused there."""
        other = Intake(
            self.settings,
            self.caches,
            authenticator,
            self.engine,
            self.resolver,
            self.heartbeats,
            self.metrics,
            self.key,
            lookups,
            self.clock,
            verdicts_only=True,
        )
        other.limiter, other.sources, other.in_flight = self.limiter, self.sources, self.in_flight
        other.pod_selectors, other.ready = self.pod_selectors, self.ready
        return other

    def app(self) -> web.Application:
        """The tenants' listener: ``/v1/reports`` and nothing else."""
        app = web.Application(
            client_max_size=self.settings.max_body_bytes + 1, middlewares=[json_error_middleware()]
        )
        app.router.add_post(REPORTS_PATH, self.post_report)
        app.on_response_prepare.append(_advertise_versions)
        return app

    def monitoring_app(self) -> web.Application:
        """The monitoring listener: ``/metrics`` (every opted-in job of every namespace is
        named there, so never on the tenants' port), ``/healthz``, ``/readyz``."""
        app = web.Application(client_max_size=1024, middlewares=[json_error_middleware()])
        app.router.add_get("/metrics", self.get_metrics)
        app.router.add_get("/healthz", self.get_healthz)
        app.router.add_get("/readyz", self.get_readyz)
        return app

    def runner(self, app: web.Application | None = None) -> IntakeRunner:
        """The runner to serve ``app`` (default :meth:`app`) with: slow clients cut off
        (a new connection's first headers within ``header_timeout_seconds``, a kept
        connection idle at most ``idle_timeout_seconds``), handlers cancelled when the
        client hangs up, headers up to :data:`MAX_HEADER_BYTES`."""
        return IntakeRunner(
            app or self.app(),
            first_request_seconds=self.settings.header_timeout_seconds,
            access_log=None,
            handler_cancellation=True,
            keepalive_timeout=self.settings.idle_timeout_seconds,
            max_field_size=MAX_HEADER_BYTES,
            max_line_size=MAX_HEADER_BYTES,
        )

    async def get_metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def get_healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def get_readyz(self, request: web.Request) -> web.Response:
        ready = self.ready()
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def post_report(self, request: web.Request) -> web.Response:
        now = self.in_flight.enter(self.settings.max_in_flight)
        if now is None:
            self.metrics.refusals.labels("overloaded").inc()
            return _json(
                503, "overloaded", "too many reports at once; try again", **{"Retry-After": "1"}
            )
        try:
            status, body = await self.accept(request)
        except Refusal as refusal:
            self.metrics.refusals.labels(refusal.reason).inc()
            _refusals_log.info(
                refusal.reason, "refused a report (%s): %s", refusal.reason, refusal.message
            )
            headers = {}
            if refusal.retry_after is not None:
                headers["Retry-After"] = str(max(1, round(refusal.retry_after)))
            response = _json(refusal.status, refusal.reason, refusal.message, **headers)
            if refusal.status in (408, 413):
                response.force_close()  # the rest of the body is not worth reading
            return response
        finally:
            self.in_flight.leave(request.get(_LANE), answered=request.get(_CHECKED, False))
        return web.json_response(body, status=status)

    # -- the checks, in order ---------------------------------------------------------------

    async def accept(self, request: web.Request) -> tuple[int, dict[str, Any]]:
        if not self.ready():
            raise Refusal(503, "starting", "the operator is starting; try again", retry_after=1)
        if request.content_type != "application/json":
            raise Refusal(
                415,
                "media_type",
                f"Content-Type must be application/json, got {request.content_type!r}",
            )
        limit = self.settings.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise Refusal(413, "too_large", f"report is larger than {limit} bytes")
        wait = self.sources.acquire(request.remote or "")
        if wait is not None:
            raise Refusal(
                429,
                "rate_limited",
                f"{request.remote} sends more than {self.settings.rate_per_source:g} requests "
                "per second",
                retry_after=wait,
            )
        token = bearer_token(request.headers.get("Authorization", ""))
        try:
            raw = await asyncio.wait_for(
                read_body(request, limit), timeout=self.settings.body_timeout_seconds
            )
        except asyncio.TimeoutError:
            raise Refusal(
                408,
                "timeout",
                f"the body did not arrive within {self.settings.body_timeout_seconds:g} s",
            ) from None

        self._lane(request, raw)
        if request.get(_LANE) == "heartbeat":
            # Behind the verdicts read with it: a burst's requests are read and their
            # handlers started in the order their connections became readable, so a
            # heartbeat steps back (HEARTBEAT_YIELDS turns of the loop), and one that
            # finds a verdict in flight then is shed before it costs a review, a lookup
            # or a parse.
            for _ in range(HEARTBEAT_YIELDS):
                await asyncio.sleep(0)
            self._shed_if_busy()
        # The checks' CPU, a few reports at a time and verdicts first (:class:`PriorityGate`):
        # each turn of the event loop stays short, so the containment's API calls (one turn
        # each) are not each queued behind a whole storm's checks.
        # (the token's review and the pod's read, I/O where the caches miss, go before)
        identity = await self.authenticator.authenticate(token, source=request.remote or "")
        pod = await self._pod(identity)
        await self.gate.enter(first=request.get(_LANE) == "verdict")
        try:
            if request.get(_LANE) == "heartbeat":
                self._shed_if_busy()
            report, ref, node, ignored = await self._check(identity, pod, raw)
            request[_CHECKED] = True
        finally:
            self.gate.leave()
        status, body = await self._dispatch(report, ref, pod, node)
        if ignored:
            self.metrics.ignored_fields.labels(report.kind).inc()
            body["ignored"] = ignored[:64]
            _refusals_log.info(
                f"ignored/{report.kind}",
                "ignored fields of a %s report from %s/%s (a newer agent): %s",
                report.kind,
                ref.namespace,
                ref.name,
                ", ".join(ignored[:16]),
            )
        return status, body

    async def _check(
        self, identity: PodIdentity, pod: dict[str, Any], raw: bytes
    ) -> tuple[Any, JobRef, str, list[str]]:
        """Steps 5 to 8 for the reporting pod: its namespace and job, the job's rate, the
        protocol, the reporter, age and clock; the report, its job, node and the fields it
        carried that this operator ignores."""
        namespace = identity.namespace
        admission = self.engine.admission(namespace)
        if not admission.admitted:
            raise Refusal(403, "namespace_not_admitted", admission.reason)
        ref, job = await self._job_of(pod)
        self._genuine(pod, job)
        retry_after = self.limiter.acquire(ref.uid)
        if retry_after is not None:
            raise Refusal(
                429,
                "rate_limited",
                f"job {ref.namespace}/{ref.name} sends more than {self.settings.rate_per_job:g} "
                "reports per second",
                retry_after=retry_after,
            )
        ignored: list[str] = []
        try:
            report = parse_report(raw, ignored=ignored)
        except ProtocolError as exc:
            if exc.field == "report":
                raise Refusal(400, "malformed", str(exc)) from None
            raise Refusal(422, "schema", str(exc)) from None
        pod_name = pod["metadata"]["name"]
        node = (pod.get("spec") or {}).get("nodeName") or ""
        self._reporter_is_pod(report.reporter, pod_name, node)
        self._timely(report.sent_at)
        self.metrics.report_versions.labels(str(report.version)).inc()
        if isinstance(report, HeartbeatReport) and report.unreported:
            _refusals_log.info(
                f"unreported/{ref.uid}",
                "the agents of %s/%s cannot report these fields to this operator: %s",
                ref.namespace,
                ref.name,
                ", ".join(report.unreported),
            )
        return report, ref, node, ignored

    async def _dispatch(
        self, report: Any, ref: JobRef, pod: dict[str, Any], node: str
    ) -> tuple[int, dict[str, Any]]:
        if isinstance(report, HeartbeatReport):
            self.heartbeats.observe(ref, node, report)
            self.metrics.reports.labels(report.kind, "").inc()
            return 202, {"accepted": report.kind}
        if isinstance(report, CheckpointReport):
            recorded = await self.engine.record_checkpoint(ref, report)
            self.metrics.reports.labels(report.kind, "").inc()
            return 202, {"accepted": report.kind, "recorded": recorded}
        if isinstance(report, ResumeReport):
            marked = await self.engine.record_resume(ref, report)
            self.metrics.reports.labels(report.kind, "").inc()
            return 202, {"accepted": report.kind, "incidents": marked}
        assert isinstance(report, VerdictReport)
        suspects = await self._resolve_suspects(report, ref)
        name, phase = await self.engine.record_verdict(
            ref,
            report,
            reporter_pod=pod["metadata"]["name"],
            reporter_node=node,
            suspects=suspects,
            reporter_created=pod["metadata"].get("creationTimestamp"),
        )
        self.metrics.reports.labels(report.kind, report.classification).inc()
        return 202, {"accepted": report.kind, "incident": f"{ref.namespace}/{name}", "phase": phase}

    def _lane(self, request: web.Request, raw: bytes) -> None:
        """Verdicts first: a heartbeat is shed (429) while a verdict is in flight or has
        just been, or while its own lane is full; it costs nothing more than its body. The
        kind is read from the body before anything else is checked; a body that lies about
        it is refused later, like any other."""
        kind = _kind_of(raw)
        if kind == "verdict":
            self.in_flight.join("verdict")
            request[_LANE] = "verdict"
            return
        if kind != "heartbeat":
            return
        if self.verdicts_only:
            raise Refusal(
                421,
                "misdirected",
                "heartbeats go to the intake's main port (HYPERPOD_SDC_OPERATOR_URL), not "
                "to the verdict port",
            )
        s = self.settings
        self._shed_if_busy()
        if not self.in_flight.join("heartbeat", s.max_heartbeats_in_flight):
            raise self._shed(
                f"more than {s.max_heartbeats_in_flight} heartbeats at once; try again "
                "after Retry-After"
            )
        request[_LANE] = "heartbeat"

    def _shed_if_busy(self) -> None:
        """A heartbeat is shed while a verdict is in flight or was answered just now (on
        either report listener)."""
        if self.in_flight.verdict_recent(VERDICT_QUIET):
            raise self._shed(
                "verdicts first: heartbeats are answered later; try again after Retry-After"
            )

    def _shed(self, message: str) -> Refusal:
        wait = self.settings.heartbeat_retry_after_seconds
        return Refusal(429, "shed", message, retry_after=random.uniform(wait, 2 * wait))

    def _reporter_is_pod(self, reporter: Any, pod_name: str, node: str) -> None:
        if reporter.node != node:
            raise Refusal(
                403,
                "reporter_mismatch",
                f"reporter.node: the token's pod {pod_name} runs on node {node or '(none)'!r}, "
                f"not {reporter.node!r}",
            )
        if reporter.pod is not None and reporter.pod != pod_name:
            raise Refusal(
                403,
                "reporter_mismatch",
                f"reporter.pod: the token belongs to pod {pod_name}, not {reporter.pod!r}",
            )

    def _timely(self, sent_at: float) -> None:
        age = self.clock() - sent_at
        if age > self.settings.max_report_age_seconds:
            raise Refusal(
                422,
                "stale",
                f"sent_at: the report is {age:.0f} s old, older than "
                f"{self.settings.max_report_age_seconds:g} s",
            )
        if -age > self.settings.max_clock_skew_seconds:
            raise Refusal(
                422,
                "future",
                f"sent_at: the report is dated {-age:.0f} s in the future, more than the "
                f"{self.settings.max_clock_skew_seconds:g} s of clock skew allowed",
            )

    # -- lookups (caches first) ---------------------------------------------------------------

    async def _read_once(
        self, key: tuple[str, ...], read: Callable[[], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any] | None:
        """``read()`` for an object the cache lacks; concurrent misses share one read; a
        404 is ``None``."""
        shared = self._reads.get(key)
        if shared is None:
            shared = asyncio.get_running_loop().create_future()
            self._reads[key] = shared

            async def go() -> None:
                try:
                    shared.set_result(await read())
                except ApiError as exc:
                    if is_not_found(exc):
                        shared.set_result(None)
                    else:
                        shared.set_exception(exc)
                        shared.exception()
                except Exception as exc:  # the same error for every waiter
                    shared.set_exception(exc)
                    shared.exception()
                finally:
                    self._reads.pop(key, None)

            asyncio.get_running_loop().create_task(go())
        return await asyncio.shield(shared)

    async def _pod(self, identity: PodIdentity) -> dict[str, Any]:
        pod = self.caches.pods.get(identity.namespace, identity.pod)
        if pod is None or (identity.pod_uid and pod["metadata"].get("uid") != identity.pod_uid):
            if not self.caches.pods.watches(identity.namespace):
                raise Refusal(
                    403,
                    "namespace_not_admitted",
                    f"namespace {identity.namespace} is not watched by this operator "
                    "(HYPERPOD_SDC_NAMESPACES)",
                )
            found = await self._read_once(
                ("pod", identity.namespace, identity.pod),
                lambda: self.lookups.get_pod(identity.namespace, identity.pod),
            )
            if found is not None:
                self.caches.pods.upsert(found)
                pod = self.caches.pods.get(identity.namespace, identity.pod)
            else:
                pod = None
        if pod is None:
            raise Refusal(
                403, "unknown_pod", f"pod {identity.namespace}/{identity.pod} no longer exists"
            )
        if identity.pod_uid is not None and pod["metadata"].get("uid") != identity.pod_uid:
            raise Refusal(
                403, "unknown_pod", f"pod {identity.namespace}/{identity.pod} was replaced"
            )
        node = (pod.get("spec") or {}).get("nodeName") or ""
        if identity.node is not None and identity.node != node:
            raise Refusal(
                403,
                "unknown_pod",
                f"the token of pod {identity.namespace}/{identity.pod} was issued on node "
                f"{identity.node}, the pod runs on {node or '(none)'}",
            )
        return pod

    async def _job_of(self, pod: dict[str, Any]) -> tuple[JobRef, dict[str, Any]]:
        meta = pod["metadata"]
        owner = jobs.job_owner(pod)
        if owner is None:
            kinds = ", ".join(kind for _, kind in jobs.JOB_KINDS)
            raise Refusal(
                403,
                "not_a_job_pod",
                f"pod {meta['namespace']}/{meta['name']} is not controlled by a {kinds}",
            )
        api_version, kind = owner["apiVersion"], owner["kind"]
        plural = jobs.JOB_KINDS[(api_version, kind)]
        job = self.caches.job(api_version, kind, meta["namespace"], owner["name"])
        if job is None or job["metadata"].get("uid") != owner.get("uid"):
            found = await self._read_once(
                ("job", api_version, meta["namespace"], owner["name"]),
                lambda: self.lookups.get_object(
                    api_version, plural, meta["namespace"], owner["name"]
                ),
            )
            if found is None:
                raise Refusal(
                    403,
                    "not_a_job_pod",
                    f"the pod's {kind} {owner['name']} no longer exists",
                )
            self.caches.jobs[(api_version, kind)].upsert(found)
            job = self.caches.job(api_version, kind, meta["namespace"], owner["name"]) or found
        if job["metadata"].get("uid") != owner.get("uid"):
            raise Refusal(403, "not_a_job_pod", f"the pod's {kind} {owner['name']} was replaced")
        if not jobs.is_enabled(job):
            raise Refusal(
                403,
                "not_opted_in",
                f"{kind} {meta['namespace']}/{owner['name']} does not carry the "
                'annotation hyperpod-sdc.dev/enabled: "true"',
            )
        return JobRef(api_version, kind, meta["namespace"], owner["name"], owner["uid"]), job

    def _genuine(self, pod: dict[str, Any], job: dict[str, Any]) -> None:
        problem = self._why_not_genuine(pod, job)
        if problem is not None:
            raise Refusal(
                403, "not_a_job_pod" if problem[0] == "shape" else "not_attested", problem[1]
            )

    def _why_not_genuine(
        self, pod: dict[str, Any], job: dict[str, Any] | None
    ) -> tuple[str, str] | None:
        """Why the pod is not one its job's training operator made, as (``shape`` or
        ``attestation``, message), or ``None``: named and labelled as that operator names
        them, sent to the admission webhook when it was created (its labels match the
        webhook's selectors: a pod the webhook never saw could keep a copied attestation),
        and attested there."""
        problem = jobs.pod_fits_job(pod, job) if job else None
        if problem is not None:
            return "shape", problem
        if not self.settings.require_attestation:
            return None
        meta = pod.get("metadata") or {}
        ref = f"pod {meta.get('namespace')}/{meta.get('name')}"
        if self.pod_selectors and not matches_any(self.pod_selectors, meta.get("labels") or {}):
            return "attestation", (
                f"{ref} does not carry the labels the admission webhook selects, so the "
                "webhook never saw it created"
            )
        genuine, why = verify_pod(pod, self.trusted)
        until = self.legacy_until
        if not genuine and until is not None and self.key is not None:
            legacy, legacy_why = verify_legacy(self.key.value, pod, self.trusted, until)
            if legacy:
                return None
            if ATTESTATION_ANNOTATION in (meta.get("annotations") or {}):
                why = legacy_why
        return None if genuine else ("attestation", why)

    async def _resolve_suspects(self, report: VerdictReport, ref: JobRef) -> list[ResolvedSuspect]:
        """Each suspect -> an attested pod of this very job -> its node -> the instance id."""
        if not report.suspects:
            return []
        # A suspect named by its pod costs one cache lookup, not a pass over the job's pods:
        # at 2,048 nodes every node's verdict built the job's pod list and a dict of it
        # (bench/operator_scale.py --profile: 41 s of the operator's 61 s of CPU).

        def job_pods() -> list[dict[str, Any]]:
            return [
                p
                for p in self.caches.pods_of(ref.uid)
                if p["metadata"].get("namespace") == ref.namespace
            ]

        by_name: dict[str, dict[str, Any] | None] = {}

        def named(name: str) -> dict[str, Any] | None:
            if name not in by_name:
                pod = self.caches.pods.get(ref.namespace, name)
                mine = pod is not None and (jobs.job_owner(pod) or {}).get("uid") == ref.uid
                by_name[name] = pod if mine else None
            return by_name[name]

        job = self.caches.job(ref.api_version, ref.kind, ref.namespace, ref.name) or {}
        resolved: list[ResolvedSuspect] = []
        instances: dict[str, str | None] = {}
        for i, suspect in enumerate(report.suspects):
            field = f"suspects[{i}]"
            try:
                pod = self._suspect_pod(ref, suspect, field, job_pods, named, job)
            except Refusal:
                # The cache may be behind the API server (a pod just made, moved or started):
                # the suspect's pod is read again before the report is refused for it.
                fresh = await self._reread_suspect(ref, suspect)
                if fresh is None:
                    raise
                by_name[fresh["metadata"]["name"]] = fresh
                only = [fresh]
                pod = self._suspect_pod(ref, suspect, field, only.copy, named, job)
            node = (pod.get("spec") or {}).get("nodeName") or ""
            if node not in instances:
                instances[node] = await self._instance(node)
            resolved.append(
                ResolvedSuspect(
                    rank=suspect.rank,
                    local_rank=suspect.local_rank,
                    pod=pod["metadata"]["name"],
                    node=node,
                    instance_id=instances[node],
                    gpu_uuid=suspect.gpu_uuid,
                )
            )
        return resolved

    def _suspect_pod(
        self,
        ref: JobRef,
        suspect: Suspect,
        field: str,
        job_pods: Callable[[], list[dict[str, Any]]],
        named: Callable[[str], dict[str, Any] | None],
        job: dict[str, Any],
    ) -> dict[str, Any]:
        """The suspect's pod, as the pods given have it (``named``: the job's pod of that
        name; ``job_pods``: all of them, listed only for a suspect named by its node alone):
        a genuine pod of the job, on the node the suspect names, that ran there; else
        ``Refusal(422)`` saying why not."""
        if suspect.pod is not None:
            pod = named(suspect.pod)
            if pod is None:
                raise Refusal(
                    422,
                    "unknown_suspect",
                    f"{field}.pod: rank {suspect.rank}'s pod {suspect.pod!r} is not a pod of "
                    f"{ref.kind} {ref.namespace}/{ref.name}",
                )
        else:
            on_node = [
                p for p in job_pods() if (p.get("spec") or {}).get("nodeName") == suspect.node
            ]
            if len(on_node) != 1:
                raise Refusal(
                    422,
                    "unknown_suspect",
                    f"{field}.node: {len(on_node)} pods of {ref.kind} "
                    f"{ref.namespace}/{ref.name} run on node {suspect.node!r}; name the pod",
                )
            pod = on_node[0]
        node = (pod.get("spec") or {}).get("nodeName") or ""
        if node != suspect.node:
            raise Refusal(
                422,
                "unknown_suspect",
                f"{field}.node: pod {pod['metadata']['name']} runs on node "
                f"{node or '(none)'!r}, not {suspect.node!r}",
            )
        problem = self._why_not_genuine(pod, job or None)
        if problem is not None:
            raise Refusal(422, "unknown_suspect", f"{field}: {problem[1]}")
        phase = (pod.get("status") or {}).get("phase")
        if phase not in RAN_PHASES:
            # A pod bound to a node that never ran it there (the kubelet refused it:
            # no free GPU, say) says nothing about that node's hardware.
            raise Refusal(
                422,
                "unknown_suspect",
                f"{field}: pod {pod['metadata']['name']} is {phase or 'without a phase'}, "
                f"so it never ran on node {node!r}",
            )
        return pod

    async def _reread_suspect(self, ref: JobRef, suspect: Suspect) -> dict[str, Any] | None:
        """The suspect's named pod as the API server has it now, put into the cache, where
        it is a pod of the job; ``None`` where the report names no pod or the pod is not
        the job's (no read: a node alone cannot be read without listing the namespace)."""
        name = suspect.pod
        if name is None:
            return None
        found = await self._read_once(
            ("pod", ref.namespace, name), lambda: self.lookups.get_pod(ref.namespace, name)
        )
        if found is None or (jobs.job_owner(found) or {}).get("uid") != ref.uid:
            return None
        self.caches.pods.upsert(found)
        return self.caches.pods.get(ref.namespace, name) or found

    async def _instance(self, node_name: str) -> str | None:
        node = self.caches.nodes.get(None, node_name)
        if node is None:
            return None
        found, _ = await self.resolver.instance_id(node)
        return found


VERDICT_QUIET = 5.0
"""Seconds after a verdict was answered during which heartbeats are still shed: the other
reporters' verdicts of the same audit arrive in that time, and containment (which follows
the answer) writes to the API server. At 2,048 nodes with 1 s, the heartbeats accepted after
the verdict's answer delayed containment to 3.7 s (bench/operator_scale.py --production)."""
_LANE = "sdc_lane"
_CHECKED = "sdc_checked"
"""Set on a request whose report passed every check (its pod's token, its job, the
protocol): only such a verdict keeps heartbeats shed after it is answered (a body that
merely says ``"kind": "verdict"`` sheds them only while it is in flight)."""
REPORTS_CHECKED_AT_ONCE = 8
"""Reports whose checks (token, pod, job, attestation, parse) run at once. At 2,048 nodes
every node's verdict was checked in the same turns of the event loop, and each of the
containment's dozen sequential API calls waited for such a turn: contained 5.6 s after
agreement (bench/operator_scale.py --production)."""
HEARTBEAT_YIELDS = 3
"""Turns of the event loop a heartbeat gives up after its body is read, before anything
else is checked: aiohttp takes a request from the socket's data to its handler in about
two turns, so the verdicts read in the same burst reach their lane first."""


def _kind_of(raw: bytes) -> str | None:
    """The ``kind`` a report body says it is; ``None`` where it is not a JSON object or
    says it twice (refused later, with the reason, like any other bad body)."""
    outer: list[list[tuple[str, Any]]] = [[]]

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        outer[0] = items  # the outermost object is the last one parsed
        return dict(items)

    try:
        report = json.loads(raw, object_pairs_hook=pairs)
    except ValueError:
        return None
    kinds = [v for k, v in outer[0] if k == "kind"]
    if not isinstance(report, dict) or len(kinds) != 1:
        return None
    return kinds[0] if isinstance(kinds[0], str) else None


RAN_PHASES = frozenset({"Running", "Succeeded"})
"""Pod phases in which its containers ran on its node: only such a pod can be a suspect."""


_ACCEPTED = ", ".join(map(str, ACCEPTED_VERSIONS))


async def _advertise_versions(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[PROTOCOL_HEADER] = _ACCEPTED


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body, however many TCP segments or TLS records it arrives in; a body
    over ``limit`` bytes is refused as soon as it is known to be one.

    ``request.content.read(n)`` returns what is buffered so far, not the body: a report
    split across two writes would otherwise be parsed half-read.
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await request.content.read(limit + 1 - size)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise Refusal(413, "too_large", f"report is larger than {limit} bytes")
        chunks.append(chunk)


def json_error_middleware() -> Callable[..., Awaitable[web.StreamResponse]]:
    """Every answer is JSON: an unknown path or method (404, 405) says so, and unexpected
    errors answer 500 (the agent retries 5xx), never a traceback to the client."""

    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            reason = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "bad_request")
            _refusals_log.info(
                reason, "refused %s %s: %s", request.method, request.path, exc.reason
            )
            return _json(exc.status, reason, f"{request.method} {request.path}: {exc.reason}")
        except ConnectionResetError:
            # The client went away while its request was read: nothing to answer, nothing
            # wrong here (a slow flood ending does this).
            log.info("intake: %s %s: the client reset the connection", request.method, request.path)
            return _json(400, "reset", "the connection was reset while the request was read")
        except ApiError as exc:
            log.warning("intake: the API server failed on %s: %s", request.path, exc)
            return _json(
                503,
                "unavailable",
                "the Kubernetes API server failed; try again",
                **{"Retry-After": "1"},
            )
        except Exception as exc:
            log.exception("intake error on %s", request.path)
            return _json(500, "internal", f"{type(exc).__name__}: try again")

    return middleware
