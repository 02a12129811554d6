"""What the agents' heartbeats say, kept in memory: a heartbeat costs no API call.

Per job, the newest heartbeat of each reporting node: when it came, the step and last
clean step, the time spent in each check against the interval, the fingerprint kernel,
the gradient tolerance and whether the audit found the job bit-reproducible. Every
``refresh`` (a few seconds) turns that into labelled gauges (``namespace``, ``job``), and
the leader turns a job that went quiet into an Event.

Two replicas each see part of the heartbeats (the Service sends each connection to
either). Each publishes when it last heard from each job (:meth:`Heartbeats.last_seen`,
written to its member Lease every few seconds by :mod:`.leader`), and the leader decides
silence on the newest time any replica heard, so a job is never called silent because its
heartbeats went to the other replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sdc_common.protocol import HeartbeatReport, ReplayKind

from .incidents import JobRef
from .metrics import Metrics

__all__ = ["Heartbeats", "JobBeats"]

_FORGET_SECONDS = 24 * 3600.0


@dataclass
class _NodeBeat:
    at: float
    step: int
    lag: int
    cost: dict[str, float]
    kernel: str | None
    tolerance: float | None
    reproducible: bool | None
    interval: float | None
    cap: float | None = None
    kinds: tuple[ReplayKind, ...] = ()


@dataclass
class JobBeats:
    job: JobRef
    nodes: dict[str, _NodeBeat] = field(default_factory=dict)
    last: float = 0.0
    interval: float | None = None
    silent: bool = False
    """An ``SDCAgentsSilent`` Event was posted and nothing was heard since."""
    step_seconds: float | None = None
    """Seconds per training step: the newest heartbeat's interval over the steps since the
    same node's previous heartbeat (``None`` before a node sent two)."""


class Heartbeats:
    def __init__(self, metrics: Metrics, clock: Callable[[], float] = time.time) -> None:
        self.metrics = metrics
        self.clock = clock
        self.jobs: dict[str, JobBeats] = {}
        """By job uid."""
        self._labels: dict[str, set[tuple[str, ...]]] = {}

    def observe(self, job: JobRef, node: str, report: HeartbeatReport) -> None:
        now = self.clock()
        beats = self.jobs.get(job.uid)
        if beats is None:
            beats = self.jobs[job.uid] = JobBeats(job)
        interval = report.interval_seconds
        before = beats.nodes.get(node)
        if before is not None and interval and report.step > before.step:
            beats.step_seconds = interval / (report.step - before.step)
        cost = {}
        if interval:
            cost = {check: seconds / interval for check, seconds in report.check_seconds.items()}
        beats.nodes[node] = _NodeBeat(
            now,
            report.step,
            max(0, report.step - report.last_clean_step),
            cost,
            report.fingerprint_kernel,
            report.gradient_tolerance,
            report.bit_reproducible,
            interval,
            report.replay_cap,
            report.replay_kinds,
        )
        beats.last = now
        if interval:
            beats.interval = interval
        self.metrics.heartbeats.inc()

    def step_seconds(self, uid: str) -> float | None:
        """The job's seconds per training step from its heartbeats, where known."""
        beats = self.jobs.get(uid)
        return beats.step_seconds if beats is not None else None

    def last_seen(self) -> dict[str, float]:
        """When this replica last heard from each job, by ``<namespace>/<uid>``."""
        return {f"{b.job.namespace}/{uid}": b.last for uid, b in self.jobs.items()}

    def silence_after(self, beats: JobBeats, floor: float) -> float:
        """Seconds without a heartbeat after which the job counts as silent: ``floor``, or
        three of its own heartbeat intervals if that is longer."""
        return max(floor, 3 * (beats.interval or 0.0))

    def silent(
        self, floor: float, peers: Mapping[str, float], running: Callable[[JobRef], bool]
    ) -> tuple[list[JobBeats], list[JobBeats]]:
        """(newly silent, newly heard again) jobs, given when the other replicas last heard
        from each job; jobs that are not running (stopped, deleted) never count as silent."""
        now = self.clock()
        went, came = [], []
        for uid, beats in list(self.jobs.items()):
            last = max(beats.last, peers.get(f"{beats.job.namespace}/{uid}", 0.0))
            if not running(beats.job) or now - last > _FORGET_SECONDS:
                self._forget(uid)  # stopped or deleted (or gone quiet for a day)
                continue
            quiet = now - last > self.silence_after(beats, floor)
            if quiet and not beats.silent:
                beats.silent = True
                went.append(beats)
            elif not quiet and beats.silent:
                beats.silent = False
                came.append(beats)
        self.metrics.silent_jobs.set(sum(b.silent for b in self.jobs.values()))
        return went, came

    def prune(self, running: Callable[[JobRef], bool]) -> None:
        """Forget the jobs that are not running (stopped, deleted) or were not heard for a
        day, and their gauges (every replica; :meth:`silent` does it on the leader too)."""
        now = self.clock()
        for uid, beats in list(self.jobs.items()):
            if not running(beats.job) or now - beats.last > _FORGET_SECONDS:
                self._forget(uid)

    def _forget(self, uid: str) -> None:
        beats = self.jobs.pop(uid, None)
        if beats is None:
            return
        prefix = (beats.job.namespace, beats.job.name)
        for gauge_name, seen in self._labels.items():
            gauge = getattr(self.metrics, gauge_name)
            for labels in [s for s in seen if s[:2] == prefix]:
                gauge.remove(*labels)
                seen.discard(labels)

    def _set(self, gauge_name: str, labels: tuple[str, ...], value: float) -> None:
        getattr(self.metrics, gauge_name).labels(*labels).set(value)
        self._labels.setdefault(gauge_name, set()).add(labels)

    def refresh(self, window: float) -> None:
        """The gauges, from the newest heartbeat of each node heard within ``window``."""
        now = self.clock()
        for beats in self.jobs.values():
            recent = [b for b in beats.nodes.values() if now - b.at <= window]
            for node in [n for n, b in beats.nodes.items() if now - b.at > window]:
                del beats.nodes[node]
            job = (beats.job.namespace, beats.job.name)
            self._set("heartbeat_age", job, now - beats.last)
            self._set("reporting_nodes", job, len(recent))
            if not recent:
                continue
            self._set("clean_step_lag", job, max(b.lag for b in recent))
            costs: dict[str, float] = {}
            for b in recent:
                for check, ratio in b.cost.items():
                    costs[check] = max(costs.get(check, 0.0), ratio)
            for check, ratio in costs.items():
                self._set("check_cost", (*job, check), ratio)
            kernels: dict[str, int] = {}
            for b in recent:
                if b.kernel:
                    kernels[b.kernel] = kernels.get(b.kernel, 0) + 1
            for kernel in ("compiled", "eager"):
                if kernels or (*job, kernel) in self._labels.get("fingerprint_kernel", set()):
                    self._set("fingerprint_kernel", (*job, kernel), kernels.get(kernel, 0))
            tolerances = [b.tolerance for b in recent if b.tolerance is not None]
            if tolerances:
                self._set("gradient_tolerance", job, max(tolerances))
            verdicts = [b.reproducible for b in recent if b.reproducible is not None]
            if verdicts:
                self._set("bit_reproducible", job, float(all(verdicts)))
            self._replay_kinds(job, recent)

    def _replay_kinds(self, job: tuple[str, str], recent: list[_NodeBeat]) -> None:
        """Per kind of replay evidence: threshold and noise (largest over the nodes), blind
        where any node's is (its threshold gauge removed)."""
        caps = [b.cap for b in recent if b.cap is not None]
        if caps:
            self._set("replay_noise_cap", job, max(caps))
        kinds: dict[str, tuple[float | None, float, bool]] = {}
        for b in recent:
            for k in b.kinds:
                t, n, blind = kinds.get(k.kind, (0.0, 0.0, False))
                blind = blind or k.blind or k.threshold is None
                threshold = None if blind else max(t or 0.0, k.threshold or 0.0)
                kinds[k.kind] = (threshold, max(n, k.noise), blind)
        shown = self._labels.get("replay_threshold", set())
        for name, (threshold, noise, blind) in kinds.items():
            labels = (*job, name)
            if threshold is None:
                if labels in shown:
                    self.metrics.replay_threshold.remove(*labels)
                    shown.discard(labels)
            else:
                self._set("replay_threshold", labels, threshold)
            self._set("replay_noise", labels, noise)
            self._set("replay_blind", labels, float(blind))

    def describe(self, beats: JobBeats, floor: float) -> dict[str, Any]:
        return {
            "job": f"{beats.job.namespace}/{beats.job.name}",
            "silent_after": self.silence_after(beats, floor),
            "nodes": len(beats.nodes),
        }
