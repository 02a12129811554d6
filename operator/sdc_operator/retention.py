"""Retention: incidents are deleted ``incident_retention_days`` after their last change,
once nothing is left to do for them.

An incident may go when it is closed (no action pending, none waiting for a person or a
back-off) and no node still carries its ``hyperpod-sdc.dev/incident`` annotation (a
quarantined node's incident is how a person releases it). An incident whose job was
deleted counts as closed: nothing more can be done for that job. One still in progress is
never deleted. Deletes carry the incident's uid and ``resourceVersion`` as
preconditions, so one that changed since it was read stays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from . import incidents, jobs
from .caches import Caches
from .effects import Effects
from .errors import ApiError
from .incidents import Rules
from .kube import Kube, is_conflict, is_not_found
from .metrics import Metrics
from .names import INCIDENT_ANNOTATION

__all__ = ["sweep"]

log = logging.getLogger(__name__)


async def _job_gone(kube: Kube, incident: dict[str, Any], caches: Caches) -> bool:
    ref = (incident.get("spec") or {}).get("job") or {}
    namespace = incident["metadata"]["namespace"]
    key = (ref.get("apiVersion"), ref.get("kind"))
    cached = caches.job(str(key[0]), str(key[1]), namespace, str(ref.get("name")))
    if cached is not None and cached["metadata"].get("uid") == ref.get("uid"):
        return False
    if key not in jobs.JOB_KINDS:
        return True
    try:  # the cache says gone: make sure before deleting a record
        plural = jobs.JOB_KINDS[(str(key[0]), str(key[1]))]
        found = await kube.get_object(str(key[0]), plural, namespace, str(ref.get("name")))
    except ApiError as exc:
        if is_not_found(exc):
            return True
        raise
    return bool(found["metadata"].get("uid") != ref.get("uid"))


async def sweep(
    caches: Caches,
    kube: Kube,
    retention_days: float,
    rules_for: Callable[[str], Rules],
    metrics: Metrics,
    now: datetime | None = None,
) -> list[str]:
    """Delete what retention allows; returns ``<namespace>/<name>`` of each deleted."""
    if retention_days <= 0:
        return []
    cutoff = (now or datetime.now(timezone.utc)) - timedelta(days=retention_days)
    held = {
        ((n.get("metadata") or {}).get("annotations") or {}).get(INCIDENT_ANNOTATION)
        for n in caches.nodes.values()
    }
    deleted = []
    effects = Effects(kube, caches)
    for incident in caches.incidents.values():
        meta = incident["metadata"]
        ref = f"{meta['namespace']}/{meta['name']}"
        last = incidents.last_activity(incident)
        if ref in held or last is None or last >= cutoff:
            continue
        status = incident.get("status") or {}
        if any(a.get("result") == incidents.PENDING for a in status.get("actions") or []):
            continue
        why = "closed"
        if not incidents.is_closed(incident, rules_for(meta["namespace"])):
            if not await _job_gone(kube, incident, caches):
                continue
            why = "job_deleted"
        try:
            await effects.delete_incident(incident)
        except ApiError as exc:
            if is_not_found(exc) or is_conflict(exc):
                continue  # gone, or changed since it was read: left for the next sweep
            raise
        metrics.retention_deleted.labels(why).inc()
        log.info("retention: deleted incident %s (%s, last change %s)", ref, why, last)
        deleted.append(ref)
    return deleted
