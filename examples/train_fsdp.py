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

Verified snapshots, as in examples/train.py (on unless ``--snapshot-copies 0``): the Guard
keeps ``last_clean_step``'s shards in host memory (HSDP: every replica of a shard holds it;
FSDP: each rank's shards also on the next node) and at a detection the healthy ranks write
them as ``<checkpoint dir>/sdc-snapshot-step_<k>``; the script then trains no further and
waits to be stopped (``--hold-seconds``), and a restart resumes from the snapshot, loaded
into however many ranks it now has (:func:`sdc_agent.snapshot.load_snapshot`). The
snapshot, hold and stop helpers are examples/train.py's, imported from beside this file.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from train import hold, snapshot_copies, stop, stopping  # examples/train.py, beside this file

import sdc_agent
from sdc_agent.checkpoint import (
    find_checkpoints,
    load_dcp,
    save_dcp,
    select_checkpoint,
    state_digest,
)
from sdc_agent.config import SNAPSHOT_DIR_ENV
from sdc_agent.snapshot import SNAPSHOT_PREFIX, load_snapshot


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
        "--snapshot-copies",
        type=int,
        help="verified snapshot in host memory (0: off; default: HYPERPOD_SDC_SNAPSHOT_COPIES, "
        "else 2, or 1 on one node; HSDP keeps its replicas' shards whatever the number)",
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
        help="write each checkpoint's, the loaded and the final state's SHA-256 here (JSON)",
    )
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: stopping.set())

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
        if ckpt.path.name.startswith(SNAPSHOT_PREFIX):  # written at a detection
            start, _ = load_snapshot(ckpt.path, model, optimizer)  # each rank its own shards
        else:
            load_dcp(ckpt.path, model, optimizer)  # every rank, resharded to this world
            start = ckpt.step
        if args.result_file is not None:
            outcome["loaded"] = {"step": start, "sha256": state_digest(model, optimizer)}
        if rank == 0:
            print(f"resumed from {ckpt.path} (step {start})", flush=True)
    outcome["resumed_from"] = start
    # Evidence bundles and snapshots go next to the checkpoints (a volume every node mounts).
    here = str(args.checkpoint_dir.resolve())
    settings: dict[str, Any] = {"snapshot_copies": snapshot_copies(args.snapshot_copies)}
    if not os.environ.get(SNAPSHOT_DIR_ENV, "").strip():
        settings["snapshot_dir"] = here
    config = sdc_agent.GuardConfig.from_env(bundle_dir=here, **settings)
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
        snapshot = guard.snapshot
        if snapshot is not None and snapshot.holding:
            hold(guard, args.hold_seconds, rank)
        if stopping.is_set():
            stop(guard, rank)
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
    if args.result_file is not None:
        final = state_digest(model, optimizer)  # every rank (it gathers the state)
        if rank == 0:
            outcome |= {
                "checkpoints": digests,
                "last_clean_step": last_clean,
                "steps": args.steps,
                "sha256": final,
            }
            args.result_file.write_text(json.dumps(outcome))


if __name__ == "__main__":
    main()
