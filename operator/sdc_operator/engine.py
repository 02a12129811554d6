"""The incident engine: folds verdicts into ``SDCIncident`` objects and drives containment.

Every change goes through the incident's status, written with its ``resourceVersion`` (a
conflict re-reads and tries again), and every action is recorded right after it is taken.
:meth:`IncidentEngine.reconcile` takes the first action the status does not yet record as
done; actions are idempotent, so one taken but not recorded before a crash is found in
place and recorded, not repeated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sdc_agent.protocol import CheckpointReport, ResumeReport, VerdictReport

from . import incidents, jobs, nodes
from .incidents import Action, JobRef, ResolvedSuspect, now_iso
from .kube import Kube, is_conflict, is_not_found
from .metrics import Metrics
from .names import (
    GROUP,
    HYPERPOD_CLUSTER_LABEL,
    HYPERPOD_HEALTH_LABEL,
    INCIDENT_ANNOTATION,
    RESUME_MAX_STEP_ENV,
    SUSPECT_KEY,
)
from .remediate import HyperPodNodes
from .settings import OperatorSettings

__all__ = ["IncidentEngine"]

log = logging.getLogger(__name__)
_CONFLICT_RETRIES = 20


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

    def apply(self, status: dict[str, Any], action: Action) -> dict[str, Any]:
        at = now_iso()
        status = incidents.record_action(status, action, self.result, self.message, at, self.reason)
        status.update(self.fields)
        if self.condition is not None:
            incidents.set_condition(status, *self.condition, at)
        return status


def _released(result: str, message: str) -> Outcome:
    """A node given back (or found gone or held by another incident): the end of it."""
    return Outcome(
        result, message, ("Remediated", "True", "Released", message), {"phase": "Released"}
    )


def _remediation_failed(message: str) -> Outcome:
    """Retried after a back-off (incidents.retry_at)."""
    return Outcome("Failed", message, ("Remediated", "False", "RemediationFailed", message))


class IncidentEngine:
    def __init__(
        self,
        kube: Kube,
        settings: OperatorSettings,
        metrics: Metrics,
        hyperpod: HyperPodNodes | None = None,
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.rules = incidents.Rules.of(settings)
        self.metrics = metrics
        self.hyperpod = hyperpod
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._agreed_at: dict[tuple[str, str], float] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def _lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    # -- intake side -----------------------------------------------------------------------

    async def record_verdict(
        self,
        job: JobRef,
        report: VerdictReport,
        *,
        reporter_pod: str,
        reporter_node: str,
        suspects: Sequence[ResolvedSuspect],
    ) -> tuple[str, str]:
        """Create or update the incident for ``report``'s window; returns (name, phase)."""
        name = incidents.incident_name(job, report)
        key = (job.namespace, name)
        async with self._lock(*key):
            for _ in range(_CONFLICT_RETRIES):
                incident = await self._get_or_create(job, name, report)
                status, changed = incidents.fold_report(
                    incident.get("status") or {},
                    report,
                    reporter_pod=reporter_pod,
                    reporter_node=reporter_node,
                    suspects=suspects,
                    needed=self.settings.agreement_nodes,
                    received_at=now_iso(),
                )
                if not changed:
                    return name, str(status.get("phase"))
                was = (incident.get("status") or {}).get("phase")
                incident["status"] = status
                try:
                    await self.kube.replace_incident_status(incident)
                except Exception as exc:
                    if is_conflict(exc):
                        continue
                    raise
                if status["phase"] == "Detected" and was != "Detected":
                    self._agreed_at[key] = time.monotonic()
                    log.warning("incident %s/%s: %s", job.namespace, name, report.message)
                break
            else:
                raise RuntimeError(f"incident {job.namespace}/{name}: too many write conflicts")
        self.schedule(job.namespace, name)
        return name, str(status.get("phase"))

    async def _get_or_create(self, job: JobRef, name: str, report: VerdictReport) -> dict[str, Any]:
        try:
            return await self.kube.get_incident(job.namespace, name)
        except Exception as exc:
            if not is_not_found(exc):
                raise
        body = incidents.new_incident(job, name, report)
        try:
            created = await self.kube.create_incident(body)
        except Exception as exc:
            if is_conflict(exc):  # created meanwhile by an earlier operator process
                return await self.kube.get_incident(job.namespace, name)
            raise
        self.metrics.incidents.labels(report.check, report.classification).inc()
        await self._event(created, "Detected", report.message, True)
        return created

    async def record_checkpoint(self, job: JobRef, report: CheckpointReport) -> bool:
        """Remember a verified checkpoint on the job (a resume needs one old enough);
        returns whether it was recorded."""
        if not report.verified:
            return False
        plural = jobs.JOB_KINDS[(job.api_version, job.kind)]
        current = await self.kube.get_object(job.api_version, plural, job.namespace, job.name)
        patch = jobs.checkpoint_patch(current, report.step, report.location)
        if patch is not None:
            await self.kube.patch_object(job.api_version, plural, job.namespace, job.name, patch)
        return True

    async def record_resume(self, job: JobRef, report: ResumeReport) -> list[str]:
        """The job's agents restarted from ``report.step``: mark each incident that was
        waiting for it. Returns the incidents marked."""
        marked = []
        found = await self.kube.list_incidents(
            job.namespace, label_selector=f"{GROUP}/job={job.name[:63]}"
        )
        for candidate in found:
            if (candidate.get("spec") or {}).get("job", {}).get("uid") != job.uid:
                continue
            name = candidate["metadata"]["name"]
            async with self._lock(job.namespace, name):
                for _ in range(_CONFLICT_RETRIES):
                    incident = await self.kube.get_incident(job.namespace, name)
                    update = incidents.resumed_status(
                        incident, report.step, report.location, now_iso()
                    )
                    if update is None:
                        break
                    incident["status"] = update
                    try:
                        incident = await self.kube.replace_incident_status(incident)
                    except Exception as exc:
                        if is_conflict(exc):
                            continue
                        raise
                    marked.append(name)
                    resumed = next(c for c in update["conditions"] if c["type"] == "Resumed")
                    await self._event(
                        incident, resumed["reason"], resumed["message"], resumed["status"] != "True"
                    )
                    break
        return marked

    # -- containment -----------------------------------------------------------------------

    def schedule(self, namespace: str, name: str) -> None:
        """Reconcile in the background (from the intake, a watch event or the resync)."""
        task = asyncio.get_running_loop().create_task(self._reconcile_logged(namespace, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reconcile_logged(self, namespace: str, name: str) -> None:
        try:
            await self.reconcile(namespace, name)
        except Exception:
            log.exception(
                "incident %s/%s: containment failed; retried at the next resync", namespace, name
            )

    async def reconcile(self, namespace: str, name: str) -> None:
        rules = self.rules
        contained: tuple[str, str] | None = None  # (phase, message) when contained now
        async with self._lock(namespace, name):
            for _ in range(_CONFLICT_RETRIES):
                try:
                    incident = await self.kube.get_incident(namespace, name)
                except Exception as exc:
                    if is_not_found(exc):
                        return
                    raise
                try:
                    while True:
                        action = incidents.next_action(incident, rules)
                        if action is not None:
                            outcome = await self._take(incident, action)
                            incident["status"] = outcome.apply(incident["status"], action)
                            incident = await self.kube.replace_incident_status(incident)
                            self.metrics.actions.labels(action.action, outcome.result).inc()
                            continue
                        summary = incidents.containment_summary(incident, rules)
                        if summary is None:
                            break
                        phase, value, reason, message = summary
                        status = dict(incident["status"])
                        status["phase"] = phase
                        incidents.set_condition(
                            status, "Contained", value, reason, message, now_iso()
                        )
                        incident["status"] = status
                        incident = await self.kube.replace_incident_status(incident)
                        contained = (phase, message)
                except Exception as exc:
                    if is_conflict(exc):
                        continue
                    raise
                break
            else:
                raise RuntimeError(f"incident {namespace}/{name}: too many write conflicts")
        if contained is None:
            return
        phase, message = contained
        agreed = self._agreed_at.pop((namespace, name), None)
        if agreed is not None and phase == "Contained":
            self.metrics.report_to_contained.observe(time.monotonic() - agreed)
        await self._event(incident, phase, message, False)
        log.warning("incident %s/%s: %s", namespace, name, message)

    async def _take(self, incident: dict[str, Any], action: Action) -> Outcome:
        """Take one action (or, in dry-run, only say what it would be)."""
        if self.settings.dry_run:
            return Outcome(
                "DryRun", f"dry-run: would {action.action.replace('-', ' ')} {action.target}"
            )
        if action.action == "suspend-job":
            return Outcome(*await self._suspend_job(incident))
        if action.action == "quarantine-node":
            return await self._quarantine_node(incident, action.target)
        if action.action == "resume-job":
            return await self._resume_job(incident)
        if action.action in ("reboot-node", "replace-node"):
            return await self._remediate(incident, action)
        if action.action == "release-node":
            return await self._release(incident, action.target)
        raise ValueError(f"unknown action {action.action!r}")

    async def _job(self, incident: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        """The incident's job as it is now, or (None, why not)."""
        ref = incident["spec"]["job"]
        namespace = incident["metadata"]["namespace"]
        plural = jobs.JOB_KINDS[(ref["apiVersion"], ref["kind"])]
        try:
            job = await self.kube.get_object(ref["apiVersion"], plural, namespace, ref["name"])
        except Exception as exc:
            if is_not_found(exc):
                return None, "the job no longer exists"
            raise
        if job["metadata"].get("uid") != ref["uid"]:
            return None, "the job was deleted and recreated since the report"
        return job, ""

    async def _patch_job(self, job: dict[str, Any], patch: dict[str, Any]) -> None:
        meta = job["metadata"]
        plural = jobs.JOB_KINDS[(job["apiVersion"], job["kind"])]
        await self.kube.patch_object(
            job["apiVersion"], plural, meta["namespace"], meta["name"], patch
        )

    async def _resume_job(self, incident: dict[str, Any]) -> Outcome:
        job, why = await self._job(incident)
        if job is None:
            return Outcome("Skipped", why, ("Resumed", "False", "JobGone", why))
        last_clean = int(incident["spec"]["lastCleanStep"])
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
                f"{why}; the job stays suspended, with {RESUME_MAX_STEP_ENV}={last_clean} set "
                "so that a restart by hand starts from a clean checkpoint"
            )
            await self._event(job, "SDCJobNotResumed", message, True)
            return Outcome("Skipped", message, ("Resumed", "False", reason, message))
        assert checkpoint is not None
        how = "lifted runPolicy.suspend"
        reactivated = (
            await self._set_workloads_active(job, True) if jobs.is_kueue_managed(job) else None
        )
        if reactivated is not None:
            how = reactivated
        elif (patch := jobs.unsuspend_patch(job)) is not None:
            await self._patch_job(job, patch)
        message = (
            f"set {RESUME_MAX_STEP_ENV}={last_clean} on every container and {how}; "
            f"expecting the checkpoint of step {checkpoint['step']} ({checkpoint['location']})"
        )
        await self._event(job, "SDCJobResumed", message, False)
        return Outcome(
            "Succeeded",
            message,
            (
                "Resumed",
                "Unknown",
                "Restarting",
                "waiting for the job's agents to report the step they resumed from",
            ),
            {"resumeCheckpoint": checkpoint},
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
                await self.kube.patch_object(
                    jobs.KUEUE_WORKLOAD_API,
                    jobs.KUEUE_WORKLOAD_PLURAL,
                    job["metadata"]["namespace"],
                    workload["metadata"]["name"],
                    patch,
                )
        names = ", ".join(w["metadata"]["name"] for w in owned)
        verb = "reactivated" if active else "deactivated"
        return f"{verb} Kueue Workload {names} (spec.active={str(active).lower()})"

    async def _suspend_job(self, incident: dict[str, Any]) -> tuple[str, str]:
        job, why = await self._job(incident)
        if job is None:
            return "Skipped", why
        if jobs.is_kueue_managed(job):
            done = await self._set_workloads_active(job, False)
            if done is not None:
                await self._event(job, "SDCJobStopped", f"{done} ({self._ref(incident)})", True)
                return "Succeeded", done
        patch = jobs.suspend_patch(job)
        if patch is None:
            return "Succeeded", "runPolicy.suspend was already true"
        await self._patch_job(job, patch)
        message = (
            f"set runPolicy.suspend=true: suspected silent data corruption ({self._ref(incident)})"
        )
        await self._event(job, "SDCJobSuspended", message, True)
        return "Succeeded", "set runPolicy.suspend=true"

    async def _workloads_of(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        """The Kueue Workloads the job owns; none where Kueue is not installed."""
        try:
            workloads = await self.kube.list_objects(
                jobs.KUEUE_WORKLOAD_API, jobs.KUEUE_WORKLOAD_PLURAL, job["metadata"]["namespace"]
            )
        except Exception as exc:
            if is_not_found(exc):
                return []
            raise
        uid = job["metadata"]["uid"]
        return [
            w
            for w in workloads
            if any(r.get("uid") == uid for r in w["metadata"].get("ownerReferences") or [])
        ]

    async def _quarantine_node(self, incident: dict[str, Any], node_name: str) -> Outcome:
        try:
            node = await self.kube.get_node(node_name)
        except Exception as exc:
            if is_not_found(exc):
                return Outcome("Skipped", f"node {node_name} no longer exists", reason="NodeGone")
            raise
        ref = self._ref(incident)
        patch = nodes.quarantine_patch(node, ref)
        if patch is None:
            return Outcome("Succeeded", "already cordoned, tainted, labelled and annotated")
        # All or nothing: the incident's remaining suspect nodes must fit under the caps
        # together, so a cap never leaves an incident half quarantined.
        planned = [
            a.target
            for a in incidents.planned_actions(incident, self.rules)
            if a.action == "quarantine-node"
        ]
        remaining = len(set(planned) - set(incidents.quarantined_nodes(incident["status"])))
        refusal = await self._over_cap(incident, node_name, max(1, remaining))
        if refusal is not None:
            await self._event(incident, "SDCQuarantineCapReached", refusal, True)
            return Outcome("Skipped", refusal, reason="CapReached")
        await self.kube.patch_node(node_name, patch)
        await self.refresh_quarantined()
        message = (
            f"cordoned; taint {SUSPECT_KEY}=true:NoSchedule, label {SUSPECT_KEY}=true and "
            f"annotation for incident {ref}"
        )
        await self._event(node, "SDCNodeQuarantined", message, True)
        return Outcome("Succeeded", message)

    async def _over_cap(self, incident: dict[str, Any], node_name: str, adding: int) -> str | None:
        """Why quarantining ``adding`` more nodes would break a cap, or ``None``."""
        quarantined = await self.kube.list_nodes(label_selector=f"{SUSPECT_KEY}=true")
        total = len(await self.kube.list_nodes())
        cap = self.settings.quarantine_cap(total)
        if len(quarantined) + adding > cap:
            return (
                f"not quarantining {node_name} ({adding} suspect node(s)): {len(quarantined)} of "
                f"{total} nodes are "
                f"quarantined already, the cluster-wide cap is {cap} "
                f"(HYPERPOD_SDC_MAX_QUARANTINED_NODES={self.settings.max_quarantined_nodes}); "
                "a person must review"
            )
        job = incident["spec"]["job"]
        namespace = incident["metadata"]["namespace"]
        of_job = {
            f"{namespace}/{i['metadata']['name']}"
            for i in await self.kube.list_incidents(
                namespace, label_selector=f"{GROUP}/job={job['name'][:63]}"
            )
            if (i.get("spec") or {}).get("job", {}).get("uid") == job["uid"]
        }
        mine = [
            n
            for n in quarantined
            if ((n["metadata"].get("annotations") or {}).get(INCIDENT_ANNOTATION)) in of_job
        ]
        if len(mine) + adding > self.settings.max_quarantined_per_job:
            return (
                f"not quarantining {node_name} ({adding} suspect node(s)): job "
                f"{namespace}/{job['name']} has "
                f"{len(mine)} quarantined node(s), the cap per job is "
                f"{self.settings.max_quarantined_per_job} (HYPERPOD_SDC_MAX_QUARANTINED_PER_JOB)"
            )
        return None

    async def _remediate(self, incident: dict[str, Any], action: Action) -> Outcome:
        kind = action.action.removesuffix("-node")  # reboot or replace
        node_name = action.target
        try:
            node = await self.kube.get_node(node_name)
        except Exception as exc:
            if is_not_found(exc):  # replaced already, or gone: nothing left to do
                message = f"node {node_name} no longer exists"
                return Outcome("Skipped", message, ("Remediated", "True", "NodeGone", message))
            raise
        done = {"reboot": "RebootRequested", "replace": "ReplaceRequested"}[kind]
        if self.settings.remediation_method == "label":
            patch = nodes.health_label_patch(node, kind)
            if patch is not None:
                await self.kube.patch_node(node_name, patch)
            value = nodes.HEALTH_LABEL_VALUES[kind]
            message = (
                f"labelled {node_name} {HYPERPOD_HEALTH_LABEL}={value} for HyperPod to {kind} it"
            )
        else:
            labels = node["metadata"].get("labels") or {}
            cluster = labels.get(HYPERPOD_CLUSTER_LABEL) or self.settings.cluster_name
            instance = next(
                (
                    s.get("instanceId")
                    for s in incident["status"].get("suspects") or []
                    if s.get("node") == node_name and s.get("instanceId")
                ),
                None,
            )
            if not cluster or not instance or self.hyperpod is None:
                message = f"cannot {kind} {node_name} through SageMaker: " + (
                    "no instance id known"
                    if not instance
                    else f"no {HYPERPOD_CLUSTER_LABEL} label and no HYPERPOD_SDC_CLUSTER_NAME"
                )
                return _remediation_failed(message)
            ok, message = await self.hyperpod.remediate(kind, cluster, instance)
            if not ok:
                return _remediation_failed(message)
        await self._event(node, f"SDCNode{done}", message, True)
        return Outcome(
            "Succeeded", message, ("Remediated", "True", done, message), {"phase": "Remediated"}
        )

    async def _release(self, incident: dict[str, Any], node_name: str) -> Outcome:
        try:
            node = await self.kube.get_node(node_name)
        except Exception as exc:
            if is_not_found(exc):
                message = f"node {node_name} no longer exists"
                return _released("Skipped", message)
            raise
        annotations = node["metadata"].get("annotations") or {}
        if annotations.get(INCIDENT_ANNOTATION, self._ref(incident)) != self._ref(incident):
            holder = annotations[INCIDENT_ANNOTATION]
            message = f"node {node_name} is held by incident {holder} now; left as it is"
            return _released("Skipped", message)
        patch = nodes.release_patch(node)
        if patch is not None:
            await self.kube.patch_node(node_name, patch)
            await self.refresh_quarantined()
        message = f"released {node_name} after review: cordon, taint, label and annotation removed"
        await self._event(node, "SDCNodeReleased", message, False)
        return _released("Succeeded", message)

    async def refresh_quarantined(self) -> None:
        quarantined = await self.kube.list_nodes(label_selector=f"{SUSPECT_KEY}=true")
        self.metrics.quarantined_nodes.set(len(quarantined))

    @staticmethod
    def _ref(incident: dict[str, Any]) -> str:
        meta = incident["metadata"]
        return f"{meta['namespace']}/{meta['name']}"

    async def _event(self, obj: dict[str, Any], reason: str, message: str, warning: bool) -> None:
        try:
            await self.kube.emit_event(obj, reason, message, warning=warning)
        except Exception as exc:  # an Event is a courtesy; never fail an action over one
            log.warning("could not post event %s: %s", reason, exc)

    # -- resync ----------------------------------------------------------------------------

    async def resync(self) -> None:
        """Drive every unfinished incident (after a restart or a failed action)."""
        namespaces: Sequence[str | None] = self.settings.namespaces or (None,)
        for namespace in namespaces:
            for incident in await self.kube.list_incidents(namespace):
                if incidents.pending_actions(incident, self.rules):
                    meta = incident["metadata"]
                    self.schedule(meta["namespace"], meta["name"])
        await self.refresh_quarantined()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
