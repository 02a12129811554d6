"""Pure decisions about training jobs: opt-in, suspend, and resume from a clean step.

Works on the job as a plain dict (what the Kubernetes API returns). ``PyTorchJob``
(``kubeflow.org/v1``) keeps its replicas in ``spec.pytorchReplicaSpecs``; HyperPod's
``HyperPodPyTorchJob`` (``sagemaker.amazonaws.com/v1``) keeps them in the list
``spec.replicaSpecs``; both have ``spec.runPolicy.suspend``.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from .names import (
    AUTO_RESUME_ANNOTATION,
    CHECKPOINTS_ANNOTATION,
    ENABLED_ANNOTATION,
    HYPERPOD_AUTO_RESUME_ANNOTATION,
    RESUME_MAX_STEP_ENV,
)

__all__ = [
    "JOB_KINDS",
    "KUEUE_QUEUE_LABEL",
    "is_enabled",
    "is_kueue_managed",
    "is_suspended",
    "job_owner",
    "pod_fits_job",
    "auto_resume_refusal",
    "checkpoint_patch",
    "newest_checkpoint",
    "resume_env_patch",
    "resume_env_set",
    "suspend_patch",
    "unsuspend_patch",
    "verified_checkpoints",
    "workload_active_patch",
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
MAX_CHECKPOINTS = 16


def job_owner(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The pod's controlling owner reference if it is a supported training job."""
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") and (ref.get("apiVersion"), ref.get("kind")) in JOB_KINDS:
            return dict(ref)
    return None


REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"


def pod_fits_job(pod: dict[str, Any], job: dict[str, Any]) -> str | None:
    """Why ``pod`` cannot be one the training operator made for ``job``, or ``None``.

    Cheap, and independent of attestation. Kubeflow names a ``PyTorchJob``'s pods
    ``<job>-<replica type>-<index>``, the index below that replica type's count, and labels
    them with both: a pod that claims another type, an index past the count, or a name not
    made that way is not one of them. (HyperPod's training operator does not document its
    pod names, so a ``HyperPodPyTorchJob``'s pods are left to the attestation.)
    """
    specs = (job.get("spec") or {}).get(REPLICA_SPECS)
    if job.get("kind") != "PyTorchJob" or not isinstance(specs, dict):
        return None
    meta = pod.get("metadata") or {}
    name = str(meta.get("name") or "")
    job_name = str((job.get("metadata") or {}).get("name") or "")
    ref = f"pod {meta.get('namespace')}/{name}"
    if not name.startswith(job_name + "-"):
        return f"{ref} is not named after its job {job_name} (<job>-<replica type>-<index>)"
    counts = {str(k).lower(): int((v or {}).get("replicas", 1) or 0) for k, v in specs.items()}
    kind, _, index = name[len(job_name) + 1 :].rpartition("-")
    if kind not in counts or not index.isdigit() or int(index) >= counts[kind]:
        replicas = ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))
        return f"{ref} is not one of {job_name}'s replicas ({replicas})"
    labels = meta.get("labels") or {}
    for label, want in ((REPLICA_TYPE_LABEL, kind), (REPLICA_INDEX_LABEL, index)):
        if label in labels and str(labels[label]).lower() != want:
            return f"{ref} has {label}={labels[label]}, but its name says {want}"
    return None


def is_kueue_managed(job: dict[str, Any]) -> bool:
    """Kueue admits (and suspends) jobs that carry its queue label; such a job is stopped
    through its Workload, or Kueue would lift our suspension when it next admits it."""
    return bool(((job.get("metadata") or {}).get("labels") or {}).get(KUEUE_QUEUE_LABEL))


def workload_active_patch(workload: dict[str, Any], active: bool) -> dict[str, Any] | None:
    """Merge patch that deactivates a Kueue Workload (Kueue then evicts and suspends its
    job) or reactivates it, or ``None`` if it is so already (a Workload is active unless
    ``spec.active`` is false)."""
    if ((workload.get("spec") or {}).get("active") is not False) == active:
        return None
    return {"spec": {"active": active}}


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


def _with_resume_env(containers: list[dict[str, Any]], max_step: int) -> list[dict[str, Any]]:
    out = []
    for container in containers:
        c = copy.deepcopy(container)
        env = [e for e in c.get("env") or [] if e.get("name") != RESUME_MAX_STEP_ENV]
        env.append({"name": RESUME_MAX_STEP_ENV, "value": str(max_step)})
        c["env"] = env
        out.append(c)
    return out


def _templates(job: dict[str, Any]) -> list[dict[str, Any]]:
    spec = job.get("spec") or {}
    if REPLICA_SPECS in spec:
        replicas = list((spec.get(REPLICA_SPECS) or {}).values())
    else:  # HyperPodPyTorchJob: a list of named replica specs
        replicas = list(spec.get("replicaSpecs") or [])
    return [((r or {}).get("template") or {}).get("spec") or {} for r in replicas]


def resume_env_set(job: dict[str, Any], max_step: int) -> bool:
    """Every container of every replica template has ``HYPERPOD_SDC_RESUME_MAX_STEP``."""
    want = {"name": RESUME_MAX_STEP_ENV, "value": str(max_step)}
    return all(
        want in (c.get("env") or []) for t in _templates(job) for c in t.get("containers") or []
    )


def resume_env_patch(job: dict[str, Any], max_step: int) -> dict[str, Any] | None:
    """Merge patch that sets ``HYPERPOD_SDC_RESUME_MAX_STEP=max_step`` on every container of
    every replica template (replacing an older value), or ``None`` if it is set already.

    A merge patch replaces lists whole: a ``PyTorchJob``'s replicas are a map, so each
    replica's containers are sent complete; a ``HyperPodPyTorchJob``'s replicas are a list,
    so the whole list is sent, each replica as it was but for the variable.
    """
    if not isinstance(max_step, int) or isinstance(max_step, bool) or max_step < 0:
        raise ValueError(f"max_step: must be an integer >= 0, got {max_step!r}")
    if resume_env_set(job, max_step):
        return None
    spec = job.get("spec") or {}
    if REPLICA_SPECS in spec:
        patched: dict[str, Any] = {}
        for name, replica in (spec.get(REPLICA_SPECS) or {}).items():
            pod_spec = ((replica or {}).get("template") or {}).get("spec") or {}
            containers = _with_resume_env(pod_spec.get("containers") or [], max_step)
            patched[name] = {"template": {"spec": {"containers": containers}}}
        return {"spec": {REPLICA_SPECS: patched}}
    replicas = copy.deepcopy(spec.get("replicaSpecs") or [])
    for replica in replicas:
        pod_spec = replica.setdefault("template", {}).setdefault("spec", {})
        pod_spec["containers"] = _with_resume_env(pod_spec.get("containers") or [], max_step)
    return {"spec": {"replicaSpecs": replicas}}


def unsuspend_patch(job: dict[str, Any]) -> dict[str, Any] | None:
    """Merge patch that lifts ``runPolicy.suspend``, or ``None`` if the job is not suspended."""
    if not is_suspended(job):
        return None
    return {"spec": {"runPolicy": {"suspend": False}}}


def auto_resume_refusal(job: dict[str, Any]) -> tuple[str, str] | None:
    """Why the operator must not restart this job itself, as (reason, message), or ``None``."""
    annotations = (job.get("metadata") or {}).get("annotations") or {}
    if annotations.get(AUTO_RESUME_ANNOTATION) == "false":
        return "OptedOut", f'the job carries {AUTO_RESUME_ANNOTATION}: "false"'
    if annotations.get(HYPERPOD_AUTO_RESUME_ANNOTATION) == "true":
        return (
            "HyperPodAutoResume",
            f"the job has HyperPod's job auto-resume ({HYPERPOD_AUTO_RESUME_ANNOTATION}); "
            "hyperpod-sdc does not restart it, so two controllers never restart one job",
        )
    return None


def verified_checkpoints(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The verified checkpoints the job's agents reported, oldest first (annotation
    ``hyperpod-sdc.dev/checkpoints``; a damaged value reads as none)."""
    raw = ((job.get("metadata") or {}).get("annotations") or {}).get(CHECKPOINTS_ANNOTATION)
    try:
        found = json.loads(raw) if raw else []
    except ValueError:
        return []
    if not isinstance(found, list):
        return []
    good = [
        c
        for c in found
        if isinstance(c, dict)
        and isinstance(c.get("step"), int)
        and isinstance(c.get("location"), str)
    ]
    return sorted(good, key=lambda c: c["step"])


def checkpoint_patch(job: dict[str, Any], step: int, location: str) -> dict[str, Any] | None:
    """Merge patch that records a verified checkpoint (the newest 16 are kept), or ``None``
    if it is recorded already."""
    known = verified_checkpoints(job)
    if any(c["step"] == step and c["location"] == location for c in known):
        return None
    known = [c for c in known if c["step"] != step] + [{"step": step, "location": location}]
    known = sorted(known, key=lambda c: c["step"])[-MAX_CHECKPOINTS:]
    return {"metadata": {"annotations": {CHECKPOINTS_ANNOTATION: json.dumps(known)}}}


def newest_checkpoint(job: dict[str, Any], max_step: int) -> dict[str, Any] | None:
    """The newest verified checkpoint at or before ``max_step``, or ``None``."""
    return next((c for c in reversed(verified_checkpoints(job)) if c["step"] <= max_step), None)
