"""Per module of the GPT-2, how far the forward noise and a fault move its output's statistics.

Prints JSON. One process, no Guard: the drill's GPT-2 (three blocks, width 32, 16 tokens, 8
sequences) under bf16 autocast on CPU, with the drill's emulated forward noise (±1 bf16 ulp
in 1 % of the middle block's MLP output, drawn afresh per computation) and, where asked,
the drill's persistent fault there (``--fault``, 1e-3 relative in every element: one ulp,
see sdc_agent.faults). For each of ``--batches`` micro-batches it computes the forward three
times (two with noise only, drawn from different seeds, and one with the fault too) and, per
module of :func:`sdc_agent.evidence.output_modules` and the modules below them, the relative
difference of three float64 statistics of its output (:func:`sdc_agent.evidence.output_tensor`):
the sum of absolute values, the plain sum (on the scale of the sum of absolute values) and
the norm. ``noise``: the largest difference between the two noisy computations over the
micro-batches; ``fault``: the smallest between a noisy one and the faulty one. Where ``fault``
stands far above ``noise`` the module's output kind separates the fault
(docs/agent.md, "The forward output kinds"). The noise is emulated, not measured on a GPU.

    .venv/bin/python bench/output_kinds.py [--batches 8] [--fault 1e-3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from typing import Any

import torch

from sdc_agent.drill import (
    GPT2_MIDDLE,
    _ForwardNoise,
    gpt2_loss,
    make_gpt2,
    make_gpt2_batch,
    seed_noise,
)
from sdc_agent.evidence import output_modules, output_tensor
from sdc_agent.faults import FaultSpec, _CorruptForward

STATS = ("sum_abs", "sum", "norm")


def _stats(t: torch.Tensor) -> tuple[float, float, float]:
    x = t.detach().to(torch.float64)
    return float(x.abs().sum()), float(x.sum()), math.sqrt(float((x * x).sum()))


def _rel(a: tuple[float, ...], b: tuple[float, ...]) -> list[float]:
    scale = (max(a[0], b[0]), max(a[0], b[0]), max(a[2], b[2]))
    return [abs(x - y) / max(s, 1e-300) for x, y, s in zip(a, b, scale, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--fault", type=float, default=1e-3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = make_gpt2(32)
    modules = dict(model.named_modules())
    faulty = {"on": False}
    spec = FaultSpec(
        rank=0,
        step=1,
        site="forward",
        target=GPT2_MIDDLE,
        index=None,
        persistent=True,
        kind="relative",
        relative_error=args.fault,
    )
    middle = modules[GPT2_MIDDLE]
    middle.register_forward_hook(lambda _m, _i, out: _ForwardNoise.apply(out, 0.01))
    middle.register_forward_hook(
        lambda _m, _i, out: _CorruptForward.apply(out, spec) if faulty["on"] else out
    )
    watched = {name for name, _ in output_modules(model)}
    seen: dict[str, tuple[float, float, float]] = {}
    dtypes: dict[str, str] = {}
    sizes: dict[str, int] = {}

    def hook(name: str) -> Any:
        def record(_m: torch.nn.Module, _i: Any, out: Any) -> None:
            t = output_tensor(out)
            if t is not None:
                seen[name] = _stats(t)
                dtypes[name] = str(t.dtype).removeprefix("torch.")
                sizes[name] = t.numel()

        return record

    for name, m in modules.items():
        if name:
            m.register_forward_hook(hook(name))

    def forward(fault: bool, noise_seed: int, batch: int) -> dict[str, tuple[float, ...]]:
        seed_noise(noise_seed, 0)
        faulty["on"] = fault
        seen.clear()
        torch.manual_seed(batch)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            gpt2_loss(model, make_gpt2_batch(2, 0, batch, 8))
        return dict(seen)

    noise: dict[str, list[float]] = {}
    fault: dict[str, list[float]] = {}
    for batch in range(1, args.batches + 1):
        a = forward(False, 100 + batch, batch)
        b = forward(False, 200 + batch, batch)
        f = forward(True, 300 + batch, batch)
        for name in a:
            n, d = _rel(a[name], b[name]), _rel(a[name], f[name])
            before_n, before_f = noise.get(name, [0.0] * 3), fault.get(name, [math.inf] * 3)
            noise[name] = [max(x, y) for x, y in zip(before_n, n, strict=True)]
            fault[name] = [min(x, y) for x, y in zip(before_f, d, strict=True)]
    report = {
        "bench": "output_kinds",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": "gpt2 (3 blocks, width 32, 16 tokens, 8 sequences), bf16 autocast, CPU",
        "noise": "±1 bf16 ulp in 1 % of the middle MLP's output (emulated)",
        "fault_relative_error": args.fault,
        "batches": args.batches,
        "modules": [
            {
                "module": name,
                "output_kind": name in watched,
                "elements": sizes[name],
                "dtype": dtypes[name],
                "noise": dict(zip(STATS, noise[name], strict=True)),
                "fault": dict(zip(STATS, fault[name], strict=True)),
            }
            for name in noise
        ],
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
