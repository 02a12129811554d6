"""The intake: ``POST /v1/reports`` (docs/protocol.md), ``/metrics``, ``/healthz``.

A report is checked in this order, cheapest first, and the first failure answers a 4xx
with ``{"error": <reason>, "message": <what to fix>}``, counts under that reason in
``hyperpod_sdc_refusals_total`` and changes nothing:

1. media type and size (415, 413);
2. the Bearer token -> the reporting pod (401), which must still exist (403);
3. the pod's controlling owner -> an opted-in job (403);
4. the job's rate (429 with ``Retry-After``);
5. the protocol (400 not JSON, 422 against the schema), the reporter against the pod (403),
   age (422);
6. for a verdict, each suspect must be a pod of the same job, on the node it names (422).

Verdicts fold into the job's incident (202); heartbeats and checkpoints are counted (202).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sdc_agent.errors import ProtocolError
from sdc_agent.protocol import CheckpointReport, ResumeReport, VerdictReport, parse_report

from . import jobs
from .auth import Authenticator, PodIdentity
from .engine import IncidentEngine
from .errors import Refusal
from .incidents import JobRef, ResolvedSuspect
from .kube import Kube, is_not_found
from .localize import InstanceResolver
from .metrics import Metrics
from .ratelimit import RateLimiter
from .settings import OperatorSettings

__all__ = ["REPORTS_PATH", "Intake"]

log = logging.getLogger(__name__)
REPORTS_PATH = "/v1/reports"


class Intake:
    def __init__(
        self,
        settings: OperatorSettings,
        kube: Kube,
        authenticator: Authenticator,
        engine: IncidentEngine,
        resolver: InstanceResolver,
        metrics: Metrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.kube = kube
        self.authenticator = authenticator
        self.engine = engine
        self.resolver = resolver
        self.metrics = metrics
        self.limiter = RateLimiter(settings.rate_per_job, settings.rate_burst)
        self.clock = clock
        self.ready: Callable[[], bool] = lambda: True

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.settings.max_body_bytes + 1, middlewares=[json_error_middleware()]
        )
        app.router.add_post(REPORTS_PATH, self.post_report)
        app.router.add_get("/metrics", self.get_metrics)
        app.router.add_get("/healthz", self.get_healthz)
        app.router.add_get("/readyz", self.get_readyz)
        return app

    async def get_metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def get_healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def get_readyz(self, request: web.Request) -> web.Response:
        ready = self.ready()
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def post_report(self, request: web.Request) -> web.Response:
        try:
            status, body = await self.accept(request)
        except Refusal as refusal:
            self.metrics.refusals.labels(refusal.reason).inc()
            log.info("refused a report (%s): %s", refusal.reason, refusal.message)
            headers = {}
            if refusal.retry_after is not None:
                headers["Retry-After"] = str(max(1, round(refusal.retry_after)))
            return web.json_response(
                {"error": refusal.reason, "message": refusal.message},
                status=refusal.status,
                headers=headers,
            )
        return web.json_response(body, status=status)

    async def accept(self, request: web.Request) -> tuple[int, dict[str, Any]]:
        if request.content_type != "application/json":
            raise Refusal(
                415,
                "media_type",
                f"Content-Type must be application/json, got {request.content_type!r}",
            )
        limit = self.settings.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise Refusal(413, "too_large", f"report is larger than {limit} bytes")
        raw = await read_body(request, limit)

        identity = await self._authenticate(request.headers.get("Authorization", ""))
        pod = await self._pod(identity)
        ref = await self._job_of(pod)
        retry_after = self.limiter.acquire(ref.uid)
        if retry_after is not None:
            raise Refusal(
                429,
                "rate_limited",
                f"job {ref.namespace}/{ref.name} sends more than {self.settings.rate_per_job:g} "
                "reports per second",
                retry_after=retry_after,
            )
        try:
            report = parse_report(raw)
        except ProtocolError as exc:
            if exc.field == "report":
                raise Refusal(400, "malformed", str(exc)) from None
            raise Refusal(422, "schema", str(exc)) from None

        pod_name = pod["metadata"]["name"]
        node = (pod.get("spec") or {}).get("nodeName") or ""
        if report.reporter.node != node:
            raise Refusal(
                403,
                "reporter_mismatch",
                f"reporter.node: the token's pod {pod_name} runs on node {node or '(none)'!r}, "
                f"not {report.reporter.node!r}",
            )
        if report.reporter.pod is not None and report.reporter.pod != pod_name:
            raise Refusal(
                403,
                "reporter_mismatch",
                f"reporter.pod: the token belongs to pod {pod_name}, not {report.reporter.pod!r}",
            )
        age = self.clock() - report.sent_at
        if age > self.settings.max_report_age_seconds:
            raise Refusal(
                422,
                "stale",
                f"sent_at: the report is {age:.0f} s old, older than "
                f"{self.settings.max_report_age_seconds:g} s",
            )

        if isinstance(report, CheckpointReport):
            recorded = await self.engine.record_checkpoint(ref, report)
            self.metrics.reports.labels(report.kind, "").inc()
            return 202, {"accepted": report.kind, "recorded": recorded}
        if isinstance(report, ResumeReport):
            marked = await self.engine.record_resume(ref, report)
            self.metrics.reports.labels(report.kind, "").inc()
            return 202, {"accepted": report.kind, "incidents": marked}
        if not isinstance(report, VerdictReport):
            self.metrics.reports.labels(report.kind, "").inc()
            return 202, {"accepted": report.kind}
        suspects = await self._resolve_suspects(report, ref)
        name, phase = await self.engine.record_verdict(
            ref, report, reporter_pod=pod_name, reporter_node=node, suspects=suspects
        )
        self.metrics.reports.labels(report.kind, report.classification).inc()
        return 202, {"accepted": report.kind, "incident": f"{ref.namespace}/{name}", "phase": phase}

    async def _authenticate(self, header: str) -> PodIdentity:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Refusal(401, "unauthenticated", "Authorization: a Bearer token is required")
        return await self.authenticator.authenticate(token.strip())

    async def _pod(self, identity: PodIdentity) -> dict[str, Any]:
        try:
            pod = await self.kube.get_pod(identity.namespace, identity.pod)
        except Exception as exc:
            if is_not_found(exc):
                raise Refusal(
                    403, "unknown_pod", f"pod {identity.namespace}/{identity.pod} no longer exists"
                ) from None
            raise
        if identity.pod_uid is not None and pod["metadata"].get("uid") != identity.pod_uid:
            raise Refusal(
                403, "unknown_pod", f"pod {identity.namespace}/{identity.pod} was replaced"
            )
        return pod

    async def _job_of(self, pod: dict[str, Any]) -> JobRef:
        meta = pod["metadata"]
        owner = jobs.job_owner(pod)
        if owner is None:
            kinds = ", ".join(kind for _, kind in jobs.JOB_KINDS)
            raise Refusal(
                403,
                "not_a_job_pod",
                f"pod {meta['namespace']}/{meta['name']} is not controlled by a {kinds}",
            )
        plural = jobs.JOB_KINDS[(owner["apiVersion"], owner["kind"])]
        try:
            job = await self.kube.get_object(
                owner["apiVersion"], plural, meta["namespace"], owner["name"]
            )
        except Exception as exc:
            if is_not_found(exc):
                raise Refusal(
                    403,
                    "not_a_job_pod",
                    f"the pod's {owner['kind']} {owner['name']} no longer exists",
                ) from None
            raise
        if job["metadata"].get("uid") != owner.get("uid"):
            raise Refusal(
                403, "not_a_job_pod", f"the pod's {owner['kind']} {owner['name']} was replaced"
            )
        if not jobs.is_enabled(job):
            raise Refusal(
                403,
                "not_opted_in",
                f"{owner['kind']} {meta['namespace']}/{owner['name']} does not carry the "
                'annotation hyperpod-sdc.dev/enabled: "true"',
            )
        ref = JobRef(
            owner["apiVersion"], owner["kind"], meta["namespace"], owner["name"], owner["uid"]
        )
        return ref

    async def _resolve_suspects(self, report: VerdictReport, ref: JobRef) -> list[ResolvedSuspect]:
        """Each suspect -> a pod of this very job -> its node -> the instance id."""
        if not report.suspects:
            return []
        job_pods = [
            p
            for p in await self.kube.list_pods(ref.namespace)
            if (jobs.job_owner(p) or {}).get("uid") == ref.uid
        ]
        by_name = {p["metadata"]["name"]: p for p in job_pods}
        resolved: list[ResolvedSuspect] = []
        nodes: dict[str, tuple[str | None, str]] = {}
        for i, suspect in enumerate(report.suspects):
            field = f"suspects[{i}]"
            if suspect.pod is not None:
                pod = by_name.get(suspect.pod)
                if pod is None:
                    raise Refusal(
                        422,
                        "unknown_suspect",
                        f"{field}.pod: rank {suspect.rank}'s pod {suspect.pod!r} is not a pod of "
                        f"{ref.kind} {ref.namespace}/{ref.name}",
                    )
            else:
                on_node = [
                    p for p in job_pods if (p.get("spec") or {}).get("nodeName") == suspect.node
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
            if node not in nodes:
                nodes[node] = await self._instance(node)
            resolved.append(
                ResolvedSuspect(
                    rank=suspect.rank,
                    local_rank=suspect.local_rank,
                    pod=pod["metadata"]["name"],
                    node=node,
                    instance_id=nodes[node][0],
                    gpu_uuid=suspect.gpu_uuid,
                )
            )
        return resolved

    async def _instance(self, node_name: str) -> tuple[str | None, str]:
        try:
            node = await self.kube.get_node(node_name)
        except Exception as exc:
            if is_not_found(exc):
                return None, f"node {node_name} does not exist"
            raise
        return await self.resolver.instance_id(node)


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
    """Unexpected errors answer 500 as JSON (the agent retries 5xx), never a traceback."""

    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except Exception as exc:
            log.exception("intake error on %s", request.path)
            return web.json_response(
                {"error": "internal", "message": f"{type(exc).__name__}: try again"}, status=500
            )

    return middleware
