"""What the loop registers with ``guard.snapshot_state`` is read when the snapshot's step
returns, on either path that takes the snapshot.

Two ranks on two nodes audit every 4 steps, with a learning-rate scheduler stepped after
``guard.step()`` and a data position set before it. On CPU the snapshot of step 8 is taken
as step 8 returns; on CUDA (emulated here, as tests/distributed/test_host_sync.py does: the
fused optimizer's flags and check 3's exchange come back during the next step) it is taken
during step 9's checks, after the loop stepped its scheduler and moved its data position.
Either way the snapshot holds the scheduler, the optimizer's learning rate and the data
position as step 8 returned them: the scheduler at epoch 7, the position at 8.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sdc_agent.launch import spawn_local

pytestmark = pytest.mark.distributed

STEPS = 9
SNAPSHOT = 8


def _factor(epoch: int) -> float:
    return 1.0 / (1 + epoch)


def _run(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from sdc_agent import Guard, GuardConfig
    from sdc_agent.snapshot import load_snapshot

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(m(batch[0]), batch[1])

    def model() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        return net, torch.optim.Adam(net.parameters(), lr=1e-2, fused=True)

    out: dict[str, Any] = {}
    for path in ("cpu", "cuda"):
        net, optimizer = model()
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _factor)
        config = GuardConfig(
            replay_every=4,
            weights_every=4,
            fingerprint_backend="eager",
            snapshot_copies=2,
            snapshot_dir=str(Path(root) / path),
        )
        guard = Guard(DistributedDataParallel(net), optimizer, loss_fn, config, reporter=None)
        if path == "cuda":
            guard._defer_flags = True
            guard._weight_check.overlap = True
        position = {"batches": 0}
        guard.snapshot_state("scheduler", scheduler)
        guard.snapshot_state("data", lambda: dict(position))  # noqa: B023 (this Guard's)
        taken_at: dict[int, str] = {}
        for step in range(1, STEPS + 1):
            g = torch.Generator().manual_seed(step * 101 + rank)
            x = torch.randn(8, 16, generator=g)
            position["batches"] = step
            guard.step((x, x[:, :4] * 3.0))
            snapshot = guard.snapshot
            assert snapshot is not None
            taken_at.setdefault(int(snapshot.step or 0), f"by the end of step {step}")
            scheduler.step()
        snapshot = guard.snapshot
        assert snapshot is not None
        written = snapshot.write_at_detection([])
        dist.barrier()
        assert written.complete and written.path is not None, written
        fresh, fresh_optimizer = model()
        step, extras = load_snapshot(written.path, fresh, fresh_optimizer)
        out[path] = {
            "step": step,
            "taken": taken_at.get(SNAPSHOT),
            "scheduler_epoch": extras["scheduler"]["last_epoch"],
            "lr": [g["lr"] for g in fresh_optimizer.param_groups],
            "data": extras["data"],
        }
        guard.close()
    return out


def test_extras_are_read_when_the_snapshot_step_returns(tmp_path: Path) -> None:
    ranks = spawn_local(_run, ["n0", "n1"], (str(tmp_path),))
    for path in ("cpu", "cuda"):
        got = ranks[0][path]
        assert got["step"] == SNAPSHOT, (path, got)
        assert got["data"] == {"batches": SNAPSHOT}, (path, got)
        assert got["scheduler_epoch"] == SNAPSHOT - 1, (path, got)
        assert got["lr"] == [1e-2 * _factor(SNAPSHOT - 1)], (path, got)
    # The two paths did take it at different points.
    assert ranks[0]["cpu"]["taken"] == f"by the end of step {SNAPSHOT}"
    assert ranks[0]["cuda"]["taken"] == f"by the end of step {SNAPSHOT + 1}"
    assert ranks[1] == ranks[0]
