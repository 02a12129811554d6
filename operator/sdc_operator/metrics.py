"""Prometheus metrics (prefix ``hyperpod_sdc_``), on the intake's ``/metrics``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sdc_common.protocol import CHECKS, CLASSIFICATIONS

__all__ = ["LEADER_OWNED", "Metrics"]

_JOB = ["namespace", "job"]
LEADER_OWNED = ("quarantined_nodes", "silent_jobs")
"""Gauges only the leader computes: exported by the leader alone, so that a replica that
stepped down does not keep its last count (``max()`` over replicas would alert on it for
ever)."""


class Metrics:
    """One registry per operator (tests run several in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._exported: set[str] = set()
        self.reports = Counter(
            "hyperpod_sdc_reports",
            "Reports accepted, by kind and, for verdicts, classification.",
            ["kind", "verdict"],
            registry=r,
        )
        self.report_versions = Counter(
            "hyperpod_sdc_report_versions",
            "Reports accepted, by protocol version: when the previous version's count stays "
            "at 0, no agent needs it any more.",
            ["version"],
            registry=r,
        )
        self.ignored_fields = Counter(
            "hyperpod_sdc_ignored_fields",
            "Reports accepted with fields this operator does not know (from a newer agent), "
            "by kind; the fields are in the log.",
            ["kind"],
            registry=r,
        )
        self.refusals = Counter(
            "hyperpod_sdc_refusals", "Reports refused, by reason.", ["reason"], registry=r
        )
        self.report_answers = Counter(
            "hyperpod_sdc_verdict_answers",
            "Verdicts answered from memory (nothing new) or after a status write.",
            ["how"],
            registry=r,
        )
        self.incidents = Counter(
            "hyperpod_sdc_incidents",
            "SDCIncidents created, by check and classification.",
            ["check", "classification"],
            registry=r,
        )
        self.held = Counter(
            "hyperpod_sdc_held_incidents",
            "Incidents that accuse hardware but act on nothing yet (Transient, AwaitingEvidence).",
            ["phase"],
            registry=r,
        )
        self.escalations = Counter(
            "hyperpod_sdc_escalations",
            "Held incidents contained after all, by reason (Repeated).",
            ["reason"],
            registry=r,
        )
        self.actions = Counter(
            "hyperpod_sdc_actions",
            "Containment actions, by action and result.",
            ["action", "result"],
            registry=r,
        )
        self.quarantined_nodes = Gauge(
            "hyperpod_sdc_quarantined_nodes",
            "Nodes carrying the hyperpod-sdc.dev/suspect label (the leader's count).",
            registry=None,  # leader-owned: exported by lead()
        )
        self.report_to_contained = Histogram(
            "hyperpod_sdc_report_to_contained_seconds",
            "From the report that completed agreement to the incident contained.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
            registry=r,
        )
        self.api_requests = Counter(
            "hyperpod_sdc_api_requests",
            "Requests to the Kubernetes API server, by client, verb, resource and status code.",
            ["client", "verb", "resource", "code"],
            registry=r,
        )
        self.token_reviews = Counter(
            "hyperpod_sdc_token_reviews",
            "Token lookups by outcome: accepted and rejected are TokenReviews sent; cached, "
            "shared (waited for a review in flight) and limited sent none.",
            ["outcome"],
            registry=r,
        )
        self.resyncs = Counter(
            "hyperpod_sdc_resyncs",
            "Resync passes the leader completed: every unfinished incident driven as far as "
            "it goes for now (a pass starts only once the one before it has ended).",
            registry=r,
        )
        self.in_flight = Gauge(
            "hyperpod_sdc_reports_in_flight", "Reports being processed.", registry=r
        )
        self.leader = Gauge(
            "hyperpod_sdc_leader", "1 on the replica that acts on the cluster, else 0.", registry=r
        )
        self.heartbeats = Counter(
            "hyperpod_sdc_heartbeats", "Heartbeats accepted (no API call each).", registry=r
        )
        self.heartbeat_age = Gauge(
            "hyperpod_sdc_heartbeat_age_seconds",
            "Seconds since this replica last heard a heartbeat from the job.",
            _JOB,
            registry=r,
        )
        self.reporting_nodes = Gauge(
            "hyperpod_sdc_reporting_nodes",
            "Nodes of the job whose heartbeats this replica heard recently.",
            _JOB,
            registry=r,
        )
        self.silent_jobs = Gauge(
            "hyperpod_sdc_silent_jobs",
            "Running jobs whose agents sent heartbeats, then none for the silence period "
            "(the leader's count).",
            registry=None,  # leader-owned: exported by lead()
        )
        self.clean_step_lag = Gauge(
            "hyperpod_sdc_last_clean_step_lag_steps",
            "Steps between the newest step and the last clean step (largest over the nodes).",
            _JOB,
            registry=r,
        )
        self.check_cost = Gauge(
            "hyperpod_sdc_check_cost_ratio",
            "Share of the heartbeat interval spent in each check (largest over the nodes).",
            [*_JOB, "check"],
            registry=r,
        )
        self.fingerprint_kernel = Gauge(
            "hyperpod_sdc_fingerprint_kernel_nodes",
            "Nodes running each fingerprint kernel (eager is the slow fallback).",
            [*_JOB, "kernel"],
            registry=r,
        )
        self.gradient_tolerance = Gauge(
            "hyperpod_sdc_gradient_tolerance",
            "The replay audit's gradient threshold in force (relative; 0: bit-reproducible).",
            _JOB,
            registry=r,
        )
        self.bit_reproducible = Gauge(
            "hyperpod_sdc_bit_reproducible",
            "1 when every reporting node found the job bit-reproducible, 0 when one did not.",
            _JOB,
            registry=r,
        )
        self.replay_threshold = Gauge(
            "hyperpod_sdc_replay_threshold",
            "The replay audit's threshold in force per kind of evidence (loss, "
            "gradients:<layer>, outputs:<module>; relative, 0: compared bit for bit; largest "
            "over the nodes; absent while the kind is blind).",
            [*_JOB, "kind"],
            registry=r,
        )
        self.replay_noise = Gauge(
            "hyperpod_sdc_replay_noise",
            "The replay audit's learned run-to-run noise per kind of evidence (relative, "
            "largest over the nodes): against hyperpod_sdc_replay_noise_cap.",
            [*_JOB, "kind"],
            registry=r,
        )
        self.replay_noise_cap = Gauge(
            "hyperpod_sdc_replay_noise_cap",
            "The most rounding in the audited computation's dtype can produce (relative): "
            "a kind whose noise reaches half of it goes blind.",
            _JOB,
            registry=r,
        )
        self.replay_blind = Gauge(
            "hyperpod_sdc_replay_blind",
            "1 for a kind of replay evidence that cannot tell a fault from noise on some "
            "node (the other kinds keep watching), else 0.",
            [*_JOB, "kind"],
            registry=r,
        )
        self.confirmations = Counter(
            "hyperpod_sdc_confirmations",
            "Confirmation runs ended, by outcome: confirmed (the fault came back on a GPU of "
            "the node), not-confirmed, unknown (could not run, or inconclusive).",
            ["outcome"],
            registry=r,
        )
        self.snapshot_waits = Counter(
            "hyperpod_sdc_snapshot_waits",
            "Stops that waited for the job's verified snapshot, by outcome: reported (the "
            "snapshot's checkpoint report came), timed_out (the deadline passed: the resume "
            "falls back to the newest periodic verified checkpoint, or uses the snapshot if "
            "it is reported by then: condition Snapshot=True, ReportedLate).",
            ["outcome"],
            registry=r,
        )
        self.lost_steps = Histogram(
            "hyperpod_sdc_lost_steps",
            "Training steps an incident threw away: its detection step minus the step the job "
            "was resumed from, counted when the job's agents report that step (once per restart: "
            "incidents one restart resumes together count the latest detection's).",
            buckets=(0, 10, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 50000),
            registry=r,
        )
        self.lost_gpu_hours = Counter(
            "hyperpod_sdc_lost_gpu_hours",
            "GPU-hours those steps cost (steps x the heartbeats' step time x the job's GPUs), "
            "where the step time and the GPU count are known.",
            registry=r,
        )
        # Series the alert rules take increase() of exist from the start, at 0: a counter
        # whose first sample is already 1 shows no increase, and its first (often only)
        # incident would never fire an alert.
        for check in CHECKS:
            for classification in CLASSIFICATIONS:
                self.incidents.labels(check, classification)
        self.actions.labels("resume-job", "Skipped")
        for outcome in ("confirmed", "not-confirmed", "unknown"):
            self.confirmations.labels(outcome)
        for outcome in ("reported", "timed_out"):
            self.snapshot_waits.labels(outcome)
        self.retention_deleted = Counter(
            "hyperpod_sdc_incidents_deleted",
            "Incidents deleted by retention, by why (closed, job_deleted).",
            ["why"],
            registry=r,
        )

    def lead(self, leading: bool) -> None:
        """This replica leads (``hyperpod_sdc_leader`` 1, the leader-owned gauges exported)
        or not (0; those gauges zeroed and no longer exported)."""
        self.leader.set(1 if leading else 0)
        for name in LEADER_OWNED:
            gauge = getattr(self, name)
            if leading and name not in self._exported:
                self.registry.register(gauge)
                self._exported.add(name)
            elif not leading and name in self._exported:
                self.registry.unregister(gauge)
                self._exported.discard(name)
            if not leading:
                gauge.set(0)
