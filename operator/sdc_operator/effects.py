"""The operator's writes to the cluster and to AWS, in one place.

Every write the engine, the actions and retention make goes through an :class:`Effects`
(one per API client: containment on the leader, records on every replica): job, Kueue
Workload and node patches, the confirmation pod's create and delete, incident deletes,
Events, and SageMaker's reboot and replace. Each one puts what the API server answered into
the caches at once (read-your-writes: a decision made right after a write sees it), and
each delete carries preconditions (the uid, and where known the ``resourceVersion``), so
an object made since under the same name is never deleted.

What an effect means (its intent recorded ``Pending`` before, its verification after a
restart, the hold and request ledgers) is :mod:`.actions`'; this module only writes. Reads
go to the caches or to :class:`~.kube.Kube` directly. The incident records themselves
(status writes, creates) are the engine's (:meth:`.engine.IncidentEngine._write`); the
Leases are the election's (:mod:`.leader`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from . import jobs
from .caches import Caches
from .kube import Kube
from .remediate import HyperPodNodes

__all__ = ["Effects", "Emit"]

log = logging.getLogger(__name__)

Emit = Callable[[dict[str, Any], str, str, bool], Awaitable[None]]


class Effects:
    def __init__(
        self,
        kube: Kube,
        caches: Caches,
        hyperpod: HyperPodNodes | None = None,
        *,
        emit: Emit | None = None,
    ) -> None:
        self.kube = kube
        self.caches = caches
        self.hyperpod = hyperpod
        self._emit = emit

    # -- jobs ------------------------------------------------------------------------------

    async def patch_job(
        self, api_version: str, kind: str, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        """Merge-patch a job (a ``metadata.resourceVersion`` in ``patch`` makes it
        conditional: 409 if the job changed since)."""
        plural = jobs.JOB_KINDS[(api_version, kind)]
        written = await self.kube.patch_object(api_version, plural, namespace, name, patch)
        group = self.caches.jobs.get((api_version, kind))
        if group is not None:
            group.upsert(written)
        return written

    async def patch_workload(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        await self.kube.patch_object(
            jobs.KUEUE_WORKLOAD_API, jobs.KUEUE_WORKLOAD_PLURAL, namespace, name, patch
        )

    # -- nodes -----------------------------------------------------------------------------

    async def patch_node(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch a node (under the ``resourceVersion`` the patch carries)."""
        written = await self.kube.patch_node(name, patch)
        self.caches.nodes.upsert(written)
        return written

    # -- pods ------------------------------------------------------------------------------

    async def create_pod(self, body: dict[str, Any]) -> dict[str, Any]:
        created = await self.kube.create("v1", "pods", body["metadata"]["namespace"], body)
        self.caches.pods.upsert(created)
        return created

    async def delete_pod(self, namespace: str, name: str, uid: str | None) -> None:
        """Delete the pod with this uid (409 if a pod of another uid has the name now)."""
        await self.kube.delete("v1", "pods", namespace, name, uid=uid or None)

    # -- incidents -------------------------------------------------------------------------

    async def delete_incident(self, incident: dict[str, Any]) -> None:
        """Delete the incident as it was read (uid and ``resourceVersion``: 409 if it was
        replaced or changed since)."""
        await self.kube.delete_incident(incident)
        self.caches.incidents.forget(incident)

    # -- Events ----------------------------------------------------------------------------

    async def emit(self, obj: dict[str, Any], reason: str, message: str, warning: bool) -> None:
        """An Event on ``obj``; never fails the caller (an Event is a courtesy)."""
        if self._emit is not None:
            await self._emit(obj, reason, message, warning)
            return
        try:
            await self.kube.emit_event(obj, reason, message, warning=warning)
        except Exception as exc:
            log.warning("could not post event %s: %s", reason, exc)

    # -- SageMaker -------------------------------------------------------------------------

    async def remediate(self, kind: str, cluster: str, instance: str) -> tuple[bool | None, str]:
        """``BatchRebootClusterNodes`` or ``BatchReplaceClusterNodes`` for one instance,
        once: ``(True, ...)`` accepted, ``(False, ...)`` refused, ``(None, ...)`` no answer
        (it may have acted: verified, never simply called again)."""
        assert self.hyperpod is not None
        return await self.hyperpod.remediate(kind, cluster, instance)
