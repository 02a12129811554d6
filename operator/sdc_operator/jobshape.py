"""What the audit can do for a job of a given shape: pure, on the job as a dict.

The ring replay audit (check 2) needs at least three nodes to name a suspect, and audits
only ranks whose partner (the rank ``ranks per node`` further on) is on another node
(docs/agent.md). A job whose shape prevents that still runs, guarded by checks 1 and 3;
the operator says so in an Event on the job.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["accelerators", "audit_limits", "replica_shapes"]

GPU_RESOURCES = ("nvidia.com/gpu", "aws.amazon.com/neuron", "aws.amazon.com/neuroncore")


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def _devices(template: Mapping[str, Any]) -> int | None:
    """Accelerators the pod's containers ask for: its ranks, where torchrun's
    ``--nproc-per-node`` is ``gpu`` or ``auto``."""
    total = 0
    for container in (template.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        for source in (resources.get("limits") or {}, resources.get("requests") or {}):
            found = [_int(source.get(r)) for r in GPU_RESOURCES if source.get(r) is not None]
            if found:
                total += sum(n or 0 for n in found)
                break
    return total or None


def replica_shapes(job: Mapping[str, Any]) -> list[tuple[str, int, int | None]]:
    """(replica type, pods, ranks per pod or ``None`` if unknown) of each replica spec."""
    spec = job.get("spec") or {}
    nproc = _int(spec.get("nprocPerNode")) or _int(
        (spec.get("elasticPolicy") or {}).get("nProcPerNode")
    )
    if "pytorchReplicaSpecs" in spec:
        replicas = [
            (name, r or {}) for name, r in sorted((spec.get("pytorchReplicaSpecs") or {}).items())
        ]
    else:
        replicas = [
            (str((r or {}).get("name") or i), r or {})
            for i, r in enumerate(spec.get("replicaSpecs") or [])
        ]
    shapes = []
    for name, replica in replicas:
        pods = _int(replica.get("replicas"))
        pods = 1 if pods is None else pods
        ranks = nproc if nproc is not None else _devices(replica.get("template") or {})
        shapes.append((name, pods, ranks))
    return shapes


def accelerators(job: Mapping[str, Any]) -> int | None:
    """The job's ranks (one per accelerator: ``nprocPerNode`` or the accelerators its pods
    ask for) over all its pods, or ``None`` where a replica spec does not say."""
    shapes = [s for s in replica_shapes(job) if s[1] > 0]
    if not shapes or any(ranks is None for _, _, ranks in shapes):
        return None
    return sum(pods * (ranks or 0) for _, pods, ranks in shapes) or None


def audit_limits(job: Mapping[str, Any]) -> list[str]:
    """What the audit cannot do for this job, in words (empty: nothing to say). One pod is
    one node: training pods ask for every accelerator of their node."""
    shapes = [s for s in replica_shapes(job) if s[1] > 0]
    nodes = sum(pods for _, pods, _ in shapes)
    limits = []
    if nodes == 1:
        limits.append(
            "it runs on 1 node: no other node checks its work, so the replay audit (check 2) "
            "does not run, and a fault that checks 1 and 3 find cannot reach the agreement of "
            "two nodes the operator needs before it stops the job or quarantines a node"
        )
    elif nodes == 2:
        limits.append(
            "it runs on 2 nodes: the replay audit (check 2) sees that they disagree but needs a "
            "third node to tell which one computed wrong, so such a fault stops the job "
            "without quarantining either node"
        )
    ranks = {r for _, pods, r in shapes if r is not None}
    if len(ranks) > 1:
        per_type = ", ".join(f"{name}: {r}" for name, _, r in shapes if r is not None)
        limits.append(
            f"its pods run uneven numbers of ranks ({per_type}): ranks whose replay partner "
            "would be on their own node are left out of the replay audit"
        )
    return limits
