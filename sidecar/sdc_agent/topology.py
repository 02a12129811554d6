"""Which rank runs on which node: exchanged once, at start-up, over the data-parallel group."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .gpu_identity import uuid_of_device

__all__ = [
    "RankIdentity",
    "Topology",
    "all_gather_bytes",
    "discover_topology",
    "exchange_identities",
    "local_node_name",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class RankIdentity:
    rank: int
    """Global rank."""
    node: str
    local_rank: int
    """Position among the ranks of the same node, in rank order."""
    pod: str | None
    gpu_uuid: str | None = None
    """The CUDA device's UUID (``GPU-...``) where CUDA reports one."""


@dataclass(frozen=True, slots=True)
class Topology:
    """Identities of the ranks of one data-parallel group, indexed by group rank."""

    ranks: tuple[RankIdentity, ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        """Node names in order of their lowest rank."""
        return tuple(dict.fromkeys(r.node for r in self.ranks))

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank].rank

    def node_of(self, group_rank: int) -> str:
        return self.ranks[group_rank].node

    def nodes_of(self, group_ranks: list[int] | tuple[int, ...]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.ranks[r].node for r in group_ranks))

    def local_world_size(self, node: str) -> int:
        return sum(1 for r in self.ranks if r.node == node)

    @classmethod
    def from_nodes(cls, nodes: list[str], global_ranks: list[int] | None = None) -> Topology:
        """Build from each group rank's node name (what :func:`discover_topology` gathers)."""
        seen: dict[str, int] = {}
        ranks = []
        for i, node in enumerate(nodes):
            local = seen.get(node, 0)
            seen[node] = local + 1
            rank = i if global_ranks is None else global_ranks[i]
            ranks.append(RankIdentity(rank=rank, node=node, local_rank=local, pod=None))
        return cls(tuple(ranks))


def local_node_name(configured: str | None = None) -> str:
    """``configured``, else env ``NODE_NAME`` (downward API), else the host name."""
    return configured or os.environ.get("NODE_NAME", "").strip() or socket.gethostname()


def discover_topology(
    group: dist.ProcessGroup | None,
    node: str,
    device: torch.device | None = None,
    extra: dict[str, Any] | None = None,
    *,
    model_device: torch.device | None = None,
) -> Topology:
    """All-gather every rank's node and pod name (a collective: every rank must call it)."""
    return exchange_identities(group, node, device, extra, model_device=model_device)[0]


def exchange_identities(
    group: dist.ProcessGroup | None,
    node: str,
    device: torch.device | None = None,
    extra: dict[str, Any] | None = None,
    *,
    model_device: torch.device | None = None,
) -> tuple[Topology, list[dict[str, Any]]]:
    """:func:`discover_topology`, and every rank's ``extra`` (JSON values), by group rank.

    The start-up exchange carries what ranks must agree on (settings, the run id), so
    that comparing it costs no second collective. ``device``: where the collective's
    tensors live (the model's device with NCCL; default: the CPU, or the current CUDA
    device for an NCCL group). ``model_device``: the GPU whose UUID this rank reports
    (default ``device``); with gloo the collectives run on the CPU while the model is on
    a GPU, which is not the current CUDA device where the rank never called
    ``set_device``.
    """
    mine = {
        "rank": dist.get_rank(),
        "node": node,
        "pod": os.environ.get("POD_NAME") or None,
        "gpu": _gpu_uuid(model_device if model_device is not None else device),
        "extra": extra or {},
    }
    gathered: list[dict[str, Any]] = [
        json.loads(raw) for raw in all_gather_bytes(json.dumps(mine).encode(), group, device)
    ]
    base = Topology.from_nodes(
        [str(g["node"]) for g in gathered if g is not None],
        [int(str(g["rank"])) for g in gathered if g is not None],
    )
    ranks = tuple(
        RankIdentity(
            rank=r.rank,
            node=r.node,
            local_rank=r.local_rank,
            pod=_text(g, "pod"),
            gpu_uuid=_text(g, "gpu"),
        )
        for r, g in zip(base.ranks, gathered, strict=True)
    )
    return Topology(ranks), [dict(g.get("extra") or {}) for g in gathered]


def all_gather_bytes(
    data: bytes, group: dist.ProcessGroup | None, device: torch.device | None = None
) -> list[bytes]:
    """Every rank's ``data``, by group rank (two tensor all-gathers, no pickling)."""
    world = dist.get_world_size(group)
    if device is None:
        backend = str(dist.get_backend(group))
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else None
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s.item()) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return [bytes(t[: int(n.item())].cpu().tolist()) for t, n in zip(out, sizes, strict=True)]


def _text(info: dict[str, object] | None, key: str) -> str | None:
    value = None if info is None else info.get(key)
    return str(value) if value else None


def _gpu_uuid(device: torch.device | None) -> str | None:
    """The UUID of the CUDA device the model is on, or ``None`` (not on CUDA, or not
    known for certain). From torch where CUDA is initialized; else without initializing
    it (:mod:`.gpu_identity`: the driver's listing and ``CUDA_VISIBLE_DEVICES``), the
    device numbered by its index, else by ``LOCAL_RANK`` (torchrun's, which is the device
    a rank takes by convention). ``None``: the current CUDA device, where CUDA is
    initialized."""
    if device is None:
        if not torch.cuda.is_initialized():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        return None
    if torch.cuda.is_initialized():
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            uuid = torch.cuda.get_device_properties(index).uuid
        except (RuntimeError, AttributeError):
            return None
        text = str(uuid)
        return text if text.startswith("GPU-") else f"GPU-{text}"
    index = device.index
    if index is None:
        local = os.environ.get("LOCAL_RANK", "")
        if not local.isdigit():
            return None
        index = int(local)
    return uuid_of_device(index)
