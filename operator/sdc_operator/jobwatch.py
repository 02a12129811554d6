"""The opted-in jobs, watched: the CA published where they run, Events where the audit is
limited, and the pods that missed the webhook counted.

kopf's ``on.event`` watches of ``PyTorchJob`` and ``HyperPodPyTorchJob`` (no finalizer and
nothing of kopf's written onto the jobs) feed :class:`JobWatch`; a periodic sweep counts each
opted-in job's pods, read from the operator's pod cache (a LIST only for a namespace the
cache does not watch). Writes (ConfigMaps, Events) are the leader's only, through
:class:`~.effects.Effects` (an Event says a thing once, even across restarts); both
replicas answer admission requests.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import kopf
from prometheus_client import CollectorRegistry, Gauge

from . import jobs
from .caches import Caches
from .effects import Effects
from .injection import INJECTION_ANNOTATION, label_selector_string, matches_any
from .jobshape import audit_limits
from .kube import Kube
from .trust_bundle import CaPublisher
from .webhook import AdmissionLookups

__all__ = ["JobWatch", "hyperpodpytorchjob_event", "pytorchjob_event", "unguarded_pods"]

log = logging.getLogger(__name__)
FINISHED_PHASES = ("Succeeded", "Failed")


def unguarded_pods(
    pods: Sequence[dict[str, Any]], job_uid: str, selectors: Sequence[dict[str, Any]]
) -> list[str]:
    """Names of the job's live pods that the webhook should have wired and did not."""
    names = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        owner = jobs.job_owner(pod)
        if owner is None or owner.get("uid") != job_uid or meta.get("deletionTimestamp"):
            continue
        if (pod.get("status") or {}).get("phase") in FINISHED_PHASES:
            continue
        if not matches_any(selectors, meta.get("labels") or {}):
            continue  # never sent to the webhook: the chart's selectors do not cover it
        if INJECTION_ANNOTATION not in (meta.get("annotations") or {}):
            names.append(str(meta.get("name")))
    return sorted(names)


@dataclass(slots=True)
class _Known:
    job: dict[str, Any]
    told_limits: bool = False
    told_unguarded: frozenset[str] = field(default_factory=frozenset)


class JobWatch:
    def __init__(
        self,
        kube: Kube,
        effects: Effects,
        caches: Caches | None,
        lookups: AdmissionLookups,
        publisher: CaPublisher | None,
        selectors: Sequence[dict[str, Any]],
        registry: CollectorRegistry,
        leader: Callable[[], bool],
    ) -> None:
        self.kube = kube
        self.effects = effects
        self.caches = caches
        self.lookups = lookups
        self.publisher = publisher
        self.selectors = list(selectors)
        self.leader = leader
        self._known: dict[str, _Known] = {}  # by job uid
        self.unguarded = Gauge(
            "hyperpod_sdc_unguarded_pods",
            "Pods of an opted-in job running without the agent's wiring (created while the "
            "webhook was unavailable, or before the job opted in).",
            ["namespace", "job"],
            registry=registry,
        )

    async def observe(self, event_type: str | None, job: dict[str, Any]) -> None:
        meta = job.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        if event_type == "DELETED" or not jobs.is_enabled(job):
            self._forget(uid)
            return
        known = self._known.setdefault(uid, _Known(job))
        known.job = job
        if not self.leader():
            return
        namespace = str(meta.get("namespace"))
        if self.publisher is not None:
            await self.publisher.ensure(namespace)
        limits = audit_limits(job)
        if limits and not known.told_limits:
            await self.effects.emit(
                job,
                "SDCAuditLimited",
                f"hyperpod-sdc guards this job with limits: {'; and '.join(limits)}.",
                True,
            )
            known.told_limits = True

    def _forget(self, uid: str) -> None:
        known = self._known.pop(uid, None)
        if known is not None:
            meta = known.job["metadata"]
            with contextlib.suppress(KeyError):
                self.unguarded.remove(meta.get("namespace"), meta.get("name"))

    async def sweep(self) -> None:
        """Count each opted-in job's unguarded pods; an Event when new ones appear."""
        if not self.leader():
            return
        if self.publisher is not None:
            await self.publisher.refresh()
        for known in list(self._known.values()):
            try:
                if self.publisher is not None:  # retries a namespace whose first write failed
                    await self.publisher.ensure(str(known.job["metadata"]["namespace"]))
                await self._check_pods(known)
            except Exception as exc:
                meta = known.job["metadata"]
                log.warning(
                    "cannot check the pods of %s/%s: %s",
                    meta.get("namespace"),
                    meta.get("name"),
                    exc,
                )

    async def _check_pods(self, known: _Known) -> None:
        job = known.job
        meta = job["metadata"]
        namespace, name = str(meta["namespace"]), str(meta["name"])
        admission = await self.lookups.admission(namespace)
        if not admission.admitted:
            self.unguarded.labels(namespace, name).set(0)
            return  # not wired on purpose; the intake refuses its reports and says why
        missed = unguarded_pods(
            await self._pods(namespace, str(meta["uid"])), str(meta["uid"]), self.selectors
        )
        self.unguarded.labels(namespace, name).set(len(missed))
        new = frozenset(missed) - known.told_unguarded
        known.told_unguarded = frozenset(missed)
        if new:
            shown = ", ".join(sorted(new)[:10]) + (" ..." if len(new) > 10 else "")
            await self.effects.emit(
                job,
                "SDCPodsUnguarded",
                f"{len(missed)} pod(s) of this job run without the hyperpod-sdc agent's wiring "
                f"({shown}): they were created while the admission webhook was unavailable, "
                "or before the job opted in, so their reports cannot reach the operator. "
                "Delete them to have them recreated, or restart the job.",
                True,
            )

    async def _pods(self, namespace: str, job_uid: str) -> list[dict[str, Any]]:
        """The job's pods: from the pod cache where it watches the namespace (it keeps
        labels, owners and our annotations), else listed by the webhook's selectors."""
        if self.caches is not None and self.caches.pods.watches(namespace):
            return self.caches.pods_of(job_uid)
        pods: dict[str, dict[str, Any]] = {}
        for selector in self.selectors:
            for pod in await self.kube.list_all(
                "v1", "pods", namespace, label_selector=label_selector_string(selector)
            ):
                pods[pod["metadata"]["name"]] = pod
        return list(pods.values())


async def _observe(type: str | None, body: kopf.Body, memo: kopf.Memo) -> None:
    operator = getattr(memo, "operator", None)
    optin = getattr(operator, "optin", None)
    if optin is not None:
        await optin.jobs.observe(type, dict(body))


@kopf.on.event("kubeflow.org", "v1", "pytorchjobs")
async def pytorchjob_event(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    await _observe(type, body, memo)


@kopf.on.event("sagemaker.amazonaws.com", "v1", "hyperpodpytorchjobs")
async def hyperpodpytorchjob_event(
    type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    await _observe(type, body, memo)
