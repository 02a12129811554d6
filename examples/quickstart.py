"""The README's example: a DDP training loop guarded by sdc_agent.

    python -m torch.distributed.run --nproc-per-node 2 examples/quickstart.py

Set HYPERPOD_SDC_FAULTS to run a drill, e.g.
HYPERPOD_SDC_FAULTS="rank=1,step=20,site=weights,kind=bitflip,bit=3".
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sdc_agent


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def train() -> None:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = sdc_agent.Guard(
        model,
        optimizer,
        loss_fn,
        # On one machine every rank is on one node, and the replay audit needs other nodes
        # to recompute on: turn it off here, leave it at its default on a cluster.
        config=sdc_agent.GuardConfig.from_env(
            weights_every=5, replay_every=0, fingerprint_backend="eager"
        ),
    )
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(40):
        batch = (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
        result = guard.step(batch)
        for verdict in result.verdicts:
            print(f"rank {dist.get_rank()}: step {verdict.step}: {verdict.message}", flush=True)
    guard.close()
    if dist.get_rank() == 0:
        print(f"done: last clean step {guard.last_clean_step}, loss {result.loss:.4f}", flush=True)


def main() -> None:
    dist.init_process_group("gloo")  # "nccl" on GPUs
    # The model, its optimizer and the closed Guard go when train() returns, so nothing
    # holds the group any more: destroy_process_group() ends it and joins gloo's threads.
    train()
    dist.barrier()  # every rank done before any closes its connections
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
