"""A training script guarded by sdc_agent, as it runs in a PyTorchJob or HyperPodPyTorchJob
(examples/pytorchjob.yaml, examples/hyperpodpytorchjob.yaml).

    torchrun --nnodes 3 --nproc-per-node 8 ... examples/train.py --checkpoint-dir /fsx/ckpt/run1

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK ...; the pod spec sets POD_NAME, NODE_NAME and the
HYPERPOD_SDC_* variables, so the Guard reports to the operator without further code.

Checkpoints: every ``--checkpoint-every`` steps (a multiple of the replay interval, so the
audit has vouched for them when they are written), marked verified when every check has.
On start it resumes from the newest verified checkpoint at or before
``HYPERPOD_SDC_RESUME_MAX_STEP``, which the operator sets after an incident.

Evidence: when the replay audit catches a GPU that computes wrong (persistently), one
healthy rank writes an evidence bundle under ``<checkpoint dir>/sdc-evidence/`` and the
verdict names it; the operator's confirmation pod recomputes it on the suspect node
(docs/confirmation.md).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sdc_agent
from sdc_agent.checkpoint import find_checkpoints, select_checkpoint


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def batch_for(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Data depends on (step, rank) only, so a resumed run sees what the first run saw."""
    g = torch.Generator().manual_seed(step * 100_003 + rank)
    x = torch.randn(32, 64, generator=g)
    return x.to(device), (x[:, :8] * 2.0).to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument(
        "--result-file",
        type=Path,
        help="write the final weights' SHA-256 here (JSON), to compare runs",
    )
    args = parser.parse_args()

    sdc_agent.enable_determinism()  # before CUDA is used: the replay audit compares bits
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    train(args, cuda)
    # torch keeps DDP's constructor frame, and with it the model and its reducer, in a
    # reference cycle: collect it, so that destroy_process_group() really ends the group
    # and joins gloo's threads (left running at interpreter exit, they sometimes abort
    # the process there: "terminate called without an active exception").
    gc.collect()
    dist.barrier()  # every rank done before any closes its connections
    dist.destroy_process_group()


def train(args: argparse.Namespace, cuda: bool) -> None:
    rank = dist.get_rank()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    start = 0
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    if find_checkpoints(args.checkpoint_dir):
        ckpt = select_checkpoint(args.checkpoint_dir)  # honours HYPERPOD_SDC_RESUME_MAX_STEP
        state = torch.load(ckpt.path, map_location=device)
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = ckpt.step
        if rank == 0:
            print(f"resumed from {ckpt.path} (step {start})", flush=True)
    model = DistributedDataParallel(net)
    # Evidence bundles go next to the checkpoints (a volume every node mounts), so the
    # operator's confirmation pod on the suspect node finds them; the first checkpoint
    # is written only later, so the directory is given up front.
    config = sdc_agent.GuardConfig.from_env(bundle_dir=str(args.checkpoint_dir.resolve()))
    guard = sdc_agent.Guard(model, optimizer, loss_fn, config)
    if start:
        guard.restore(start, location=str(ckpt.path))

    for step in range(start + 1, args.steps + 1):
        result = guard.step(batch_for(step, rank, device))
        for verdict in result.verdicts:
            if rank == 0:
                print(f"step {verdict.step}: {verdict.message}", flush=True)
        if step % args.checkpoint_every == 0 and rank == 0:
            path = args.checkpoint_dir / f"step_{step}.pt"
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, path)
            guard.mark_checkpoint(path)
    guard.close()
    if args.result_file is not None and rank == 0:
        digest = hashlib.sha256()
        for name, tensor in sorted(net.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        outcome = {"steps": args.steps, "resumed_from": start, "sha256": digest.hexdigest()}
        args.result_file.write_text(json.dumps(outcome))


if __name__ == "__main__":
    main()
