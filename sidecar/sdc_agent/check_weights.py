"""Check 3 as a unit: the replicas' weights (and optimizer state where cheap) compared by
fingerprint every ``weights_every`` steps, after the optimizer step (the fingerprints and
their comparison are :mod:`sdc_agent.weights`).

The minority differs from the majority and is the suspect. Diverged weights stay diverged
until the job restores a checkpoint: each new split is reported once, and no later step is
clean.

With ``overlap`` (the Guard sets it on CUDA), a check step's fingerprints are taken after
its optimizer step and their exchange runs during the next step's forward and backward:
the next step's :meth:`~WeightCheck.before_step` reads the result, before that step's
optimizer step, and holds it back on a mismatch. The checked step then counts toward
``last_clean_step`` from there (from :meth:`Guard.mark_checkpoint` too, where the words
agree).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .checks import CheckUnit, StepState
from .errors import ConfigError
from .topology import Topology
from .verdict import Verdict
from .weights import (
    MajoritySplit,
    PendingComparison,
    WeightFingerprints,
    keeps_replicas_apart,
)

__all__ = ["WeightCheck"]


class WeightCheck(CheckUnit):
    name = "weights"
    vouches = True

    def __init__(
        self,
        weights: WeightFingerprints,
        *,
        every: int,
        topology: Topology,
        group: dist.ProcessGroup | None,
        comm_device: torch.device,
        world_size: int,
        seconds: dict[str, float],
    ) -> None:
        self.weights = weights
        self.every = every
        self.topology = topology
        self.group = group
        self.comm_device = comm_device
        self.world_size = world_size
        self._seconds = seconds
        self.diverged = False
        """Check 3 failed: the replicas' weights differ until a checkpoint is restored."""
        self._reported: tuple[int, ...] = ()
        self._checked = False
        self.overlap = False
        """Finish a check step's exchange during the next step (see the module docstring)."""
        self._pending: tuple[StepState, PendingComparison] | None = None
        self._settled: tuple[int, bool] | None = None

    @staticmethod
    def refuse(optimizer: torch.optim.Optimizer, every: int) -> None:
        """Raise where the replicas are apart by design."""
        if every > 0 and keeps_replicas_apart(optimizer):
            raise ConfigError(
                "weights_every: PostLocalSGDOptimizer keeps the replicas apart between its "
                "averaging steps, so check 3 would accuse every rank; set weights_every=0"
            )

    def without_replicas(self) -> None:
        """No rank holds a replica of another's weights (pure FSDP): nothing to compare,
        so the check neither runs nor vouches for any step (the update check,
        :mod:`sdc_agent.check_update`, stands in for it)."""
        self.every = 0
        self.vouches = False

    @property
    def blocks_clean(self) -> bool:
        return self.diverged

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def after_step(self, state: StepState) -> None:
        self._checked = self.due(state.step)
        if not self._checked:
            return
        started = time.perf_counter()
        if self.overlap:
            self._pending = (state, self.weights.start(self.group, self.comm_device))
            self._seconds["weights"] += time.perf_counter() - started
            return
        verdict = self._verdict(state, *self.weights.compare(self.group, self.comm_device))
        self._seconds["weights"] += time.perf_counter() - started
        if verdict is not None:
            self._diverged(verdict, state.verdicts)

    def before_step(self, state: StepState) -> None:
        """The previous check step's exchange, overlapped with this step's forward and
        backward: a mismatch holds this step back. A collective on a mismatch."""
        found = self.finish_pending()
        if found is not None:
            state.hold = True
            state.late_verdicts.extend(found)

    def finish_pending(self) -> list[Verdict] | None:
        """Finish an overlapped exchange: ``None`` where there was none or the replicas
        agree, else the verdicts to report (none for a split already reported)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        checked, comparison = pending
        started = time.perf_counter()
        verdict = self._verdict(checked, *comparison.finish())
        self._seconds["weights"] += time.perf_counter() - started
        self._settled = (checked.step, verdict is None)
        if verdict is None:
            return None
        found: list[Verdict] = []
        self._diverged(verdict, found)
        return found

    def agree_pending(self) -> None:
        """Where an overlapped exchange shows every replica agreeing, settle it now (not a
        collective; a mismatch waits for the next step's checks)."""
        if self._pending is not None and self._pending[1].agree():
            self.finish_pending()

    def awaits(self, state: StepState) -> bool:
        return self._pending is not None and self._pending[0] is state

    def settled(self) -> tuple[int, bool] | None:
        settled, self._settled = self._settled, None
        return settled

    def vouched(self, state: StepState) -> bool:
        return self._checked or self.every == 0

    def restored(self, step: int) -> None:
        self.diverged = False
        self._reported = ()
        self._pending = None
        self._settled = None

    def _diverged(self, verdict: Verdict, verdicts: list[Verdict]) -> None:
        # Diverged weights stay diverged: report each new split once.
        if verdict.suspect_ranks != self._reported:
            verdicts.append(verdict)
            self._reported = verdict.suspect_ranks
        self.diverged = True

    def _verdict(
        self, state: StepState, split: MajoritySplit | None, evidence: dict[str, object]
    ) -> Verdict | None:
        if split is None:
            return None
        topology = self.topology
        suspects = tuple(topology.global_rank(r) for r in split.suspects)
        differing = evidence.get("differing_tensors")
        if isinstance(differing, dict):
            evidence["differing_tensors"] = {
                str(topology.global_rank(int(r))): names for r, names in differing.items()
            }
        classes = self.weights.replica_classes
        # The ranks the suspects are compared with: every rank (DDP), or the replicas of
        # the suspects' shards (HSDP).
        peers = (
            range(self.world_size)
            if classes is None
            else [
                r
                for r in range(self.world_size)
                if classes[r] in {classes[s] for s in split.suspects}
            ]
        )
        if split.localized and classes is not None:
            replicas = sum(1 for c in classes if c == classes[split.suspects[0]])
            message = (
                f"weights of rank(s) {', '.join(map(str, suspects))} differ from the "
                f"majority of the {replicas} replicas of their shard"
            )
        elif split.localized:
            message = (
                f"weights of rank(s) {', '.join(map(str, suspects))} differ from the "
                f"majority of {self.world_size} replicas"
            )
        else:
            message = (
                f"replica weights differ and no majority agrees (ranks "
                f"{', '.join(map(str, suspects))}): cannot tell which is wrong"
            )
        # A strict majority on at least two other nodes is independent evidence.
        majority_nodes = {topology.node_of(r) for r in peers if r not in split.suspects} - set(
            topology.nodes_of(split.suspects)
        )
        return Verdict(
            check="weights",
            step=state.step,
            classification="replica",
            suspect_ranks=suspects,
            suspect_nodes=topology.nodes_of(split.suspects),
            localized=split.localized,
            last_clean_step=state.last_clean_step,
            message=message,
            evidence=evidence,
            corroborated=split.localized and len(majority_nodes) >= 2,
        )
