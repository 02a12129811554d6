"""The kopf handlers: start the caches, the intake, the engine and the leader election.

kopf runs standalone in every replica (its peering would pause the standby's watches,
which the intake's caches need; :mod:`.leader` elects the replica that acts). The
incidents are watched by :mod:`.caches` itself, which drives the engine: an incident that
changes (a report, a person's annotation, the other replica's write) is reconciled by the
leader, and every ``resync_seconds`` the leader drives each unfinished incident again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import boto3
import kopf
from aiohttp import web

from . import jobwatch, retention  # noqa: F401  (jobwatch registers the job watches)
from .apiserver import ApiServerAddresses
from .attestation import AttestationKey, load_key
from .auth import Authenticator, StaticTokens, TokenReviewer
from .caches import Caches
from .creator_check import verify_installed
from .effects import Effects
from .engine import IncidentEngine
from .errors import ApiError, OperatorError
from .heartbeats import Heartbeats
from .intake import Intake, json_error_middleware
from .kube import Endpoint, Kube
from .lane import LoopThread
from .leader import ElectionThread, Members
from .listeners import Connections, GuardedSite, Hold
from .localize import InstanceResolver
from .metrics import Metrics
from .optin import OptIn
from .remediate import HyperPodNodes, client_config
from .settings import OperatorSettings
from .trust_bundle import ServingCertificate
from .webhook import MAX_REVIEW_BYTES, WebhookSettings

__all__ = ["Operator"]

log = logging.getLogger(__name__)
RETENTION_EVERY_SECONDS = 600.0
MEMBERS_EVERY_SECONDS = 5.0
SAGEMAKER_FINISH_SECONDS = 15.0
"""How long a stopping operator waits for a SageMaker call in flight before it gives the
Lease up (within the chart's terminationGracePeriodSeconds of 30)."""
OTHER_LISTENER_CONNECTIONS = 512
"""Connections the admission and metrics listeners hold open at once, each (the API
server and the probes open few; a flood of either cannot grow memory without bound)."""
ADMISSION_CONNECTIONS_PER_SOURCE = 128
"""Connections one address may hold on the admission listener. An API server holds one
per review in flight (the webhook answers at most 64 at once from one address, more get
503 and the connection is closed) and keeps at most 25 idle per webhook configuration
(client-go's transport; the chart registers two): 64 + 2 x 25 = 114 at most. So one
address cannot hold the listener's 512, and an API server's address is never refused by
this limit; its published addresses are not counted by it at all."""
METRICS_CONNECTIONS_PER_SOURCE = 64
"""Connections one address may hold on the metrics listener: Prometheus keeps one or two
per target and the kubelet's probes one each; one address cannot hold the listener's 512
(where the liveness probe would then be refused and the operator restarted)."""
ADMISSION_RESERVED = 128
"""Of the admission listener's 512 connections, those only the API server's published
addresses (:mod:`.apiserver`) may use: any number of other addresses together hold at most
384, so idle or slow connections from tenants' pods cannot refuse the API server's
reviews (which, under the creator check's ``failurePolicy: Fail``, would refuse every
pod)."""
VERDICT_PORT_CONNECTIONS = 64
"""Connections the verdict port holds open at once; more are reset as they are accepted,
and their agents send on their kept connection to the intake's main port instead. The
elected reporters (3 per verdict) need few; when every node of a large job reports at once,
the first 64 are answered quickly (agreement needs two) instead of every node's TLS
handshake being interleaved with every other's: at 2,048 nodes with no such limit the first
verdict was answered after 6.4 s, loaded (docs/operator.md, "Verdicts first")."""
API_SERVER_EVERY_SECONDS = 30.0
"""How often the API server's addresses are read again (they change when the control
plane is replaced: an EKS upgrade)."""
WATCH_POOL_SPARE = 8
"""Connections of the watch pool beyond one per watch (re-lists while a watch restarts)."""


def _sagemaker_factory(settings: OperatorSettings) -> Callable[[], Any]:
    """One boto3 SageMaker client for the process, made on first use (boto3 honours
    ``AWS_ENDPOINT_URL_SAGEMAKER`` for VPC endpoints)."""
    made: list[Any] = []

    def make() -> Any:
        if not made:
            made.append(
                boto3.client("sagemaker", region_name=settings.aws_region, config=client_config())
            )
        return made[0]

    return make


class Operator:
    """Everything the operator runs besides kopf itself."""

    def __init__(self, settings: OperatorSettings, endpoint: Endpoint | None = None) -> None:
        self.settings = settings
        endpoint = endpoint or Endpoint.load()
        self.metrics = metrics = Metrics()
        # One connection pool each: nothing the intake does can delay containment or the
        # Lease renewals.
        self.watches = Kube(endpoint, name="watch", metrics=metrics)  # sized below
        self.lookups = Kube(endpoint, name="intake", pool_size=32, metrics=metrics)
        # This loop's records (the webhook's, start-up's, the members' Events).
        self.records = Kube(endpoint, name="records", pool_size=16, metrics=metrics)
        # The engine (the verdicts' records, containment) runs on a thread and event loop of
        # its own, like the election, with pools used there only: its sequential calls do
        # not each wait for a turn of the intake's loop (docs/operator.md).
        self.lane = LoopThread("incident engine")
        # The verdict listener (verdict_port) serves on a thread and event loop of its own,
        # with its own pool for the lookups of its reports: a verdict is read, checked and
        # handed to the engine without waiting behind the heartbeats the main port's loop
        # reads and sheds (docs/operator.md, "Verdicts first").
        self.verdict_thread = LoopThread("verdict intake")
        self.verdict_lookups = Kube(endpoint, name="verdicts", pool_size=8, metrics=metrics)
        self._verdict_runner: web.AppRunner | None = None
        self.hold: Hold | None = None
        self.engine_records = Kube(endpoint, name="engine", pool_size=16, metrics=metrics)
        self.containment = Kube(endpoint, name="containment", pool_size=8, metrics=metrics)
        # Retention's deletions (every 10 minutes, on this loop) have their own small pool.
        self.retention = Kube(endpoint, name="retention", pool_size=2, metrics=metrics)
        self.coordination = Kube(endpoint, name="election", pool_size=2, metrics=metrics)
        # The member Leases (every few seconds, and a LIST on the leader) have their own
        # pool: a slow one must not hold up a renewal.
        self.membership = Kube(endpoint, name="members", pool_size=2, metrics=metrics)
        self.engine_ready = False
        # A background read every 30 s, like the member Leases: not on the intake's pool,
        # whose GETs are the intake's cache misses (test_scale counts them).
        self.api_server = ApiServerAddresses(self.membership, settings.api_server_addresses)
        self.caches = Caches(
            self.watches,
            settings.namespaces,
            on_incident=self._on_incident,
            on_pod=self._on_pod,
            on_policy=self._on_policy,
        )
        # Each cache holds one connection open for its watch (3 + 4 per namespace watched);
        # a pool smaller than that leaves some watches queued, their caches stale.
        self.watches.pool_size = len(self.caches.informers()) + WATCH_POOL_SPARE
        sagemaker = _sagemaker_factory(settings)
        self.hyperpod = HyperPodNodes(sagemaker)
        self.engine = IncidentEngine(
            settings,
            metrics,
            self.caches,
            records=self.engine_records,
            containment=self.containment,
            hyperpod=self.hyperpod,
            lane=self.lane,
        )
        self.recorded = Effects(self.records, self.caches)
        self.heartbeats = Heartbeats(metrics)
        self.engine.step_seconds = self.heartbeats.step_seconds
        self.key: AttestationKey | None = None
        self.elector: ElectionThread | None = None
        self._stopping = False
        self.members = Members(
            self.membership,
            settings.namespace,
            settings.lease_name,
            settings.identity,
            last_seen=self.heartbeats.last_seen,
        )
        self._runners: list[web.AppRunner] = []
        self._loops: list[asyncio.Task[None]] = []
        self._peers: dict[str, float] = {}
        # The admission webhook (its own listener, same TLS), CA publishing, the job watch.
        self.serving = None
        if settings.tls_cert_file and settings.tls_key_file:
            self.serving = ServingCertificate(settings.tls_cert_file, settings.tls_key_file)
        webhook_settings = WebhookSettings.from_env()
        self.optin = OptIn(
            self.lookups,
            webhook_settings,
            token_audience=settings.token_audience,
            trusted_creators=lambda: settings.trusted_pod_creators,
            leader=lambda: self.engine.leader,
            registry=self.metrics.registry,
            serving=self.serving,
            caches=self.caches,
            effects=self.recorded,
            api_server=self.api_server,
        )

    def _on_incident(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        if self.engine_ready:
            self.engine.on_incident(old, new)

    def _on_policy(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        # A policy's change (its approvals, a cluster admin's decision) drives the incidents
        # now, not at the next resync.
        if self.engine_ready:
            self.engine.resync()

    def _on_pod(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        if self.engine_ready:
            self.engine.on_pod(old, new)

    def _verdicts_authenticator(self, main: Authenticator) -> Authenticator:
        """``main`` for the verdict listener's loop: the same remembered tokens."""
        return main.on(self.verdict_lookups) if isinstance(main, TokenReviewer) else main

    def _authenticator(self) -> Authenticator:
        s = self.settings
        if s.auth_mode == "static":
            assert s.static_tokens_file is not None
            log.warning("auth mode is static: development only, tokens are not reviewed")
            return StaticTokens(s.static_tokens_file)
        return TokenReviewer(
            self.lookups,
            s.token_audience,
            s.token_cache_seconds,
            negative_seconds=s.negative_token_cache_seconds,
            reviews_per_second=s.token_reviews_per_second,
            burst=s.token_review_burst,
            reviews_per_source=s.token_reviews_per_source,
            source_burst=s.token_review_source_burst,
            metrics=self.metrics,
        )

    async def start(self) -> None:
        s = self.settings
        self.lane.start()
        # An incident's first calls find a connection to the API server open.
        self.lane.call(self.engine_records.keep_warm)
        self.lane.call(self.containment.keep_warm)
        while True:
            try:
                self.key = await load_key(
                    self.records, self.recorded, s.namespace, s.attestation_secret
                )
                break
            except OperatorError as exc:
                cause = exc.__cause__
                if not isinstance(cause, ApiError) or 0 < cause.status < 500:
                    raise  # refused (RBAC, a bad key): retrying will not help
                log.warning("%s; trying again in 2 s", exc)
                await asyncio.sleep(2)
        if s.require_attestation:
            # The marker is believed only because the API server refuses it from anyone
            # else: without that check, do not start (a tenant could mark its own pods).
            while True:
                try:
                    found = await verify_installed(self.records, s.creator_check)
                    break
                except ApiError as exc:
                    if 0 < exc.status < 500:
                        raise
                    log.warning("looking for the creator check: %s; again in 2 s", exc)
                    await asyncio.sleep(2)
            log.info("creator check: %s", found)
        self.caches.start()
        resolver = InstanceResolver(_sagemaker_factory(s), cluster_name=s.cluster_name)
        authenticator = self._authenticator()
        self.intake = Intake(
            s,
            self.caches,
            authenticator,
            self.engine,
            resolver,
            self.heartbeats,
            self.metrics,
            self.key,
            self.lookups,
        )
        # Ready once every listener listens (the verdict port starts last, on its own
        # thread) and the caches are synced: a pod marked ready before its verdict port
        # listened sent the agents' first verdicts to the main port.
        listening = threading.Event()  # read on the verdict port's thread too
        self.intake.ready = lambda: listening.is_set() and self.caches.synced()
        self.intake.pod_selectors = self.optin.settings.webhook_pod_selectors
        # One listener per audience (.listeners): the tenants reach only the intake.
        admission = web.Application(
            client_max_size=MAX_REVIEW_BYTES + 1, middlewares=[json_error_middleware()]
        )
        self.optin.add_routes(admission)
        # The intake's connections are bounded globally and per address (the tenants');
        # the admission listener's per address too, with a reserve for the API server's own
        # addresses (read before it listens); the metrics listener's per address too.
        await self.api_server.refresh()
        # The two report listeners count their connections together: an agent's verdict
        # connection and its kept one count against the same max_connections.
        reports = Connections(s.max_connections, s.connections_per_source)
        others = {
            "admission": Connections(
                OTHER_LISTENER_CONNECTIONS,
                ADMISSION_CONNECTIONS_PER_SOURCE,
                reserved=ADMISSION_RESERVED,
                reserved_for=self.api_server,
            ),
            "metrics": Connections(OTHER_LISTENER_CONNECTIONS, METRICS_CONNECTIONS_PER_SOURCE),
        }
        sites = {}
        for name, app, port, connections in (
            ("intake", self.intake.app(), s.listen_port, reports),
            ("admission", admission, s.admission_port, others["admission"]),
            ("metrics", self.intake.monitoring_app(), s.metrics_port, others["metrics"]),
        ):
            runner, sites[name] = await self._listen(name, self.intake, app, port, connections)
            self._runners.append(runner)
        if s.verdict_port:
            self.verdict_thread.start()
            verdicts = self.intake.for_verdicts(
                self.verdict_lookups, self._verdicts_authenticator(authenticator)
            )
            # While the verdict port has a connection open, the main port is not read
            # (at most 1 s at a time, then at least 1 s read): .listeners.Hold
            self.hold = Hold(sites["intake"], asyncio.get_running_loop())
            self._verdict_runner, site = await self.verdict_thread.run(
                self._listen(
                    "verdicts",
                    verdicts,
                    None,
                    s.verdict_port,
                    reports,
                    most_open=VERDICT_PORT_CONNECTIONS,
                )
            )
            site.busy, site.overflowed = self.hold.busy, self.hold.overflowed
        listening.set()
        self._loops.append(asyncio.get_running_loop().create_task(self._elect_when_synced()))
        self._every(API_SERVER_EVERY_SECONDS, self.api_server.refresh)
        await self.optin.start()

    async def _listen(
        self,
        name: str,
        intake: Intake,
        app: web.Application | None,
        port: int,
        connections: Connections,
        most_open: int | None = None,
    ) -> tuple[web.AppRunner, GuardedSite]:
        """Serve ``app`` (default: ``intake``'s reports app) on ``port``, on the event loop
        this runs on; its runner and site."""
        s = self.settings
        runner = intake.runner(app)
        await runner.setup()
        site = GuardedSite(
            runner,
            s.listen_address,
            port,
            ssl_context=self.serving.context if self.serving is not None else None,
            handshake_seconds=s.tls_handshake_timeout_seconds,
            handshakes_per_source=s.handshakes_per_source,
            name=name,
            connections=connections,
            most_open=most_open,
        )
        await site.start()
        log.info("%s listening on %s", name, site.name)
        return runner, site

    async def _elect_when_synced(self) -> None:
        """Act only with full caches: a leader that counted quarantined nodes from a
        half-listed cache could break a cap."""
        while not self.caches.synced():
            await asyncio.sleep(0.1)
        self.engine_ready = True
        self._elect()
        s = self.settings
        self._every(s.resync_seconds, self._resync)
        self._every(min(MEMBERS_EVERY_SECONDS, s.resync_seconds), self._members)
        self._every(RETENTION_EVERY_SECONDS, self._retention, first=min(5.0, s.resync_seconds))

    def _elect(self) -> None:
        """Lead once elected (at once without leader election)."""
        s = self.settings
        if s.leader_election:
            elector = self.elector = ElectionThread(
                self.coordination,
                s.namespace,
                s.lease_name,
                s.identity,
                s.lease_seconds,
                on_start=self._lead,
                on_stop=self._follow,
                stop_acting=self.engine.stop_acting,
            )
            self.engine.leading = lambda: elector.is_leader
            elector.start()
        else:
            self._lead()

    def _lead(self) -> None:
        if self._stopping:
            return  # won during the shutdown: stop() gives the Lease up
        self.metrics.lead(True)
        self.engine.become_leader()

    def _follow(self) -> None:
        self.metrics.lead(False)
        self.engine.become_standby()

    def _every(
        self, seconds: float, fn: Callable[[], Awaitable[None]], first: float | None = None
    ) -> None:
        async def loop() -> None:
            await asyncio.sleep(seconds if first is None else first)
            while True:
                try:
                    await fn()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("%s failed; trying again in %g s", fn.__name__, seconds)
                await asyncio.sleep(seconds)

        self._loops.append(asyncio.get_running_loop().create_task(loop()))

    async def _resync(self) -> None:
        self.engine.resync()
        await self.engine.flush_counts()

    async def _members(self) -> None:
        """Publish what this replica heard; the leader reads the others and posts an Event
        on each job that went silent."""
        s = self.settings
        # Every replica forgets jobs that stopped or went away (else a standby's
        # heartbeat_age for a deleted job would grow for a day).
        self.heartbeats.prune(self._running)
        self.heartbeats.refresh(window=s.heartbeat_silence_seconds)
        if s.leader_election:
            await self.members.publish()
        if not self.engine.leader:
            return
        if s.leader_election:
            self._peers = await self.members.peers(prune=True)
        went, came = self.heartbeats.silent(s.heartbeat_silence_seconds, self._peers, self._running)
        for beats in went:
            job = self._job_body(beats.job)
            message = (
                f"no heartbeat from the job's agents for "
                f"{self.heartbeats.silence_after(beats, s.heartbeat_silence_seconds):.0f} s: "
                "the job runs unobserved (agents crashed, or cannot reach the operator)"
            )
            log.warning("job %s/%s: %s", beats.job.namespace, beats.job.name, message)
            # one Event per silence (a job may fall silent again later)
            await self.recorded.emit(
                job, "SDCAgentsSilent", message, True, occurrence=f"after {beats.last:.3f}"
            )
        for beats in came:
            job = self._job_body(beats.job)
            await self.recorded.emit(
                job,
                "SDCAgentsReporting",
                "heartbeats arrive again",
                False,
                occurrence=f"at {beats.last:.3f}",
            )

    def _running(self, ref: Any) -> bool:
        job = self.caches.job(ref.api_version, ref.kind, ref.namespace, ref.name)
        return bool(
            job
            and job["metadata"].get("uid") == ref.uid
            and not ((job.get("spec") or {}).get("runPolicy") or {}).get("suspend")
        )

    def _job_body(self, ref: Any) -> dict[str, Any]:
        found = self.caches.job(ref.api_version, ref.kind, ref.namespace, ref.name)
        return found or {
            "apiVersion": ref.api_version,
            "kind": ref.kind,
            "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
        }

    async def _retention(self) -> None:
        if self.engine.leader:
            await retention.sweep(
                self.caches,
                self.retention,
                self.settings.incident_retention_days,
                self.engine.rules_for,
                self.metrics,
            )

    async def stop(self) -> None:
        # The engine stops acting, and what it was taking ends, before the Lease is given
        # up: else the next leader could act while this one still does.
        self._stopping = True
        await self.optin.stop()
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        if self._verdict_runner is not None:
            await self.verdict_thread.run(self._verdict_runner.cleanup())
        for runner in self._runners:
            await runner.cleanup()
        self.engine.stop_acting()
        await self.engine.close()
        # A SageMaker call runs on the pool's thread, which cancelling its task does not
        # stop: wait for it too (within the pod's 30 s grace period).
        if not await self.hyperpod.finish(SAGEMAKER_FINISH_SECONDS):
            log.warning(
                "stopping: a SageMaker call still in flight after %.0f s; the next leader "
                "verifies its intent before calling again",
                SAGEMAKER_FINISH_SECONDS,
            )
        if self.elector is not None:
            await self.elector.stop()
        if self.lane.alive:
            for kube in (self.engine_records, self.containment):  # (their sessions live there)
                await self.lane.run(kube.close())
            await self.lane.stop()
        if self.verdict_thread.alive:
            await self.verdict_thread.run(self.verdict_lookups.close())
            await self.verdict_thread.stop()
        await self.caches.stop()
        self.hyperpod.close()
        for kube in (
            self.watches,
            self.lookups,
            self.records,
            self.retention,
            self.membership,
        ):
            await kube.close()
        if self.elector is None:  # (else closed on the election's own thread)
            await self.coordination.close()


@kopf.on.startup()
async def operator_startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.posting.enabled = False  # the engine posts its own, meaningful Events
    settings.peering.standalone = True  # leader election is ours (.leader)
    operator = Operator(OperatorSettings.from_env())
    memo.operator = operator
    try:
        await operator.start()
    except OperatorError as exc:
        raise kopf.PermanentError(str(exc)) from exc


@kopf.on.cleanup()
async def operator_cleanup(memo: kopf.Memo, **_: Any) -> None:
    operator = getattr(memo, "operator", None)
    if operator is not None:
        await operator.stop()
