"""What the agent's own code does on a step where no check is due, counted (not timed).

Prints JSON. Wall-clock overhead (``bench/overhead.py``) on a loaded machine cannot resolve a
change of a fraction of a percent; the number of Python calls the agent makes per step can:
it does not move with load, and two versions of ``sdc_agent`` can be compared exactly by
putting one or the other on ``PYTHONPATH`` under this same script.

Two gloo ranks on two emulated nodes train ``bench/overhead.py``'s MLP (fused Adam) with
``Guard.step``, once per variant; after ``--warmup`` steps, ``--steps`` steps (all before the
variant's first audit; ``defaults``' weight checks, every 10 steps, fall among them) run under
``cProfile`` on rank 0. Per step:
``calls`` into ``sdc_agent`` and ``sdc_common`` functions, ``by_file`` and ``by_function``
the same per source file and per function, and ``own_ms`` the time spent in those functions'
own code under the profiler (which inflates it, as does load: indicative only; the torch
work they start is not in it).

    PYTHONPATH=<tree>/sidecar:<tree>/common .venv/bin/python bench/step_calls.py
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sdc_agent
from bench.overhead import IN, VARIANTS, loss_fn, make_model
from sdc_agent import Guard, GuardConfig
from sdc_agent.launch import spawn_local

NAMES = ("hook_only", "replay_every_50_only", "defaults")
OURS = ("/sdc_agent/", "/sdc_common/")


def _profile(name: str, steps: int, warmup: int, hidden: int, rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(make_model(hidden))
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-4, fused=True)
    guard = Guard(ddp, opt, loss_fn, GuardConfig(**(VARIANTS[name] or {})), reporter=None)
    g = torch.Generator().manual_seed(rank)
    data = (torch.randn(32, IN, generator=g), torch.randn(32, IN, generator=g))
    for _ in range(warmup):
        guard.step(data)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        guard.step(data)
    profiler.disable()
    guard.close(timeout=5.0)
    calls: dict[str, int] = {}
    functions: dict[str, int] = {}
    own = 0.0
    for (path, _line, func), (_prim, n, tottime, _cum, _callers) in pstats.Stats(
        profiler
    ).stats.items():  # type: ignore[attr-defined]
        if any(part in path for part in OURS):
            short = path[path.rfind("/sdc_") + 1 :]
            calls[short] = calls.get(short, 0) + n
            name = f"{short}:{func}"
            functions[name] = functions.get(name, 0) + n
            own += tottime
    return {
        "calls": round(sum(calls.values()) / steps, 2),
        "own_ms": round(own / steps * 1e3, 3),
        "by_file": {k: round(v / steps, 2) for k, v in sorted(calls.items())},
        "by_function": {k: round(v / steps, 2) for k, v in sorted(functions.items())},
    }


def worker(
    rank: int, world: int, names: Sequence[str], steps: int, warmup: int, hidden: int
) -> dict[str, Any]:
    del world
    return {name: _profile(name, steps, warmup, hidden, rank) for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="profiled steps per variant")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--variants", default=",".join(NAMES))
    args = parser.parse_args()
    names = [n for n in args.variants.split(",") if n]
    # Every profiled step must come before the variant's first audit.
    last = args.warmup + args.steps
    for name in names:
        every = (VARIANTS[name] or {}).get("replay_every", GuardConfig().replay_every)
        if 0 < every <= last:
            parser.error(f"--steps: {name} audits at step {every}, within {last} steps")
    results = spawn_local(
        worker, ["bench-node-0", "bench-node-1"], (names, args.steps, args.warmup, args.hidden)
    )
    print(
        json.dumps(
            {
                "benchmark": "step_calls",
                "sdc_agent": sdc_agent.__file__,
                "ranks": 2,
                "hidden": args.hidden,
                "profiled_steps": args.steps,
                "variants": results[0],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
