"""Per-step cost of the Guard against plain DDP, measured side by side.

Prints JSON. By default two gloo ranks on CPU (one thread each) train the same ~10 M
parameter MLP with Adam, once per variant; the variants take turns one step at a time, so
machine noise hits them alike, and each variant's periodic checks are amortized over its
own steps. ``overhead`` = mean guarded step time / mean plain step time - 1.

    .venv/bin/python bench/overhead.py [--steps 200] [--warmup 5]

``--device cuda`` runs one NCCL rank (world size 1) in this process on ``cuda:0``: NCCL
refuses two ranks on one GPU, so this measures the checks' own GPU cost, not the
all-reduce. Every timed step then ends with ``torch.cuda.synchronize()``, for every
variant alike. Use ``--hidden`` and ``--batch`` to make a step long enough to time::

    python3 bench/overhead.py --device cuda --hidden 6144 --batch 2048
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdc_agent import Guard, GuardConfig
from sdc_agent.launch import free_port, spawn_local

OFF = {"nonfinite_check": False, "weights_every": 0, "replay_every": 0}
VARIANTS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "hook_only": OFF,
    "nonfinite_only": {**OFF, "nonfinite_check": True},
    "weights_every_10_only": {**OFF, "weights_every": 10},
    "replay_every_10_only": {**OFF, "replay_every": 10},
    "replay_every_25_only": {**OFF, "replay_every": 25},
    "replay_every_50_only": {**OFF, "replay_every": 50},
    "replay_every_100_only": {**OFF, "replay_every": 100},
    "defaults": {},
    "every_step": {"weights_every": 1, "replay_every": 1},
}
IN = 1024
"""Input and output width of the MLP."""


def make_model(hidden: int = 2048) -> nn.Module:
    # 1024-hidden-hidden-1024-1024; the default hidden=2048 gives 9.45 M parameters.
    return nn.Sequential(
        nn.Linear(IN, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, IN),
        nn.ReLU(),
        nn.Linear(IN, IN),
    )


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _no_sync() -> None:
    return None


def measure_variants(
    names: Sequence[str],
    *,
    rank: int,
    steps: int,
    warmup: int,
    batch: int,
    hidden: int = 2048,
    bucket_view: bool = False,
    device: torch.device | None = None,
) -> dict[str, list[float]]:
    """Seconds per step of each variant in ``names`` (keys of :data:`VARIANTS`).

    Needs an initialized default process group; every rank of it must call this. On CUDA
    each timed step ends with a device synchronisation.
    """
    device = device if device is not None else torch.device("cpu")
    sync: Callable[[], object] = torch.cuda.synchronize if device.type == "cuda" else _no_sync
    device_ids = [device.index] if device.type == "cuda" else None
    runners: dict[str, Callable[[Any], object]] = {}
    for name in names:
        config = VARIANTS[name]
        torch.manual_seed(0)
        ddp = DistributedDataParallel(
            make_model(hidden).to(device),
            device_ids=device_ids,
            gradient_as_bucket_view=bucket_view,
        )
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)
        if config is None:

            def plain(b: Any, ddp: nn.Module = ddp, opt: torch.optim.Optimizer = opt) -> None:
                opt.zero_grad(set_to_none=True)
                loss_fn(ddp, b).backward()
                opt.step()

            runners[name] = plain
        else:
            guard = Guard(ddp, opt, loss_fn, GuardConfig(**config), reporter=None)
            runners[name] = guard.step
    g = torch.Generator().manual_seed(rank)
    data = (
        torch.randn(batch, IN, generator=g).to(device),
        torch.randn(batch, IN, generator=g).to(device),
    )
    for run in runners.values():  # warm-up: allocations, Adam state, kernels
        for _ in range(warmup):
            run(data)
    sync()
    # One step of each variant in turn: noise on this shared machine hits all alike, and
    # each variant's periodic checks fall on its own steps, amortized over all of them.
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(steps):
        for name, run in runners.items():
            start = time.perf_counter()
            run(data)
            sync()
            times[name].append(time.perf_counter() - start)
    return times


def summarize(times: dict[str, list[float]]) -> dict[str, Any]:
    """Mean ms per step of ``plain`` and, per other variant, ms per step and overhead."""
    plain = statistics.fmean(times["plain"])
    out: dict[str, Any] = {"plain_step_ms": round(plain * 1e3, 3), "variants": {}}
    for name, samples in times.items():
        if name == "plain":
            continue
        mean = statistics.fmean(samples)
        out["variants"][name] = {
            "config": VARIANTS[name],
            "step_ms": round(mean * 1e3, 3),
            "overhead": round(mean / plain - 1, 4),
        }
    return out


def worker(
    rank: int,
    world: int,
    steps: int,
    warmup: int,
    batch: int,
    bucket_view: bool,
    names: Sequence[str] = tuple(VARIANTS),
    hidden: int = 2048,
) -> dict[str, list[float]]:
    return measure_variants(
        names,
        rank=rank,
        steps=steps,
        warmup=warmup,
        batch=batch,
        hidden=hidden,
        bucket_view=bucket_view,
    )


def _single_rank_cuda(args: argparse.Namespace, names: list[str]) -> dict[str, list[float]]:
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        return measure_variants(
            names,
            rank=0,
            steps=args.steps,
            warmup=args.warmup,
            batch=args.batch,
            hidden=args.hidden,
            bucket_view=args.bucket_view,
            device=torch.device("cuda", 0),
        )
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps per variant")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=2048, help="hidden width of the MLP")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: two gloo ranks; cuda: one NCCL rank on cuda:0",
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated; plain is always run"
    )
    parser.add_argument(
        "--bucket-view",
        action="store_true",
        help="DDP(gradient_as_bucket_view=True) for every variant, plain included",
    )
    args = parser.parse_args()
    names = ["plain", *(n for n in args.variants.split(",") if n and n != "plain")]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if args.device == "cuda":
        ranks, backend = 1, "nccl"
        times = _single_rank_cuda(args, names)
    else:
        ranks, backend = 2, "gloo"
        results = spawn_local(
            worker,
            ["bench-node-0", "bench-node-1"],
            (args.steps, args.warmup, args.batch, args.bucket_view, names, args.hidden),
        )
        times = results[0]  # ranks run in lockstep; rank 0 is representative
    summary = summarize(times)
    out: dict[str, Any] = {
        "benchmark": "overhead",
        "torch": torch.__version__,
        "device": args.device,
        "backend": backend,
        "ranks": ranks,
        "parameters": sum(p.numel() for p in make_model(args.hidden).parameters()),
        "batch": args.batch,
        "gradient_as_bucket_view": args.bucket_view,
        "steps_per_variant": args.steps,
        **summary,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
