"""The names users see (DESIGN.md), in one place."""

from __future__ import annotations

GROUP = "hyperpod-sdc.dev"
VERSION = "v1alpha1"
INCIDENT_KIND = "SDCIncident"
INCIDENT_PLURAL = "sdcincidents"
POLICY_KIND = "SDCPolicy"
POLICY_PLURAL = "sdcpolicies"
FIELD_MANAGER = "hyperpod-sdc"
"""The field manager of the operator's writes (``metadata.managedFields``)."""

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
RESUME_MAX_STEP_ENV = "HYPERPOD_SDC_RESUME_MAX_STEP"
AUTO_RESUME_ANNOTATION = f"{GROUP}/auto-resume"
"""On a job: ``"false"`` keeps the operator from restarting it after an incident."""
CHECKPOINTS_ANNOTATION = f"{GROUP}/checkpoints"
"""On a job: the verified checkpoints its agents reported (JSON), written by the operator."""
HYPERPOD_AUTO_RESUME_ANNOTATION = "sagemaker.amazonaws.com/enable-job-auto-resume"

HYPERPOD_CLUSTER_LABEL = "sagemaker.amazonaws.com/cluster-name"
HYPERPOD_HEALTH_LABEL = "sagemaker.amazonaws.com/node-health-status"
