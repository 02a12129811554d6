"""Operator settings, from ``HYPERPOD_SDC_*`` environment variables (docs/operator.md).

Every field has a default that is safe on a production cluster: TokenReview on, dry-run
off, agreement of two nodes before any node is quarantined.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from sdc_common.protocol import MAX_REPORT_BYTES

from .errors import ConfigError

__all__ = [
    "AUTH_MODES",
    "ENV_OF_FIELD",
    "REMEDIATION_METHODS",
    "REMEDIATION_POLICIES",
    "OperatorSettings",
]

AUTH_MODES = ("tokenreview", "static")
_SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
REMEDIATION_POLICIES = ("manual", "auto-replace-confirmed", "auto-reboot", "auto-replace")
REMEDIATION_METHODS = ("api", "label")
CREATOR_CHECKS = ("any", "policy", "webhook", "unchecked")


@dataclass(frozen=True, kw_only=True, slots=True)
class OperatorSettings:
    listen_address: str = "0.0.0.0"
    """Address the three listeners (intake, admission, metrics) listen on."""
    listen_port: int = 8443
    """Port of the tenants' intake: ``/v1/reports`` and nothing else."""
    verdict_port: int = 8444
    """Port of the intake's verdict listener: ``/v1/reports`` again, for every report but
    heartbeats, served on a thread and event loop of its own so that a verdict is never read
    behind a burst of heartbeats (docs/operator.md, "Verdicts first"); agents that do not
    know it report on ``listen_port``, as before. 0: no verdict listener."""
    admission_port: int = 9443
    """Port of the admission webhook (``/v1/admission/...``), for the API server only."""
    metrics_port: int = 9090
    """Port of ``/metrics``, ``/healthz`` and ``/readyz``, for monitoring and the kubelet's
    probes (``/metrics`` names every opted-in job of every namespace)."""
    tls_handshake_timeout_seconds: float = 5.0
    """A TLS connection whose handshake is not complete this long after it opened is
    closed."""
    handshakes_per_source: int = 32
    """TLS handshakes one client address may have in progress at once, on each listener;
    more are closed unanswered."""
    max_connections: int = 4608
    """Connections the intake holds open at once (handshaking, reading or idle between
    requests); past it a new one is reset as it is accepted, before its TLS handshake,
    and the agent retries. Bounds the intake's memory (docs/operator.md, "Memory")."""
    connections_per_source: int = 32
    """Connections one client address may hold open at once on the intake; more are reset
    as they are accepted. An agent holds one (or one per reporting rank of its pod)."""
    api_server_addresses: tuple[str, ...] = ()
    """IP addresses the API server calls the webhooks from, besides those it publishes in
    the Endpoints ``default/kubernetes`` (comma-separated): the admission listener keeps
    connections in reserve for them. Needed only where the API server calls from an
    address it does not publish (another interface, a NAT)."""
    tls_cert_file: str | None = None
    """PEM certificate for HTTPS; with ``tls_key_file``. Unset: plain HTTP (only behind a
    mesh or for development: the Bearer tokens travel in the clear)."""
    tls_key_file: str | None = None
    """PEM private key for ``tls_cert_file``."""
    auth_mode: str = "tokenreview"
    """``tokenreview``: a report's Bearer token is a ServiceAccount token bound to the
    reporting pod, checked with the API server's TokenReview. ``static``: development only,
    tokens listed in ``static_tokens_file``."""
    token_audience: str = "hyperpod-sdc"
    """The audience the pods' projected tokens must carry (TokenReview's ``audiences``)."""
    static_tokens_file: str | None = None
    """``static`` mode: one ``<token> <namespace>/<pod>`` per line."""
    token_cache_seconds: float = 300.0
    """How long a successful token review is reused (never past the token's own expiry);
    0 reviews every report. Safe to keep long: the pod is looked up on every report, so a
    token whose pod is gone is refused however long its review is cached."""
    max_body_bytes: int = MAX_REPORT_BYTES
    """Largest accepted report body, at most the protocol's limit (64 KiB)."""
    max_report_age_seconds: float = 3600.0
    """Reports sent (``sent_at``) longer ago than this are refused as stale."""
    rate_per_job: float = 100.0
    """Reports per second one job may send on average (a token bucket per job)."""
    rate_burst: int = 5000
    """Size of that bucket: how many reports a job may send at once (every node sends its
    heartbeat at about the same step, and old agents every verdict, so keep it above twice
    the number of nodes of the largest job)."""
    agreement_nodes: int = 2
    """Distinct nodes whose verdicts must name the same suspects before a node is
    quarantined. 1 lets a single node's report quarantine (not recommended)."""
    dry_run: bool = False
    """Record incidents and the actions that would be taken; take none."""
    auto_resume: bool = True
    """Restart a contained job from its last clean checkpoint once its suspect node is
    quarantined. A job opts out with ``hyperpod-sdc.dev/auto-resume: "false"``."""
    snapshot_wait_seconds: float = 30.0
    """How long the stop of a job waits for the verified snapshot its agents write at
    detection (``snapshot_copies`` > 0: the verdict names ``snapshot_step``) to be reported,
    before it suspends the job anyway and the resume falls back to the newest periodic
    verified checkpoint. The suspect node is cordoned and tainted at once; only the
    suspension waits. It should fit the pods' termination grace period and the agents'
    ``snapshot_write_seconds`` (default 20) with a margin. 0: never wait."""
    remediation_policy: str = "manual"
    """``manual``: a person annotates the incident with ``hyperpod-sdc.dev/action`` =
    ``reboot``, ``replace`` or ``release``. ``auto-replace-confirmed``: replace a node at
    once where the confirmation run reproduced the fault on it (``Confirmed=True``), and
    otherwise wait for a person as ``manual`` does. ``auto-reboot``, ``auto-replace``: at
    once, once the node is quarantined."""
    remediation_method: str = "api"
    """``api``: SageMaker BatchRebootClusterNodes / BatchReplaceClusterNodes. ``label``: the
    node's ``sagemaker.amazonaws.com/node-health-status`` label
    (``UnschedulablePendingReboot`` / ``UnschedulablePendingReplacement``)."""
    remediation_backoff_seconds: float = 30.0
    """Wait before retrying a failed reboot or replace; doubles each time, up to 32 times."""
    max_quarantined_per_job: int = 2
    """Nodes one job's incidents may quarantine at a time; beyond it the job is stopped and
    no further node is quarantined."""
    max_quarantined_nodes: str = "5%"
    """Nodes quarantined cluster-wide at a time: a count (``10``) or a share of all nodes
    (``5%``, at least 1)."""
    storm_suspect_nodes: int = 2
    """An incident whose suspects span more nodes than this is a storm (software
    non-determinism, not hardware): the job is stopped, no node is quarantined."""
    cluster_name: str | None = None
    """HyperPod cluster name for ``ListClusterNodes``, where a node has no
    ``sagemaker.amazonaws.com/cluster-name`` label."""
    aws_region: str | None = None
    """Region of the HyperPod cluster; unset: boto3's default chain (``AWS_REGION``)."""
    resync_seconds: float = 10.0
    """How often unfinished incidents are driven again (after an error or a restart)."""
    namespaces: tuple[str, ...] = ()
    """Namespaces to watch (comma-separated); empty: the whole cluster. Which namespaces
    may report at all is the cluster admin's ``SDCPolicy``, not this setting."""
    operator_namespace: str = ""
    """The operator's own namespace (its Lease and attestation key Secret live there);
    empty: the pod's namespace (its ServiceAccount's), else ``hyperpod-sdc``."""
    pod_name: str = ""
    """This replica's name in the leader election (the chart sets the pod's name); empty:
    ``<hostname>-<pid>``."""
    leader_election: bool = True
    """Elect one acting replica with a ``coordination.k8s.io/v1`` Lease. Every replica
    serves the intake and records reports; only the leader acts on the cluster."""
    lease_name: str = "hyperpod-sdc-leader"
    """Name of that Lease in the operator's namespace."""
    lease_seconds: float = 8.0
    """How long a leader's Lease lasts without renewal: a standby takes over at most this
    long (plus two retries of ``lease_seconds / 5``) after the leader dies: 11 s by default."""
    attestation_secret: str = "hyperpod-sdc-attestation"
    """Secret (key ``key``) in the operator's namespace holding the 32-byte key of the
    legacy ``v2`` attestations (read only with ``legacy_attestation_until``); created by
    the first replica that finds it missing."""
    require_attestation: bool = True
    """Accept reports (and suspects) only from pods that carry the creator marker of a
    trusted pod creator (the webhook writes it, the API server's validating check keeps it
    true). ``false`` only for clusters that run without the webhook: any user who may
    create pods in an admitted namespace can then point one at a job."""
    creator_check: str = "any"
    """What keeps the creator marker true, looked for at start-up where attestation is
    required (:mod:`.creator_check`): ``policy``, a ``ValidatingAdmissionPolicy`` and its
    ``Deny`` binding (Kubernetes 1.30+); ``webhook``, a ``ValidatingWebhookConfiguration``
    sending pods and ``pods/status`` to ``/v1/admission/pods/creator`` with
    ``failurePolicy: Fail``; ``any``, either. The operator does not start where none is
    installed: without one, anyone who may create pods can mark its own pods as a training
    operator's, and their verdicts quarantine nodes. ``unchecked`` skips the look, only
    where other admission control enforces the same rule (and in tests)."""
    legacy_attestation_until: str = ""
    """An RFC 3339 time (``2027-01-31T00:00:00Z``): until then, a pod created before it
    that carries only the ``v2`` HMAC attestation of an earlier version is believed too,
    so that jobs running through the upgrade keep reporting. Empty (the default): never.
    Set it to the end of the longest job's run at upgrade, and no later."""
    trusted_pod_creators: tuple[str, ...] = (
        "system:serviceaccount:kubeflow:training-operator",
        "system:serviceaccount:kubeflow:pytorch-operator",
        "system:serviceaccount:aws-hyperpod:hp-training-operator-controller-manager",
    )
    """Users (comma-separated) whose pods count as a training operator's: Kubeflow's
    training operator, its older PyTorch operator, and HyperPod's training operator."""
    max_clock_skew_seconds: float = 300.0
    """Reports sent (``sent_at``) further in the future than this are refused."""
    header_timeout_seconds: float = 10.0
    """A new connection whose first request's headers are not complete this long after it
    opened is closed."""
    idle_timeout_seconds: float = 120.0
    """A connection idle this long after its previous answer (or whose next request's
    headers are not complete by then) is closed. The agent keeps its one connection open
    between reports (a heartbeat every 30 s or so, spread by up to 10 s of jitter), so that
    a storm of verdicts and heartbeats costs no TLS handshakes; the connections it holds
    are bounded by ``max_connections``."""
    body_timeout_seconds: float = 10.0
    """A request whose body is not complete this long after its headers is answered 408."""
    rate_per_source: float = 50.0
    """Requests per second one client address may send on average, checked before any
    API call (a token bucket per address)."""
    rate_source_burst: int = 200
    """Size of that bucket."""
    token_reviews_per_second: float = 200.0
    """TokenReviews per second for tokens not in the cache, cluster-wide: past it a report
    with an unknown token is answered 429, so a flood of bogus tokens costs the API server
    a bounded load."""
    token_review_burst: int = 2500
    """How many TokenReviews of new tokens may be sent at once (the size of that bucket):
    keep it above the node count of the largest job, whose agents all report for the first
    time at about the same moment."""
    token_reviews_per_source: float = 5.0
    """TokenReviews per second one client address may cause, on average, for tokens not
    in the cache: bogus tokens from a few addresses cannot spend the cluster-wide budget
    (an agent's pod has an address of its own and reviews one token an hour)."""
    token_review_source_burst: int = 50
    """Size of that bucket."""
    negative_token_cache_seconds: float = 60.0
    """How long a token the API server rejected is rejected without asking again."""
    max_in_flight: int = 4096
    """Reports processed at once; past it new ones get 503 and are retried by the agent.
    Bounds memory: each holds at most one body of ``max_body_bytes``."""
    max_heartbeats_in_flight: int = 256
    """Heartbeats processed at once: the heartbeats' own lane. Past it, and while a verdict
    is in flight or arrived in the last 5 s, a heartbeat is answered 429 with a
    ``Retry-After`` of ``heartbeat_retry_after_seconds`` to twice that (spread at random)
    as soon as its body is read, so that a verdict never waits behind heartbeats."""
    heartbeat_retry_after_seconds: float = 5.0
    """The shortest ``Retry-After`` given to a heartbeat shed for a verdict or a full lane."""
    repeat_count: int = 2
    """A transient or uncorroborated verdict quarantines nothing until the same node of
    the same job was caught this many times (this incident included) ..."""
    repeat_window_steps: int = 1000
    """... within this many training steps."""
    heartbeat_silence_seconds: float = 600.0
    """A job whose agents sent heartbeats and then none for this long (or for three of
    their own intervals, if longer) gets an Event ``SDCAgentsSilent`` and counts in
    ``hyperpod_sdc_silent_jobs``."""
    incident_retention_days: float = 30.0
    """Closed incidents (nothing left to do, no node held) are deleted this many days after
    their last change; so are incidents of deleted jobs. 0 keeps them forever."""
    confirmation: bool = True
    """Once a suspect node is quarantined and its verdict named an evidence bundle, run
    ``python -m sdc_agent.confirm BUNDLE`` in a pod pinned to that node, with the job's
    image, ServiceAccount and volumes, and record the result as the incident's condition
    ``Confirmed``. Needs ``create``/``delete`` on pods in the jobs' namespaces."""
    confirmation_repeat: int = 3
    """How many times the confirmation recomputes the micro-batch on each GPU (``--repeat``)."""
    confirmation_deadline_seconds: float = 3600.0
    """The confirmation pod's ``activeDeadlineSeconds``: the recomputation, the GEMM stress
    check and ``dcgmi diag -r 3`` (up to 30 minutes) must end within it (``Confirmed=Unknown``,
    reason ``Timeout``, otherwise)."""
    confirmation_start_seconds: float = 600.0
    """How long the confirmation pod may take to start (scheduled, image pulled, the node's
    GPUs free of the stopped job's pods) before it is given up (``Confirmed=Unknown``,
    reason ``Unschedulable``, ``ImagePullFailed`` ...) and deleted."""
    confirmation_image: str | None = None
    """The image of the confirmation pod; unset: the job's training container's image (it has
    the training code the bundle's model is rebuilt from, and ``sdc_agent``)."""
    remediation_verify_seconds: float = 60.0
    """After a restart that finds a reboot or replace whose call may or may not have
    reached SageMaker, how long to keep asking ``DescribeClusterNode`` for its effect
    before calling again."""

    def __post_init__(self) -> None:
        def bad(name: str, problem: str) -> ConfigError:
            return ConfigError(f"{ENV_OF_FIELD[name]}: {problem}")

        if self.legacy_attestation_until:
            try:
                self.legacy_until()
            except ValueError:
                raise bad(
                    "legacy_attestation_until",
                    "must be an RFC 3339 time with its zone, e.g. 2027-01-31T00:00:00Z, got "
                    f"{self.legacy_attestation_until!r}",
                ) from None

        ports = ("listen_port", "admission_port", "metrics_port")
        for name in ports:
            if not 0 < getattr(self, name) < 65536:
                raise bad(name, f"must be a port number, got {getattr(self, name)}")
        if len({getattr(self, name) for name in ports}) != len(ports):
            raise bad(
                "admission_port",
                f"{ENV_OF_FIELD['listen_port']}, {ENV_OF_FIELD['admission_port']} and "
                f"{ENV_OF_FIELD['metrics_port']} must differ: each listener serves one "
                "audience",
            )
        if not 0 <= self.verdict_port < 65536:
            raise bad("verdict_port", f"must be a port number or 0, got {self.verdict_port}")
        if self.verdict_port in {getattr(self, name) for name in ports}:
            raise bad(
                "verdict_port",
                f"must differ from {ENV_OF_FIELD['listen_port']}, "
                f"{ENV_OF_FIELD['admission_port']} and {ENV_OF_FIELD['metrics_port']}, "
                f"got {self.verdict_port}",
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise bad("tls_cert_file", f"and {ENV_OF_FIELD['tls_key_file']} go together")
        if self.auth_mode not in AUTH_MODES:
            raise bad(
                "auth_mode", f"must be one of {', '.join(AUTH_MODES)}, got {self.auth_mode!r}"
            )
        for name, choices in (
            ("remediation_policy", REMEDIATION_POLICIES),
            ("remediation_method", REMEDIATION_METHODS),
            ("creator_check", CREATOR_CHECKS),
        ):
            if getattr(self, name) not in choices:
                raise bad(name, f"must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        cap = self.max_quarantined_nodes
        number = cap[:-1] if cap.endswith("%") else cap
        if not number.isdigit() or int(number) < 1 or (cap.endswith("%") and int(number) > 100):
            raise bad(
                "max_quarantined_nodes",
                f"must be a count >= 1 or a percentage 1% to 100%, got {cap!r}",
            )
        if self.auth_mode == "static" and not self.static_tokens_file:
            raise bad("static_tokens_file", "is required when the auth mode is static")
        if self.require_attestation and not self.trusted_pod_creators:
            raise bad(
                "trusted_pod_creators", "must name at least one user when attestation is required"
            )
        for address in self.api_server_addresses:
            try:
                ipaddress.ip_address(address)
            except ValueError:
                raise bad("api_server_addresses", f"not an IP address: {address!r}") from None
        if self.lease_seconds < 2:
            raise bad("lease_seconds", f"must be >= 2, got {self.lease_seconds}")
        if not self.token_audience:
            raise bad("token_audience", "must not be empty")
        if not 1 <= self.max_body_bytes <= MAX_REPORT_BYTES:
            raise bad(
                "max_body_bytes",
                f"must be between 1 and {MAX_REPORT_BYTES}, got {self.max_body_bytes}",
            )
        for name in (
            "token_cache_seconds",
            "max_report_age_seconds",
            "max_clock_skew_seconds",
            "negative_token_cache_seconds",
            "incident_retention_days",
            "remediation_verify_seconds",
            "snapshot_wait_seconds",
        ):
            if getattr(self, name) < 0:
                raise bad(name, f"must be >= 0, got {getattr(self, name)}")
        for name in (
            "rate_per_job",
            "resync_seconds",
            "max_report_age_seconds",
            "remediation_backoff_seconds",
            "lease_seconds",
            "header_timeout_seconds",
            "idle_timeout_seconds",
            "body_timeout_seconds",
            "rate_per_source",
            "token_reviews_per_second",
            "token_reviews_per_source",
            "tls_handshake_timeout_seconds",
            "heartbeat_retry_after_seconds",
            "heartbeat_silence_seconds",
            "confirmation_deadline_seconds",
            "confirmation_start_seconds",
        ):
            if getattr(self, name) <= 0:
                raise bad(name, f"must be > 0, got {getattr(self, name)}")
        for name in (
            "rate_burst",
            "agreement_nodes",
            "max_quarantined_per_job",
            "storm_suspect_nodes",
            "rate_source_burst",
            "token_review_burst",
            "token_review_source_burst",
            "handshakes_per_source",
            "max_connections",
            "connections_per_source",
            "max_in_flight",
            "max_heartbeats_in_flight",
            "repeat_count",
            "repeat_window_steps",
            "confirmation_repeat",
        ):
            if getattr(self, name) < 1:
                raise bad(name, f"must be >= 1, got {getattr(self, name)}")

    def legacy_until(self) -> float | None:
        """``legacy_attestation_until`` as unix seconds; ``None`` where unset."""
        if not self.legacy_attestation_until:
            return None
        when = datetime.datetime.fromisoformat(self.legacy_attestation_until.replace("Z", "+00:00"))
        if when.tzinfo is None:
            raise ValueError("no time zone")
        return when.timestamp()

    @property
    def namespace(self) -> str:
        """The operator's own namespace (see ``operator_namespace``)."""
        if self.operator_namespace:
            return self.operator_namespace
        try:
            with open(_SA_NAMESPACE_FILE, encoding="utf-8") as f:
                found = f.read().strip()
        except OSError:
            found = ""
        return found or "hyperpod-sdc"

    @property
    def identity(self) -> str:
        """This replica's name in the leader election."""
        return self.pod_name or f"{socket.gethostname()}-{os.getpid()}"

    def quarantine_cap(self, total_nodes: int) -> int:
        """The cluster-wide cap for a cluster of ``total_nodes``."""
        cap = self.max_quarantined_nodes
        if cap.endswith("%"):
            return max(1, total_nodes * int(cap[:-1]) // 100)
        return int(cap)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorSettings:
        """Read every ``HYPERPOD_SDC_*`` setting; a bad value raises :class:`ConfigError`
        naming the variable."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = ENV_OF_FIELD[f.name]
            raw = env.get(name)
            if raw is None or raw.strip() == "":
                continue
            raw = raw.strip()
            kind = _KINDS.get(str(f.type).split(" ")[0].split("[")[0], str)
            values[f.name] = _parse(name, raw, kind)
        return cls(**values)


_KINDS: dict[str, type] = {"int": int, "float": float, "bool": bool, "tuple": tuple}


def _parse(name: str, raw: str, kind: type) -> Any:
    if kind is bool:
        lowered = raw.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}: expected true or false, got {raw!r}")
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{name}: expected an integer, got {raw!r}") from None
    if kind is float:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{name}: expected a number, got {raw!r}") from None
    if kind is tuple:
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    return raw


ENV_OF_FIELD: dict[str, str] = {
    f.name: "HYPERPOD_SDC_" + f.name.upper() for f in fields(OperatorSettings)
}
