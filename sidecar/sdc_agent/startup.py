"""What a Guard checks before it starts: its arguments, and the settings every rank must
share (one all-gather that also exchanges the ranks' identities and the run id)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .config import GuardConfig
from .errors import ConfigError, SDCError
from .topology import Topology, exchange_identities, local_node_name

__all__ = ["start_up_exchange", "validate_arguments"]


def validate_arguments(
    model: nn.Module,
    optimizer: object,
    loss_fn: object,
    config: object,
    start_step: object,
    scaler: object,
) -> None:
    """Refuse what a Guard cannot take, naming the argument."""
    from .layout_fsdp import is_fsdp

    if not isinstance(model, DistributedDataParallel) and not is_fsdp(model):
        raise ConfigError(
            f"model: must be wrapped in torch.nn.parallel.DistributedDataParallel or be an "
            f"FSDP2 module (torch.distributed.fsdp.fully_shard), got {type(model).__name__}"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer: must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError("loss_fn: must be callable as loss_fn(model, batch)")
    if config is not None and not isinstance(config, GuardConfig):
        raise ConfigError(f"config: must be a GuardConfig, got {type(config).__name__}")
    if not isinstance(start_step, int) or start_step < 0:
        raise ConfigError(f"start_step: must be an integer >= 0, got {start_step!r}")
    if scaler is not None and not hasattr(scaler, "get_scale"):
        raise ConfigError(f"scaler: must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    if not dist.is_initialized():
        raise SDCError("torch.distributed is not initialized: call init_process_group first")


def start_up_exchange(
    *,
    config: GuardConfig,
    group: dist.ProcessGroup | None,
    comm_device: torch.device,
    agreed: Mapping[str, Any],
    model_device: torch.device | None = None,
) -> tuple[Topology, str]:
    """One all-gather: identities, the settings that must agree (``config``'s and
    ``agreed``), the run id. A collective; raises when the settings differ."""
    agreed = {**config.agreed(), **agreed}
    extra = {"agreed": agreed, "run_id": uuid.uuid4().hex[:16]}
    topology, extras = exchange_identities(
        group, local_node_name(config.node_name), comm_device, extra, model_device=model_device
    )
    differing = sorted(
        name
        for name in agreed
        if len({json.dumps(e["agreed"].get(name), sort_keys=True) for e in extras}) > 1
    )
    if differing:
        values = "; ".join(
            f"{name}: "
            + ", ".join(
                f"rank {topology.global_rank(r)}={e['agreed'].get(name)!r}"
                for r, e in enumerate(extras)
            )
            for name in differing[:4]
        )
        raise ConfigError(
            f"settings differ between ranks ({', '.join(differing)}), so ranks would run "
            f"different collectives and hang: {values}. Give every rank (the Master and "
            "the Worker templates) the same HYPERPOD_SDC_* settings"
        )
    return topology, str(extras[0]["run_id"])
