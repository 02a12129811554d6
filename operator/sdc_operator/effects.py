"""The operator's writes to the cluster and to AWS, in one place.

Every write the operator makes goes through an :class:`Effects` (one per API client:
containment on the leader, records on every replica): job, Kueue Workload and node
patches, the confirmation pod's create and delete, incident deletes, Events, the CA
ConfigMaps (:mod:`.trust_bundle`), the attestation key Secret (:mod:`.attestation`), and
SageMaker's reboot and replace. Each one puts what the API server answered into the caches
at once (read-your-writes: a decision made right after a write sees it), and each delete
carries preconditions (the uid, and where known the ``resourceVersion``), so an object made
since under the same name is never deleted.

Writes that have no status entry of their own know what already happened by looking:

- an Event's name is derived from what it says (:func:`event_name`: the object's uid, the
  reason, the message or an occurrence key), so the same Event posted again after a crash
  or by the other replica is refused 409 and read back, never shown twice;
- a ConfigMap is read first and written only where it differs, under the
  ``resourceVersion`` read (a conflict reads again: the other replica may have written the
  same);
- a create that must happen once (the key Secret) reads the winner on 409;
- a pod delete says what it found (deleted, already gone, or replaced by another pod of
  that name), and the pod leaves the cache only once it is gone.

What an effect means (its intent recorded ``Pending`` before, its verification after a
restart, the hold and request ledgers) is :mod:`.actions`'; this module only writes. Reads
go to the caches or to :class:`~.kube.Kube` directly. The incident records themselves
(status writes, creates) are the engine's (:meth:`.engine.IncidentEngine._write`); the
Leases are the election's (:mod:`.leader`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from . import jobs
from .caches import Caches
from .errors import ApiError
from .kube import Kube, is_conflict, is_not_found
from .remediate import HyperPodNodes

__all__ = ["CONFLICT_RETRIES", "Effects", "Emit", "event_name"]

log = logging.getLogger(__name__)

Emit = Callable[[dict[str, Any], str, str, bool], Awaitable[object]]

CONFLICT_RETRIES = 5
"""How often a ConfigMap write is tried again after a conflict (each time read first)."""


def event_name(obj: dict[str, Any], reason: str, occurrence: str) -> str:
    """The name of the Event that says ``reason`` about ``obj`` once: the object's name and
    a digest of its uid, the reason and ``occurrence`` (the message, or a key the caller
    gives for a thing that may be said twice). A DNS subdomain of at most 253 characters."""
    meta = obj.get("metadata") or {}
    digest = hashlib.sha256(
        "\0".join((str(meta.get("uid") or ""), reason, occurrence)).encode()
    ).hexdigest()[:20]
    base = str(meta.get("name") or "object")[:200].rstrip(".-") or "object"
    return f"{base}.{digest}"


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

    async def delete_pod(self, namespace: str, name: str, uid: str | None) -> str:
        """Delete the pod with this uid; what was found: ``deleted`` (it terminates now),
        ``gone`` (deleted before: by us before a restart, or by someone else) or
        ``replaced`` (a pod of another uid has the name now: left alone). Other errors
        raise (the caller's intent stays recorded and is verified again)."""
        try:
            answer = await self.kube.delete("v1", "pods", namespace, name, uid=uid or None)
        except ApiError as exc:
            if is_not_found(exc):
                self._forget_pod(namespace, name, uid)
                return "gone"
            if is_conflict(exc):
                return "replaced"
            raise
        if (answer.get("metadata") or {}).get("deletionTimestamp"):
            self.caches.pods.upsert(answer)  # terminating: the watch removes it when gone
        else:
            self._forget_pod(namespace, name, uid)
        return "deleted"

    def _forget_pod(self, namespace: str, name: str, uid: str | None) -> None:
        cached = self.caches.pods.get(namespace, name)
        if cached is not None and (not uid or cached["metadata"].get("uid") == uid):
            self.caches.pods.forget(cached)

    async def pod_as_stored(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` as the API server would store it (a dry-run create: its defaults and
        admission applied; nothing is stored)."""
        return await self.kube.create(
            "v1", "pods", body["metadata"]["namespace"], body, dry_run=True
        )

    # -- incidents -------------------------------------------------------------------------

    async def delete_incident(self, incident: dict[str, Any]) -> None:
        """Delete the incident as it was read (uid and ``resourceVersion``: 409 if it was
        replaced or changed since)."""
        await self.kube.delete_incident(incident)
        self.caches.incidents.forget(incident)

    # -- Events ----------------------------------------------------------------------------

    async def emit(
        self,
        obj: dict[str, Any],
        reason: str,
        message: str,
        warning: bool,
        *,
        occurrence: str | None = None,
    ) -> bool:
        """An Event on ``obj``, once (:func:`event_name`: ``occurrence`` tells apart two
        Events that say the same thing at different times; by default the message does).
        True if posted now, false if it was posted before (read back: ours, the same
        reason on the same object) or could not be. Never fails the caller (an Event is
        a courtesy)."""
        if self._emit is not None:
            await self._emit(obj, reason, message, warning)
            return True
        name = event_name(obj, reason, message if occurrence is None else occurrence)
        try:
            await self.kube.emit_event(obj, reason, message, warning=warning, name=name)
            return True
        except ApiError as exc:
            if not is_conflict(exc):
                log.warning("could not post event %s: %s", reason, exc)
                return False
        except Exception as exc:
            log.warning("could not post event %s: %s", reason, exc)
            return False
        namespace = (obj.get("metadata") or {}).get("namespace") or "default"
        try:
            found = await self.kube.get("v1", "events", namespace, name)
        except Exception as exc:
            log.warning("event %s: name taken, cannot read it: %s", name, exc)
            return False
        involved = found.get("involvedObject") or {}
        if found.get("reason") != reason or involved.get("uid") != (
            (obj.get("metadata") or {}).get("uid")
        ):
            log.warning("event %s/%s: the name is taken by another Event", namespace, name)
        return False

    # -- ConfigMaps and Secrets ------------------------------------------------------------

    async def put_configmap(self, body: dict[str, Any]) -> bool:
        """The ConfigMap ``body`` names holds ``body``'s data; true if written now. Read
        first (what a crash or the other replica left), then created or replaced under the
        ``resourceVersion`` read; a conflict reads again."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        for _ in range(CONFLICT_RETRIES):
            try:
                existing = await self.kube.get("v1", "configmaps", namespace, name)
            except ApiError as exc:
                if not is_not_found(exc):
                    raise
                try:
                    await self.kube.create("v1", "configmaps", namespace, body)
                except ApiError as create_exc:
                    if is_conflict(create_exc):
                        continue  # another replica made it: read it again
                    raise
                return True
            if (existing.get("data") or {}) == (body.get("data") or {}):
                return False
            replaced = {
                **body,
                "metadata": {**meta, "resourceVersion": existing["metadata"]["resourceVersion"]},
            }
            try:
                await self.kube.replace("v1", "configmaps", namespace, replaced)
            except ApiError as exc:
                if is_conflict(exc):
                    continue
                raise
            return True
        raise ApiError(409, f"ConfigMap {namespace}/{name}: {CONFLICT_RETRIES} write conflicts")

    async def create_once(
        self, api_version: str, plural: str, namespace: str, body: dict[str, Any]
    ) -> tuple[dict[str, Any], bool]:
        """Create ``body`` unless it exists: ``(the object, true)`` if made now, else
        ``(the one that won, false)`` (another replica, or this one before a restart)."""
        try:
            return await self.kube.create(api_version, plural, namespace, body), True
        except ApiError as exc:
            if not is_conflict(exc):
                raise
        name = body["metadata"]["name"]
        return await self.kube.get(api_version, plural, namespace, name), False

    # -- SageMaker -------------------------------------------------------------------------

    async def remediate(self, kind: str, cluster: str, instance: str) -> tuple[bool | None, str]:
        """``BatchRebootClusterNodes`` or ``BatchReplaceClusterNodes`` for one instance,
        once: ``(True, ...)`` accepted, ``(False, ...)`` refused, ``(None, ...)`` no answer
        (it may have acted: verified, never simply called again)."""
        assert self.hyperpod is not None
        return await self.hyperpod.remediate(kind, cluster, instance)
