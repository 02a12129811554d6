"""Fingerprint throughput against torch.sum over the same bytes, measured side by side.

Prints JSON. ``ratio`` = time of ``torch.sum`` / time of the fingerprint over the same
tensor (1.0 = as fast as a sum; the goal is at least 0.5). Measurements of the
contenders alternate within each round, so machine noise hits them alike; each figure is
the median over rounds.

    .venv/bin/python bench/fingerprint.py [--threads 1] [--rounds 15]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch

from sdc_agent.fingerprint import Fingerprinter


def _run(fn: Callable[[torch.Tensor], object], x: torch.Tensor, sync: Callable[[], object]) -> None:
    fn(x)
    sync()


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sizes", default="1000000,10000000,50000000")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync: Callable[[], object] = torch.cuda.synchronize if device.type == "cuda" else time.time
    eager, compiled = Fingerprinter("eager"), Fingerprinter("compile")
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in (int(s) for s in args.sizes.split(",")):
            x = torch.randn(n, device=device).to(dtype)
            contenders: dict[str, Callable[[], object]] = {
                "sum": functools.partial(_run, torch.sum, x, sync),
                "compiled": functools.partial(_run, compiled, x, sync),
                "eager": functools.partial(_run, eager, x, sync),
            }
            assert torch.equal(compiled(x), eager(x))  # also warms up the compiled kernel
            for fn in contenders.values():
                fn()
            times: dict[str, list[float]] = {k: [] for k in contenders}
            for _ in range(args.rounds):
                for name, fn in contenders.items():
                    times[name].append(_time(fn))
            med = {k: statistics.median(v) for k, v in times.items()}
            gbps = x.numel() * x.element_size() / 1e9
            results.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "elements": n,
                    "sum_ms": round(med["sum"] * 1e3, 3),
                    "compiled_ms": round(med["compiled"] * 1e3, 3),
                    "eager_ms": round(med["eager"] * 1e3, 3),
                    "compiled_GBps": round(gbps / med["compiled"], 2),
                    "ratio_compiled": round(med["sum"] / med["compiled"], 3),
                    "ratio_eager": round(med["sum"] / med["eager"], 3),
                }
            )
    print(
        json.dumps(
            {
                "benchmark": "fingerprint",
                "device": device.type,
                "threads": args.threads,
                "torch": torch.__version__,
                "rounds": args.rounds,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
