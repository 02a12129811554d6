"""Opt in with one annotation: the webhook, the CA publisher and the job watch, put
together for :class:`.handlers.Operator` (docs/webhook.md)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection

from aiohttp import web
from prometheus_client import CollectorRegistry

from .caches import Caches
from .effects import Effects
from .jobwatch import JobWatch
from .kube import Kube
from .trust_bundle import CaPublisher, ServingCertificate
from .webhook import AdmissionLookups, PodWebhook, WebhookSettings

__all__ = ["OptIn"]

log = logging.getLogger(__name__)


class OptIn:
    def __init__(
        self,
        kube: Kube,
        settings: WebhookSettings,
        *,
        token_audience: str,
        trusted_creators: Callable[[], tuple[str, ...]],
        leader: Callable[[], bool],
        registry: CollectorRegistry,
        serving: ServingCertificate | None = None,
        caches: Caches | None = None,
        effects: Effects | None = None,
        api_server: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        self.settings = settings
        self.serving = serving
        self.lookups = AdmissionLookups(kube, settings.webhook_cache_seconds, caches=caches)
        # Writes (the CA ConfigMaps, Events) go through the effects layer (.effects).
        effects = effects or Effects(kube, caches or Caches(kube, []))
        self.publisher = (
            CaPublisher(effects, settings.tls_ca_file) if settings.tls_ca_file else None
        )
        publisher = self.publisher
        self.webhook = PodWebhook(
            settings,
            self.lookups,
            token_audience=token_audience,
            trusted_creators=trusted_creators,
            registry=registry,
            ca_available=lambda: publisher is not None and publisher.current() is not None,
            api_server=api_server,
        )
        if self.publisher is not None and self.publisher.current() is None:
            log.warning(
                "the CA file %s is missing or empty: no CA is published until it appears",
                settings.tls_ca_file,
            )
        self.jobs = JobWatch(
            kube,
            effects,
            caches,
            self.lookups,
            self.publisher,
            settings.webhook_pod_selectors,
            registry,
            leader,
        )
        self._sweeper: asyncio.Task[None] | None = None

    def add_routes(self, app: web.Application) -> None:
        self.webhook.add_routes(app)

    async def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.job_sweep_seconds)
            try:
                if self.serving is not None and self.serving.refresh():
                    log.info("reloaded the serving certificate %s", self.serving.cert_file)
                await self.jobs.sweep()
            except Exception:
                log.exception(
                    "the job sweep failed; trying again in %g s", self.settings.job_sweep_seconds
                )

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
