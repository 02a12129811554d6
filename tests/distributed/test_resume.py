"""A run resumed from a checkpoint reproduces the uninterrupted run bit for bit."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from sdc_agent.launch import spawn_local

# slow: six-rank runs, interrupted and resumed (about 2 min on 2 cores)
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

NODES = ["n0", "n0", "n1", "n1", "n2", "n2"]  # six ranks: sums of six depend on their order
STEPS = 12


def _train(rank: int, world: int, root: str, start: int, save_at: int) -> str:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from sdc_agent import Guard, GuardConfig

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    path = Path(root) / f"step_{save_at}.pt"
    if start:
        state = torch.load(path)
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    model = DistributedDataParallel(net)

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(m(batch[0]), batch[1])

    config = GuardConfig(replay_every=4, weights_every=4, fingerprint_backend="eager")
    guard = Guard(model, optimizer, loss_fn, config=config, reporter=None)
    if start:
        guard.restore(start)
    for step in range(start + 1, STEPS + 1):
        g = torch.Generator().manual_seed(step * 101 + rank)
        x = torch.randn(8, 16, generator=g)
        guard.step((x, x[:, :4] * 3.0))
        if step == save_at and rank == 0 and not start:
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, path)
    guard.close()
    digest = hashlib.sha256()
    for name, tensor in sorted(net.state_dict().items()):
        digest.update(name.encode() + tensor.numpy().tobytes())
    return digest.hexdigest()


def test_resumed_run_equals_the_uninterrupted_one(tmp_path: Path) -> None:
    straight = spawn_local(_train, NODES, (str(tmp_path), 0, 6))
    resumed = spawn_local(_train, NODES, (str(tmp_path), 6, 6))
    assert len(set(straight)) == 1 and len(set(resumed)) == 1  # replicas agree
    assert resumed[0] == straight[0]
