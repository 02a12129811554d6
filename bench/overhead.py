"""Per-step cost of the Guard against plain DDP, measured side by side.

Prints JSON. Two gloo ranks on CPU (one thread each) train the same ~10 M parameter MLP
with Adam, once per variant; variants alternate in blocks of ``--block`` steps within
each round so machine noise hits them alike. ``overhead`` = median guarded step time /
median plain step time - 1, computed per round and then the median taken.

    .venv/bin/python bench/overhead.py [--rounds 5] [--block 10]
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

VARIANTS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "hook_only": {"nonfinite_check": False, "weights_every": 0},
    "nonfinite_only": {"weights_every": 0},
    "defaults": {},
    "every_step": {"weights_every": 1},
    "defaults_eager": {"fingerprint_backend": "eager"},
    "every_step_eager": {"weights_every": 1, "fingerprint_backend": "eager"},
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


def worker(rank: int, world: int, rounds: int, block: int, batch: int) -> dict[str, Any]:
    runners: dict[str, Callable[[Any], object]] = {}
    for name, config in VARIANTS.items():
        torch.manual_seed(0)
        ddp = DistributedDataParallel(make_model())
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
    data = [(torch.randn(batch, 1024, generator=g), torch.randn(batch, 1024, generator=g))]
    for run in runners.values():  # warm-up: allocations, Adam state, first weight check
        for _ in range(block):
            run(data[0])
    per_round: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            times = []
            for _ in range(block):
                start = time.perf_counter()
                run(data[0])
                times.append(time.perf_counter() - start)
            per_round[name].append(statistics.mean(times))
    return per_round


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=10, help="steps per variant and round")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    results = spawn_local(
        worker, ["bench-node-0", "bench-node-1"], (args.rounds, args.block, args.batch)
    )
    per_round = results[0]  # ranks run in lockstep; rank 0 is representative
    plain = per_round["plain"]
    out: dict[str, Any] = {
        "benchmark": "overhead",
        "torch": torch.__version__,
        "ranks": 2,
        "parameters": sum(p.numel() for p in make_model().parameters()),
        "batch": args.batch,
        "rounds": args.rounds,
        "block_steps": args.block,
        "plain_step_ms": round(statistics.median(plain) * 1e3, 2),
        "variants": {},
    }
    for name, times in per_round.items():
        if name == "plain":
            continue
        ratios = [t / p - 1 for t, p in zip(times, plain, strict=True)]
        out["variants"][name] = {
            "config": VARIANTS[name],
            "step_ms": round(statistics.median(times) * 1e3, 2),
            "overhead": round(statistics.median(ratios), 4),
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
