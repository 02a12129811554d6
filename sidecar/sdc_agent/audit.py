"""Runs check 2 inside a Guard: captures the audited micro-batch, replays, compares."""

from __future__ import annotations

import dataclasses
import os
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .faults import FaultInjector, FaultSpec, corrupt_
from .fingerprint import Fingerprinter
from .replay import (
    Payload,
    ReplayFinding,
    choose_tiebreakers,
    combine_per_parameter,
    exchange,
    explain_mismatches,
    gradient_fingerprint,
    loss_bits,
    plan_ring,
    replay,
    resolve,
    storm_threshold,
)
from .topology import Topology

__all__ = ["AuditOutcome", "ReplayAudit", "ReplayStats"]


@dataclass(slots=True)
class ReplayStats:
    """Counts since the Guard started; in ``calibrate`` mode, the answer to "is my model
    deterministic?" is ``mismatches == 0``."""

    audits: int = 0
    comparisons: int = 0
    mismatches: int = 0
    loss_mismatches: int = 0
    mismatch_steps: list[int] = field(default_factory=list)

    @property
    def mismatch_rate(self) -> float:
        return self.mismatches / self.comparisons if self.comparisons else 0.0


@dataclass(frozen=True, slots=True)
class AuditOutcome:
    finding: ReplayFinding | None
    evidence: dict[str, Any]


class ReplayAudit:
    """The per-rank side of check 2 (group ranks throughout)."""

    def __init__(
        self,
        *,
        module: nn.Module,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None,
        topology: Topology,
        group: dist.ProcessGroup | None,
        comm_device: torch.device,
        fingerprinter: Fingerprinter,
        injector: FaultInjector,
        every: int,
        probability: float,
        calibrate: bool,
    ) -> None:
        self.module = module
        self.loss_fn = loss_fn
        self.topology = topology
        self.group = group
        self.comm_device = comm_device
        self.fingerprinter = fingerprinter
        self.injector = injector
        self.every = every
        self.probability = probability
        self.calibrate = calibrate
        self.me = dist.get_rank(group)
        nodes = [r.node for r in topology.ranks]
        self.nodes = nodes
        self.replayer_of = plan_ring(nodes)
        self.partner_of = {r: p for p, r in self.replayer_of.items()}
        self.params = [p for p in module.parameters() if p.requires_grad]
        first = next(iter(self.params), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.stats = ReplayStats()
        self.max_mismatches = storm_threshold(len(nodes))
        missing = sorted(set(range(len(nodes))) - set(self.replayer_of))
        if missing and (every or probability):
            warnings.warn(
                f"sdc_agent: the replay audit cannot cover rank(s) {missing}: no other node "
                "in the ring (it needs at least two nodes with the same number of ranks)",
                RuntimeWarning,
                stacklevel=3,
            )
        self._schedule = random.Random(self._shared_seed() if probability > 0 else 0)
        self.due = False
        self.payload: Payload | None = None
        self.own_loss: torch.Tensor | None = None
        self._own_fps: dict[int, torch.Tensor] = {}
        self._bucket0: list[tuple[torch.Tensor, int, int]] | None = None

    def _shared_seed(self) -> int:
        # Group rank 0 draws, everyone adds: the same seed on every rank.
        seed = torch.zeros(1, dtype=torch.int64, device=self.comm_device)
        if self.me == 0:
            seed[0] = int.from_bytes(os.urandom(7), "little")
        dist.all_reduce(seed, group=self.group)
        return int(seed.item())

    # -- during the step -----------------------------------------------------------------

    def begin(self, step: int) -> None:
        scheduled = self.every > 0 and step % self.every == 0
        # Draw every step, audited or not, so all ranks stay on the same sequence.
        drawn = self.probability > 0 and self._schedule.random() < self.probability
        self.due = (scheduled or drawn) and self.loss_fn is not None
        self.payload = None
        self.own_loss = None
        self._own_fps = {}

    @property
    def capturing_in_hook(self) -> bool:
        return self.due and self.payload is not None and self.payload.divisor == 1

    def observe_bucket(self, bucket: dist.GradBucket) -> None:
        """From the comm hook, before the all-reduce: remember each local gradient."""
        # Where bucket 0's gradients sit, for replaying local-gradient faults (drills only;
        # recorded every step because DDP may rebuild its buckets after the first).
        if bucket.index() == 0 and self.injector:
            base = bucket.buffer().data_ptr()
            size = bucket.buffer().element_size()
            self._bucket0 = [
                (p, (g.data_ptr() - base) // size, g.numel())
                for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)
            ]
        if self.capturing_in_hook:
            for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
                self._own_fps[id(p)] = self.fingerprinter(g)

    def observe_grads(self) -> None:
        """After the audited micro-batch's backward under ``no_sync`` (accumulation)."""
        if self.due:
            for p in self.params:
                if p.grad is not None:
                    self._own_fps[id(p)] = self.fingerprinter(p.grad)

    def _own_row(self) -> torch.Tensor:
        fp = combine_per_parameter([self._own_fps.get(id(p)) for p in self.params], self.device)
        assert self.own_loss is not None
        return torch.cat([loss_bits(self.own_loss).reshape(1).to(self.device), fp])

    def _replay(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(loss, gradient fingerprint, non-finite?) of ``payload`` recomputed here."""
        assert self.loss_fn is not None
        result = replay(self.module, self.params, self.loss_fn, payload, self.device)
        grads = result.grads
        self._inject_replay_grads(grads)
        fp = gradient_fingerprint(grads, self.fingerprinter, self.device)
        finite = bool(torch.isfinite(result.loss).all()) and all(
            bool(torch.isfinite(torch.stack(torch.aminmax(g))).all())
            for g in grads
            if g is not None and g.numel()
        )
        return result.loss, fp, not finite

    def _inject_replay_grads(self, grads: list[torch.Tensor | None]) -> None:
        # The same local-gradient faults as the comm hook applies to real gradients.
        index_of = {id(p): i for i, p in enumerate(self.params)}
        for spec in self.injector.pending("grad_local"):
            if spec.target is not None:
                named = dict(self.module.named_parameters())
                hits = [(index_of[id(named[spec.target])], spec.index)]
            elif self._bucket0 is not None:
                hits = [
                    (index_of[id(p)], None if spec.index is None else spec.index - off)
                    for p, off, n in self._bucket0
                    if spec.index is None or off <= spec.index < off + n
                ]
            else:
                continue
            if not self.injector.fire(spec):
                continue
            for i, index in hits:
                g = grads[i]
                if g is not None:
                    g = g.clone()
                    corrupt_(g, spec if index == spec.index else _at(spec, index))
                    grads[i] = g

    # -- after backward ------------------------------------------------------------------

    def audit(self) -> AuditOutcome:
        """Compare this step's audited micro-batches across the ring. A collective."""
        me = self.me
        assert self.payload is not None
        sends = {self.replayer_of[me]: self.payload.to_bytes()} if me in self.replayer_of else {}
        partner = self.partner_of.get(me)
        received = exchange(
            sends, [partner] if partner is not None else [], self.group, self.comm_device
        )
        row = torch.zeros(6, dtype=torch.int64, device=self.device)
        row[0:3] = self._own_row()
        if partner is not None:
            loss, fp, _ = self._replay(Payload.from_bytes(received[partner]))
            row[3] = loss_bits(loss)
            row[4:6] = fp
        table = self._gather(row)
        mismatched = [p for p, r in self.replayer_of.items() if table[p][0:3] != table[r][3:6]]
        self.stats.audits += 1
        self.stats.comparisons += len(self.replayer_of)
        self.stats.mismatches += len(mismatched)
        self.stats.loss_mismatches += sum(
            table[p][0] != table[self.replayer_of[p]][3] for p in mismatched
        )
        if not mismatched:
            return AuditOutcome(None, {})
        evidence: dict[str, Any] = {
            "mismatches": [
                {
                    "work_of": self.topology.global_rank(p),
                    "replayed_by": self.topology.global_rank(self.replayer_of[p]),
                    "loss_equal": table[p][0] == table[self.replayer_of[p]][3],
                    "gradients_equal": table[p][1:3] == table[self.replayer_of[p]][4:6],
                }
                for p in mismatched
            ]
        }
        if self.calibrate:
            return AuditOutcome(None, evidence)
        explanation = explain_mismatches(
            mismatched, self.replayer_of, max_mismatches=self.max_mismatches
        )
        involved = {r for p in mismatched for r in (p, self.replayer_of[p])}
        tiebreakers = choose_tiebreakers(
            explanation.unexplained, self.replayer_of, self.nodes, involved
        )
        outcomes = self._tiebreak(tiebreakers, table) if tiebreakers else {}
        if tiebreakers:
            evidence["tiebreaks"] = [
                {
                    "work_of": self.topology.global_rank(p),
                    "replayed_by": self.topology.global_rank(t),
                    "agrees_with": outcomes[p],
                }
                for p, t in tiebreakers.items()
            ]
        return AuditOutcome(resolve(explanation, self.replayer_of, outcomes), evidence)

    def _tiebreak(self, tiebreakers: dict[int, int], table: list[list[int]]) -> dict[int, str]:
        me = self.me
        assert self.payload is not None
        sends = {t: self.payload.to_bytes() for p, t in tiebreakers.items() if p == me}
        sources = [p for p, t in tiebreakers.items() if t == me]
        received = exchange(sends, sources, self.group, self.comm_device)
        row = torch.zeros(3, dtype=torch.int64, device=self.device)
        for p in sources:
            loss, fp, _ = self._replay(Payload.from_bytes(received[p]))
            row[0] = loss_bits(loss)
            row[1:3] = fp
        third = self._gather(row)
        outcomes = {}
        for p, t in tiebreakers.items():
            if third[t] == table[p][0:3]:
                outcomes[p] = "original"
            elif third[t] == table[self.replayer_of[p]][3:6]:
                outcomes[p] = "replay"
            else:
                outcomes[p] = "neither"
        return outcomes

    def replay_nonfinite(self, suspects: tuple[int, ...]) -> dict[int, bool]:
        """Replay each suspect's micro-batch on its ring partner node. A collective.

        Returns, per suspect that could be replayed, whether the replay was non-finite
        too (then it is the data or the model, not the hardware).
        """
        me = self.me
        targets = {p: self.replayer_of[p] for p in suspects if p in self.replayer_of}
        sends = {}
        if me in targets and self.payload is not None:
            sends = {targets[me]: self.payload.to_bytes()}
        sources = [p for p, r in targets.items() if r == me]
        received = exchange(sends, sources, self.group, self.comm_device)
        row = torch.full((1,), -1, dtype=torch.int64, device=self.device)
        for p in sources:
            _, _, nonfinite = self._replay(Payload.from_bytes(received[p]))
            row[0] = int(nonfinite)
        flags = self._gather(row)
        return {p: bool(flags[r][0]) for p, r in targets.items() if flags[r][0] >= 0}

    def _gather(self, row: torch.Tensor) -> list[list[int]]:
        world = dist.get_world_size(self.group)
        mine = row.to(self.comm_device)
        out = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(out, mine, group=self.group)
        return [t.tolist() for t in out]


def _at(spec: FaultSpec, index: int | None) -> FaultSpec:
    return dataclasses.replace(spec, index=index)
