"""A training loop that owns its backward and optimizer step, guarded by sdc_agent's phases:
gradient accumulation with no_sync, gradient clipping, an LR scheduler, and (with --amp)
autocast with a GradScaler.

    python -m torch.distributed.run --nproc-per-node 3 examples/custom_loop.py

Set HYPERPOD_SDC_FAULTS to run a drill, e.g.
HYPERPOD_SDC_FAULTS="rank=1,step=12,site=forward,kind=relative,persistent=true,index=all".
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sdc_agent


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).float(), y)


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # skips on the device
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    scaler = torch.amp.GradScaler("cpu", enabled=args.amp)
    autocast = torch.autocast("cpu", dtype=torch.float16) if args.amp else contextlib.nullcontext()
    guard = sdc_agent.Guard(
        model,
        optimizer,
        loss_fn,  # what the replay audit recomputes: loss_fn(model, batch)
        sdc_agent.GuardConfig.from_env(
            replay_every=5,
            weights_every=5,
            fingerprint_backend="eager",
            # One machine: let each process stand for a node, so the replay audit has
            # partners on "other nodes". On a cluster leave node_name unset.
            node_name=os.environ.get("NODE_NAME") or f"local-node-{rank}",
        ),
        scaler=scaler if args.amp else None,
    )
    torch.manual_seed(1 + rank)  # a dropout stream of its own per rank
    g = torch.Generator().manual_seed(100 + rank)
    accumulate = 2
    for _ in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        for i in range(accumulate):
            batch = (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
            sync = contextlib.nullcontext() if i == accumulate - 1 else model.no_sync()
            with sync:
                with autocast:
                    loss = loss_fn(model, batch)
                guard.before_backward(batch, loss)  # the micro-batch and the loss it gave
                scaler.scale(loss / accumulate).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if guard.before_optimizer_step():  # checks 1 and 2; False: hold the step back
            scaler.step(optimizer)
        scaler.update()
        result = guard.after_optimizer_step()  # check 3, last_clean_step, reports
        scheduler.step()
        for verdict in result.verdicts:
            if rank == 0:
                print(f"step {verdict.step}: {verdict.message}", flush=True)
    guard.close()
    if rank == 0:
        print(
            f"done: last clean step {guard.last_clean_step}, "
            f"gradient tolerance {guard.gradient_tolerance}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--amp", action="store_true", help="float16 autocast and a GradScaler")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train(args)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
