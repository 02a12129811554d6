"""Per-step cost of the Guard against plain DDP, measured side by side.

Prints JSON. Two gloo ranks on CPU (one thread each) train the same ~10 M parameter MLP
with Adam, once per variant; the variants take turns one step at a time, so machine noise
hits them alike, and each variant's periodic checks are amortized over its own steps.
``overhead`` = mean guarded step time / mean plain step time - 1.

    .venv/bin/python bench/overhead.py [--steps 200] [--warmup 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdc_agent import Guard, GuardConfig
from sdc_agent.launch import spawn_local

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


def make_model() -> nn.Module:
    # 1024-2048-2048-1024-1024: 9.45 M parameters.
    return nn.Sequential(
        nn.Linear(1024, 2048),
        nn.ReLU(),
        nn.Linear(2048, 2048),
        nn.ReLU(),
        nn.Linear(2048, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
    )


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def worker(
    rank: int, world: int, steps: int, warmup: int, batch: int, bucket_view: bool
) -> dict[str, Any]:
    runners: dict[str, Callable[[Any], object]] = {}
    for name, config in VARIANTS.items():
        torch.manual_seed(0)
        ddp = DistributedDataParallel(make_model(), gradient_as_bucket_view=bucket_view)
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)
        if config is None:

            def plain(b: Any, ddp: nn.Module = ddp, opt: torch.optim.Optimizer = opt) -> None:
                opt.zero_grad(set_to_none=True)
                loss_fn(ddp, b).backward()
                opt.step()

            runners[name] = plain
        else:
            guard = Guard(ddp, opt, loss_fn, GuardConfig(**config))
            runners[name] = guard.step
    g = torch.Generator().manual_seed(rank)
    data = (torch.randn(batch, 1024, generator=g), torch.randn(batch, 1024, generator=g))
    for run in runners.values():  # warm-up: allocations, Adam state
        for _ in range(warmup):
            run(data)
    # One step of each variant in turn: noise on this shared machine hits all alike, and
    # each variant's periodic checks fall on its own steps, amortized over all of them.
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(steps):
        for name, run in runners.items():
            start = time.perf_counter()
            run(data)
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps per variant")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--bucket-view",
        action="store_true",
        help="DDP(gradient_as_bucket_view=True) for every variant, plain included",
    )
    args = parser.parse_args()
    results = spawn_local(
        worker,
        ["bench-node-0", "bench-node-1"],
        (args.steps, args.warmup, args.batch, args.bucket_view),
    )
    times = results[0]  # ranks run in lockstep; rank 0 is representative
    plain = statistics.fmean(times["plain"])
    out: dict[str, Any] = {
        "benchmark": "overhead",
        "torch": torch.__version__,
        "ranks": 2,
        "parameters": sum(p.numel() for p in make_model().parameters()),
        "batch": args.batch,
        "gradient_as_bucket_view": args.bucket_view,
        "steps_per_variant": args.steps,
        "plain_step_ms": round(plain * 1e3, 2),
        "variants": {},
    }
    for name, samples in times.items():
        if name == "plain":
            continue
        mean = statistics.fmean(samples)
        out["variants"][name] = {
            "config": VARIANTS[name],
            "step_ms": round(mean * 1e3, 2),
            "overhead": round(mean / plain - 1, 4),
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
