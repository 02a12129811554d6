"""What the operator keeps in memory: pods, nodes, jobs, namespaces, policies, incidents.

Each is an :class:`~.informer.Informer` (one per watched namespace for namespaced kinds)
holding only what the operator reads, so memory grows with the cluster by a few hundred
bytes per pod and node, not by their full specs (docs/operator.md, "Memory"):

- a pod: name, uid, generate name, creation time, its controlling owner, labels, our
  annotations (the attestation), node; for a confirmation pod also its container's state
  and restarts, its scheduling condition and why it stopped (its result), and its
  containers' names and images;
- a node: name, labels, our annotations, providerID, unschedulable, taints, addresses,
  boot id;
- a job: name, uid, annotations, ``runPolicy.suspend`` and its replica counts;
- a namespace: its labels; an ``SDCPolicy`` and an ``SDCIncident``: whole.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from . import confirmation, jobs
from .informer import ChangeHandler, Informer, Projection
from .jobshape import GPU_RESOURCES
from .kube import INCIDENTS, Kube
from .names import GROUP, INCIDENT_PLURAL, POLICY_PLURAL

__all__ = [
    "Caches",
    "InformerSet",
    "project_job",
    "project_namespace",
    "project_node",
    "project_pod",
]

_OURS = GROUP + "/"
_KEPT_META = ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
_KEPT_FOREIGN_ANNOTATIONS = frozenset(
    {"sagemaker.amazonaws.com/enable-job-auto-resume", "kueue.x-k8s.io/queue-name"}
)


def _meta(meta: dict[str, Any], *, labels: bool = True) -> dict[str, Any]:
    out = {k: meta[k] for k in _KEPT_META if k in meta}
    if labels and meta.get("labels"):
        out["labels"] = dict(meta["labels"])
    annotations = {
        k: v
        for k, v in (meta.get("annotations") or {}).items()
        if k.startswith(_OURS) or k in _KEPT_FOREIGN_ANNOTATIONS
    }
    if annotations:
        out["annotations"] = annotations
    return out


def project_pod(pod: dict[str, Any]) -> dict[str, Any]:
    meta = pod.get("metadata") or {}
    kept = _meta(meta)
    for key in ("generateName", "deletionTimestamp"):
        if meta.get(key):
            kept[key] = meta[key]
    owners = [dict(r) for r in meta.get("ownerReferences") or [] if r.get("controller")]
    if owners:
        kept["ownerReferences"] = owners
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    kept_status: dict[str, Any] = {"phase": status.get("phase")}
    kept_spec = {k: spec[k] for k in ("nodeName", "serviceAccountName") if spec.get(k)}
    if (kept.get("labels") or {}).get(confirmation.CONFIRMATION_LABEL) == "true":
        kept_status.update(_confirmation_status(status))
        # what its result is read against: its images, and whether anything was added
        for key in ("initContainers", "containers", "ephemeralContainers"):
            if spec.get(key):
                kept_spec[key] = [
                    {"name": c.get("name"), "image": c.get("image")} for c in spec[key]
                ]
    return {"metadata": kept, "spec": kept_spec, "status": kept_status}


def _confirmation_status(status: dict[str, Any]) -> dict[str, Any]:
    """What a confirmation pod's result is read from (a few kilobytes: one pod per
    incident): why the pod stopped, whether it was scheduled, its container's state."""
    out: dict[str, Any] = {k: status[k] for k in ("reason", "message", "startTime") if k in status}
    scheduled = [
        {k: c[k] for k in ("type", "status", "reason", "message") if k in c}
        for c in status.get("conditions") or []
        if c.get("type") == "PodScheduled"
    ]
    if scheduled:
        out["conditions"] = scheduled
    containers = [
        {
            "name": c.get("name"),
            "state": dict(c.get("state") or {}),
            "restartCount": int(c.get("restartCount") or 0),
        }
        for c in status.get("containerStatuses") or []
        if c.get("name") == confirmation.CONTAINER
    ]
    if containers:
        out["containerStatuses"] = containers
    return out


def project_node(node: dict[str, Any]) -> dict[str, Any]:
    spec = node.get("spec") or {}
    status = node.get("status") or {}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": _meta(node.get("metadata") or {}),
        "spec": {k: spec[k] for k in ("providerID", "unschedulable", "taints") if k in spec},
        "status": {
            "addresses": list(status.get("addresses") or []),
            "nodeInfo": {"bootID": (status.get("nodeInfo") or {}).get("bootID", "")},
            # the accelerators a confirmation pod asks for, all of them
            "allocatable": {
                k: v for k, v in (status.get("allocatable") or {}).items() if k in GPU_RESOURCES
            },
        },
    }


def project_job(job: dict[str, Any]) -> dict[str, Any]:
    spec = job.get("spec") or {}
    kept_spec: dict[str, Any] = {"runPolicy": {"suspend": jobs.is_suspended(job)}}
    if jobs.REPLICA_SPECS in spec:
        kept_spec[jobs.REPLICA_SPECS] = {
            name: {"replicas": (replica or {}).get("replicas", 1)}
            for name, replica in (spec.get(jobs.REPLICA_SPECS) or {}).items()
        }
    else:
        kept_spec["replicaSpecs"] = [
            {"name": (r or {}).get("name"), "replicas": (r or {}).get("replicas", 1)}
            for r in spec.get("replicaSpecs") or []
        ]
    meta = _meta(job.get("metadata") or {})
    return {
        "apiVersion": job.get("apiVersion"),
        "kind": job.get("kind"),
        "metadata": meta,
        "spec": kept_spec,
    }


def project_namespace(namespace: dict[str, Any]) -> dict[str, Any]:
    meta = namespace.get("metadata") or {}
    return {
        "metadata": {k: meta[k] for k in ("name", "uid", "resourceVersion", "labels") if k in meta}
    }


class InformerSet:
    """One kind across several namespaces (one informer each), read as one."""

    def __init__(
        self,
        kube: Kube,
        api_version: str,
        plural: str,
        namespaces: Sequence[str | None],
        *,
        project: Projection | None = None,
        on_change: ChangeHandler | None = None,
    ) -> None:
        self.members = {
            ns: Informer(kube, api_version, plural, ns, project=project, on_change=on_change)
            for ns in namespaces
        }
        self._cluster_wide = None in self.members

    def _for(self, namespace: str | None) -> Informer | None:
        if self._cluster_wide:
            return self.members[None]
        return self.members.get(namespace)

    def get(self, namespace: str | None, name: str) -> dict[str, Any] | None:
        informer = self._for(namespace)
        return informer.get(namespace, name) if informer is not None else None

    def values(self) -> list[dict[str, Any]]:
        return [obj for informer in self.members.values() for obj in informer.values()]

    def add_index(self, name: str, indexer: Any) -> None:
        for informer in self.members.values():
            informer.add_index(name, indexer)

    def by(self, index: str, value: Hashable) -> list[dict[str, Any]]:
        return [obj for informer in self.members.values() for obj in informer.by(index, value)]

    def upsert(self, obj: dict[str, Any]) -> None:
        informer = self._for((obj.get("metadata") or {}).get("namespace"))
        if informer is not None:
            informer.upsert(obj)

    def forget(self, obj: dict[str, Any]) -> None:
        informer = self._for((obj.get("metadata") or {}).get("namespace"))
        if informer is not None:
            informer.forget(obj)

    def watches(self, namespace: str | None) -> bool:
        return self._for(namespace) is not None

    @property
    def absent(self) -> bool:
        return all(i.absent for i in self.members.values())

    def informers(self) -> Iterable[Informer]:
        return self.members.values()


def _owner_uid(pod: dict[str, Any]) -> list[str]:
    return [
        str(r.get("uid"))
        for r in (pod.get("metadata") or {}).get("ownerReferences") or []
        if r.get("controller")
    ]


def _confirmation_pod(pod: dict[str, Any]) -> list[bool]:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return [True] if labels.get(confirmation.CONFIRMATION_LABEL) == "true" else []


def _job_uid(incident: dict[str, Any]) -> list[str]:
    uid = ((incident.get("spec") or {}).get("job") or {}).get("uid")
    return [str(uid)] if uid else []


class Caches:
    """Every cache the operator reads; :meth:`synced` once all have listed."""

    def __init__(
        self,
        kube: Kube,
        namespaces: Sequence[str],
        *,
        on_incident: ChangeHandler | None = None,
        on_pod: ChangeHandler | None = None,
        on_policy: ChangeHandler | None = None,
    ) -> None:
        scope: list[str | None] = list(namespaces) or [None]
        self.pods = InformerSet(kube, "v1", "pods", scope, project=project_pod, on_change=on_pod)
        self.pods.add_index("owner", _owner_uid)
        self.pods.add_index("confirmation", _confirmation_pod)
        self.nodes = Informer(kube, "v1", "nodes", project=project_node)
        self.jobs = {
            key: InformerSet(kube, key[0], plural, scope, project=project_job)
            for key, plural in jobs.JOB_KINDS.items()
        }
        self.namespaces = Informer(kube, "v1", "namespaces", project=project_namespace)
        self.policies = Informer(kube, f"{GROUP}/v1alpha1", POLICY_PLURAL, on_change=on_policy)
        self.incidents = InformerSet(kube, INCIDENTS, INCIDENT_PLURAL, scope, on_change=on_incident)
        self.incidents.add_index("job", _job_uid)

    def informers(self) -> list[Informer]:
        out: list[Informer] = [self.nodes, self.namespaces, self.policies]
        for group in (self.pods, self.incidents, *self.jobs.values()):
            out += list(group.informers())
        return out

    def start(self) -> None:
        for informer in self.informers():
            informer.start()

    async def stop(self) -> None:
        for informer in self.informers():
            await informer.stop()

    def synced(self) -> bool:
        return all(i.synced.is_set() for i in self.informers())

    def job(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        group = self.jobs.get((api_version, kind))
        return group.get(namespace, name) if group is not None else None

    def namespace_labels(self, namespace: str) -> dict[str, str] | None:
        found = self.namespaces.get(None, namespace)
        if found is None:
            return None
        return dict((found.get("metadata") or {}).get("labels") or {})

    def pods_of(self, owner_uid: str) -> list[dict[str, Any]]:
        return self.pods.by("owner", owner_uid)

    def confirmation_pods(self) -> list[dict[str, Any]]:
        return self.pods.by("confirmation", True)

    def incidents_of(self, job_uid: str) -> list[dict[str, Any]]:
        return self.incidents.by("job", job_uid)
