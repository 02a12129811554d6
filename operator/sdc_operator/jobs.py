"""Pure decisions about training jobs: opt-in, suspend, and resume from a clean step.

Works on the job as a plain dict (what the Kubernetes API returns). ``PyTorchJob``
(``kubeflow.org/v1``) keeps its replicas in ``spec.pytorchReplicaSpecs``; HyperPod's
``HyperPodPyTorchJob`` will be added next.
"""

from __future__ import annotations

import copy
from typing import Any

from .names import ENABLED_ANNOTATION, RESUME_MAX_STEP_ENV

__all__ = ["is_enabled", "is_suspended", "resume_patch", "suspend_patch"]

REPLICA_SPECS = "pytorchReplicaSpecs"


def is_enabled(job: dict[str, Any]) -> bool:
    """The job opted in with ``hyperpod-sdc.dev/enabled: "true"``."""
    annotations = (job.get("metadata") or {}).get("annotations") or {}
    return annotations.get(ENABLED_ANNOTATION) == "true"


def is_suspended(job: dict[str, Any]) -> bool:
    return ((job.get("spec") or {}).get("runPolicy") or {}).get("suspend") is True


def suspend_patch(job: dict[str, Any]) -> dict[str, Any] | None:
    """Merge patch that stops the job (``runPolicy.suspend``), or ``None`` if it is stopped."""
    if is_suspended(job):
        return None
    return {"spec": {"runPolicy": {"suspend": True}}}


def resume_patch(job: dict[str, Any], max_step: int) -> dict[str, Any]:
    """Merge patch that sets ``HYPERPOD_SDC_RESUME_MAX_STEP=max_step`` on every container
    of every replica template and lifts the suspension.

    A merge patch replaces lists whole, so each replica's containers are sent complete,
    with the variable set (replaced where it was already there).
    """
    if not isinstance(max_step, int) or isinstance(max_step, bool) or max_step < 0:
        raise ValueError(f"max_step: must be an integer >= 0, got {max_step!r}")
    replicas = (job.get("spec") or {}).get(REPLICA_SPECS) or {}
    patched: dict[str, Any] = {}
    for name, replica in replicas.items():
        pod_spec = ((replica or {}).get("template") or {}).get("spec") or {}
        containers = []
        for container in pod_spec.get("containers") or []:
            c = copy.deepcopy(container)
            env = [e for e in c.get("env") or [] if e.get("name") != RESUME_MAX_STEP_ENV]
            env.append({"name": RESUME_MAX_STEP_ENV, "value": str(max_step)})
            c["env"] = env
            containers.append(c)
        patched[name] = {"template": {"spec": {"containers": containers}}}
    return {"spec": {"runPolicy": {"suspend": False}, REPLICA_SPECS: patched}}
