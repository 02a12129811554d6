"""The kopf handlers: start the intake and the engine, and react to incidents.

Only ``on.event`` watches ``SDCIncident`` objects: it needs no finalizer and writes
nothing of kopf's onto them. kopf lists every existing incident when it starts, so an
operator restarted in the middle of an incident picks it up at once; a resync every
``resync_seconds`` retries what failed.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import ssl
from collections.abc import Callable
from typing import Any

import boto3
import kopf
from aiohttp import web

from . import incidents, jobwatch  # noqa: F401  (jobwatch registers the job watches)
from .auth import Authenticator, StaticTokens, TokenReviewer
from .engine import IncidentEngine
from .intake import Intake
from .kube import Kube, load_config
from .localize import InstanceResolver
from .metrics import Metrics
from .names import GROUP, INCIDENT_PLURAL, VERSION
from .optin import OptIn, trusted_pod_creators
from .remediate import HyperPodNodes
from .settings import OperatorSettings
from .trust_bundle import ServingCertificate
from .webhook import WebhookSettings

__all__ = ["Operator"]

log = logging.getLogger(__name__)


def _sagemaker_factory(settings: OperatorSettings) -> Callable[[], Any]:
    """One boto3 SageMaker client for the process, made on first use (boto3 honours
    ``AWS_ENDPOINT_URL_SAGEMAKER`` for VPC endpoints)."""
    made: list[Any] = []

    def make() -> Any:
        if not made:
            made.append(boto3.client("sagemaker", region_name=settings.aws_region))
        return made[0]

    return make


class Operator:
    """Everything the operator runs besides kopf's own watches."""

    def __init__(self, settings: OperatorSettings) -> None:
        self.settings = settings
        load_config()
        self.kube = Kube()
        self.metrics = Metrics()
        sagemaker = _sagemaker_factory(settings)
        self.engine = IncidentEngine(self.kube, settings, self.metrics, HyperPodNodes(sagemaker))
        authenticator: Authenticator
        if settings.auth_mode == "static":
            assert settings.static_tokens_file is not None
            authenticator = StaticTokens(settings.static_tokens_file)
            log.warning("auth mode is static: development only, tokens are not reviewed")
        else:
            authenticator = TokenReviewer(
                self.kube, settings.token_audience, settings.token_cache_seconds
            )
        resolver = InstanceResolver(sagemaker, cluster_name=settings.cluster_name)
        self.intake = Intake(
            settings, self.kube, authenticator, self.engine, resolver, self.metrics
        )
        self._runner: web.AppRunner | None = None
        self._resync: asyncio.Task[None] | None = None
        # The admission webhook (same server, same TLS), CA publishing and the job watch.
        # Until the operator has its own attestation key and leader flag, a per-process key
        # and "always the leader" stand in for them.
        self.serving = None
        if settings.tls_cert_file and settings.tls_key_file:
            self.serving = ServingCertificate(settings.tls_cert_file, settings.tls_key_file)
        webhook_settings = WebhookSettings.from_env()
        stub_key = secrets.token_bytes(32)
        self.optin = OptIn(
            self.kube,
            webhook_settings,
            token_audience=settings.token_audience,
            trusted_creators=lambda: trusted_pod_creators(settings, webhook_settings),
            key=lambda: getattr(self, "attestation_key", None) or stub_key,
            leader=lambda: True,
            registry=self.metrics.registry,
            serving=self.serving,
        )

    async def start(self) -> None:
        ssl_context: ssl.SSLContext | None = None
        if self.serving is not None:
            ssl_context = self.serving.context
        app = self.intake.app()
        self.optin.add_routes(app)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner,
            self.settings.listen_address,
            self.settings.listen_port,
            ssl_context=ssl_context,
        )
        await site.start()
        log.info(
            "intake listening on %s://%s:%d",
            "https" if ssl_context else "http",
            self.settings.listen_address,
            self.settings.listen_port,
        )
        self._resync = asyncio.get_running_loop().create_task(self._resync_forever())
        await self.optin.start()

    async def _resync_forever(self) -> None:
        while True:
            try:
                await self.engine.resync()
            except Exception:
                log.exception("resync failed; trying again in %g s", self.settings.resync_seconds)
            await asyncio.sleep(self.settings.resync_seconds)

    async def stop(self) -> None:
        await self.optin.stop()
        if self._resync is not None:
            self._resync.cancel()
            await asyncio.gather(self._resync, return_exceptions=True)
        await self.engine.close()
        if self._runner is not None:
            await self._runner.cleanup()
        self.kube.close()


@kopf.on.startup()
async def operator_startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.posting.enabled = False  # the engine posts its own, meaningful Events
    settings.peering.standalone = True  # one replica (Deployment strategy Recreate)
    operator = Operator(OperatorSettings.from_env())
    await operator.start()
    memo.operator = operator


@kopf.on.cleanup()
async def operator_cleanup(memo: kopf.Memo, **_: Any) -> None:
    operator = getattr(memo, "operator", None)
    if operator is not None:
        await operator.stop()


@kopf.on.event(GROUP, VERSION, INCIDENT_PLURAL)
async def sdcincident_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    if type == "DELETED":
        return
    engine = memo.operator.engine
    if incidents.pending_actions(dict(body), engine.rules):
        engine.schedule(body.metadata.namespace, body.metadata.name)
