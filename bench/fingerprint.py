"""Fingerprint throughput against torch.sum over the same bytes, measured side by side.

Prints JSON. ``ratio`` = time of ``torch.sum`` / time of the fingerprint over the same
tensor (1.0 = as fast as a sum; the goals are 0.8 for float32 and 0.5 for bfloat16).
Measurements of the contenders alternate within each round, so machine noise hits them
alike; each figure is the median over rounds. Every row says which kernel ran.

Contenders per dtype and size:

``agent``
    ``Fingerprinter("auto")``, what the agent uses; ``agent_kernel`` says which kernel
    that was (``native``, ``torch.compile`` or ``eager``).
``eager``
    ``Fingerprinter("eager")``: plain PyTorch, the fallback where nothing can be built.
``widen_only`` (CPU)
    only the eager kernel's widening copies (each cache-sized block into int64, or int32
    for 16-bit elements), no sums: a lower bound on any plain-PyTorch kernel that must
    widen before it can sum exactly, and why ``eager`` stays below the goals.
``native_<march>`` (CPU, ``--marches``)
    the C kernel built for another target, e.g. ``x86-64-v3`` (AVX2, no AVX-512) and
    ``x86-64`` (SSE2 only): how fast it is on CPUs this machine stands in for.
``inductor`` (CPU, ``--inductor``)
    ``torch.compile`` of the definition on CPU, which the agent no longer uses there;
    ``null`` with the error where Inductor fails or disagrees.

The ``many`` section times check 3's case: a transformer's parameters and Adam state
(hundreds of tensors, many small), ``Fingerprinter.many`` against one fingerprint call per
tensor and against one ``torch.sum`` over a flat tensor of the same bytes.

``--no-compile`` makes every build fail (``torch.compile`` raises and ``$CC`` names no
compiler), so ``agent`` shows the fallback: it must say ``eager`` and still run.

    .venv/bin/python bench/fingerprint.py [--threads 1] [--rounds 15] [--no-compile]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from sdc_agent.fingerprint import (
    _EAGER_SHAPE_CPU,
    Fingerprinter,
    _as_flat_bits,
    _fused_words,
)
from sdc_agent.fingerprint_native import (
    COMPILER_ENV,
    NativeKernel,
    NativeKernelError,
    native_kernel,
)


def _time(fn: Callable[[], object], sync: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _break_builds() -> None:
    """Every kernel build fails from here on, as on a machine without a working toolchain."""
    os.environ[COMPILER_ENV] = "/nonexistent/cc"

    def refuse(*_args: object, **_kwargs: object) -> object:
        raise RuntimeError("torch.compile disabled by bench/fingerprint.py --no-compile")

    torch.compile = refuse  # type: ignore[assignment]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _contenders(
    device: torch.device, marches: list[str], inductor: bool
) -> tuple[dict[str, Callable[[torch.Tensor], torch.Tensor]], dict[str, str]]:
    """Fingerprint functions by name, and the reason for every one that could not be built."""
    agent, eager = Fingerprinter("auto"), Fingerprinter("eager")
    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"agent": agent, "eager": eager}
    skipped: dict[str, str] = {}
    if device.type == "cpu":
        fns["widen_only"] = _widen_only
        for march in marches:
            try:
                kernel = native_kernel(march)
            except NativeKernelError as exc:
                skipped[f"native_{march}"] = str(exc)[:500]
                continue
            fns[f"native_{march}"] = _native_fn(kernel)
        if inductor:
            try:
                compiled = torch.compile(_fused_words, dynamic=True)

                def run(x: torch.Tensor, c: Any = compiled) -> torch.Tensor:
                    with torch.no_grad():
                        words: torch.Tensor = c(_as_flat_bits(x))
                    return words

                probe = torch.randn(70001)
                if not torch.equal(run(probe), eager(probe)):
                    raise RuntimeError("the Inductor kernel disagrees with the definition")
                fns["inductor"] = run
            except Exception as exc:
                skipped["inductor"] = f"{type(exc).__name__}: {exc}"[:500]
    return fns, skipped


def _widen_only(x: torch.Tensor) -> torch.Tensor:
    bits = _as_flat_bits(x)
    rows, width = _EAGER_SHAPE_CPU
    block = rows * width
    acc = torch.int32 if bits.element_size() <= 2 else torch.int64
    staging = torch.empty(block, dtype=acc)
    for start in range(0, bits.numel() - block + 1, block):
        staging.copy_(bits[start : start + block])
    return staging[:2]


def _native_fn(kernel: NativeKernel) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        return kernel.words([_as_flat_bits(x)])[0]

    return run


def _throughput(args: argparse.Namespace, device: torch.device, sync: Callable[[], object]):
    fns, skipped = _contenders(
        device, [m for m in args.marches.split(",") if m], args.inductor and not args.no_compile
    )
    agent = fns["agent"]
    assert isinstance(agent, Fingerprinter)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in (int(s) for s in args.sizes.split(",")):
            x = torch.randn(n, device=device).to(dtype)
            want = fns["eager"](x)
            agree = {
                name: bool(torch.equal(fn(x), want))
                for name, fn in fns.items()
                if name != "widen_only"
            }
            contenders = {"sum": functools.partial(torch.sum, x)}
            contenders.update({name: functools.partial(fn, x) for name, fn in fns.items()})
            times: dict[str, list[float]] = {k: [] for k in contenders}
            for fn in contenders.values():
                fn()
            for _ in range(args.rounds):
                for name, fn in contenders.items():
                    times[name].append(_time(fn, sync))
            med = {k: statistics.median(v) for k, v in times.items()}
            gbytes = x.numel() * x.element_size() / 1e9
            row: dict[str, Any] = {
                "dtype": str(dtype).removeprefix("torch."),
                "elements": n,
                "agent_kernel": agent.kernels.get(device.type, agent.kernel),
                "sum_ms": round(med["sum"] * 1e3, 3),
                "sum_GBps": round(gbytes / med["sum"], 2),
            }
            for name in fns:
                row[f"{name}_ms"] = round(med[name] * 1e3, 3)
                row[f"ratio_{name}"] = round(med["sum"] / med[name], 3)
            row["equal_to_eager"] = agree
            rows.append(row)
    return rows, skipped, agent


def _transformer_state(layers: int, width: int) -> list[torch.Tensor]:
    """Parameters, Adam moments and CPU step counters of a GPT-2-like model."""
    g = torch.Generator().manual_seed(0)
    shapes: list[tuple[int, ...]] = [(8192, width), (1024, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (3 * width, width), (3 * width,), (width, width)]
        shapes += [(width,), (width,), (width,), (4 * width, width), (4 * width,)]
        shapes += [(width, 4 * width), (width,)]
    shapes += [(width,), (width,)]
    out: list[torch.Tensor] = []
    for shape in shapes:
        out.append(torch.randn(shape, generator=g))
        out.append(torch.randn(shape, generator=g))  # exp_avg
        out.append(torch.rand(shape, generator=g))  # exp_avg_sq
        out.append(torch.tensor(float(1000)))  # step, a CPU scalar in torch's Adam
    return out


def _many(args: argparse.Namespace) -> dict[str, Any]:
    tensors = _transformer_state(args.layers, args.width)
    total = sum(t.numel() for t in tensors)
    flat = torch.randn(total)
    agent = Fingerprinter("auto")
    eager = Fingerprinter("eager")
    want = torch.stack([eager(t) for t in tensors])
    got_agent = agent.many(tensors)[1]
    got_eager = eager.many(tensors)[1]
    contenders: dict[str, Callable[[], object]] = {
        "flat_sum": lambda: torch.sum(flat),
        "many": lambda: agent.many(tensors),
        "per_tensor": lambda: [agent(t) for t in tensors],
        "eager_many": lambda: eager.many(tensors),
    }
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for fn in contenders.values():
        fn()
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            times[name].append(_time(fn, lambda: None))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "tensors": len(tensors),
        "elements": total,
        "MB": round(total * 4 / 1e6, 1),
        "kernel": agent.kernels,
        "many_equals_per_tensor": bool(torch.equal(got_agent, want))
        and bool(torch.equal(got_eager, want)),
        **{f"{k}_ms": round(v * 1e3, 3) for k, v in med.items()},
        "ratio_many": round(med["flat_sum"] / med["many"], 3),
        "ratio_eager_many": round(med["flat_sum"] / med["eager_many"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sizes", default="1000000,10000000,50000000")
    parser.add_argument("--marches", default="x86-64-v3,x86-64" if _is_x86() else "")
    parser.add_argument("--inductor", action="store_true", help="also time torch.compile on CPU")
    parser.add_argument("--no-compile", action="store_true", help="make every build fail")
    parser.add_argument("--layers", type=int, default=12, help="transformer layers for 'many'")
    parser.add_argument("--width", type=int, default=256, help="transformer width for 'many'")
    args = parser.parse_args()
    if args.no_compile:
        _break_builds()
        args.marches = ""
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync: Callable[[], object] = torch.cuda.synchronize if device.type == "cuda" else time.time
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows, skipped, agent = _throughput(args, device, sync)
        many = _many(args) if device.type == "cpu" else None
    print(
        json.dumps(
            {
                "benchmark": "fingerprint",
                "device": device.type,
                "cpu": _cpu_model(),
                "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "threads": args.threads,
                "torch": torch.__version__,
                "rounds": args.rounds,
                "no_compile": args.no_compile,
                "agent_kernel": agent.kernel,
                "agent_kernels": agent.kernels,
                "not_built": skipped,
                "warnings": sorted(
                    {
                        str(w.message)[:300]
                        for w in caught
                        if not issubclass(w.category, DeprecationWarning | FutureWarning)
                    }
                ),
                "results": rows,
                "many": many,
            },
            indent=2,
        )
    )


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


if __name__ == "__main__":
    main()
