"""Pure decisions about training jobs: opt-in, suspend, and resume from a clean step.

Works on the job as a plain dict (what the Kubernetes API returns). ``PyTorchJob``
(``kubeflow.org/v1``) keeps its replicas in ``spec.pytorchReplicaSpecs``; HyperPod's
``HyperPodPyTorchJob`` will be added next.
"""

from __future__ import annotations

import copy
from typing import Any

from .names import ENABLED_ANNOTATION, RESUME_MAX_STEP_ENV

__all__ = [
    "JOB_KINDS",
    "KUEUE_QUEUE_LABEL",
    "deactivate_workload_patch",
    "is_enabled",
    "is_kueue_managed",
    "is_suspended",
    "job_owner",
    "resume_patch",
    "suspend_patch",
]

REPLICA_SPECS = "pytorchReplicaSpecs"
JOB_KINDS: dict[tuple[str, str], str] = {
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjobs",
    ("sagemaker.amazonaws.com/v1", "HyperPodPyTorchJob"): "hyperpodpytorchjobs",
}
"""(apiVersion, kind) of each supported job kind -> its plural."""
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_WORKLOAD_API = "kueue.x-k8s.io/v1beta1"
KUEUE_WORKLOAD_PLURAL = "workloads"


def job_owner(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The pod's controlling owner reference if it is a supported training job."""
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") and (ref.get("apiVersion"), ref.get("kind")) in JOB_KINDS:
            return dict(ref)
    return None


def is_kueue_managed(job: dict[str, Any]) -> bool:
    """Kueue admits (and suspends) jobs that carry its queue label; such a job is stopped
    through its Workload, or Kueue would lift our suspension when it next admits it."""
    return bool(((job.get("metadata") or {}).get("labels") or {}).get(KUEUE_QUEUE_LABEL))


def deactivate_workload_patch(workload: dict[str, Any]) -> dict[str, Any] | None:
    """Merge patch that deactivates a Kueue Workload (Kueue then evicts and suspends its
    job), or ``None`` if it is inactive already."""
    if (workload.get("spec") or {}).get("active") is False:
        return None
    return {"spec": {"active": False}}


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
