"""The names both sides use (DESIGN.md, "Names users see"), defined once.

The operator sets the agent's environment (the admission webhook, the resume directive)
and reads the confirmation's exit code; the agent reads that environment and exits with
that code. Both import these constants, so neither can drift from the other.
"""

from __future__ import annotations

__all__ = [
    "ACTIONS",
    "ACTION_ANNOTATION",
    "AUTO_RESUME_ANNOTATION",
    "CA_BUNDLE_ENV",
    "CHECKPOINTS_ANNOTATION",
    "CONFIRM_EXIT_CODES",
    "DEFAULT_TOKEN_FILE",
    "ENABLED_ANNOTATION",
    "ENV_PREFIX",
    "FIELD_MANAGER",
    "GROUP",
    "HYPERPOD_AUTO_RESUME_ANNOTATION",
    "HYPERPOD_CLUSTER_LABEL",
    "HYPERPOD_HEALTH_LABEL",
    "INCIDENT_ANNOTATION",
    "INCIDENT_KIND",
    "INCIDENT_PLURAL",
    "OPERATOR_URL_ENV",
    "POLICY_KIND",
    "POLICY_PLURAL",
    "PRIOR_CORDON_ANNOTATION",
    "RESUME_MAX_STEP_ENV",
    "SUSPECT_KEY",
    "TOKEN_FILE_ENV",
    "VERDICT_URL_ENV",
    "VERSION",
]

# -- the API ----------------------------------------------------------------------------------

GROUP = "hyperpod-sdc.dev"
VERSION = "v1alpha1"
INCIDENT_KIND = "SDCIncident"
INCIDENT_PLURAL = "sdcincidents"
POLICY_KIND = "SDCPolicy"
POLICY_PLURAL = "sdcpolicies"
FIELD_MANAGER = "hyperpod-sdc"
"""The field manager of the operator's writes (``metadata.managedFields``)."""

# -- labels, taints and annotations -----------------------------------------------------------

ENABLED_ANNOTATION = f"{GROUP}/enabled"
SUSPECT_KEY = f"{GROUP}/suspect"
"""Taint key (``true:NoSchedule``) and label of a quarantined node."""
INCIDENT_ANNOTATION = f"{GROUP}/incident"
"""On a quarantined node: ``<namespace>/<incident name>``."""
PRIOR_CORDON_ANNOTATION = f"{GROUP}/was-cordoned"
"""On a quarantined node that was cordoned before: a release leaves it cordoned."""
ACTION_ANNOTATION = f"{GROUP}/action"
"""On an incident: ``reboot``, ``replace`` or ``release``, set by the person who reviewed it."""
ACTIONS = ("reboot", "replace", "release")
AUTO_RESUME_ANNOTATION = f"{GROUP}/auto-resume"
"""On a job: ``"false"`` keeps the operator from restarting it after an incident."""
CHECKPOINTS_ANNOTATION = f"{GROUP}/checkpoints"
"""On a job: the verified checkpoints its agents reported (JSON), written by the operator."""
HYPERPOD_AUTO_RESUME_ANNOTATION = "sagemaker.amazonaws.com/enable-job-auto-resume"
HYPERPOD_CLUSTER_LABEL = "sagemaker.amazonaws.com/cluster-name"
HYPERPOD_HEALTH_LABEL = "sagemaker.amazonaws.com/node-health-status"

# -- the agent's environment, as the operator sets it -----------------------------------------

ENV_PREFIX = "HYPERPOD_SDC_"
OPERATOR_URL_ENV = "HYPERPOD_SDC_OPERATOR_URL"
"""Base URL of the operator's intake (set by the admission webhook)."""
VERDICT_URL_ENV = "HYPERPOD_SDC_VERDICT_URL"
"""Base URL of the intake's verdict listener, for every report but heartbeats (set by the
admission webhook of releases that have one; unset: everything goes to the intake's URL)."""
TOKEN_FILE_ENV = "HYPERPOD_SDC_TOKEN_FILE"
"""The projected ServiceAccount token the agent authenticates with."""
CA_BUNDLE_ENV = "HYPERPOD_SDC_CA_BUNDLE"
"""The CA that signed the operator's certificate (set with TLS only)."""
DEFAULT_TOKEN_FILE = "/var/run/secrets/hyperpod-sdc/token"
"""Where the admission webhook mounts the token (and where the agent looks without the env)."""
RESUME_MAX_STEP_ENV = "HYPERPOD_SDC_RESUME_MAX_STEP"
"""The resume directive: set on a job's containers after an incident, the newest step a
restart may resume from (its last clean step)."""

# -- exit codes -------------------------------------------------------------------------------

CONFIRM_EXIT_CODES: dict[str, int] = {"not-confirmed": 0, "confirmed": 3, "unknown": 4}
"""``python -m sdc_agent.confirm``'s exit code for each outcome; the operator judges a
confirmation pod by it (any other code: the run failed, outcome unknown)."""
