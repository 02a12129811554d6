"""``mark_checkpoint`` on one rank of a pure FSDP job whose flags are read a step late (a
fused optimizer on CUDA; forced here on the CPU, as ``test_host_sync`` does), with the
verified snapshot on (``snapshot_copies=2``: each take exchanges shards between nodes).

It says whether the step is verified without counting it: counting it there would take the
snapshot, an exchange, on that rank alone, which would wait for the others forever while
they wait for it in the next step's collectives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sdc_agent.launch import spawn_local

pytestmark = pytest.mark.distributed

STEPS, MARKED = 4, 2


def _run(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from sdc_agent import Guard, GuardConfig

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for sub in (net[0], net[2]):
        fully_shard(sub, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(m(batch[0]), batch[1])

    config = GuardConfig(
        replay_every=0,  # an audited step reads its flags at once
        weights_every=MARKED,
        fingerprint_backend="eager",
        snapshot_copies=2,
        snapshot_dir=root,
    )
    guard = Guard(net, optimizer, loss_fn, config, reporter=None)
    guard._defer_flags = True  # what a fused optimizer on CUDA does
    assert guard.snapshot is not None and guard.snapshot.copies == 2
    g = torch.Generator().manual_seed(rank)
    out: dict[str, Any] = {"verified": None}
    for _ in range(STEPS):
        result = guard.step((torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)))
        assert not result.verdicts, result.verdicts
        if rank == 0 and result.step == MARKED:
            path = Path(root) / f"step_{MARKED}.pt"
            path.write_bytes(b"weights")
            out["verified"] = guard.mark_checkpoint(path)
        if result.step == MARKED + 1:
            out["snapshot_step"] = guard.snapshot.step
    guard.close()
    out["last_clean_step"] = guard.last_clean_step
    return out


def test_mark_checkpoint_on_one_rank_takes_no_snapshot_alone(tmp_path: Path) -> None:
    ranks = spawn_local(_run, ["n0", "n1"], (str(tmp_path),), timeout=120)
    assert ranks[0]["verified"] is True  # its flags came back clean: step 2 is verified
    # Every rank counted step 2 and took its snapshot at step 3's checks, alike; step 4's
    # flags are counted at close.
    assert [r["snapshot_step"] for r in ranks] == [MARKED, MARKED]
    assert [r["last_clean_step"] for r in ranks] == [STEPS, STEPS]
