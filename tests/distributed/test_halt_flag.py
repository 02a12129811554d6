"""Check 1 off, the halt flag on: where only the operator-unreachable halt flag travels,
a training NaN in the last bucket's first element is no flag (it rides in a small
all-reduce of its own there, not in the bucket)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdc_agent.launch import free_port, spawn_local

pytestmark = pytest.mark.distributed

STEPS, BAD_STEP, BAD_RANK = 5, 3, 1


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _halt_only(rank: int, world: int, nan: bool) -> dict[str, Any]:
    from sdc_agent import Guard, GuardConfig
    from sdc_agent.faults import FaultSpec

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = DistributedDataParallel(net)  # one bucket: the fault's element 0 is its first
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2, fused=True)
    faults = (FaultSpec(rank=BAD_RANK, step=BAD_STEP, site="grad_local", kind="nan"),)
    config = GuardConfig(
        nonfinite_check=False,
        weights_every=0,
        replay_every=0,
        fingerprint_backend="eager",
        faults=faults if nan else (),
    )
    guard = Guard(ddp, optimizer, _loss, config)  # the reporter from the environment
    assert guard._stop_when_unreachable
    g = torch.Generator().manual_seed(rank)
    results = []
    for _ in range(STEPS):
        batch = (torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
        results.append(guard.step(batch))
    guard.close(timeout=0)
    return {
        "applied": [bool(r.applied) for r in results],
        "verdicts": [v.check for r in results for v in r.verdicts],
        "finite": all(bool(torch.isfinite(p).all()) for p in net.parameters()),
    }


def test_with_check_1_off_a_training_nan_is_not_a_halt_flag() -> None:
    env = {  # the halt policy is on: a reporter, nobody listening, no verdict to deliver
        "HYPERPOD_SDC_OPERATOR_URL": f"http://127.0.0.1:{free_port()}",
        "HYPERPOD_SDC_TOKEN_FILE": "",
    }
    clean = spawn_local(_halt_only, ["n0", "n1"], (False,), env=env, timeout=120)
    assert clean == [{"applied": [True] * STEPS, "verdicts": [], "finite": True}] * 2
    ranks = spawn_local(_halt_only, ["n0", "n1"], (True,), env=env, timeout=120)
    # Check 1 is off: the NaN step is applied on every rank, as without the Guard.
    assert ranks == [{"applied": [True] * STEPS, "verdicts": [], "finite": False}] * 2
