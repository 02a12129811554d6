"""A closed Guard that the caller drops is freed (DDP's comm hook holds it weakly), and the
model trains on exactly as plain DDP does."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sdc_agent
from sdc_agent.launch import spawn_local

pytestmark = pytest.mark.distributed


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, steps: int) -> None:
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        optimizer.zero_grad()
        _loss(model, (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))).backward()
        optimizer.step()


def _guard_dropped_then_plain_training(rank: int, world_size: int) -> tuple[bool, bool]:
    torch.manual_seed(0)
    guarded = DistributedDataParallel(nn.Linear(16, 4))
    torch.manual_seed(0)
    plain = DistributedDataParallel(nn.Linear(16, 4))
    opt_guarded = torch.optim.SGD(guarded.parameters(), lr=0.1)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    config = sdc_agent.GuardConfig(weights_every=1, replay_every=0, fingerprint_backend="eager")
    guard = sdc_agent.Guard(guarded, opt_guarded, _loss, config, reporter=None)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        guard.step((torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)))
    guard.close()
    gone = weakref.ref(guard)
    del guard
    gc.collect()
    freed = gone() is None
    # The same three steps on the plain model, then both train on through DDP alone.
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt_plain.zero_grad()
        _loss(plain, (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))).backward()
        opt_plain.step()
    _train(guarded, opt_guarded, rank, 4)
    _train(plain, opt_plain, rank, 4)
    same = all(
        torch.equal(a, b) for a, b in zip(guarded.parameters(), plain.parameters(), strict=True)
    )
    return freed, same


def test_a_dropped_guard_is_freed_and_its_model_trains_on_as_plain_ddp() -> None:
    results = spawn_local(_guard_dropped_then_plain_training, ["n0", "n1"])
    assert [freed for freed, _ in results] == [True] * 2, "the comm hook kept the Guard alive"
    assert [same for _, same in results] == [True] * 2, "training after the Guard differs"
