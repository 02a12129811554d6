"""An FSDP2 or HSDP training script guarded by sdc_agent, with sharded (DCP) checkpoints.

    torchrun --nnodes 3 --nproc-per-node 8 ... examples/train_fsdp.py --layout hsdp \\
        --checkpoint-dir /fsx/ckpt/run1

``--layout hsdp``: a 2-D mesh ``(replicate, shard)``, one replica per node (``replicate`` =
the number of nodes, ``shard`` = the ranks per node, from torchrun's ``LOCAL_WORLD_SIZE``),
so check 3 compares each shard across its replicas on other nodes. ``--layout fsdp``:
``fully_shard`` over every rank; no shard has a replica and the update check stands in for
check 3 (docs/agent.md, Layouts). ``fully_shard`` goes on each block, then on the root, as
torchtitan applies it; the Guard finds the layout from the model.

Checkpoints: every ``--checkpoint-every`` steps (a multiple of the check intervals, so the
checks have vouched for the step when it is written) every rank writes its shards with
``torch.distributed.checkpoint`` (:func:`sdc_agent.checkpoint.save_dcp`) and rank 0 marks
the directory verified when every check has. On start the script resumes from the newest
verified checkpoint at or before ``HYPERPOD_SDC_RESUME_MAX_STEP`` (set by the operator after
an incident), on however many nodes the job now has: DCP reshards on load.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import sdc_agent
from sdc_agent.checkpoint import (
    find_checkpoints,
    load_dcp,
    save_dcp,
    select_checkpoint,
    state_digest,
)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def batch_for(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Data depends on (step, rank) only, so a resumed run sees what the first run saw."""
    g = torch.Generator().manual_seed(step * 100_003 + rank)
    x = torch.randn(32, 64, generator=g)
    return x.to(device), (x[:, :8] * 2.0).to(device)


def build_mesh(layout: str, device: torch.device) -> DeviceMesh:
    world = dist.get_world_size()
    if layout == "fsdp":
        return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % per_node:
        raise SystemExit(f"--layout hsdp: {world} ranks are not whole nodes of {per_node}")
    return init_device_mesh(
        device.type, (world // per_node, per_node), mesh_dim_names=("replicate", "shard")
    )


def build_model(mesh: DeviceMesh, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)
    ).to(device)
    for block in (net[0], net[2], net[4]):
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def release_dtensor_caches() -> None:
    """Empty DTensor's sharding and redistribution caches (private torch APIs, looked up
    defensively: a torch without them just keeps its caches)."""
    try:
        from torch.distributed.tensor._collective_utils import MeshTopoInfo
        from torch.distributed.tensor._redistribute import (
            _gen_transform_infos,
            clear_redistribute_planner_cache,
        )
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:
        return
    _clear_sharding_prop_cache()
    _gen_transform_infos.cache_clear()
    clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=("hsdp", "fsdp"), default="hsdp")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument(
        "--result-file",
        type=Path,
        help="write each checkpoint's and the loaded state's SHA-256 here (JSON), to compare",
    )
    args = parser.parse_args()

    sdc_agent.enable_determinism()  # before CUDA is used: the replay audit compares bits
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    train(args, build_mesh(args.layout, device), device)
    # destroy_process_group() joins a group's gloo threads only once nothing holds the
    # group: the model and its FSDP state sit in reference cycles (collect them), and
    # DTensor's caches (filled by the checkpoint's state dicts) hold the mesh and its
    # groups. Threads left running at interpreter exit sometimes abort the process.
    release_dtensor_caches()
    gc.collect()
    dist.barrier()  # every rank done before any closes its connections
    dist.destroy_process_group()


def train(args: argparse.Namespace, mesh: DeviceMesh, device: torch.device) -> None:
    rank = dist.get_rank()
    model = build_model(mesh, device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    outcome: dict[str, object] = {"layout": args.layout, "world": dist.get_world_size()}
    digests: dict[str, str] = {}
    start = 0
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    if find_checkpoints(args.checkpoint_dir):
        ckpt = select_checkpoint(args.checkpoint_dir)  # honours HYPERPOD_SDC_RESUME_MAX_STEP
        load_dcp(ckpt.path, model, optimizer)  # every rank, resharded to this world
        start = ckpt.step
        if args.result_file is not None:
            outcome["loaded"] = {"step": start, "sha256": state_digest(model, optimizer)}
        if rank == 0:
            print(f"resumed from {ckpt.path} (step {start})", flush=True)
    # Evidence bundles go next to the checkpoints (a volume every node mounts).
    config = sdc_agent.GuardConfig.from_env(bundle_dir=str(args.checkpoint_dir.resolve()))
    guard = sdc_agent.Guard(model, optimizer, loss_fn, config)
    if start:
        guard.restore(start, location=str(ckpt.path))
    if rank == 0:
        print(f"layout {guard.layout} over mesh {mesh.mesh_dim_names}", flush=True)

    for step in range(start + 1, args.steps + 1):
        result = guard.step(batch_for(step, rank, device))
        for verdict in result.verdicts:
            if rank == 0:
                print(f"step {verdict.step}: {verdict.message}", flush=True)
        if step % args.checkpoint_every == 0:
            path = save_dcp(args.checkpoint_dir / f"step_{step}", model, optimizer)
            if args.result_file is not None:
                digests[str(step)] = state_digest(model, optimizer)
            if rank == 0:
                verified = guard.mark_checkpoint(path)
                print(f"checkpoint {path.name}: verified {verified}", flush=True)
    last_clean = guard.last_clean_step
    guard.close()
    if rank == 0:
        print(f"done: last clean step {last_clean}", flush=True)
    if args.result_file is not None and rank == 0:
        outcome |= {"checkpoints": digests, "last_clean_step": last_clean}
        args.result_file.write_text(json.dumps(outcome))


if __name__ == "__main__":
    main()
