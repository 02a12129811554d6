"""The Guard's check units, built for one layout: check 1 (non-finite flags), the replay
audit (check 2), check 3 (the replicas' weights) and, where no shard has a replica (pure
FSDP), the update check; with what they share (the fingerprinter, the evidence bundles,
the seconds each check took since the last heartbeat)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .audit import ReplayAudit
from .bundling import EvidenceKeeper
from .check_nonfinite import NonFiniteCheck
from .check_replay import ReplayCheck
from .check_update import UpdateCheck
from .check_weights import WeightCheck
from .checks import CheckUnit
from .config import GuardConfig
from .fingerprint import Fingerprinter
from .layout import ParallelLayout
from .reporting import CHECKS
from .topology import Topology
from .weights import WeightFingerprints

__all__ = ["CheckSet", "build_checks"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass(slots=True)
class CheckSet:
    seconds: dict[str, float]
    """Each check's seconds since the last heartbeat."""
    fingerprinter: Fingerprinter
    audit: ReplayAudit
    evidence: EvidenceKeeper
    nonfinite: NonFiniteCheck
    replay: ReplayCheck
    weights: WeightCheck
    update: UpdateCheck | None
    units: tuple[CheckUnit, ...]
    """In the order the Guard calls them."""


def build_checks(
    *,
    layout: ParallelLayout,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn | None,
    config: GuardConfig,
    topology: Topology,
    run_id: str,
    scaled: bool,
    loss_scale: Callable[[], float | None],
) -> CheckSet:
    seconds = dict.fromkeys(CHECKS, 0.0)  # since the last heartbeat
    fingerprinter = Fingerprinter(config.fingerprint_backend)
    weights = WeightFingerprints(
        layout.module,
        optimizer,
        fingerprinter,
        config.weights_include_optimizer_state,
        layout.replica_classes,
    )
    _warm_up(fingerprinter, config, layout.module, layout.device)
    audit = ReplayAudit(
        module=layout.module,
        loss_fn=loss_fn,
        topology=topology,
        group=layout.group,
        comm_device=layout.comm_device,
        fingerprinter=fingerprinter,
        injector=layout.injector,
        every=config.replay_every,
        probability=config.replay_probability,
        calibrate=config.replay_mode == "calibrate",
        params=layout.unsharded,
        grads_by_hook=layout.grads_by_hook,
        replaying=layout.replaying,
    )
    evidence = EvidenceKeeper(config.bundles, layout.group, layout.comm_device, layout.group_rank)
    nonfinite = NonFiniteCheck(
        enabled=config.nonfinite_check,
        topology=topology,
        audit=audit,
        scaled=scaled,
        collective=layout.collective,
    )
    replay = ReplayCheck(
        audit,
        enabled=config.replay_enabled,
        topology=topology,
        module=layout.module,
        group_rank=layout.group_rank,
        evidence=evidence,
        run_id=run_id,
        loss_scale=loss_scale,
        seconds=seconds,
    )
    weight_check = WeightCheck(
        weights,
        every=config.weights_every,
        topology=topology,
        group=layout.group,
        comm_device=layout.comm_device,
        world_size=layout.world_size,
        seconds=seconds,
    )
    units: tuple[CheckUnit, ...] = (nonfinite, replay, weight_check)
    update: UpdateCheck | None = None
    classes = layout.replica_classes
    if classes is not None and len(set(classes)) == len(classes):
        # Pure FSDP: no shard has a replica, check 3 has nothing to compare; the update
        # check recomputes a slice of every shard's update on two other nodes instead.
        weight_check.without_replicas()
        update = UpdateCheck(
            module=layout.module,
            optimizer=optimizer,
            fingerprinter=fingerprinter,
            every=config.weights_every,
            slices=config.update_slices,
            topology=topology,
            comm_device=layout.comm_device,
            seconds=seconds,
        )
        units += (update,)
    return CheckSet(
        seconds, fingerprinter, audit, evidence, nonfinite, replay, weight_check, update, units
    )


def _warm_up(
    fingerprinter: Fingerprinter, config: GuardConfig, module: nn.Module, device: torch.device
) -> None:
    if config.weights_every <= 0 and not config.replay_enabled:
        return
    params = list(module.parameters())
    if not params:
        return
    # Compile the fingerprint kernels now, not in the middle of training, and under
    # no_grad: the hooks and the weight check fingerprint without grad mode, and
    # torch.compile guards on it (a kernel warmed up with grad mode on recompiles).
    dtypes = {p.dtype for p in params} | {torch.float32}
    with torch.no_grad():
        fingerprinter.warm_up(dtypes, device)
