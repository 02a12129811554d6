"""The incident engine: folds verdicts into ``SDCIncident`` objects and drives containment.

Two halves, with their own API clients so neither waits for the other:

- **Records** (every replica): a verdict folds into its incident's status. Reports that
  arrive while one write is in flight are folded together into the next one (group
  commit), and a report that cannot change anything (its node is recorded already, or
  containment has started) is answered from memory without an API call. A replica that is
  not the leader records too, so a report that reaches it is not lost.
- **Containment** (the leader only): :meth:`IncidentEngine.reconcile` takes the first
  action the status does not record as done. Each action is recorded ``Pending`` with what
  identifies it before it is taken and its result after; one found ``Pending`` (after a
  crash, a conflict or a change of leader) is verified before it is taken again
  (:mod:`.actions`).

Every status write carries the ``resourceVersion`` it was computed from; a conflict reads
the incident again and applies the same change to what it finds.

Given a ``lane`` (:mod:`.lane`), the engine lives on that thread's event loop: its entry
points (a report to record, a cache's change, a resync) hand their work there, and its
``records`` and ``containment`` clients are made for it. So the records' and the
containment's sequential API calls do not each wait for a turn of the intake's loop behind
a storm of reports; the intake's loop waits for their answers only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sdc_common.protocol import CheckpointReport, ResumeReport, VerdictReport

from . import confirmation, incidents, jobs
from .actions import UNKNOWN, Actions, Outcome
from .caches import Caches
from .effects import Effects
from .errors import ApiError
from .incidents import (
    HELD_PHASES,
    MAX_RECORDED_REPORTS,
    OPEN_PHASES,
    Action,
    JobRef,
    ResolvedSuspect,
    Rules,
)
from .kube import Kube, is_conflict, is_not_found
from .lane import LoopThread
from .metrics import Metrics
from .policy import POLICY_CAUTION, Admission, namespace_admission
from .remediate import HyperPodNodes
from .settings import OperatorSettings
from .times import now_iso, parse_time

__all__ = ["IncidentEngine"]

log = logging.getLogger(__name__)
_CONFLICT_RETRIES = 20
_MAX_STEPS = 64
Key = tuple[str, str]


@dataclass
class _Fold:
    report: VerdictReport
    reporter_pod: str
    reporter_node: str
    suspects: list[ResolvedSuspect]
    future: asyncio.Future[str]


def _key_of(incident: dict[str, Any]) -> Key:
    meta = incident.get("metadata") or {}
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


def _contained(status: dict[str, Any], summary: tuple[str, str, str, str]) -> bool:
    """Set the containment ``summary`` (phase, ``Contained`` status, reason, message) in a
    ``Detected`` incident's ``status``; whether it was one."""
    if status.get("phase") != "Detected":
        return False
    phase, value, reason, message = summary
    status["phase"] = phase
    incidents.set_condition(status, "Contained", value, reason, message, now_iso())
    return True


def _with_step_seconds(status: dict[str, Any], step_seconds: float | None) -> dict[str, Any]:
    """``status`` with the job's step time, where a stop read one and none is recorded."""
    if step_seconds and "stepSeconds" not in status:
        status["stepSeconds"] = round(step_seconds, 6)
    return status


class IncidentEngine:
    def __init__(
        self,
        settings: OperatorSettings,
        metrics: Metrics,
        caches: Caches,
        *,
        records: Kube,
        containment: Kube,
        hyperpod: HyperPodNodes | None = None,
        lane: LoopThread | None = None,
    ) -> None:
        self.settings = settings
        self._lane = lane
        """The thread whose loop the engine runs on; ``None``: the caller's."""
        self.rules = Rules.of(settings)
        self.metrics = metrics
        self.caches = caches
        self.records = records
        self.containment = containment
        self.effects = Effects(containment, caches, hyperpod)
        """The leader's writes (containment); :attr:`recorded`: every replica's records."""
        self.recorded = Effects(records, caches)
        # The actions' Events (job suspended, node quarantined, ...) are posted beside the
        # containment, not in its path: each was one more API call, in turn, between the
        # job's stop and the node's quarantine and the incident's Contained
        # (docs/operator.md, "The engine's own thread").
        self.actions = Actions(containment, caches, settings, hyperpod, self._emit_soon)
        self.leader = False
        """Whether this replica acts; set on any thread (:meth:`stop_acting` is the
        election's), read before each step of a reconcile."""
        self.leading: Callable[[], bool] = lambda: True
        """Whether the election still gives this replica the Lease, read on any thread
        right before an action's intent is recorded and right before it is taken (set by
        the handlers to the election's ``is_leader``)."""
        self.step_seconds: Callable[[str], float | None] = lambda uid: None
        """Seconds per training step of a job (by uid) from its heartbeats, where known:
        the lost work's GPU-hours estimate (set by the handlers to the heartbeats')."""
        self._locks: dict[Key, asyncio.Lock] = {}
        self._pending: dict[Key, list[_Fold]] = {}
        self._flushers: dict[Key, asyncio.Task[None]] = {}
        self._reconciles: dict[Key, asyncio.Task[None]] = {}
        self._dirty: set[Key] = set()
        self._seen: dict[Key, set[str]] = {}
        self._extra: dict[Key, int] = {}
        self._agreed_at: dict[Key, float] = {}
        self._waiting: dict[Key, str] = {}
        """What an action that could not be told yet said last, by incident (logged once)."""
        self._background: set[asyncio.Task[Any]] = set()
        self._pass: asyncio.Task[None] | None = None
        self._sweep: asyncio.Task[int] | None = None
        """The sweep of left-over confirmation pods of the counted pass under way."""

    def _lock(self, key: Key) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    def _elsewhere(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Whether ``fn(*args)`` was handed to the lane's loop (the caller runs elsewhere)."""
        if self._lane is None or self._lane.here():
            return False
        self._lane.call(fn, *args)
        return True

    def _current(self, key: Key) -> dict[str, Any] | None:
        return self.caches.incidents.get(*key)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _emit_soon(
        self, obj: dict[str, Any], reason: str, message: str, warning: bool
    ) -> None:
        """:meth:`.effects.Effects.emit` in the background: an Event is a courtesy, posted
        once whenever it is posted (its name says which), so nothing waits for it. It goes
        on the records' pool: on the containment's, it would hold the connection the
        containment's next call was about to reuse."""
        self._spawn(self.recorded.emit(obj, reason, message, warning))

    # -- policy ----------------------------------------------------------------------------

    def admission(self, namespace: str) -> Admission:
        labels = self.caches.namespace_labels(namespace) or {}
        return namespace_admission(self.caches.policies.values(), namespace, labels)

    def rules_for(self, namespace: str) -> Rules:
        """The operator's rules as the namespace's ``SDCPolicy`` narrows them: never bolder
        than ``HYPERPOD_SDC_REMEDIATION_POLICY``; dry-run where any policy says so, and for a
        namespace no policy admits any more (its open incidents act on nothing)."""
        found = self.admission(namespace)
        caution = min(
            POLICY_CAUTION.index(self.rules.remediation_policy),
            POLICY_CAUTION.index(found.remediation_policy) if found.admitted else 0,
        )
        return dataclasses.replace(
            self.rules,
            remediation_policy=POLICY_CAUTION[caution],
            dry_run=self.rules.dry_run or found.dry_run or not found.admitted,
            cluster_approvals=found.cluster_approvals,
            approved=found.approved,
        )

    # -- writes ----------------------------------------------------------------------------

    async def _write(
        self, key: Key, change: Callable[[dict[str, Any]], dict[str, Any] | None], kube: Kube
    ) -> dict[str, Any] | None:
        """Apply ``change`` to the incident's status and write it under its
        ``resourceVersion``, reading it again after a conflict. The incident as written (or
        as it is, when ``change`` returns ``None``); ``None`` if it no longer exists."""
        for _ in range(_CONFLICT_RETRIES):
            incident = self._current(key)
            if incident is None:
                try:
                    incident = await kube.get_incident(*key)
                except ApiError as exc:
                    if is_not_found(exc):
                        return None
                    raise
                self.caches.incidents.upsert(incident)
            status = change(incidents._copy_status(incident.get("status") or {}))
            if status is None:
                return incident
            body = {**incident, "status": status}
            try:
                written = await kube.replace_incident_status(body)
            except ApiError as exc:
                if is_not_found(exc):
                    self.caches.incidents.forget(incident)
                    return None
                if not is_conflict(exc):
                    raise
                fresh = await kube.get_incident(*key)
                self.caches.incidents.upsert(fresh)
                continue
            self.caches.incidents.upsert(written)
            return written
        raise RuntimeError(f"incident {key[0]}/{key[1]}: too many write conflicts")

    # -- records: verdicts -------------------------------------------------------------------

    def generation(self, job: JobRef, report: VerdictReport, reporter_created: str | None) -> int:
        """Which run of the job a verdict without a ``run_id`` belongs to: past every
        incident of this window that stopped the job before the reporting pod was
        created (that pod belongs to a later run).

        Both times are in whole seconds. A pod created in the second of the stop belongs
        to the run that was stopped: a pod of the stopped run was made before its stop,
        and the resume waits for the stop's second to pass (``Actions._resume_job``), so
        the next run's pods are made in a later second."""
        if report.run_id or report.classification == "nondeterministic" or not reporter_created:
            return 0
        try:
            created = parse_time(reporter_created)
        except ValueError:
            return 0
        generation = 0
        while generation < 1000:
            found = self.caches.incidents.get(
                job.namespace, incidents.incident_name(job, report, generation)
            )
            stopped = incidents.job_stopped_at(found) if found else None
            if stopped is None or created <= parse_time(stopped):
                return generation
            generation += 1
        return generation

    async def record_verdict(
        self,
        job: JobRef,
        report: VerdictReport,
        *,
        reporter_pod: str,
        reporter_node: str,
        suspects: list[ResolvedSuspect],
        reporter_created: str | None = None,
    ) -> tuple[str, str]:
        """Fold ``report`` into its incident; returns (name, phase)."""
        if self._lane is not None and not self._lane.here():
            return await self._lane.run(
                self.record_verdict(
                    job,
                    report,
                    reporter_pod=reporter_pod,
                    reporter_node=reporter_node,
                    suspects=suspects,
                    reporter_created=reporter_created,
                )
            )
        name = incidents.incident_name(job, report, self.generation(job, report, reporter_created))
        key = (job.namespace, name)
        current = self._current(key)
        if current is not None:
            answer = self._from_memory(key, current, report, reporter_node)
            if answer is not None:
                self.metrics.report_answers.labels("memory").inc()
                return name, answer
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._pending.setdefault(key, []).append(
            _Fold(report, reporter_pod, reporter_node, suspects, future)
        )
        if key not in self._flushers:
            self._flushers[key] = asyncio.get_running_loop().create_task(self._flush(key, job))
        self.metrics.report_answers.labels("written").inc()
        return name, await asyncio.shield(future)

    def _from_memory(
        self, key: Key, incident: dict[str, Any], report: VerdictReport, node: str
    ) -> str | None:
        """The phase to answer without writing, where the report cannot change anything."""
        status = incident.get("status") or {}
        phase = str(status.get("phase") or "WaitingForAgreement")
        recorded = {e.get("node") for e in status.get("reports") or []}
        seen = self._seen.setdefault(key, set())
        if report.classification == "nondeterministic":
            steps = set(status.get("occurrenceSteps") or []) | {status.get("firstStep")}
            if report.step not in steps:
                return None
        if node in recorded or node in seen:
            return phase
        if status.get("phase") not in OPEN_PHASES or len(recorded) >= MAX_RECORDED_REPORTS:
            seen.add(node)
            self._extra[key] = self._extra.get(key, 0) + 1
            return phase
        return None

    async def _flush(self, key: Key, job: JobRef) -> None:
        try:
            while batch := self._pending.pop(key, None):
                try:
                    phase = await self._write_folds(key, job, batch)
                except Exception as exc:
                    for fold in batch:
                        if not fold.future.done():
                            fold.future.set_exception(exc)
                            fold.future.exception()  # the client may have gone: seen
                    continue
                for fold in batch:
                    if not fold.future.done():
                        fold.future.set_result(phase)
        finally:
            self._flushers.pop(key, None)

    async def _create(self, key: Key, job: JobRef, report: VerdictReport) -> dict[str, Any]:
        body = incidents.new_incident(job, key[1], report)
        try:
            created = await self.records.create_incident(body)
        except ApiError as exc:
            if not is_conflict(exc):
                raise
            created = await self.records.get_incident(*key)  # created meanwhile
        else:
            self.metrics.incidents.labels(report.check, report.classification).inc()
            self._spawn(self.recorded.emit(created, "Detected", report.message, True))
        self.caches.incidents.upsert(created)
        return created

    async def _write_folds(self, key: Key, job: JobRef, batch: list[_Fold]) -> str:
        async with self._lock(key):
            incident = self._current(key)
            if incident is None:
                incident = await self._create(key, job, batch[0].report)
                # the reports that came while it was created go into the same write: with
                # every node reporting, agreement waited for one more write (0.4 s, loaded)
                batch.extend(self._pending.pop(key, []))
            was = (incident.get("status") or {}).get("phase")
            check = str((incident.get("spec") or {}).get("check") or batch[0].report.check)
            needed = self.settings.agreement_nodes
            extra = self._extra.get(key, 0)

            def fold(status: dict[str, Any]) -> dict[str, Any] | None:
                changed = False
                for f in batch:
                    status, did = incidents.fold_report(
                        status,
                        f.report,
                        reporter_pod=f.reporter_pod,
                        reporter_node=f.reporter_node,
                        suspects=f.suspects,
                        needed=needed,
                        received_at=now_iso(),
                        check=check,
                        in_place=True,  # _write hands ``fold`` a copy of its own
                    )
                    changed = changed or did
                if extra:
                    status["reportingNodes"] = int(status.get("reportingNodes") or 0) + extra
                return status if changed or extra else None

            written = await self._write(key, fold, self.records)
            if written is None:
                raise RuntimeError(f"incident {key[0]}/{key[1]} was deleted meanwhile")
            self._extra[key] = self._extra.get(key, 0) - extra
            self._seen.setdefault(key, set()).update(f.reporter_node for f in batch)
            written = await self._escalate_repeats(key, written)
            phase = str((written.get("status") or {}).get("phase") or "")
        self._after_transition(key, written, was)
        return phase

    async def _escalate_repeats(self, key: Key, incident: dict[str, Any]) -> dict[str, Any]:
        """A held incident whose node the job's other incidents caught often enough within
        the window is contained as a persistent fault after all."""
        if (incident.get("status") or {}).get("phase") not in HELD_PHASES:
            return incident
        if not incidents.repeats_are_evidence(incident):
            return incident
        uid = incident["spec"]["job"]["uid"]
        repeats = incidents.repeat_candidates(
            incident, self.caches.incidents_of(uid), self.settings.repeat_window_steps
        )
        if len(repeats) + 1 < self.settings.repeat_count:
            return incident
        message = (
            f"the same node was caught {len(repeats) + 1} times within "
            f"{self.settings.repeat_window_steps} steps (also in {', '.join(repeats)}): "
            "contained as a persistent fault"
        )

        def escalate(status: dict[str, Any]) -> dict[str, Any] | None:
            if status.get("phase") not in HELD_PHASES:
                return None
            return incidents.escalate(status, "Repeated", message, repeats, now_iso())

        written = await self._write(key, escalate, self.records)
        self.metrics.escalations.labels("Repeated").inc()
        return written or incident

    def _after_transition(self, key: Key, incident: dict[str, Any], was: str | None) -> None:
        status = incident.get("status") or {}
        phase = status.get("phase")
        if phase == was:
            return
        if phase == "Detected":
            self._agreed_at.setdefault(key, time.monotonic())
            log.warning("incident %s/%s: %s", *key, incident["spec"].get("message", ""))
        elif phase in HELD_PHASES:
            self.metrics.held.labels(str(phase)).inc()
            hold = incidents.evidence_hold(incident, self.settings.agreement_nodes)
            message = hold[1] if hold else str(phase)
            reason = "SDCTransientFault" if phase == "Transient" else "SDCAwaitingEvidence"
            self._spawn(self.recorded.emit(incident, reason, message, True))
        if self.leader and incidents.pending_actions(incident, self.rules_for(key[0])):
            self.schedule(*key)

    async def flush_counts(self) -> None:
        """Write the counts of reports answered from memory (``status.reportingNodes``)."""
        if self._lane is not None and not self._lane.here():
            return await self._lane.run(self.flush_counts())
        for key, extra in list(self._extra.items()):
            if extra <= 0:
                self._extra.pop(key, None)
                continue
            if self._lock(key).locked() or self._current(key) is None:
                continue
            async with self._lock(key):

                def count(status: dict[str, Any], extra: int = extra) -> dict[str, Any]:
                    status["reportingNodes"] = int(status.get("reportingNodes") or 0) + extra
                    return status

                if await self._write(key, count, self.records) is not None:
                    self._extra[key] = self._extra.get(key, 0) - extra

    # -- records: checkpoints and resumes ---------------------------------------------------

    async def record_checkpoint(self, job: JobRef, report: CheckpointReport) -> bool:
        """Remember a verified checkpoint on the job (a resume needs one old enough);
        returns whether it was recorded. Patched under the job's ``resourceVersion``, so
        two replicas recording at once do not lose one."""
        if self._lane is not None and not self._lane.here():
            return await self._lane.run(self.record_checkpoint(job, report))
        if not report.verified:
            return False
        plural = jobs.JOB_KINDS[(job.api_version, job.kind)]
        current = self.caches.job(job.api_version, job.kind, job.namespace, job.name)
        for _ in range(_CONFLICT_RETRIES):
            if current is None:
                current = await self.records.get_object(
                    job.api_version, plural, job.namespace, job.name
                )
            patch = jobs.checkpoint_patch(current, report.step, report.location)
            if patch is None:
                self.snapshot_waiting(job.uid)
                return True
            patch["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            try:
                await self.recorded.patch_job(
                    job.api_version, job.kind, job.namespace, job.name, patch
                )
            except ApiError as exc:
                if not is_conflict(exc):
                    raise
                current = None
                continue
            self.snapshot_waiting(job.uid)
            return True
        raise RuntimeError(f"job {job.namespace}/{job.name}: too many write conflicts")

    async def record_resume(self, job: JobRef, report: ResumeReport) -> list[str]:
        """The job's agents restarted from ``report.step``: mark each incident that was
        waiting for it. Returns the incidents marked."""
        if self._lane is not None and not self._lane.here():
            return await self._lane.run(self.record_resume(job, report))
        marked = []
        losses: list[dict[str, Any]] = []
        for candidate in self.caches.incidents_of(job.uid):
            key = (job.namespace, candidate["metadata"]["name"])
            changed: list[dict[str, Any]] = []

            def resume(
                status: dict[str, Any], key: Key = key, changed: list[dict[str, Any]] = changed
            ) -> dict[str, Any] | None:
                incident = {**(self._current(key) or {}), "status": status}
                update = incidents.resumed_status(incident, report.step, report.location, now_iso())
                changed.clear()
                if update is not None:
                    changed.append(update)
                return update

            async with self._lock(key):
                written = await self._write(key, resume, self.records)
            if written is None or not changed:
                continue
            marked.append(key[1])
            lost = changed[0].get("lostWork")
            if isinstance(lost, dict):
                losses.append(lost)
            condition = next(c for c in changed[0]["conditions"] if c["type"] == "Resumed")
            await self.recorded.emit(
                written,
                condition["reason"],
                condition["message"],
                condition["status"] != "True",
            )
        if losses:
            # Counted once the agents said where they resumed: the work actually lost (the
            # resume's own estimate is corrected by then, as lostWork is). Incidents this
            # restart resumed together lost the same steps, up to the latest detection:
            # once, not once each.
            lost = max(losses, key=lambda entry: entry["steps"])
            self.metrics.lost_steps.observe(lost["steps"])
            if "gpuHours" in lost:
                self.metrics.lost_gpu_hours.inc(lost["gpuHours"])
        return marked

    # -- containment (the leader) --------------------------------------------------------------

    def on_incident(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        """The incident cache changed (a watch event, or one of our writes)."""
        if self._elsewhere(self.on_incident, old, new):
            return
        if new is None:
            if old is not None:
                meta = old.get("metadata") or {}
                key = (meta.get("namespace", ""), meta.get("name", ""))
                for memory in (self._seen, self._extra, self._agreed_at, self._waiting):
                    memory.pop(key, None)
                lock = self._locks.get(key)
                if lock is not None and not lock.locked():
                    del self._locks[key]
            return
        if not self.leader:
            return
        meta = new["metadata"]
        rules = self.rules_for(meta["namespace"])
        if incidents.pending_actions(new, rules):
            self.schedule(meta["namespace"], meta["name"])
        ignored = incidents.ignored_decision(new, rules)
        if ignored is not None:  # once per decision written (the Event's name says it)
            self._spawn(
                self.recorded.emit(new, "SDCDecisionIgnored", ignored, True, occurrence=ignored)
            )

    def on_pod(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        """A pod changed: where it is a confirmation pod, its incident reads its result
        (no polling: the pod watch brings its terminated state)."""
        if self._elsewhere(self.on_pod, old, new):
            return
        pod = new or old or {}
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if not self.leader or labels.get(confirmation.CONFIRMATION_LABEL) != "true":
            return
        name = labels.get(confirmation.INCIDENT_LABEL)
        namespace = str(pod["metadata"].get("namespace", ""))
        if name:
            self.schedule(namespace, str(name))
        for other in self._sharers(namespace, str(pod["metadata"].get("uid") or ""), name):
            self.schedule(namespace, other)

    def _sharers(self, namespace: str, uid: str, but: str | None) -> list[str]:
        """The incidents of ``namespace`` but ``but`` whose running confirmation reads the
        pod of ``uid`` (one confirmation pod per node, shared)."""
        if not uid:
            return []
        return [
            str(i["metadata"]["name"])
            for i in self.caches.incidents.values()
            if i["metadata"].get("namespace") == namespace
            and i["metadata"].get("name") != but
            and confirmation.is_running(i.get("status") or {})
            and (i["status"]["confirmation"].get("podUid") == uid)
        ]

    def become_leader(self) -> None:
        if not self.leading():
            return  # a start posted before the election lost the Lease again, run late
        self.leader = True
        self.resync()

    def become_standby(self) -> None:
        self.stop_acting()
        if self._lane is None or self._lane.here():
            self._stop_reconciles()

    def stop_acting(self) -> None:
        """:meth:`become_standby` from any thread (the election's, the moment it stops
        leading): no step after the current one, and the reconciles on the lane cancelled,
        without waiting for a turn of the intake's loop. Without a lane the reconciles run
        on that loop, and the ``on_stop`` that follows there cancels them."""
        self.leader = False
        if self._lane is not None and self._lane.alive and not self._lane.here():
            self._lane.call(self._stop_reconciles)

    def _acting(self) -> bool:
        return self.leader and self.leading()

    def _stop_reconciles(self) -> None:
        for task in list(self._reconciles.values()):
            task.cancel()

    def schedule(self, namespace: str, name: str) -> None:
        """Reconcile in the background (from a record, a watch event or the resync)."""
        if not self.leader or self._elsewhere(self.schedule, namespace, name):
            return
        key = (namespace, name)
        running = self._reconciles.get(key)
        if running is not None and not running.done():
            self._dirty.add(key)
            return
        self._reconciles[key] = asyncio.get_running_loop().create_task(self._reconcile_loop(key))

    def _later(self, key: Key, delay: float) -> None:
        asyncio.get_running_loop().call_later(delay, self.schedule, *key)

    async def _reconcile_loop(self, key: Key) -> None:
        try:
            while True:
                self._dirty.discard(key)
                try:
                    await self.reconcile(*key)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception(
                        "incident %s/%s: containment failed; retried at the next resync", *key
                    )
                if key not in self._dirty or not self.leader:
                    return
        finally:
            if self._reconciles.get(key) is asyncio.current_task():
                self._reconciles.pop(key, None)

    async def reconcile(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        async with self._lock(key):
            for _ in range(_MAX_STEPS):
                if not self.leader:
                    return
                incident = self._current(key)
                if incident is None:
                    return
                rules = self.rules_for(namespace)
                action = incidents.next_action(incident, rules)
                if action is not None and action.action == "suspend-job":
                    gated = await self._snapshot_gate(key, incident, rules)
                    if gated is None:
                        return  # waiting for the snapshot: scheduled again
                    if gated is not incident:
                        continue  # written: decide again on what was written
                if action is not None:
                    together = incidents.actions_together(incident, rules, action)
                    if len(together) > 1:
                        incident = await self._act_together(key, incident, together, rules)
                    else:
                        incident = await self._act(key, incident, action, rules)
                    if incident is None:
                        return
                    continue
                if await self._confirmation_result(key, incident, rules):
                    continue
                summary = incidents.containment_summary(incident, rules)
                if summary is None:
                    return
                await self._contain(key, summary)

    async def _act(
        self, key: Key, incident: dict[str, Any], action: Action, rules: Rules
    ) -> dict[str, Any] | None:
        """Take (or verify) one action and record it; the incident after, or ``None`` to
        stop for now."""
        entry = incidents.pending_entry(incident.get("status") or {}, action)
        outcome: Outcome | None
        if not self._acting():
            return None  # checked again right before an intent is recorded and taken
        if rules.dry_run:
            outcome = await self.actions.take(incident, action, rules)
        elif entry is not None:
            outcome = await self.actions.verify(incident, action, entry, rules)
            if outcome is None:
                self._later(key, min(5.0, self.settings.resync_seconds))
                return None
        else:
            recorded, now = await self._record_intents(key, incident, [action])
            if not now or recorded is None:
                return recorded
            if not self._acting():
                return None  # recorded: the next leader verifies it
            outcome = await self.actions.take(recorded, action, rules)
        if outcome.result == UNKNOWN:
            # asked again every few seconds (a confirmation waiting for another namespace's
            # pod, a SageMaker call not yet visible): said once, not at every try
            said = log.warning if self._waiting.get(key) != outcome.message else log.debug
            said("incident %s/%s: %s; verifying before anything else", *key, outcome.message)
            self._waiting[key] = outcome.message
            self._later(key, min(5.0, self.settings.resync_seconds))
            return None
        self._waiting.pop(key, None)
        step_seconds = self._step_seconds_at_stop(incident, [(action, outcome)])

        def apply(status: dict[str, Any]) -> dict[str, Any]:
            return _with_step_seconds(outcome.apply(status, action), step_seconds)

        written = await self._write(key, apply, self.containment)
        self.metrics.actions.labels(action.action, outcome.result).inc()
        found = outcome.fields.get("confirmation") or {}
        if written is not None and found.get("outcome") in confirmation.OUTCOMES:
            self.metrics.confirmations.labels(found["outcome"]).inc()
            assert outcome.condition is not None
            await self._confirmation_said(written, found["outcome"], rules, outcome.condition)
        return written

    async def _record_intents(
        self, key: Key, incident: dict[str, Any], actions: list[Action]
    ) -> tuple[dict[str, Any] | None, bool]:
        """Record the intents of ``actions`` in one status write, before any is taken:
        (the incident as written, True); (the incident as read, False) where one of them was
        started or done meanwhile (by another leader, after a conflict, or our cache was
        late: decided again on what is written, never overwritten and taken again); (None,
        False) where this replica no longer acts or nothing could be written."""
        intents = [await self.actions.intent(incident, action) for action in actions]
        already: list[bool] = []

        def record(status: dict[str, Any]) -> dict[str, Any] | None:
            already.clear()
            if any(
                action in incidents.done_actions(status)
                or incidents.pending_entry(status, action) is not None
                for action in actions
            ):
                already.append(True)
                return None
            if not self._acting():
                already.append(False)
                return None
            at = now_iso()
            for action, intent in zip(actions, intents, strict=True):
                status = incidents.record_intent(status, action, intent, at)
            return status

        recorded = await self._write(key, record, self.containment)
        if recorded is None or already == [False]:
            return None, False
        return recorded, not already

    def _step_seconds_at_stop(
        self, incident: dict[str, Any], outcomes: list[tuple[Action, Outcome]]
    ) -> float | None:
        """The job's step time, where ``outcomes`` stopped it (read before its heartbeats
        stop)."""
        if any(a.action == "suspend-job" and o.result == "Succeeded" for a, o in outcomes):
            return self.step_seconds(str(incident["spec"]["job"]["uid"]))
        return None

    async def _act_together(
        self, key: Key, incident: dict[str, Any], together: list[Action], rules: Rules
    ) -> dict[str, Any] | None:
        """Take the containment actions ``together`` (:func:`incidents.actions_together`:
        none started before) as :meth:`_act` takes one: every intent recorded, in one
        write, before any is taken; the actions taken in their order; their results
        recorded in one write, with the incident's containment when that is what they
        complete (where they do not, the next step decides it). 4 calls on the way to
        containment instead of 7 (intent, effect, result per action, then Contained). An
        action that raises, or whose result is not known, stays ``Pending``: verified
        alone before anything else, as after a crash."""
        if not self._acting():
            return None
        recorded, now = await self._record_intents(key, incident, together)
        if not now or recorded is None:
            return recorded  # decided again on what is written, one at a time
        if not self._acting():
            return None  # recorded: the next leader verifies them
        # In their order, on the pool's one connection kept open: at once, the second
        # would open another connection to the API server, a TLS handshake on the way
        # (measured slower than the call it saved, loaded). One that raises stops none
        # of the others (they are independent); it stays Pending.
        taken: list[Outcome | BaseException] = []
        for action in together:
            try:
                taken.append(await self.actions.take(recorded, action, rules))
            except Exception as exc:
                taken.append(exc)
        known = [
            (action, outcome)
            for action, outcome in zip(together, taken, strict=True)
            if isinstance(outcome, Outcome) and outcome.result != UNKNOWN
        ]
        step_seconds = self._step_seconds_at_stop(incident, known)
        summaries: list[tuple[str, str, str, str]] = []

        def apply(status: dict[str, Any]) -> dict[str, Any] | None:
            summaries.clear()
            if not known:
                return None
            for action, outcome in known:
                status = outcome.apply(status, action)
            status = _with_step_seconds(status, step_seconds)
            summary = incidents.containment_summary({**recorded, "status": status}, rules)
            if summary is not None and _contained(status, summary):
                summaries.append(summary)
            return status

        written = await self._write(key, apply, self.containment)
        for action, outcome in known:
            self.metrics.actions.labels(action.action, outcome.result).inc()
        failed = [o for o in taken if isinstance(o, BaseException)]
        if failed:
            raise failed[0]
        if len(known) < len(together):
            self._later(key, min(5.0, self.settings.resync_seconds))
            return None
        if written is not None and summaries:
            await self._after_contained(key, written, summaries[0])
        return written

    # -- the verified snapshot ---------------------------------------------------------------

    def _checkpoints_of(self, incident: dict[str, Any]) -> list[dict[str, Any]]:
        """The verified checkpoints the job cache has for the incident's job."""
        ref = (incident.get("spec") or {}).get("job") or {}
        namespace = str((incident.get("metadata") or {}).get("namespace", ""))
        job = self.caches.job(
            str(ref.get("apiVersion")), str(ref.get("kind")), namespace, str(ref.get("name"))
        )
        if job is None or job["metadata"].get("uid") != ref.get("uid"):
            return []
        return jobs.verified_checkpoints(job)

    async def _snapshot_gate(
        self, key: Key, incident: dict[str, Any], rules: Rules
    ) -> dict[str, Any] | None:
        """Before the job is stopped: where its agents announced a verified snapshot, wait
        for its checkpoint report up to the deadline recorded in the status
        (:func:`incidents.snapshot_gate`). The incident to go on with (the same object when
        nothing was written), or ``None`` while waiting (scheduled again: every second,
        the job cache is read, and at once when a checkpoint report is recorded)."""
        now = datetime.now(timezone.utc)
        checkpoints = self._checkpoints_of(incident)
        change, wait = incidents.snapshot_gate(incident, rules, checkpoints, now)
        if change is None:
            if wait <= 0:
                return incident
            self._later(key, min(wait, 1.0))
            return None
        uid = str(incident["spec"]["job"]["uid"])
        step_seconds = self.step_seconds(uid)

        def gate(status: dict[str, Any]) -> dict[str, Any] | None:
            view = {**incident, "status": status}
            written, _ = incidents.snapshot_gate(view, rules, checkpoints, now)
            if written is not None and step_seconds and "stepSeconds" not in written:
                written["stepSeconds"] = round(step_seconds, 6)
            return written

        before = (incident.get("status") or {}).get("snapshot") or {}
        try:
            written = await self._write(key, gate, self.containment)
        except ApiError as exc:
            # The stop must never depend on the wait: an SDCIncident CRD older than this
            # release refuses the Snapshot condition (422). Stop now, say why.
            log.warning(
                "incident %s/%s: could not record the wait for the snapshot (%s); stopping "
                "the job without waiting (install this release's SDCIncident CRD)",
                *key,
                exc,
            )
            return incident
        if written is None:
            return None
        after = (written.get("status") or {}).get("snapshot") or {}
        if not after:
            # Pruned by an older CRD: a wait that cannot be recorded is not taken.
            log.warning(
                "incident %s/%s: the API server dropped status.snapshot (an SDCIncident CRD "
                "older than this release); stopping the job without waiting",
                *key,
            )
            return incident
        result = after.get("result")
        if result and not before.get("result"):
            outcome = "reported" if result == incidents.SNAPSHOT_REPORTED else "timed_out"
            self.metrics.snapshot_waits.labels(outcome).inc()
            condition = next(
                c
                for c in written["status"].get("conditions") or []
                if c.get("type") == incidents.SNAPSHOT_CONDITION
            )
            log.warning("incident %s/%s: %s", *key, condition["message"])
            self._spawn(
                self.effects.emit(
                    written,
                    "SDCSnapshotReported" if outcome == "reported" else "SDCSnapshotLate",
                    condition["message"],
                    outcome != "reported",
                )
            )
        elif after and not before:
            log.warning(
                "incident %s/%s: the stop waits until %s for the verified snapshot of step %s",
                *key,
                after.get("deadline"),
                after.get("step"),
            )
        return written

    def snapshot_waiting(self, job_uid: str) -> None:
        """A checkpoint of the job was recorded: its incidents waiting for a snapshot look
        at once."""
        for incident in self.caches.incidents_of(job_uid):
            found = (incident.get("status") or {}).get("snapshot") or {}
            if found and not found.get("result"):
                self.schedule(*_key_of(incident))

    # -- confirmation ------------------------------------------------------------------------

    def _judge_confirmation(
        self, key: Key, incident: dict[str, Any], rules: Rules
    ) -> tuple[tuple[str, str, str, dict[str, Any]], dict[str, Any] | None] | None:
        """What to record about the confirmation now, with its pod as the cache has it,
        or ``None``: nothing (none runs, or it still runs)."""
        status = incident.get("status") or {}
        if incidents.needs_bundle_note(incident, rules):
            node = str(confirmation.confirmation_node(incident))
            message = (
                f"nothing to recompute on node {node}: the verdict named no evidence bundle "
                "(the agent writes one next to the checkpoints it is told of; docs/agent.md)"
            )
            return ("unknown", "NoBundle", message, {"node": node}), None
        if not confirmation.is_running(status) or rules.dry_run:
            return None
        running = status["confirmation"]
        pod = self.caches.pods.get(key[0], str(running.get("pod") or ""))
        judged = confirmation.judge(
            running,
            pod,
            datetime.now(timezone.utc),
            start_seconds=self.settings.confirmation_start_seconds,
            deadline_seconds=self.settings.confirmation_deadline_seconds,
            suspects=[
                s for s in status.get("suspects") or [] if s.get("node") == running.get("node")
            ],
        )
        return (judged, pod) if judged is not None else None

    async def _confirmation_result(self, key: Key, incident: dict[str, Any], rules: Rules) -> bool:
        """Record what the confirmation pod came to (or, for a quarantined node whose
        verdict named no bundle, that there is nothing to confirm). Whether it wrote."""
        found = self._judge_confirmation(key, incident, rules)
        if found is None:
            return False
        (outcome, reason, message, record), pod = found
        entry, condition = confirmation.record(outcome, reason, message, record, now_iso())
        wanted = (incident.get("status") or {}).get("confirmation")

        def change(status: dict[str, Any]) -> dict[str, Any] | None:
            if status.get("confirmation") != wanted:
                return None  # recorded meanwhile (the previous leader, or a retry)
            status["confirmation"] = entry
            incidents.set_condition(status, *condition, now_iso())
            return status

        written = await self._write(key, change, self.containment)
        if written is None:
            return False
        if (written.get("status") or {}).get("confirmation") != entry:
            return True  # someone else recorded it: read again
        self.metrics.confirmations.labels(outcome).inc()
        if pod is not None and (pod.get("status") or {}).get("phase") not in (
            "Succeeded",
            "Failed",
        ):
            # Given up before it ended: it must not start later and hold the node's GPUs.
            # A pod another incident still reads (shared) is deleted by the last to judge it.
            uid = str(wanted.get("podUid") or "") if wanted else ""
            if not self._sharers(key[0], uid or str(pod["metadata"].get("uid") or ""), key[1]):
                await self._delete_pod(pod, uid)
        await self._confirmation_said(written, outcome, rules, condition)
        return True

    async def _confirmation_said(
        self,
        incident: dict[str, Any],
        outcome: str,
        rules: Rules,
        condition: tuple[str, str, str, str],
    ) -> None:
        """The Event (and the log line) for a confirmation's end."""
        message = condition[3]
        if outcome != "confirmed" and rules.remediation_policy == "auto-replace-confirmed":
            meta = incident["metadata"]
            message += (
                "; policy auto-replace-confirmed replaces only a confirmed node, so a person "
                f"decides: kubectl sdc approve|release {meta['name']} -n {meta['namespace']}"
            )
        reason = {
            "confirmed": "SDCConfirmed",
            "not-confirmed": "SDCNotConfirmed",
            "unknown": "SDCConfirmationUnknown",
        }[outcome]
        await self.effects.emit(incident, reason, message, outcome != "not-confirmed")
        log.warning("incident %s/%s: confirmation %s: %s", *_key_of(incident), outcome, message)

    async def _delete_pod(self, pod: dict[str, Any], uid: str) -> bool:
        """Delete the confirmation pod by its uid (the one recorded when it was created,
        else the cache's): a pod made since under its name (by a tenant, or a later
        confirmation) is not deleted (409). Whether this call deleted it."""
        meta = pod["metadata"]
        namespace, name = str(meta.get("namespace", "")), str(meta["name"])
        uid = uid or str(meta.get("uid") or "")
        try:
            found = await self.effects.delete_pod(namespace, name, uid)
        except Exception as exc:  # the next resync's sweep tries again
            log.warning("could not delete confirmation pod %s/%s: %s", namespace, name, exc)
            return False
        if found == "replaced":
            log.info("confirmation pod %s/%s was replaced since; left alone", namespace, name)
        return found == "deleted"

    def _left_over(self) -> list[dict[str, Any]]:
        """The confirmation pods left over (:func:`.confirmation.orphaned`)."""
        return [
            pod
            for pod in self.caches.confirmation_pods()
            if confirmation.orphaned(pod, self._readers(str(pod["metadata"].get("namespace"))))
        ]

    async def sweep_confirmation_pods(self, pods: list[dict[str, Any]]) -> int:
        """Delete the confirmation pods left over (:meth:`_left_over`: every incident that
        reads one has recorded its result, and it has not ended), as a leader does at its
        start and at every counted resync pass; how many were deleted. Each under the locks
        of the incidents that read it, looked at again there (a reconcile that just recorded
        the result deletes it itself), and by its uid: one delete per pod."""
        deleted = 0
        for pod in pods:
            namespace = str(pod["metadata"].get("namespace") or "")
            name, uid = str(pod["metadata"]["name"]), str(pod["metadata"]["uid"])
            readers = sorted(
                _key_of(i)
                for i in self._readers(namespace)
                if ((i.get("status") or {}).get("confirmation") or {}).get("podUid") == uid
            )
            async with contextlib.AsyncExitStack() as held:
                for key in readers:
                    await held.enter_async_context(self._lock(key))
                now = self.caches.pods.get(namespace, name)
                if not self.leader or now is None or now["metadata"].get("uid") != uid:
                    continue
                why = confirmation.orphaned(now, self._readers(namespace))
                if why is None:
                    continue
                log.warning("confirmation pod %s/%s: %s; deleting it", namespace, name, why)
                if await self._delete_pod(now, uid):
                    deleted += 1
        return deleted

    def _readers(self, namespace: str) -> list[dict[str, Any]]:
        """The incidents of ``namespace`` that record a confirmation pod."""
        return [
            i
            for i in self.caches.incidents.values()
            if i["metadata"].get("namespace") == namespace
            and ((i.get("status") or {}).get("confirmation") or {}).get("podUid")
        ]

    async def _contain(self, key: Key, summary: tuple[str, str, str, str]) -> None:
        def contained(status: dict[str, Any]) -> dict[str, Any] | None:
            return status if _contained(status, summary) else None

        written = await self._write(key, contained, self.containment)
        if written is None:
            self.actions.forget(f"{key[0]}/{key[1]}")
            return
        await self._after_contained(key, written, summary)

    async def _after_contained(
        self, key: Key, written: dict[str, Any], summary: tuple[str, str, str, str]
    ) -> None:
        """The incident's containment was written (``summary``, as :func:`_contained` set
        it): its reservations end, it is counted, logged and said in an Event."""
        phase, _, _, message = summary
        self.actions.forget(f"{key[0]}/{key[1]}")
        agreed = self._agreed_at.pop(key, None)
        if agreed is not None and phase == "Contained":
            self.metrics.report_to_contained.observe(time.monotonic() - agreed)
        self.refresh_quarantined()
        log.warning("incident %s/%s: %s", *key, message)
        await self._emit_soon(written, phase, message, False)

    def refresh_quarantined(self) -> None:
        self.metrics.quarantined_nodes.set(len(self.actions.quarantined()))

    def resync(self) -> None:
        """Drive every unfinished incident (after a restart, a change of leader or a
        failed action). Where no counted pass is in progress, this resync starts one,
        with a sweep of the confirmation pods left over (:meth:`sweep_confirmation_pods`):
        ``hyperpod_sdc_resyncs_total`` goes up once every reconcile it drove and the sweep
        have ended (counted passes never overlap, so two increments after a moment mean a
        whole pass began and ended after it)."""
        if not self.leader or self._elsewhere(self.resync):
            return
        driven: list[asyncio.Task[Any]] = []
        for incident in self.caches.incidents.values():
            meta = incident["metadata"]
            if incidents.pending_actions(incident, self.rules_for(meta["namespace"])):
                self.schedule(meta["namespace"], meta["name"])
                task = self._reconciles.get((meta["namespace"], meta["name"]))
                if task is not None:
                    driven.append(task)
        self.refresh_quarantined()
        if self._pass is None or self._pass.done():
            loop = asyncio.get_running_loop()
            left = self._left_over()
            if left:
                self._sweep = loop.create_task(self.sweep_confirmation_pods(left))
                driven.append(self._sweep)
            self._pass = loop.create_task(self._count_pass(driven))

    async def _count_pass(self, driven: list[asyncio.Task[Any]]) -> None:
        if driven:
            await asyncio.wait(driven)
        if self.leader:
            self.metrics.resyncs.inc()

    async def close(self) -> None:
        """Cancel what runs here and on the lane."""
        if self._lane is not None and self._lane.alive and not self._lane.here():
            await self._lane.run(self._cancel_tasks())
        await self._cancel_tasks()

    async def _cancel_tasks(self) -> None:
        """Cancel this loop's tasks, and wait for them."""
        here = asyncio.get_running_loop()
        tasks = [
            task
            for task in (
                *list(self._reconciles.values()),
                *list(self._flushers.values()),
                *list(self._background),
                self._pass,
                self._sweep,
            )
            if task is not None and task.get_loop() is here
        ]
        events = sum(1 for t in self._background if t.get_loop() is here and not t.done())
        if events:
            log.info("stopping: %d Event(s) not posted (each is posted once or not at all)", events)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
