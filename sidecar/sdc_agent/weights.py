"""Check 3: data-parallel replicas must hold bit-identical weights after every update.

What is compared (:meth:`WeightFingerprints.tensors`): every parameter (frozen ones too:
corrupted memory of a frozen weight matters as much), and the optimizer state that
replicas hold alike by construction, per optimizer (:data:`REPLICATED_STATE`). Excluded:
buffers (DDP broadcasts them from rank 0 before each forward, and the forward then
updates them from each rank's own data); scalar counters such as Adam's ``step`` (a host
counter on CPU, and a one-element tensor the fingerprint kernel would have to be compiled
for on another device: a wrong one shows up in the weights at the next update anyway);
all state of optimizers that shard it across ranks (``ZeroRedundancyOptimizer``).
Optimizers that keep replicas apart by design (``PostLocalSGDOptimizer`` averages them
only every few steps) cannot be checked at all.

Sharded layouts (HSDP) hold replicas of each shard, not of the model: ``replica_classes``
gives each rank its shard's class, and each class is compared on its own (its ranks must
agree bit for bit; ranks of different classes hold different numbers). Every rank gathers
every rank's words in one all-gather, so every rank decides the same. A parameter (or
optimizer state) that is a ``DTensor`` is compared by its local shard.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .fingerprint import Fingerprinter, format_fingerprint

__all__ = [
    "REPLICATED_STATE",
    "MajoritySplit",
    "PendingComparison",
    "WeightFingerprints",
    "keeps_replicas_apart",
    "replicated_state_keys",
    "split_by_class",
    "split_majority",
]

REPLICATED_STATE: dict[str, tuple[str, ...]] = {
    "Adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "AdamW": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "NAdam": ("exp_avg", "exp_avg_sq"),
    "RAdam": ("exp_avg", "exp_avg_sq"),
    "Adamax": ("exp_avg", "exp_inf"),
    "SparseAdam": ("exp_avg", "exp_avg_sq"),
    "Adagrad": ("sum",),
    "Adadelta": ("square_avg", "acc_delta"),
    "RMSprop": ("square_avg", "momentum_buffer", "grad_avg"),
    "Rprop": ("prev", "step_size"),
    "SGD": ("momentum_buffer",),
    "ASGD": ("ax",),
}
"""Per-parameter state of torch's optimizers that every data-parallel replica holds bit
for bit alike (same gradients, same arithmetic). Other optimizers: every state tensor of
more than one element (a one-element tensor is taken for a counter)."""


def replicated_state_keys(optimizer: torch.optim.Optimizer) -> tuple[str, ...] | None:
    """The state keys compared for ``optimizer``; ``None``: every tensor of more than one
    element; ``()``: none (state sharded across ranks)."""
    if _is_sharded(optimizer):
        return ()
    return REPLICATED_STATE.get(type(optimizer).__name__)


def keeps_replicas_apart(optimizer: torch.optim.Optimizer) -> bool:
    return _is_a(optimizer, "torch.distributed.optim.post_localSGD_optimizer.PostLocalSGDOptimizer")


# Per-rank fingerprints go into the evidence up to this world size; beyond, only groups.
_EVIDENCE_MAX_RANKS = 64
# At most this many differing tensor names per suspect in the evidence.
_EVIDENCE_MAX_TENSORS = 8


def _is_sharded(optimizer: torch.optim.Optimizer) -> bool:
    return _is_a(
        optimizer, "torch.distributed.optim.zero_redundancy_optimizer.ZeroRedundancyOptimizer"
    )


def _is_a(obj: object, qualified_name: str) -> bool:
    """``isinstance`` by the class's qualified name, without importing its module.

    ``torch.distributed.optim`` binds the default process group into a default argument
    when it is imported: imported after ``init_process_group`` (as a check here would),
    it holds that group for good, ``destroy_process_group()`` no longer ends it, and
    gloo's threads outlive the training (see :func:`sdc_agent.layout._held_weakly`). An
    optimizer of one of its classes exists only once the user imported it anyway.
    """
    return any(f"{c.__module__}.{c.__qualname__}" == qualified_name for c in type(obj).__mro__)


@dataclass(frozen=True, slots=True)
class MajoritySplit:
    suspects: tuple[int, ...]
    """Indices whose value is outside the majority (every index when there is none)."""
    localized: bool
    """True when a strict majority agrees, so the rest can be named."""
    reference: int | None
    """The lowest index of the majority (or of the unique largest group), if any."""


def split_majority(values: Sequence[Hashable]) -> MajoritySplit | None:
    """``None`` when all values agree; else who disagrees with the strict majority.

    Without a strict majority (two replicas that differ, an even split) nobody can be
    singled out: every index outside a unique largest group is named, or every index when
    the largest groups tie, and ``localized`` is false.
    """
    counts = Counter(values)
    if len(counts) <= 1:
        return None
    ranked = counts.most_common()
    top_value, top_count = ranked[0]
    tie = len(ranked) > 1 and ranked[1][1] == top_count
    if tie:
        return MajoritySplit(tuple(range(len(values))), False, None)
    outside = tuple(i for i, v in enumerate(values) if v != top_value)
    reference = next(i for i, v in enumerate(values) if v == top_value)
    if top_count * 2 > len(values):
        return MajoritySplit(outside, True, reference)
    return MajoritySplit(outside, False, reference)


def split_by_class(
    values: Sequence[Hashable], classes: Sequence[int]
) -> tuple[MajoritySplit, dict[int, int]] | None:
    """:func:`split_majority` within each class of ranks (``classes[r]``: rank ``r``'s);
    ``None`` when every class agrees. The split names the suspects of every class that
    differs (ranks, not positions in the class), ``localized`` when each such class has a
    strict majority; the dict maps each differing class to its majority's lowest rank
    (absent: no majority)."""
    members: dict[int, list[int]] = {}
    for r, c in enumerate(classes):
        members.setdefault(c, []).append(r)
    suspects: list[int] = []
    localized = True
    references: dict[int, int] = {}
    for c, ranks in members.items():
        split = split_majority([values[r] for r in ranks])
        if split is None:
            continue
        suspects.extend(ranks[i] for i in split.suspects)
        localized = localized and split.localized
        if split.reference is not None:
            references[c] = ranks[split.reference]
    if not suspects:
        return None
    reference = min(references.values()) if references else None
    return MajoritySplit(tuple(sorted(suspects)), localized, reference), references


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard (a view), any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    if not callable(to_local):
        return t
    with torch.no_grad():
        return to_local()


class WeightFingerprints:
    """Fingerprints parameters (and optimizer state) and compares them across replicas."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        fingerprinter: Fingerprinter,
        include_optimizer_state: bool,
        replica_classes: Sequence[int] | None = None,
    ) -> None:
        self.module = module
        self.replica_classes = None if replica_classes is None else tuple(replica_classes)
        """Each rank's class of replicas (see the module docstring); ``None``: every rank
        is a replica of every other (DDP)."""
        self.optimizer = optimizer
        self.fingerprinter = fingerprinter
        self._cache: tuple[tuple[int, int], list[str], list[torch.Tensor]] | None = None
        self._sharded = False
        self._state_keys = replicated_state_keys(optimizer)
        if include_optimizer_state and _is_sharded(optimizer):
            warnings.warn(
                f"sdc_agent: {type(optimizer).__name__} shards its state across ranks, so "
                "only the parameters are compared across replicas",
                RuntimeWarning,
                stacklevel=3,
            )
            include_optimizer_state = False
        self.include_optimizer_state = include_optimizer_state

    def tensors(self) -> tuple[list[str], list[torch.Tensor]]:
        """Named tensors to compare, in a deterministic order (see the module docstring).

        Built once and again only when the optimizer's state is replaced or grows, so a
        weight check makes no Python pass over the parameters.
        """
        key = (id(self.optimizer.state), len(self.optimizer.state))
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1], self._locals(self._cache[2])
        names: list[str] = []
        tensors: list[torch.Tensor] = []
        keys = self._state_keys
        for name, param in self.module.named_parameters():
            names.append(name)
            tensors.append(param)
            if not self.include_optimizer_state:
                continue
            state = self.optimizer.state.get(param, {})
            chosen = sorted(state, key=str) if keys is None else [k for k in keys if k in state]
            for k in chosen:
                value = state[k]
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    names.append(f"{name}:{k}")
                    tensors.append(value)
        self._cache = (key, names, tensors)
        self._sharded = any(hasattr(t, "to_local") for t in tensors)
        return names, self._locals(tensors)

    def _locals(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        # A DTensor's local shard is taken at each check (a view; cheap), never cached:
        # what holds it may be replaced (a checkpoint load) while the DTensor stays.
        if not self._sharded:
            return tensors
        return [local_tensor(t) for t in tensors]

    def compare(
        self, group: dist.ProcessGroup | None, device: torch.device
    ) -> tuple[MajoritySplit | None, dict[str, object]]:
        """All-gather the combined fingerprint; on a mismatch find which tensors differ.

        A collective: every rank of ``group`` must call it at the same step. Returns the
        split (``None`` when every replica agrees) and evidence for a verdict. The same as
        ``self.start(group, device).finish()``.
        """
        return self.start(group, device).finish()

    def start(self, group: dist.ProcessGroup | None, device: torch.device) -> PendingComparison:
        """Fingerprint every tensor now and start the all-gather without waiting for it.

        The fingerprints are of the tensors as they are at this call; the training loop may
        go on (the next forward pass) while the words travel, and call
        :meth:`PendingComparison.finish` later, on every rank at the same point.
        """
        names, tensors = self.tensors()
        # One pass per device over every tensor (Fingerprinter.many, which runs under
        # no_grad), nothing copied to the host until finish() reads the gathered words.
        combined, per_tensor = self.fingerprinter.many(tensors)
        world = dist.get_world_size(group)
        mine = combined.to(device)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        work = dist.all_gather(gathered, mine, group=group, async_op=True)
        return PendingComparison(self, group, device, names, per_tensor, gathered, work)

    def _differing(
        self,
        split: MajoritySplit,
        names: list[str],
        per_tensor: torch.Tensor,
        group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> dict[str, list[str]]:
        # Compare against one majority replica's per-tensor fingerprints: broadcast them,
        # let every rank diff its own, gather the (short) lists of names.
        if self.replica_classes is not None:
            return self._differing_by_class(split, names, per_tensor, group, device)
        if split.reference is None:
            return {}
        # Replicas whose state holds different tensors cannot be compared tensor by tensor
        # (and a broadcast of different shapes would hang): check the counts first.
        world = dist.get_world_size(group)
        if not _counts_agree(per_tensor, world, group, device):
            return {}
        reference = per_tensor.to(device).clone()
        dist.broadcast(
            reference,
            dist.get_global_rank(group, split.reference) if group is not None else split.reference,
            group=group,
        )
        differs = (per_tensor.to(device) != reference).any(dim=1).nonzero().flatten()
        mine = torch.full((_EVIDENCE_MAX_TENSORS,), -1, dtype=torch.int64, device=device)
        mine[: min(len(differs), _EVIDENCE_MAX_TENSORS)] = differs[:_EVIDENCE_MAX_TENSORS]
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
        return {str(r): [names[i] for i in gathered[r].tolist() if i >= 0] for r in split.suspects}

    def _differing_by_class(
        self,
        split: MajoritySplit,
        names: list[str],
        per_tensor: torch.Tensor,
        group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> dict[str, list[str]]:
        # Each class has its own reference: gather every rank's per-tensor fingerprints
        # (the slow path, after a mismatch), each suspect is diffed against its class's.
        assert self.replica_classes is not None
        classes = self.replica_classes
        world = dist.get_world_size(group)
        if not _counts_agree(per_tensor, world, group, device):
            return {}
        mine = per_tensor.to(device).contiguous()
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
        found = split_by_class([tuple(g.flatten().tolist()) for g in gathered], classes)
        references = found[1] if found is not None else {}
        out: dict[str, list[str]] = {}
        for r in split.suspects:
            ref = references.get(classes[r])
            if ref is None:
                continue
            differs = (gathered[r] != gathered[ref]).any(dim=1).nonzero().flatten().tolist()
            out[str(r)] = [names[i] for i in differs[:_EVIDENCE_MAX_TENSORS]]
        return out


def _counts_agree(
    per_tensor: torch.Tensor,
    world: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> bool:
    """Whether every rank fingerprinted as many tensors as this one."""
    count = torch.tensor([per_tensor.shape[0]], dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    return len(set(torch.cat(counts).tolist())) == 1


class PendingComparison:
    """A check-3 comparison whose all-gather is in flight (:meth:`WeightFingerprints.start`)."""

    def __init__(
        self,
        weights: WeightFingerprints,
        group: dist.ProcessGroup | None,
        device: torch.device,
        names: list[str],
        per_tensor: torch.Tensor,
        gathered: list[torch.Tensor],
        work: dist.Work | None,
    ) -> None:
        self._weights = weights
        self._group = group
        self._device = device
        self._names = names
        self._per_tensor = per_tensor
        self._gathered = gathered
        self._work = work
        self._rows: list[tuple[int, ...]] | None = None
        self._host: torch.Tensor | None = None
        self._event: Any = None
        if work is not None and gathered and gathered[0].is_cuda:
            # NCCL: the wait orders the device's stream after the all-gather (the host goes
            # on), then the words move to pinned memory; reading them waits for that copy
            # only, not for the work queued after it (the next step's forward, backward).
            work.wait()
            self._work = None
            words = torch.stack(gathered)
            self._host = torch.empty(words.shape, dtype=words.dtype, pin_memory=True)
            self._host.copy_(words, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(words.device))

    def _read(self) -> list[tuple[int, ...]]:
        if self._rows is None:
            if self._host is not None:
                self._event.synchronize()
                words = self._host.numpy().tolist()  # host memory: no device read
            else:
                if self._work is not None:
                    self._work.wait()
                    self._work = None
                words = torch.stack(self._gathered).tolist()
            self._rows = [tuple(r) for r in words]
        return self._rows

    def agree(self) -> bool:
        """Wait for the words: whether every replica agrees. Not a collective (what
        :meth:`finish` adds on a mismatch is)."""
        classes = self._weights.replica_classes
        if classes is not None:
            return split_by_class(self._read(), classes) is None
        return split_majority(self._read()) is None

    def finish(self) -> tuple[MajoritySplit | None, dict[str, object]]:
        """Wait for the words; the split (``None``: every replica agrees) and evidence.

        A collective on a mismatch (the tensor-by-tensor comparison): every rank of the
        group must call it at the same point.
        """
        rows = self._read()
        classes = self._weights.replica_classes
        if classes is None:
            split = split_majority(rows)
        else:
            found = split_by_class(rows, classes)
            split = None if found is None else found[0]
        if split is None:
            return None, {}
        evidence: dict[str, object] = {
            "groups": sorted(Counter(format_fingerprint(r) for r in rows).values(), reverse=True),
        }
        if classes is not None:
            evidence["groups"] = {
                str(c): sorted(
                    Counter(
                        format_fingerprint(r) for r, k in zip(rows, classes, strict=True) if k == c
                    ).values(),
                    reverse=True,
                )
                for c in sorted(set(classes))
            }
        if len(rows) <= _EVIDENCE_MAX_RANKS:
            evidence["fingerprints"] = [format_fingerprint(r) for r in rows]
        evidence["differing_tensors"] = self._weights._differing(
            split, self._names, self._per_tensor, self._group, self._device
        )
        return split, evidence
