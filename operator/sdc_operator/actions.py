"""The actions the leader takes on the cluster and on AWS, each exactly once.

:class:`Actions` takes one action (:meth:`Actions.take`), says what identifies its effect
before it is taken (:meth:`Actions.intent`, recorded as ``Pending`` by the engine), and,
when it finds a ``Pending`` action after a restart or a conflict, finds out whether it took
effect before taking it again (:meth:`Actions.verify`): the job's ``runPolicy.suspend``, the
node's taint and annotation, its health label, or SageMaker's ``DescribeClusterNode``.

Quarantines of every incident go through one lock: the caps are counted (from the node
cache, which every patch updates at once, plus the nodes other incidents have reserved)
and the node patched under it, so twenty incidents at once under a cap of five quarantine
exactly five nodes. Node patches carry the ``resourceVersion`` they were computed from, so a
taint or cordon another writer added in between is never written over: the patch is
refused (409), the node read again, and the patch computed again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import confirmation, incidents, jobs, jobshape, nodes
from .caches import Caches
from .effects import Effects, Emit
from .errors import ApiError
from .incidents import Action, Rules
from .kube import Kube, is_conflict, is_not_found
from .names import (
    HYPERPOD_CLUSTER_LABEL,
    HYPERPOD_HEALTH_LABEL,
    INCIDENT_ANNOTATION,
    RESUME_MAX_STEP_ENV,
    SUSPECT_KEY,
)
from .remediate import HyperPodNodes, took_effect
from .settings import OperatorSettings
from .times import now_iso, parse_time

__all__ = ["UNKNOWN", "Actions", "Outcome"]

log = logging.getLogger(__name__)
_NODE_CONFLICT_RETRIES = 20

UNKNOWN = "Unknown"
"""The result of a call whose fate cannot be told (no answer): never recorded; the action
stays ``Pending`` and :meth:`Actions.verify` finds out what happened."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What an action did: its result and message for ``status.actions``, and optionally a
    condition ``(type, status, reason, message)`` and status fields to set with it."""

    result: str
    message: str
    condition: tuple[str, str, str, str] | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None
    """Why an action was skipped, for the containment summary (``CapReached``)."""
    also: tuple[tuple[str, str, str, str], ...] = ()
    """Further conditions the action changes (the resume: ``Snapshot``, reported late)."""

    def apply(self, status: dict[str, Any], action: Action) -> dict[str, Any]:
        at = now_iso()
        status = incidents.record_action(status, action, self.result, self.message, at, self.reason)
        status.update(self.fields)
        for condition in (self.condition, *self.also):
            if condition is not None:
                incidents.set_condition(status, *condition, at)
        return status


async def _past_the_second_of(at: str | None) -> None:
    """Return once the clock has passed the whole second ``at`` (RFC 3339, seconds)."""
    if at is None:
        return
    try:
        end = parse_time(at).timestamp() + 1.0
    except ValueError:
        return
    wait = end - time.time()
    if wait > 0:
        await asyncio.sleep(min(wait, 1.0))


def _released(result: str, message: str) -> Outcome:
    """A node given back (or found gone or held by another incident): the end of it."""
    return Outcome(
        result, message, ("Remediated", "True", "Released", message), {"phase": "Released"}
    )


def _remediation_failed(message: str) -> Outcome:
    """Retried after a back-off (incidents.retry_at)."""
    return Outcome("Failed", message, ("Remediated", "False", "RemediationFailed", message))


def _ref(incident: dict[str, Any]) -> str:
    meta = incident["metadata"]
    return f"{meta['namespace']}/{meta['name']}"


class Actions:
    def __init__(
        self,
        kube: Kube,
        caches: Caches,
        settings: OperatorSettings,
        hyperpod: HyperPodNodes | None,
        emit: Emit,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kube = kube
        """For reads; every write goes through :attr:`effects`."""
        self.caches = caches
        self.settings = settings
        self.hyperpod = hyperpod
        self.effects = Effects(kube, caches, hyperpod, emit=emit)
        self._clock = clock
        self._quarantine = asyncio.Lock()
        self._reserved: dict[str, set[str]] = {}
        """Nodes an incident is about to quarantine, counted against the caps."""
        self._remediation = asyncio.Lock()
        self._requested: dict[tuple[str, str, str], tuple[str, bool]] = {}
        """(action, node, boot id) -> (the incident that made the request, whether
        SageMaker accepted it; ``False``: no answer yet), for the time until that
        incident's status shows the result."""
        self._confirm = asyncio.Lock()
        self._confirming: dict[str, tuple[str, dict[str, Any]]] = {}
        """node -> (incident, running record) of the confirmation pods this replica
        created, until the incident cache shows them (one pod per node)."""

    # -- the three entry points ------------------------------------------------------------

    async def intent(self, incident: dict[str, Any], action: Action) -> dict[str, Any]:
        """What identifies ``action``'s effect later, recorded before it is taken."""
        if action.action == "confirm-node":
            return {
                "node": action.target,
                "pod": confirmation.pod_name(incident, action.target),
                "bundle": confirmation.bundle_of(incident) or "",
            }
        if action.action.endswith("-node"):
            node = self.caches.nodes.get(None, action.target) or {}
            meta = node.get("metadata") or {}
            intent: dict[str, Any] = {
                "node": action.target,
                "resourceVersion": meta.get("resourceVersion", ""),
                "bootID": ((node.get("status") or {}).get("nodeInfo") or {}).get("bootID", ""),
            }
            if action.action in ("reboot-node", "replace-node"):
                intent["method"] = self.settings.remediation_method
                instance = self._instance_of(incident, action.target)
                if instance:
                    intent["instanceId"] = instance
            return intent
        job = (incident.get("spec") or {}).get("job") or {}
        return {"job": job.get("uid", "")}

    async def take(self, incident: dict[str, Any], action: Action, rules: Rules) -> Outcome:
        """Take ``action`` (or, in dry-run, only say what it would be)."""
        if rules.dry_run:
            return Outcome(
                "DryRun", f"dry-run: would {action.action.replace('-', ' ')} {action.target}"
            )
        if action.action == "suspend-job":
            return await self._suspend_job(incident)
        if action.action == "quarantine-node":
            return await self._quarantine_node(incident, action.target, rules)
        if action.action == "resume-job":
            return await self._resume_job(incident)
        if action.action in ("reboot-node", "replace-node"):
            return await self._remediate(incident, action)
        if action.action == "release-node":
            return await self._release(incident, action.target)
        if action.action == "confirm-node":
            return await self._start_confirmation(incident, action.target)
        raise ValueError(f"unknown action {action.action!r}")

    async def verify(
        self, incident: dict[str, Any], action: Action, entry: dict[str, Any], rules: Rules
    ) -> Outcome | None:
        """``action`` was recorded ``Pending`` and its result never: the operator died or
        lost a write in between. Its outcome if it took effect (or if taking it again is
        harmless, which is the case for every action but a SageMaker call), or ``None``
        while that cannot be told yet (retry later)."""
        if rules.dry_run or action.action not in ("reboot-node", "replace-node"):
            # Suspend, quarantine, resume and release look at the object first and do
            # nothing where it is done already ("already" in the message); a confirmation
            # pod's name is the incident's, so creating it again meets the first (409).
            return await self.take(incident, action, rules)
        if self.settings.remediation_method == "label":
            return await self.take(incident, action, rules)
        kind = action.action.removesuffix("-node")
        cluster, instance, why = self._where(incident, action.target)
        if why or self.hyperpod is None:
            return await self.take(incident, action, rules)
        assert cluster is not None and instance is not None
        try:
            described = await self.hyperpod.describe(cluster, instance)
        except Exception as exc:  # botocore's errors are many; retried at the next resync
            log.warning("DescribeClusterNode(%s, %s) failed: %s", cluster, instance, exc)
            return None
        boot = str((entry.get("intent") or {}).get("bootID") or "")
        node = self.caches.nodes.get(None, action.target)
        rebooted = bool(
            kind == "reboot"
            and boot
            and node is not None
            and ((node.get("status") or {}).get("nodeInfo") or {}).get("bootID") not in ("", boot)
        )
        if took_effect(kind, described) or rebooted:
            status = ((described or {}).get("InstanceStatus") or {}).get("Status", "NotFound")
            message = (
                f"found the {kind} of {instance} already requested before a restart "
                f"(DescribeClusterNode: {status}); not calling again"
            )
            return self._remediated(kind, message)
        age = self._clock() - parse_time(str(entry.get("at"))).timestamp()
        if age < self.settings.remediation_verify_seconds:
            return None  # SageMaker may not show it yet: ask again later, call nothing
        log.warning(
            "%s of %s recorded %.0f s ago shows no effect (DescribeClusterNode: Running); "
            "calling again",
            kind,
            instance,
            age,
        )
        return await self.take(incident, action, rules)

    def forget(self, incident_ref: str) -> None:
        """The incident's quarantines are decided: its reservations end."""
        self._reserved.pop(incident_ref, None)

    # -- jobs ------------------------------------------------------------------------------

    def _cached_job(self, incident: dict[str, Any]) -> dict[str, Any] | None:
        """The incident's job as the job cache has it (a projection: no pod templates), if
        it is there under the incident's uid."""
        ref = incident["spec"]["job"]
        job = self.caches.job(
            ref["apiVersion"], ref["kind"], incident["metadata"]["namespace"], ref["name"]
        )
        if job is None or job["metadata"].get("uid") != ref["uid"]:
            return None
        return job

    async def _job(self, incident: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        """The incident's job as it is now (read from the API server: the whole spec, and
        fresh, for the effects that need its templates or move away from safety), or
        (None, why not)."""
        ref = incident["spec"]["job"]
        namespace = incident["metadata"]["namespace"]
        plural = jobs.JOB_KINDS[(ref["apiVersion"], ref["kind"])]
        try:
            job = await self.kube.get_object(ref["apiVersion"], plural, namespace, ref["name"])
        except ApiError as exc:
            if is_not_found(exc):
                return None, "the job no longer exists"
            raise
        if job["metadata"].get("uid") != ref["uid"]:
            return None, "the job was deleted and recreated since the report"
        return job, ""

    async def _patch_job(self, job: dict[str, Any], patch: dict[str, Any]) -> None:
        meta = job["metadata"]
        await self.effects.patch_job(
            job["apiVersion"], job["kind"], meta["namespace"], meta["name"], patch
        )

    async def _suspend_job(self, incident: dict[str, Any]) -> Outcome:
        # Stopping moves toward safety: read from the job cache (no API call on the
        # containment path). A cache that says "running" costs at most a patch that changes
        # nothing; one that says "stopped" (or lacks the job) is read again before anything
        # is skipped, so a stale cache never leaves a job running.
        job = self._cached_job(incident)
        if job is None or jobs.is_suspended(job):
            job, why = await self._job(incident)
            if job is None:
                return Outcome("Skipped", why)
        if jobs.is_kueue_managed(job):
            done = await self._set_workloads_active(job, False)
            if done is not None:
                await self.effects.emit(job, "SDCJobStopped", f"{done} ({_ref(incident)})", True)
                return Outcome("Succeeded", done)
        patch = jobs.suspend_patch(job)
        if patch is None:
            return Outcome(
                "Succeeded", "runPolicy.suspend was already true", reason=incidents.ALREADY_STOPPED
            )
        await self._patch_job(job, patch)
        message = f"set runPolicy.suspend=true: suspected silent data corruption ({_ref(incident)})"
        await self.effects.emit(job, "SDCJobSuspended", message, True)
        return Outcome("Succeeded", "set runPolicy.suspend=true")

    def _held(self, incident: dict[str, Any]) -> Outcome | None:
        """Where another open incident of the job holds it stopped (the per-job hold
        ledger, :func:`incidents.job_holders`, read from the incident cache): wait while
        that incident's containment is in progress, else leave the job stopped for a
        person. ``None`` where nothing holds it."""
        uid = str(incident["spec"]["job"]["uid"])
        holders = incidents.job_holders(incident, self.caches.incidents_of(uid))
        final = [name for name, waits in holders if not waits]
        if final:
            message = (
                f"incident(s) {', '.join(final)} of this job stopped it and did not quarantine "
                "their suspect nodes (or were not allowed to resume it): the job stays "
                "suspended until a person decides"
            )
            return Outcome("Skipped", message, ("Resumed", "False", "HeldByIncident", message))
        if holders:
            names = ", ".join(name for name, _ in holders)
            return Outcome(UNKNOWN, f"not resuming yet: incident(s) {names} still contain the job")
        return None

    async def _resume_job(self, incident: dict[str, Any]) -> Outcome:
        held = self._held(incident)
        if held is not None:
            return held
        job, why = await self._job(incident)
        if job is None:
            return Outcome("Skipped", why, ("Resumed", "False", "JobGone", why))
        # The least last clean step of the job's open incidents: a checkpoint inside
        # another incident's window (the job caught twice before it stopped) is no start.
        last_clean, lowered_by = incidents.resume_max_step(
            incident, self.caches.incidents_of(str(incident["spec"]["job"]["uid"]))
        )
        also = (
            f" (the last clean step of incident(s) {', '.join(lowered_by)} of this job, "
            f"before this incident's {incident['spec']['lastCleanStep']})"
            if lowered_by
            else ""
        )
        refusal = jobs.auto_resume_refusal(job)
        if not self.settings.auto_resume:
            refusal = ("AutoResumeOff", "automatic resume is off (HYPERPOD_SDC_AUTO_RESUME)")
        checkpoint = jobs.newest_checkpoint(job, last_clean)
        if refusal is None and checkpoint is None:
            steps = [c["step"] for c in jobs.verified_checkpoints(job)]
            refusal = (
                "NoCleanCheckpoint",
                f"no verified checkpoint at or before step {last_clean} was reported "
                f"(verified checkpoints known: {steps or 'none'})",
            )
        patch = jobs.resume_env_patch(job, last_clean)
        if patch is not None:  # the variable first, while the job is still suspended
            await self._patch_job(job, patch)
        if refusal is not None:
            # The variable stays set: whoever restarts the job by hand restarts it from a
            # clean checkpoint, or it fails loudly where none is old enough.
            reason, why = refusal
            message = (
                f"{why}; the job stays suspended, with {RESUME_MAX_STEP_ENV}={last_clean}{also} "
                "set so that a restart by hand starts from a clean checkpoint"
            )
            await self.effects.emit(job, "SDCJobNotResumed", message, True)
            return Outcome("Skipped", message, ("Resumed", "False", reason, message))
        assert checkpoint is not None
        # The next run's pods are told from the stopped run's by their creation times, in
        # whole seconds (IncidentEngine.generation): it starts once the second of the stop
        # has passed, at most a second later.
        await _past_the_second_of(incidents.job_stopped_at(incident))
        how = "lifted runPolicy.suspend"
        reactivated = (
            await self._set_workloads_active(job, True) if jobs.is_kueue_managed(job) else None
        )
        if reactivated is not None:
            how = reactivated
        elif (unsuspend := jobs.unsuspend_patch(job)) is not None:
            await self._patch_job(job, unsuspend)
        status = incident.get("status") or {}
        lost = incidents.lost_work(
            int(incident["spec"].get("detectionStep", 0)),
            int(checkpoint["step"]),
            status.get("stepSeconds"),
            jobshape.accelerators(job),
        )
        message = (
            f"set {RESUME_MAX_STEP_ENV}={last_clean}{also} on every container and {how}; "
            f"expecting the checkpoint of step {checkpoint['step']} ({checkpoint['location']}); "
            f"{lost['steps']} steps lost"
            + (f" (about {lost['gpuHours']:g} GPU-hours)" if "gpuHours" in lost else "")
        )
        await self.effects.emit(job, "SDCJobResumed", message, False)
        fields: dict[str, Any] = {"resumeCheckpoint": checkpoint, "lostWork": lost}
        view = {"snapshot": status.get("snapshot")}
        late = incidents.late_snapshot(
            view, int(checkpoint["step"]), str(checkpoint["location"]), resumed=False
        )
        if late is not None:
            fields["snapshot"] = view["snapshot"]
        return Outcome(
            "Succeeded",
            message,
            (
                "Resumed",
                "Unknown",
                "Restarting",
                "waiting for the job's agents to report the step they resumed from",
            ),
            fields,
            also=() if late is None else (late,),
        )

    async def _set_workloads_active(self, job: dict[str, Any], active: bool) -> str | None:
        """Deactivate (stop) or reactivate (resume) the Kueue Workloads the job owns; what
        was done, or ``None`` when it owns none."""
        owned = await self._workloads_of(job)
        if not owned:
            return None
        for workload in owned:
            patch = jobs.workload_active_patch(workload, active)
            if patch is not None:
                await self.effects.patch_workload(
                    job["metadata"]["namespace"], workload["metadata"]["name"], patch
                )
        names = ", ".join(w["metadata"]["name"] for w in owned)
        verb = "reactivated" if active else "deactivated"
        return f"{verb} Kueue Workload {names} (spec.active={str(active).lower()})"

    async def _workloads_of(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        """The Kueue Workloads the job owns; none where Kueue is not installed."""
        try:
            workloads = await self.kube.list_objects(
                jobs.KUEUE_WORKLOAD_API, jobs.KUEUE_WORKLOAD_PLURAL, job["metadata"]["namespace"]
            )
        except ApiError as exc:
            if is_not_found(exc):
                return []
            raise
        uid = job["metadata"]["uid"]
        return [
            w
            for w in workloads
            if any(r.get("uid") == uid for r in w["metadata"].get("ownerReferences") or [])
        ]

    # -- nodes -----------------------------------------------------------------------------

    async def _node(self, name: str, *, fresh: bool = False) -> dict[str, Any] | None:
        cached = None if fresh else self.caches.nodes.get(None, name)
        if cached is not None:
            return cached
        try:
            node = await self.kube.get_node(name)
        except ApiError as exc:
            if is_not_found(exc):
                return None
            raise
        self.caches.nodes.upsert(node)
        return node

    async def _patch_node(
        self,
        name: str,
        node: dict[str, Any],
        compute: Callable[[dict[str, Any]], dict[str, Any] | None],
    ) -> dict[str, Any] | None:
        """Patch ``node`` with ``compute(node)`` under its ``resourceVersion``; on a conflict
        read it again and compute again. The node as written, or ``None`` when nothing was
        left to change."""
        for _ in range(_NODE_CONFLICT_RETRIES):
            patch = compute(node)
            if patch is None:
                return None
            try:
                written = await self.effects.patch_node(name, patch)
            except ApiError as exc:
                if not is_conflict(exc):
                    raise
                log.info("node %s changed since it was read; reading it again", name)
                fresh = await self._node(name, fresh=True)
                if fresh is None:
                    raise
                node = fresh
                continue
            return written
        raise ApiError(409, f"node {name}: too many concurrent changes")

    async def _quarantine_node(
        self, incident: dict[str, Any], node_name: str, rules: Rules
    ) -> Outcome:
        ref = _ref(incident)
        async with self._quarantine:
            node = await self._node(node_name)
            if node is None:
                return Outcome("Skipped", f"node {node_name} no longer exists", reason="NodeGone")
            if nodes.is_quarantined_for(node, ref):
                return Outcome("Succeeded", "already cordoned, tainted, labelled and annotated")
            # All or nothing: the incident's remaining suspect nodes must fit under the caps
            # together, so a cap never leaves an incident half quarantined.
            planned = [
                a.target
                for a in incidents.planned_actions(incident, rules)
                if a.action == "quarantine-node"
            ]
            remaining = set(planned) - set(incidents.quarantined_nodes(incident["status"]))
            remaining.add(node_name)
            refusal = self._over_cap(incident, node_name, remaining)
            if refusal is not None:
                self.forget(ref)
                await self.effects.emit(incident, "SDCQuarantineCapReached", refusal, True)
                return Outcome("Skipped", refusal, reason="CapReached")
            self._reserved[ref] = remaining
            try:
                written = await self._patch_node(
                    node_name, node, lambda n: nodes.quarantine_patch(n, ref)
                )
            finally:
                self._reserved[ref] = remaining - {node_name}
        message = (
            f"cordoned; taint {SUSPECT_KEY}=true:NoSchedule, label {SUSPECT_KEY}=true and "
            f"annotation for incident {ref}"
        )
        if written is None:
            return Outcome("Succeeded", "already cordoned, tainted, labelled and annotated")
        if (written["metadata"].get("annotations") or {}).get(nodes.PRIOR_CORDON_ANNOTATION):
            message += " (it was cordoned already: a release leaves it cordoned)"
        await self.effects.emit(written, "SDCNodeQuarantined", message, True)
        return Outcome("Succeeded", message)

    def quarantined(self) -> list[dict[str, Any]]:
        return [
            n
            for n in self.caches.nodes.values()
            if ((n.get("metadata") or {}).get("labels") or {}).get(SUSPECT_KEY) == "true"
        ]

    def _over_cap(self, incident: dict[str, Any], node_name: str, adding: set[str]) -> str | None:
        """Why quarantining ``adding`` more nodes would break a cap, or ``None``."""
        ref = _ref(incident)
        quarantined = {n["metadata"]["name"]: n for n in self.quarantined()}
        others = {node for holder, held in self._reserved.items() if holder != ref for node in held}
        counted = set(quarantined) | others
        new = adding - counted
        total = len(self.caches.nodes.values())
        cap = self.settings.quarantine_cap(total)
        if len(counted) + len(new) > cap:
            return (
                f"not quarantining {node_name} ({len(adding)} suspect node(s)): {len(counted)} "
                f"of {total} nodes are quarantined already, the cluster-wide cap is {cap} "
                f"(HYPERPOD_SDC_MAX_QUARANTINED_NODES={self.settings.max_quarantined_nodes}); "
                "a person must review"
            )
        uid = incident["spec"]["job"]["uid"]
        namespace = incident["metadata"]["namespace"]

        def of_job(holder: str) -> bool:
            ns, _, name = holder.partition("/")
            held_by = self.caches.incidents.get(ns, name)
            return bool(held_by) and held_by["spec"]["job"]["uid"] == uid  # type: ignore[index]

        mine = {
            name
            for name, n in quarantined.items()
            if of_job((n["metadata"].get("annotations") or {}).get(INCIDENT_ANNOTATION, ""))
        }
        mine |= {
            node
            for holder, held in self._reserved.items()
            if holder != ref and of_job(holder)
            for node in held
        }
        if len(mine | adding) > self.settings.max_quarantined_per_job:
            return (
                f"not quarantining {node_name} ({len(adding)} suspect node(s)): job "
                f"{namespace}/{incident['spec']['job']['name']} has {len(mine)} quarantined "
                f"node(s), the cap per job is {self.settings.max_quarantined_per_job} "
                "(HYPERPOD_SDC_MAX_QUARANTINED_PER_JOB)"
            )
        return None

    async def _release(self, incident: dict[str, Any], node_name: str) -> Outcome:
        ref = _ref(incident)
        async with self._quarantine:
            node = await self._node(node_name, fresh=True)  # managedFields: who cordoned it
            if node is None:
                return _released("Skipped", f"node {node_name} no longer exists")
            annotations = node["metadata"].get("annotations") or {}
            holder = annotations.get(INCIDENT_ANNOTATION, ref)
            if holder != ref:
                message = f"node {node_name} is held by incident {holder} now; left as it is"
                return _released("Skipped", message)
            # Another open incident quarantined this node too (two jobs on one node, or one
            # job caught twice): this incident's release must not undo that quarantine.
            others = nodes.holders(node_name, ref, self.caches.incidents.values())
            if others:
                await self._patch_node(
                    node_name, node, lambda n: nodes.hand_over_patch(n, others[0])
                )
                message = (
                    f"node {node_name} stays quarantined: incident(s) {', '.join(others)} "
                    f"quarantined it too and are not released; it is held by {others[0]} now"
                )
                return _released("Skipped", message)
            written = await self._patch_node(node_name, node, nodes.release_patch)
        after = written or node
        kept = " (still cordoned: cordoned before the incident, or by someone else since)"
        message = f"released {node_name} after review: our taint, label and annotation removed" + (
            kept if (after.get("spec") or {}).get("unschedulable") else "; uncordoned"
        )
        await self.effects.emit(after, "SDCNodeReleased", message, False)
        return _released("Succeeded", message)

    # -- remediation -----------------------------------------------------------------------

    def _instance_of(self, incident: dict[str, Any], node_name: str) -> str | None:
        return next(
            (
                s.get("instanceId")
                for s in (incident.get("status") or {}).get("suspects") or []
                if s.get("node") == node_name and s.get("instanceId")
            ),
            None,
        )

    def _where(
        self, incident: dict[str, Any], node_name: str
    ) -> tuple[str | None, str | None, str]:
        """(cluster, instance id, why not) for a SageMaker call about ``node_name``."""
        node = self.caches.nodes.get(None, node_name) or {}
        labels = (node.get("metadata") or {}).get("labels") or {}
        cluster = labels.get(HYPERPOD_CLUSTER_LABEL) or self.settings.cluster_name
        instance = self._instance_of(incident, node_name)
        if not instance:
            return cluster, None, "no instance id known"
        if not cluster:
            return (
                None,
                instance,
                f"no {HYPERPOD_CLUSTER_LABEL} label and no HYPERPOD_SDC_CLUSTER_NAME",
            )
        return cluster, instance, ""

    @staticmethod
    def _remediated(kind: str, message: str) -> Outcome:
        done = {"reboot": "RebootRequested", "replace": "ReplaceRequested"}[kind]
        return Outcome(
            "Succeeded", message, ("Remediated", "True", done, message), {"phase": "Remediated"}
        )

    async def _remediate(self, incident: dict[str, Any], action: Action) -> Outcome:
        kind = action.action.removesuffix("-node")  # reboot or replace
        node_name = action.target
        node = await self._node(node_name, fresh=True)
        if node is None:  # replaced already, or gone: nothing left to do
            message = f"node {node_name} no longer exists"
            return Outcome("Skipped", message, ("Remediated", "True", "NodeGone", message))
        if self.settings.remediation_method == "label":
            await self._patch_node(node_name, node, lambda n: nodes.health_label_patch(n, kind))
            value = nodes.HEALTH_LABEL_VALUES[kind]
            message = (
                f"labelled {node_name} {HYPERPOD_HEALTH_LABEL}={value} for HyperPod to {kind} it"
            )
        else:
            cluster, instance, why = self._where(incident, node_name)
            if why or self.hyperpod is None:
                return _remediation_failed(
                    f"cannot {kind} {node_name} through SageMaker: {why or 'no client'}"
                )
            assert cluster is not None and instance is not None
            boot = ((node.get("status") or {}).get("nodeInfo") or {}).get("bootID", "")
            # Two incidents of one node (a job caught twice before it stopped) ask for the
            # same replacement: one call. Checked and called under one lock.
            async with self._remediation:
                other, pending = self._requested_elsewhere(incident, action, boot)
                if other is not None and pending:
                    return await self._verify_elsewhere(kind, cluster, instance, node_name, other)
                if other is not None:
                    message = (
                        f"the {kind} of {node_name} ({instance}) was requested already by "
                        f"incident {other}; not calling again"
                    )
                    return self._remediated(kind, message)
                ok, message = await self.effects.remediate(kind, cluster, instance)
                made = (action.action, node_name, boot)
                if ok is False:  # refused: nothing was done, and anyone may ask again
                    self._requested.pop(made, None)
                else:
                    self._requested[made] = (_ref(incident), bool(ok))
            if ok is None:
                return Outcome(UNKNOWN, message)
            if not ok:
                return _remediation_failed(message)
        done = {"reboot": "RebootRequested", "replace": "ReplaceRequested"}[kind]
        await self.effects.emit(node, f"SDCNode{done}", message, True)
        return self._remediated(kind, message)

    def _requested_elsewhere(
        self, incident: dict[str, Any], action: Action, boot: str
    ) -> tuple[str | None, bool]:
        """The per-instance request ledger: another incident that made the same request
        for this node (this boot of it: a node rebooted since may need another), and
        whether its fate is still open. ``(None, False)`` where none did.

        A request SageMaker accepted is a ``Succeeded`` record (or, until that is written,
        in memory). One made and not answered (``Unknown``: in memory, and ``Pending`` in
        its incident's status), or recorded ``Pending`` earlier than this incident's own,
        counts as made too: the status survives a restart, and the request is verified
        with ``DescribeClusterNode``, never made again by a second incident. The incident
        that called (else the earliest ``Pending`` one) is the one that may call again."""
        ref = _ref(incident)
        made = self._requested.get((action.action, action.target, boot))
        if made is not None and made[0] != ref:
            return made[0], not made[1]
        mine = incidents.pending_entry(incident.get("status") or {}, action) or {}
        calls = made is not None  # this incident called: it verifies its own request
        mine_at = str(mine.get("at") or now_iso())
        earliest: tuple[str, str] | None = None
        for other in self.caches.incidents.values():
            if _ref(other) == ref:
                continue
            for entry in (other.get("status") or {}).get("actions") or []:
                if (entry.get("action"), entry.get("target")) != (action.action, action.target):
                    continue
                same_boot = str((entry.get("intent") or {}).get("bootID") or "") == boot
                if action.action == "reboot-node" and not same_boot:
                    continue
                if entry.get("result") == "Succeeded":
                    return _ref(other), False
                if entry.get("result") == incidents.PENDING and not calls:
                    at = str(entry.get("at") or "")
                    if (at, _ref(other)) < (mine_at, ref) and (
                        earliest is None or (at, _ref(other)) < earliest
                    ):
                        earliest = (at, _ref(other))
        if earliest is not None:
            return earliest[1], True
        return None, False

    async def _verify_elsewhere(
        self, kind: str, cluster: str, instance: str, node_name: str, other: str
    ) -> Outcome:
        """Another incident's request for this node has no answer yet: what
        ``DescribeClusterNode`` shows of it; ``Unknown`` (asked again later, nothing
        called) until it shows the request taken."""
        assert self.hyperpod is not None
        try:
            described = await self.hyperpod.describe(cluster, instance)
        except Exception as exc:  # botocore's errors are many; asked again later
            return Outcome(UNKNOWN, f"DescribeClusterNode({cluster}, {instance}) failed: {exc}")
        if took_effect(kind, described):
            status = ((described or {}).get("InstanceStatus") or {}).get("Status", "NotFound")
            message = (
                f"the {kind} of {node_name} ({instance}) was requested already by incident "
                f"{other} (DescribeClusterNode: {status}); not calling again"
            )
            return self._remediated(kind, message)
        return Outcome(
            UNKNOWN,
            f"the {kind} of {node_name} ({instance}) requested by incident {other} is not "
            "answered yet; waiting for it, not calling again",
        )

    # -- confirmation ----------------------------------------------------------------------

    @staticmethod
    def _not_confirmable(reason: str, message: str, node: str, bundle: str | None) -> Outcome:
        """The confirmation cannot run: said on the incident (``Confirmed=Unknown``), and
        nothing else changes."""
        found = {"node": node, **({"bundle": bundle} if bundle else {})}
        record, condition = confirmation.record("unknown", reason, message, found, now_iso())
        return Outcome("Skipped", message, condition, {"confirmation": record}, reason=reason)

    def _confirmations_on(self, node: str) -> list[tuple[str, str, dict[str, Any]]]:
        """(incident, its namespace, running record) of every confirmation running on
        ``node``: as the incident cache has them, and those this replica created whose
        record the cache does not show yet (two incidents of one node confirm at the same
        moment: the second must see the first's pod)."""
        found = []
        for other in self.caches.incidents.values():
            running = (other.get("status") or {}).get("confirmation") or {}
            if running.get("outcome") == "running" and running.get("node") == node:
                found.append((_ref(other), str(other["metadata"]["namespace"]), running))
        made = self._confirming.get(node)
        if made is not None and made[0] not in {f[0] for f in found}:
            ref, created = made
            namespace, _, name = ref.partition("/")
            cached = ((self.caches.incidents.get(namespace, name) or {}).get("status") or {}).get(
                "confirmation"
            ) or {}
            if cached.get("podUid") == created.get("podUid") and cached.get("outcome") not in (
                None,
                "running",
            ):
                self._confirming.pop(node, None)  # it ended: the cache shows its result
            else:
                found.append((ref, namespace, created))
        return found

    def _share_confirmation(self, incident: dict[str, Any], node: str) -> Outcome | None:
        """One confirmation pod per node (each asks for every GPU of the node, so a second
        would never start): where another incident's confirmation runs on ``node``, this
        incident shares its pod if it is in the same namespace (its result is read for
        both, each judged with its own suspects), else waits for it to end (``Unknown``:
        asked again shortly). ``None`` where none runs there."""
        ref = _ref(incident)
        namespace = incident["metadata"]["namespace"]
        for other_ref, other_ns, running in self._confirmations_on(node):
            if other_ref == ref:
                continue
            other_name = other_ref.partition("/")[2]
            pod_ref = f"{other_ns}/{running.get('pod')}"
            pod = self.caches.pods.get(other_ns, str(running.get("pod")))
            uid = str(running.get("podUid") or "")
            same = other_ns == namespace
            if not same or pod is None or not uid or pod["metadata"].get("uid") != uid:
                return Outcome(
                    UNKNOWN,
                    f"waiting for the confirmation pod {pod_ref} of incident {other_ref} on "
                    f"node {node} to end: one confirmation pod per node (each asks for all of "
                    "its GPUs)",
                )
            record = confirmation.running_record(
                str(running["pod"]),
                node,
                str(running.get("bundle") or ""),
                str(running.get("createdAt") or now_iso()),
                uid,
                running.get("images"),
            )
            record["sharedFrom"] = other_name
            message = (
                f"shares the confirmation pod {pod_ref} of incident {other_ref} on node "
                f"{node} (one pod per node): it recomputes that incident's bundle "
                f"{running.get('bundle')}, and its result is judged for this incident's suspects"
            )
            return Outcome(
                "Succeeded",
                message,
                ("Confirmed", "Unknown", "Running", f"confirmation pod {running['pod']} on {node}"),
                {"confirmation": record},
            )
        return None

    async def _start_confirmation(self, incident: dict[str, Any], node: str) -> Outcome:
        """Create the confirmation pod on ``node`` (or find the one created before a
        restart: its name is the incident's), or share the one another incident runs
        there; its result is read from the pod cache."""
        async with self._confirm:  # the check for another's pod and the create, at once
            outcome = await self._create_confirmation(incident, node)
            record = outcome.fields.get("confirmation") or {}
            if record.get("outcome") == "running" and not record.get("sharedFrom"):
                self._confirming[node] = (_ref(incident), record)
        return outcome

    async def _create_confirmation(self, incident: dict[str, Any], node: str) -> Outcome:
        s = self.settings
        bundle = confirmation.bundle_of(incident)
        if not bundle:
            return self._not_confirmable("NoBundle", "the verdict named no bundle", node, None)
        shared = self._share_confirmation(incident, node)
        if shared is not None:
            return shared
        job, why = await self._job(incident)
        if job is None:
            return self._not_confirmable("JobGone", f"cannot confirm: {why}", node, bundle)
        body, why = confirmation.pod_body(
            incident,
            job,
            node,
            bundle,
            repeat=s.confirmation_repeat,
            deadline_seconds=s.confirmation_deadline_seconds,
            image=s.confirmation_image,
            node_gpus=((self.caches.nodes.get(None, node) or {}).get("status") or {}).get(
                "allocatable"
            ),
        )
        if body is None:
            return self._not_confirmable("CannotConfirm", f"cannot confirm: {why}", node, bundle)
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        how = "created"
        try:
            pod = await self.effects.create_pod(body)
        except ApiError as exc:
            if is_conflict(exc):
                pod = await self.kube.get("v1", "pods", namespace, name)
                owners = [r.get("uid") for r in pod["metadata"].get("ownerReferences") or []]
                differs: str | None = None
                if incident["metadata"].get("uid") not in owners:
                    differs = "it is not owned by this incident"
                else:  # compare it with ours as the API server would store it
                    unnamed = {k: v for k, v in body["metadata"].items() if k != "name"}
                    unnamed["generateName"] = f"{name[:50]}-"
                    as_created = await self.effects.pod_as_stored({**body, "metadata": unnamed})
                    differs = confirmation.pod_difference(pod, as_created, node)
                if differs is not None:
                    message = f"a pod named {name} exists and is not this incident's: {differs}"
                    return self._not_confirmable("NameTaken", message, node, bundle)
                how = "found (created before a restart or by the other replica)"
            elif 400 <= exc.status < 500 and exc.status != 429:
                message = f"cannot create the confirmation pod {name}: {exc}"
                return self._not_confirmable("CouldNotCreate", message, node, bundle)
            else:
                raise  # retried: the action stays Pending and is verified (created again)
        self.caches.pods.upsert(pod)
        message = (
            f"{how} pod {namespace}/{name} on node {node}: python -m sdc_agent.confirm {bundle}"
        )
        await self.effects.emit(incident, "SDCConfirmationStarted", message, False)
        created = str((pod.get("metadata") or {}).get("creationTimestamp") or now_iso())
        return Outcome(
            "Succeeded",
            message,
            ("Confirmed", "Unknown", "Running", f"confirmation pod {name} on node {node}"),
            {
                "confirmation": confirmation.running_record(
                    name,
                    node,
                    bundle,
                    created,
                    str((pod.get("metadata") or {}).get("uid") or ""),
                    confirmation.pod_images(pod),
                )
            },
        )
