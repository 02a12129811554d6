"""Operator settings, from ``HYPERPOD_SDC_*`` environment variables (docs/operator.md).

Every field has a default that is safe on a production cluster: TokenReview on, dry-run
off, agreement of two nodes before any node is quarantined.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from sdc_agent.protocol import MAX_REPORT_BYTES

from .errors import ConfigError

__all__ = [
    "AUTH_MODES",
    "ENV_OF_FIELD",
    "REMEDIATION_METHODS",
    "REMEDIATION_POLICIES",
    "OperatorSettings",
]

AUTH_MODES = ("tokenreview", "static")
REMEDIATION_POLICIES = ("manual", "auto-reboot", "auto-replace")
REMEDIATION_METHODS = ("api", "label")


@dataclass(frozen=True, kw_only=True, slots=True)
class OperatorSettings:
    listen_address: str = "0.0.0.0"
    """Address the intake (``/v1/reports``, ``/metrics``, ``/healthz``) listens on."""
    listen_port: int = 8443
    """Port of the intake."""
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
    token_cache_seconds: float = 30.0
    """How long a successful token review is reused; 0 reviews every report."""
    max_body_bytes: int = MAX_REPORT_BYTES
    """Largest accepted report body, at most the protocol's limit (64 KiB)."""
    max_report_age_seconds: float = 3600.0
    """Reports sent (``sent_at``) longer ago than this are refused as stale."""
    rate_per_job: float = 20.0
    """Reports per second one job may send on average (a token bucket per job)."""
    rate_burst: int = 400
    """Size of that bucket: how many reports a job may send at once (every node sends the
    same verdict, so keep it above the number of nodes of the largest job)."""
    agreement_nodes: int = 2
    """Distinct nodes whose verdicts must name the same suspects before a node is
    quarantined. 1 lets a single node's report quarantine (not recommended)."""
    dry_run: bool = False
    """Record incidents and the actions that would be taken; take none."""
    auto_resume: bool = True
    """Restart a contained job from its last clean checkpoint once its suspect node is
    quarantined. A job opts out with ``hyperpod-sdc.dev/auto-resume: "false"``."""
    remediation_policy: str = "manual"
    """``manual``: a person annotates the incident with ``hyperpod-sdc.dev/action`` =
    ``reboot``, ``replace`` or ``release``. ``auto-reboot``, ``auto-replace``: at once, once
    the node is quarantined."""
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
    """Namespaces to watch (comma-separated); empty: the whole cluster."""

    def __post_init__(self) -> None:
        def bad(name: str, problem: str) -> ConfigError:
            return ConfigError(f"{ENV_OF_FIELD[name]}: {problem}")

        if not 0 < self.listen_port < 65536:
            raise bad("listen_port", f"must be a port number, got {self.listen_port}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise bad("tls_cert_file", f"and {ENV_OF_FIELD['tls_key_file']} go together")
        if self.auth_mode not in AUTH_MODES:
            raise bad(
                "auth_mode", f"must be one of {', '.join(AUTH_MODES)}, got {self.auth_mode!r}"
            )
        for name, choices in (
            ("remediation_policy", REMEDIATION_POLICIES),
            ("remediation_method", REMEDIATION_METHODS),
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
        if not self.token_audience:
            raise bad("token_audience", "must not be empty")
        if not 1 <= self.max_body_bytes <= MAX_REPORT_BYTES:
            raise bad(
                "max_body_bytes",
                f"must be between 1 and {MAX_REPORT_BYTES}, got {self.max_body_bytes}",
            )
        for name in ("token_cache_seconds", "max_report_age_seconds"):
            if getattr(self, name) < 0:
                raise bad(name, f"must be >= 0, got {getattr(self, name)}")
        for name in (
            "rate_per_job",
            "resync_seconds",
            "max_report_age_seconds",
            "remediation_backoff_seconds",
        ):
            if getattr(self, name) <= 0:
                raise bad(name, f"must be > 0, got {getattr(self, name)}")
        for name in (
            "rate_burst",
            "agreement_nodes",
            "max_quarantined_per_job",
            "storm_suspect_nodes",
        ):
            if getattr(self, name) < 1:
                raise bad(name, f"must be >= 1, got {getattr(self, name)}")

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
