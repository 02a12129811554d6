"""A training script guarded by sdc_agent, as it runs in a PyTorchJob or HyperPodPyTorchJob
(examples/pytorchjob.yaml, examples/hyperpodpytorchjob.yaml).

    torchrun --nnodes 3 --nproc-per-node 8 ... examples/train.py --checkpoint-dir /fsx/ckpt/run1

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK ...; the pod spec sets POD_NAME, NODE_NAME and the
HYPERPOD_SDC_* variables, so the Guard reports to the operator without further code.

Checkpoints: every ``--checkpoint-every`` steps (a multiple of the replay interval, so the
audit has vouched for them when they are written), marked verified when every check has.
On start it resumes from the newest verified checkpoint at or before
``HYPERPOD_SDC_RESUME_MAX_STEP``, which the operator sets after an incident.

Verified snapshots (on unless ``--snapshot-copies 0``; ``HYPERPOD_SDC_SNAPSHOT_COPIES``
counts where the flag is not given): the Guard keeps ``last_clean_step``'s state in host
memory, with what the loop registers (the learning-rate scheduler and the data position),
and at a detection the healthy ranks write it as a verified DCP checkpoint
``<checkpoint dir>/sdc-snapshot-step_<k>``. The operator then resumes the job from that
step, at most one audit interval before the detection, not from the last periodic
checkpoint; :func:`sdc_agent.snapshot.load_snapshot` reads it at any world size. Once it is
written the Guard applies nothing more: the script stops training and waits to be stopped
(``--hold-seconds``; then it exits with status 3, and a restart resumes from the snapshot).
The extras are read as the snapshot's step returns from ``guard.step()`` (on CPU and CUDA
alike), before the loop's ``scheduler.step()`` for that step: on resume from a snapshot the
script runs that one ``scheduler.step()``; the data position it registers is the step's.

Evidence: when the replay audit catches a GPU that computes wrong (persistently), one
healthy rank writes an evidence bundle under ``<checkpoint dir>/sdc-evidence/`` and the
verdict names it; the operator's confirmation pod recomputes it on the suspect node
(docs/confirmation.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sdc_agent
from sdc_agent.checkpoint import find_checkpoints, select_checkpoint
from sdc_agent.config import SNAPSHOT_COPIES_ENV, SNAPSHOT_DIR_ENV
from sdc_agent.snapshot import SNAPSHOT_PREFIX, load_snapshot

NOT_STOPPED = 3
"""Exit status when the job was not stopped within ``--hold-seconds`` of a detection."""
TERMINATED = 128 + signal.SIGTERM
"""Exit status when the pod was stopped (SIGTERM), as a shell reports it."""

stopping = threading.Event()
"""Set by SIGTERM (the pod is being stopped): the loop ends at the next step boundary, so
a snapshot being written at a detection is finished first (keep ``snapshot_write_seconds``
inside the pod's termination grace period)."""


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def batch_for(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Data depends on (step, rank) only, so a resumed run sees what the first run saw."""
    g = torch.Generator().manual_seed(step * 100_003 + rank)
    x = torch.randn(32, 64, generator=g)
    return x.to(device), (x[:, :8] * 2.0).to(device)


def lr_factor(step: int) -> float:
    """The learning rate's decay: a pure function of the scheduler's step."""
    return 1.0 / (1.0 + step / 100)


def snapshot_copies(flag: int | None) -> int:
    """The flag, else the environment's setting, else 2 (every slice on two nodes) where
    the job spans two nodes or more and 1 on one node."""
    if flag is not None:
        return flag
    if os.environ.get(SNAPSHOT_COPIES_ENV, "").strip():
        return int(os.environ[SNAPSHOT_COPIES_ENV])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    nodes = world // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))
    return min(2, max(1, nodes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument(
        "--snapshot-copies",
        type=int,
        help="verified snapshot in host memory, each slice on this many nodes (0: off; "
        f"default: {SNAPSHOT_COPIES_ENV}, else 2, or 1 on one node)",
    )
    parser.add_argument(
        "--hold-seconds",
        type=float,
        default=600.0,
        help="after a snapshot was written at a detection, wait this long to be stopped",
    )
    parser.add_argument(
        "--result-file",
        type=Path,
        help="write the final weights' SHA-256 here (JSON), to compare runs",
    )
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    sdc_agent.enable_determinism()  # before CUDA is used: the replay audit compares bits
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    train(args, cuda)
    # The model and the closed Guard went with train(): destroy_process_group() ends the
    # group and joins gloo's threads (left running at interpreter exit, they sometimes
    # abort the process there: "terminate called without an active exception").
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
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    start = 0
    location = None
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    if find_checkpoints(args.checkpoint_dir):
        ckpt = select_checkpoint(args.checkpoint_dir)  # honours HYPERPOD_SDC_RESUME_MAX_STEP
        location = str(ckpt.path)
        if ckpt.path.name.startswith(SNAPSHOT_PREFIX):  # written at a detection (DCP)
            start, extras = load_snapshot(ckpt.path, net, optimizer)
            scheduler.load_state_dict(extras["scheduler"])
            # The snapshot holds the loop as guard.step() returned: this loop's own code
            # after it, the step's scheduler.step(), is run here.
            scheduler.step()
            what, taken = "the verified snapshot", extras["data"]["batches"]
        else:
            state = torch.load(ckpt.path, map_location=device)
            net.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            what, start, taken = "the checkpoint", ckpt.step, ckpt.step
        if rank == 0:
            print(
                f"resumed from {what} {ckpt.path} (step {start}; data position: "
                f"{taken} batches taken)",
                flush=True,
            )
    model = DistributedDataParallel(net)
    # Evidence bundles go next to the checkpoints (a volume every node mounts), so the
    # operator's confirmation pod on the suspect node finds them; the first checkpoint
    # is written only later, so the directory is given up front. So do the snapshots.
    here = str(args.checkpoint_dir.resolve())
    settings: dict[str, Any] = {"snapshot_copies": snapshot_copies(args.snapshot_copies)}
    if not os.environ.get(SNAPSHOT_DIR_ENV, "").strip():
        settings["snapshot_dir"] = here
    config = sdc_agent.GuardConfig.from_env(bundle_dir=here, **settings)
    guard = sdc_agent.Guard(model, optimizer, loss_fn, config)
    position = {"batches": start}  # the data position: batches taken so far
    guard.snapshot_state("scheduler", scheduler)
    guard.snapshot_state("data", lambda: dict(position))
    if start:
        guard.restore(start, location=location)

    for step in range(start + 1, args.steps + 1):
        position["batches"] = step
        result = guard.step(batch_for(step, rank, device))
        scheduler.step()
        for verdict in result.verdicts:
            if rank == 0:
                print(f"step {verdict.step}: {verdict.message}", flush=True)
        snapshot = guard.snapshot
        if snapshot is not None and snapshot.holding:
            hold(guard, args.hold_seconds, rank)
        if stopping.is_set():
            stop(guard, rank)
        if step % args.checkpoint_every == 0 and rank == 0:
            path = args.checkpoint_dir / f"step_{step}.pt"
            state = {
                "model": net.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
            }
            torch.save(state, path)
            guard.mark_checkpoint(path)
    guard.close()
    if args.result_file is not None and rank == 0:
        digest = hashlib.sha256()
        for name, tensor in sorted(net.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        outcome = {"steps": args.steps, "resumed_from": start, "sha256": digest.hexdigest()}
        args.result_file.write_text(json.dumps(outcome))


def hold(guard: sdc_agent.Guard, seconds: float, rank: int) -> None:
    """A detection: the snapshot of the last clean step was written (or could not be) and
    the Guard applies nothing more. Train no further (a finished run would carry the held
    weights as if they were the last step's); wait for the operator to stop the job."""
    written = guard.snapshot_write
    if rank == 0:
        where = written.path if written is not None and written.complete else None
        print(
            f"holding after the detection: snapshot {where or 'not written'}; "
            f"waiting up to {seconds:.0f} s to be stopped",
            flush=True,
        )
    if stopping.wait(seconds):
        stop(guard, rank)
    guard.close()
    print(f"rank {rank}: not stopped within {seconds:.0f} s of the detection", flush=True)
    sys.exit(NOT_STOPPED)


def stop(guard: sdc_agent.Guard, rank: int) -> None:
    """SIGTERM: the pod is being stopped (a suspension); end here, between steps."""
    guard.close()
    print(f"rank {rank}: stopped (SIGTERM) after step {guard.step_count}", flush=True)
    sys.exit(TERMINATED)


if __name__ == "__main__":
    main()
