"""Check 1's flags per step, before and after they rode in the last DDP bucket.

Prints JSON. Two gloo ranks on CPU, one thread each, time per step, side by side in one
run: ``own_allreduce_us``, what each step paid before (the flags' own all-reduce of
``world + 1`` floats, waited on, and the device flag from it: ``StepFlags.send``,
``gathered`` and ``skip_tensor`` as they were until issue 22), against ``in_bucket_us``,
what each step pays now on a clean step (``StepFlags.mark`` on the last bucket,
``seen`` on its reduced result, ``skip_tensor``, ``to_host().clean()``, with the step's
``reset``). The bucket's all-reduce itself runs either way and is not timed. It departs
from the configuration users deploy in timing these pieces alone, not a training step
(``bench/overhead.py`` does that; on a loaded machine its noise is far larger than this).

    .venv/bin/python bench/flags_cost.py [--steps 3000]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import torch.distributed as dist

from sdc_agent.launch import spawn_local
from sdc_agent.nonfinite import StepFlags


def worker(rank: int, world: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    flags = StepFlags(world, rank, torch.device("cpu"))
    for _ in range(50):
        dist.all_reduce(torch.zeros(world + 1))
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        flags.reset(halt=False)
        vector = torch.zeros(world + 1)
        vector[rank : rank + 1].copy_(flags.local)
        work = dist.all_reduce(vector, async_op=True)
        assert work is not None
        work.wait()
        (vector.sum() > 0).to(torch.float32)
    own = (time.perf_counter() - started) / steps
    bucket = torch.randn(1 << 20)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        flags.reset(halt=False)
        flags.mark(bucket, None)
        flags.seen(bucket)
        flags.skip_tensor()
        flags.to_host().clean()
    bucketed = (time.perf_counter() - started) / steps
    return {"own_allreduce_us": round(own * 1e6, 1), "in_bucket_us": round(bucketed * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    results = spawn_local(worker, ["node-a", "node-b"], (args.steps,))
    print(
        json.dumps(
            {
                "benchmark": "flags_cost",
                "torch": torch.__version__,
                "ranks": 2,
                "steps": args.steps,
                "by_rank": results,
            }
        )
    )


if __name__ == "__main__":
    main()
