"""The agent's GPU checks in one run: fingerprint correctness and throughput, the Guard on
a single-rank NCCL group, its overhead, and determinism.

Prints one JSON object at the end (and writes it to ``$OUT/gpu_check.json`` when ``OUT``
is set, after every section, so a run cut short keeps what it finished). Every section
catches its own failure and records it in its ``error`` field.

    PYTHONPATH=sidecar:. python3 bench/gpu_check.py             # CUDA if present
    PYTHONPATH=sidecar:. python3 bench/gpu_check.py --device cpu  # small CPU rehearsal

Sections:

``fingerprint_correctness``
    For float32, bfloat16 and float16 tensors of many sizes (0, 1, odd, chunk edges,
    1_000_003), misaligned and non-contiguous views and special values, the eager and the
    compiled (Triton) fingerprints on the device equal the CPU eager fingerprint; single
    bit flips change them; a swap changes ``weighted`` but not ``plain``.
``fingerprint_throughput``
    GB/s of the compiled and eager fingerprints and of ``torch.sum`` over the same tensor,
    timed with CUDA events, contenders interleaved; ``ratio`` = sum time / fingerprint time.
``guard_nccl``
    One NCCL rank (world size 1): guarded training (checks 1 and 3) is bit-identical to
    plain DDP, and injected non-finite faults are caught at their steps. The replay audit
    (check 2) needs at least two nodes (three to localize) and check 3 at least two
    replicas, so neither can find anything here.
``overhead``
    ``bench/overhead.py``'s variants, interleaved step by step, on the same rank.
``determinism``
    The same micro-batch forward and backward, three times, in a fresh process with and
    without :func:`sdc_agent.enable_determinism`: are the loss and gradient fingerprints
    bit-identical?
``fingerprint_large``
    Tensors of more than 2**31 elements (8.6 GB each), when time is left: compiled equals
    eager, and both equal the fingerprint assembled from pieces of 2**30 elements.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdc_agent import FaultSpec, Fingerprinter, Guard, GuardConfig, enable_determinism
from sdc_agent.fingerprint import INT_OF_WIDTH, format_fingerprint
from sdc_agent.launch import free_port

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
MASK64 = (1 << 64) - 1


@dataclass
class Ctx:
    device: torch.device | None
    """None: no CUDA and no CPU rehearsal asked for; the sections skip."""
    small: bool
    """CPU rehearsal: small sizes, few steps."""
    budget: float
    started: float = field(default_factory=time.perf_counter)
    pg: bool = False

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _words(fp: torch.Tensor) -> tuple[int, int]:
    a, b = fp.tolist()
    return int(a) & MASK64, int(b) & MASK64


@contextlib.contextmanager
def _recorded_warnings(into: list[str]) -> Iterator[None]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        if issubclass(w.category, DeprecationWarning | FutureWarning):
            continue  # torch's own deprecation notices, not the agent's
        text = f"{w.category.__name__}: {w.message}"
        if text not in into:
            into.append(text)


# -- a. fingerprint correctness ----------------------------------------------------------


def _sample(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A CPU tensor of ``n`` random values with specials (NaN, infinities, -0, subnormal)."""
    t = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 100).to(dtype)
    specials = [float("nan"), float("inf"), float("-inf"), -0.0, 1e-40, -1e-42, 65504.0]
    if n >= 64:
        t[7 : 7 + len(specials)] = torch.tensor(specials).to(dtype)
    return t


def section_fingerprint_correctness(ctx: Ctx) -> dict[str, Any]:
    assert ctx.device is not None
    dev = ctx.device
    eager, compiled = Fingerprinter("eager"), Fingerprinter("compile")
    out: dict[str, Any] = {"compile_seconds": {}, "compile_error": None}
    try:
        for dtype in FLOATS:  # compile up front, timed (eager-checked on a probe inside)
            started = time.perf_counter()
            compiled.warm_up({dtype}, dev)
            ctx.sync()
            out["compile_seconds"][_name(dtype)] = round(time.perf_counter() - started, 2)
    except Exception as exc:  # keep checking the eager path on the device
        out["compile_error"] = f"{type(exc).__name__}: {exc}"[:3000]
        compiled = eager
    sizes = [0, 1, 2, 3, 7, 64, 4099, 65535, 65536, 65537, 1_000_003]
    if not ctx.small:
        sizes.append(16_777_217)
    checked = 0
    failures: list[dict[str, Any]] = []

    def compare(label: str, cpu_t: torch.Tensor, dev_t: torch.Tensor) -> None:
        nonlocal checked
        want = _words(eager(cpu_t))
        got = {
            "eager_device": _words(eager(dev_t).cpu()),
            "compiled_device": _words(compiled(dev_t).cpu()),
        }
        checked += 1
        for which, words in got.items():
            if words != want:
                failures.append(
                    {
                        "case": label,
                        "path": which,
                        "want": format_fingerprint(want),
                        "got": format_fingerprint(words),
                    }
                )

    for dtype in FLOATS:
        for n in sizes:
            cpu_t = _sample(n, dtype, seed=n)
            dev_t = cpu_t.to(dev)
            compare(f"{_name(dtype)} n={n}", cpu_t, dev_t)
            if n >= 3:  # misaligned start (odd element offset) and a strided view
                compare(f"{_name(dtype)} n={n} [1:]", cpu_t[1:], dev_t[1:])
                compare(f"{_name(dtype)} n={n} [::2]", cpu_t[::2], dev_t[::2])
        rows, cols = (1000, 37) if not ctx.small else (100, 37)
        cpu_m = _sample(rows * cols, dtype, seed=5).view(rows, cols)
        compare(f"{_name(dtype)} {rows}x{cols} transposed", cpu_m.t(), cpu_m.to(dev).t())

    # Single-bit flips on the device: both paths change, and equal the CPU fingerprint of
    # the same flip.
    flips = 0
    flip_failures: list[dict[str, Any]] = []
    big = 1_000_003 if not ctx.small else 65537
    for dtype, n in ((torch.float32, big), (torch.bfloat16, big), (torch.float16, 65537)):
        cpu_t = _sample(n, dtype, seed=11)
        dev_t = cpu_t.to(dev)
        base = (_words(compiled(dev_t).cpu()), _words(eager(dev_t).cpu()))
        width = cpu_t.element_size() * 8
        for index in (0, 1, n // 2, n - 2, n - 1):
            for bit in (0, 1, 7, width - 2, width - 1):
                mask = 1 << bit
                if mask >= 1 << (width - 1):
                    mask -= 1 << width
                cpu_f = cpu_t.clone()
                cpu_f.view(INT_OF_WIDTH[cpu_t.element_size()])[index] ^= mask
                dev_f = cpu_f.to(dev)
                want = _words(eager(cpu_f))
                got = (_words(compiled(dev_f).cpu()), _words(eager(dev_f).cpu()))
                flips += 1
                if got[0] == base[0] or got[1] == base[1] or got != (want, want):
                    flip_failures.append(
                        {"dtype": _name(dtype), "n": n, "index": index, "bit": bit}
                    )
    # A swap changes the weighted word, not the plain one.
    cpu_t = _sample(4099, torch.bfloat16, seed=3)
    swapped = cpu_t.clone()
    swapped[[10, 4000]] = cpu_t[[4000, 10]]
    a, b = _words(compiled(cpu_t.to(dev)).cpu()), _words(compiled(swapped.to(dev)).cpu())
    out.update(
        {
            "sizes": sizes,
            "dtypes": [_name(d) for d in FLOATS],
            "comparisons": checked,
            "failures": failures[:20],
            "failure_count": len(failures),
            "bit_flips": flips,
            "bit_flip_failures": flip_failures[:20],
            "bit_flip_failure_count": len(flip_failures),
            "swap_changes_weighted_only": a[0] != b[0] and a[1] == b[1],
            # Keyed by device and the integer dtype the kernel reads (int16 for both
            # 16-bit floats); tensors under 2**16 elements never use the compiled kernel.
            "compiled_kernel_verified": {k: v != "eager" for k, v in compiled.kernels.items()},
        }
    )
    out["ok"] = (
        out["compile_error"] is None
        and not failures
        and not flip_failures
        and out["swap_changes_weighted_only"]
        and all(out["compiled_kernel_verified"].values())
    )
    return out


# -- b. fingerprint throughput -----------------------------------------------------------


def _timer(ctx: Ctx) -> Callable[[Callable[[], object], int], float]:
    """``time(fn, k)``: seconds per call of ``fn`` over ``k`` back-to-back calls."""
    assert ctx.device is not None
    if ctx.device.type == "cuda":

        def cuda_time(fn: Callable[[], object], k: int) -> float:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(k):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / k

        return cuda_time

    def cpu_time(fn: Callable[[], object], k: int) -> float:
        started = time.perf_counter()
        for _ in range(k):
            fn()
        return (time.perf_counter() - started) / k

    return cpu_time


def section_fingerprint_throughput(ctx: Ctx) -> dict[str, Any]:
    assert ctx.device is not None
    dev = ctx.device
    timed = _timer(ctx)
    eager, compiled = Fingerprinter("eager"), Fingerprinter("compile")
    compile_error = None
    try:
        for dtype in (torch.float32, torch.bfloat16):
            compiled.warm_up({dtype}, dev)
    except Exception as exc:  # time the eager kernel and torch.sum all the same
        compile_error = f"{type(exc).__name__}: {exc}"[:3000]
        compiled = eager
    sizes = [1 << 20, 16 << 20, 256 << 20] if not ctx.small else [1 << 18, 1 << 21]
    rounds = 10 if not ctx.small else 3
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in sizes:
            x = torch.randn(n, device=dev).to(dtype)
            nbytes = n * x.element_size()
            agree = torch.equal(compiled(x), eager(x))  # also warms up the compiled kernel
            # Enough calls per timing that launch gaps don't dominate small tensors.
            calls = {
                "sum": max(1, (64 << 20) // n),
                "compiled": max(1, (64 << 20) // n),
                "eager": max(1, (4 << 20) // n),
            }
            fns: dict[str, Callable[[], object]] = {
                "sum": functools.partial(torch.sum, x),
                "compiled": functools.partial(compiled, x),
                "eager": functools.partial(eager, x),
            }
            for name, fn in fns.items():
                timed(fn, calls[name])
            times: dict[str, list[float]] = {k: [] for k in fns}
            for r in range(rounds):
                for name, fn in fns.items():
                    if name == "eager" and nbytes > (256 << 20) and r >= 3:
                        continue  # the eager kernel is slow on 1 GB; 3 rounds will do
                    times[name].append(timed(fn, calls[name]))
            med = {k: statistics.median(v) for k, v in times.items()}
            results.append(
                {
                    "dtype": _name(dtype),
                    "elements": n,
                    "MB": round(nbytes / 1e6, 1),
                    "compiled_equals_eager": agree,
                    "sum_ms": round(med["sum"] * 1e3, 4),
                    "compiled_ms": round(med["compiled"] * 1e3, 4),
                    "eager_ms": round(med["eager"] * 1e3, 4),
                    "sum_GBps": round(nbytes / med["sum"] / 1e9, 1),
                    "compiled_GBps": round(nbytes / med["compiled"] / 1e9, 1),
                    "eager_GBps": round(nbytes / med["eager"] / 1e9, 1),
                    "ratio_compiled": round(med["sum"] / med["compiled"], 3),
                    "ratio_eager": round(med["sum"] / med["eager"], 4),
                }
            )
            log(f"throughput {results[-1]}")
            del x
    return {
        "compile_error": compile_error,
        "timing": "CUDA events" if dev.type == "cuda" else "perf_counter",
        "rounds": rounds,
        "statistic": "median seconds per call; GB/s counts the input bytes once",
        "results": results,
    }


# -- c. Guard on one NCCL rank -----------------------------------------------------------


@contextlib.contextmanager
def process_group(ctx: Ctx) -> Iterator[None]:
    assert ctx.device is not None
    backend = "nccl" if ctx.device.type == "cuda" else "gloo"
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    kwargs: dict[str, Any] = {}
    if ctx.device.type == "cuda":
        kwargs["device_id"] = ctx.device
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
        **kwargs,
    )
    ctx.pg = True
    try:
        yield
    finally:
        ctx.pg = False
        dist.destroy_process_group()


def _model_dims(ctx: Ctx) -> tuple[int, int]:
    """(hidden width, batch) of bench/overhead.py's MLP: ~51 M parameters on the GPU."""
    return (6144, 256) if not ctx.small else (256, 32)


def _train(
    ctx: Ctx,
    dtype: torch.dtype,
    steps: int,
    config: GuardConfig | None,
    caught: list[str],
    watch: Sequence[int] = (),
) -> dict[str, Any]:
    from bench.overhead import IN, loss_fn, make_model

    assert ctx.device is not None
    dev = ctx.device
    hidden, batch = _model_dims(ctx)
    torch.manual_seed(0)
    model = make_model(hidden).to(dev, dtype)
    ddp = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        x = torch.randn(batch, IN, generator=g).to(dev, dtype)
        batches.append((x, torch.randn(batch, IN, generator=g).to(dev, dtype)))
    eager = Fingerprinter("eager")
    params = list(model.parameters())
    losses: list[float] = []
    records: list[dict[str, Any]] = []
    unchanged_when_skipped: dict[int, bool] = {}
    guard = None
    with _recorded_warnings(caught):
        if config is not None:
            guard = Guard(ddp, opt, loss_fn, config, reporter=None)
        for step, b in enumerate(batches, start=1):
            before = _words(eager.many(params)[0]) if step in watch else None
            if guard is None:
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(ddp, b)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach().float().item()))
                continue
            result = guard.step(b)
            assert result.loss is not None
            losses.append(result.loss)
            if not result.applied or result.verdicts:
                records.append(
                    {
                        "step": result.step,
                        "applied": result.applied,
                        "verdicts": [
                            {
                                "check": v.check,
                                "classification": v.classification,
                                "suspect_ranks": list(v.suspect_ranks),
                                "localized": v.localized,
                                "last_clean_step": v.last_clean_step,
                            }
                            for v in result.verdicts
                        ],
                    }
                )
            if before is not None:
                unchanged_when_skipped[step] = _words(eager.many(params)[0]) == before
    ctx.sync()
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in params],
        "fingerprint": format_fingerprint(eager.many(params)[0]),
        "records": records,
        "last_clean_step": None if guard is None else guard.last_clean_step,
        "unchanged_when_skipped": unchanged_when_skipped,
        "parameters": sum(p.numel() for p in params),
    }


def section_guard(ctx: Ctx) -> dict[str, Any]:
    assert ctx.device is not None
    steps = 20 if not ctx.small else 6
    out: dict[str, Any] = {
        "world_size": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "replay_audit": "not run: check 2 replays a rank's micro-batch on another node and "
        "needs at least two nodes (three to name a suspect); this machine has one GPU and "
        "NCCL refuses two ranks on one GPU",
        "weights_check": "runs (fingerprints every step, all-gather of one rank), but with "
        "one replica it has nothing to compare against, so it cannot flag anything here",
    }
    warned: list[str] = []
    # Bit-identity with plain DDP, float32 and bfloat16 parameters.
    identical: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        config = GuardConfig(nonfinite_check=True, weights_every=1, replay_every=0)
        plain = _train(ctx, dtype, steps, None, warned)
        again = _train(ctx, dtype, steps, None, warned)  # control: is plain DDP repeatable?
        guarded = _train(ctx, dtype, steps, config, warned)
        same_params = all(
            torch.equal(a, b) for a, b in zip(plain["params"], guarded["params"], strict=True)
        )
        identical[_name(dtype)] = {
            "parameters": plain["parameters"],
            "steps": steps,
            "plain_repeatable": plain["fingerprint"] == again["fingerprint"]
            and plain["losses"] == again["losses"],
            "losses_bitwise_equal": plain["losses"] == guarded["losses"],
            "weights_bitwise_equal": same_params,
            "fingerprint_plain": plain["fingerprint"],
            "fingerprint_guarded": guarded["fingerprint"],
            "guard_verdicts": guarded["records"],
            "last_clean_step": guarded["last_clean_step"],
            "first_loss": plain["losses"][0],
            "last_loss": plain["losses"][-1],
        }
        del plain, again, guarded
    out["guarded_equals_plain"] = identical
    # Injected faults: non-finite ones must be caught at their steps by check 1.
    fault_steps = 12 if not ctx.small else 9
    faults = (
        FaultSpec(rank=0, step=3, site="forward", kind="nan"),
        FaultSpec(rank=0, step=5, site="grad_local", kind="nan"),
        FaultSpec(rank=0, step=7, site="grad_reduced", kind="inf"),
        FaultSpec(rank=0, step=8, site="grad_local", kind="inf", index=None),
    )
    expected = {
        3: ("nonfinite", "training"),  # every rank (the only one) non-finite before
        5: ("nonfinite", "training"),
        7: ("nonfinite", "collective"),  # finite before the all-reduce, not after
        8: ("nonfinite", "training"),
    }
    config = GuardConfig(nonfinite_check=True, weights_every=1, replay_every=0, faults=faults)
    run = _train(ctx, torch.float32, fault_steps, config, warned, watch=tuple(expected))
    seen = {
        r["step"]: tuple((v["check"], v["classification"]) for v in r["verdicts"])
        for r in run["records"]
    }
    caught = {
        str(step): {
            "expected": list(want),
            "got": [list(v) for v in seen.get(step, ())],
            "caught": seen.get(step) == (want,),
            "step_skipped_weights_unchanged": run["unchanged_when_skipped"].get(step),
        }
        for step, want in expected.items()
    }
    out["faults"] = {
        "injected": [
            {"step": f.step, "site": f.site, "kind": f.kind, "index": f.index} for f in faults
        ],
        "by_step": caught,
        "unexpected_verdict_steps": sorted(s for s in seen if s not in expected),
        "records": run["records"],
    }
    out["warnings"] = warned
    out["ok"] = (
        all(
            v["losses_bitwise_equal"] and v["weights_bitwise_equal"] and not v["guard_verdicts"]
            for v in identical.values()
        )
        and all(c["caught"] and c["step_skipped_weights_unchanged"] for c in caught.values())
        and not out["faults"]["unexpected_verdict_steps"]
    )
    return out


# -- d. overhead -------------------------------------------------------------------------


def section_overhead(ctx: Ctx) -> dict[str, Any]:
    from bench.overhead import make_model, measure_variants, summarize

    assert ctx.device is not None
    names = ["plain", "hook_only", "nonfinite_only", "weights_every_10_only", "defaults"]
    hidden, batch = (6144, 2048) if not ctx.small else (256, 32)
    steps, warmup = (200, 10) if not ctx.small else (5, 2)
    warned: list[str] = []
    with _recorded_warnings(warned):
        times = measure_variants(
            names,
            rank=0,
            steps=steps,
            warmup=warmup,
            batch=batch,
            hidden=hidden,
            device=ctx.device,
        )
    summary = summarize(times)
    plain = statistics.fmean(times["plain"])
    for name, row in summary["variants"].items():
        row["median_step_ms"] = round(statistics.median(times[name]) * 1e3, 3)
        row["extra_ms_per_step"] = round((statistics.fmean(times[name]) - plain) * 1e3, 3)
    summary["plain_median_step_ms"] = round(statistics.median(times["plain"]) * 1e3, 3)
    # What one check-3 pass costs: fingerprints of the parameters and Adam's two moments.
    params = list(make_model(hidden).to(ctx.device).parameters())
    tensors = [t for p in params for t in (p.detach(), torch.randn_like(p), torch.rand_like(p))]
    fp = Fingerprinter("auto")
    fp.many(tensors)
    ctx.sync()
    timed = _timer(ctx)
    per_pass = statistics.median(timed(lambda: fp.many(tensors), 1) for _ in range(10))
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return {
        "model": f"bench/overhead.py MLP 1024-{hidden}-{hidden}-1024-1024, float32, Adam",
        "parameters": sum(p.numel() for p in params),
        "batch": batch,
        "steps_per_variant": steps,
        "warmup_per_variant": warmup,
        "timing": "perf_counter around each step, ended by a device synchronize (all variants)",
        **summary,
        "weights_check_pass_ms": round(per_pass * 1e3, 3),
        "weights_check_pass_GBps": round(nbytes / per_pass / 1e9, 1),
        "notes": "one NCCL rank: the all-reduce is a local copy and the replay audit cannot "
        "run (the defaults variant therefore costs check 1 + check 3 every 10 steps + a "
        "per-step audit schedule draw)",
        "warnings": warned,
    }


# -- e. determinism ----------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(self.norm2(x))


class _TinyLM(nn.Module):
    """Embedding, two attention blocks, a scatter-add pooling (atomics on CUDA), a head."""

    def __init__(self, vocab: int, width: int, heads: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(2))
        self.head = nn.Linear(width, vocab)
        self.pool_head = nn.Linear(width, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        lm = nn.functional.cross_entropy(
            self.head(x[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten()
        )
        flat = x.flatten(0, 1).float()
        index = tokens.flatten() % self.groups
        pooled = torch.zeros(self.groups, flat.shape[1], device=flat.device).index_add(
            0, index, flat
        )
        return lm + self.pool_head(pooled).square().mean() * 1e-3


def _repeat_step(
    model: nn.Module, tokens: torch.Tensor, attention: str, repeats: int = 3
) -> dict[str, Any]:
    """The same forward and backward ``repeats`` times: loss bits and gradient fingerprints."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = tokens.device
    params = list(model.parameters())
    fp = Fingerprinter("eager")
    runs = []
    per_param: list[list[tuple[int, int]]] = []
    warned: list[str] = []
    backend = sdpa_kernel(SDPBackend.MATH) if attention == "math" else contextlib.nullcontext()
    with _recorded_warnings(warned), backend:
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                loss = model(tokens)
            loss.backward()
            grads = [p.grad for p in params if p.grad is not None]
            combined, each = fp.many(grads)
            runs.append(
                {
                    "loss": float(loss.item()),
                    "loss_bits": f"{int(loss.detach().float().view(torch.int32).item()):08x}",
                    "grad_fingerprint": format_fingerprint(combined),
                }
            )
            per_param.append([_words(row) for row in each.cpu()])
    names = [n for n, p in model.named_parameters() if p.grad is not None]
    differing = sorted(
        {names[i] for run in per_param[1:] for i, w in enumerate(run) if w != per_param[0][i]}
    )
    return {
        "attention": attention,
        "runs": runs,
        "loss_bitwise_identical": len({r["loss_bits"] for r in runs}) == 1,
        "grads_bitwise_identical": len({r["grad_fingerprint"] for r in runs}) == 1,
        "differing_parameters": differing[:12],
        "differing_parameter_count": len(differing),
        "warnings": warned,
    }


def determinism_child(mode: str, device: str) -> dict[str, Any]:
    """Runs in a fresh process: the same micro-batch three times; bitwise equal?

    With the default attention kernels first; if that raises (an operation without a
    deterministic implementation), again with PyTorch's math attention.
    """
    out: dict[str, Any] = {"mode": mode}
    if mode == "on":
        out["set"] = enable_determinism()  # before any CUDA work
    out["CUBLAS_WORKSPACE_CONFIG"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    dev = torch.device(device)
    small = dev.type == "cpu"
    vocab, width, heads, groups = (32000, 1024, 8, 16) if not small else (500, 64, 4, 4)
    batch, seq = (8, 512) if not small else (2, 32)
    torch.manual_seed(0)
    model = _TinyLM(vocab, width, heads, groups).to(dev)
    out["parameters"] = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(dev)
    try:
        out.update(_repeat_step(model, tokens, "default"))
    except Exception as exc:
        out["default_attention_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        out.update(_repeat_step(model, tokens, "math"))
    return out


def section_determinism(ctx: Ctx) -> dict[str, Any]:
    assert ctx.device is not None
    out: dict[str, Any] = {
        "model": "embedding, 2 attention blocks (SDPA, causal), index_add pooling, LM head; "
        "bf16 autocast on CUDA; the same micro-batch forward+backward 3 times per process"
    }
    for mode in ("on", "off"):
        env = dict(os.environ)
        env.pop("CUBLAS_WORKSPACE_CONFIG", None)
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--determinism-child",
            mode,
            "--device",
            ctx.device.type,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
            lines = proc.stdout.strip().splitlines()
            if proc.returncode != 0 or not lines:
                out[mode] = {"error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
            else:
                out[mode] = json.loads(lines[-1])
        except Exception as exc:
            out[mode] = {"error": f"{type(exc).__name__}: {exc}"}
    on, off = out.get("on", {}), out.get("off", {})
    out["ok"] = bool(on.get("loss_bitwise_identical") and on.get("grads_bitwise_identical"))
    out["differs_without"] = (
        None
        if "error" in off
        else not (off.get("loss_bitwise_identical") and off.get("grads_bitwise_identical"))
    )
    return out


# -- f. more than 2**31 elements ---------------------------------------------------------


def section_fingerprint_large(ctx: Ctx) -> dict[str, Any]:
    assert ctx.device is not None
    dev = ctx.device
    eager, compiled = Fingerprinter("eager"), Fingerprinter("compile")
    piece = 1 << 30 if not ctx.small else 1 << 16
    cases = (
        [(torch.float32, (1 << 31) + 7), (torch.bfloat16, (1 << 32) + 6)]
        if not ctx.small
        else [(torch.float32, 3 * piece + 7), (torch.bfloat16, 4 * piece + 6)]
    )
    results = []
    for dtype, n in cases:
        if ctx.elapsed() > ctx.budget - 90:
            results.append({"dtype": _name(dtype), "elements": n, "skipped": "out of time"})
            continue
        row: dict[str, Any] = {"dtype": _name(dtype), "elements": n}
        try:
            x = torch.empty(n, dtype=dtype, device=dev)
            x.normal_(generator=torch.Generator(dev).manual_seed(7))
            started = time.perf_counter()
            got = _words(compiled(x).cpu())
            row["compiled_s"] = round(time.perf_counter() - started, 2)
            started = time.perf_counter()
            ref = _words(eager(x).cpu())
            row["eager_s"] = round(time.perf_counter() - started, 2)
            # From pieces: weighted(x) = sum(weighted(p_k) + 2 * off_k * plain(p_k)).
            weighted = plain = 0
            for off in range(0, n, piece):
                w, p = _words(compiled(x[off : off + piece]).cpu())
                weighted += w + 2 * off * p
                plain += p
            pieces = (weighted & MASK64, plain & MASK64)
            row.update(
                {
                    "compiled": format_fingerprint(got),
                    "eager": format_fingerprint(ref),
                    "from_pieces": format_fingerprint(pieces),
                    "ok": got == ref == pieces,
                }
            )
            del x
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        results.append(row)
        log(f"large {row}")
    return {"piece": piece, "results": results}


def section_compile_diag(ctx: Ctx) -> dict[str, Any]:
    """Is the compiled fingerprint slow because of ``dynamic=True``? Static compiles, timed."""
    from sdc_agent.fingerprint import _as_flat_bits, _fused_words, _fused_words_pairs

    assert ctx.device is not None
    timed = _timer(ctx)
    n = 256 << 20 if not ctx.small else 1 << 20
    rows = []
    for dtype, fn in ((torch.float32, _fused_words), (torch.bfloat16, _fused_words_pairs)):
        x = torch.randn(n, device=ctx.device).to(dtype)
        bits = _as_flat_bits(x)
        if dtype == torch.bfloat16:
            bits = bits.view(torch.int32)
        want = Fingerprinter("eager")(x)
        for label, dynamic in (("dynamic=True", True), ("static", False)):
            torch._dynamo.reset()
            f = torch.compile(fn, dynamic=dynamic)
            started = time.perf_counter()
            got = f(bits)
            ctx.sync()
            compile_s = time.perf_counter() - started
            t = statistics.median(timed(functools.partial(f, bits), 1) for _ in range(5))
            s_t = statistics.median(timed(functools.partial(torch.sum, x), 1) for _ in range(5))
            rows.append(
                {
                    "dtype": _name(dtype),
                    "compile": label,
                    "equal_to_eager": torch.equal(got, want),
                    "compile_s": round(compile_s, 1),
                    "ms": round(t * 1e3, 3),
                    "GBps": round(n * x.element_size() / t / 1e9, 1),
                    "ratio_to_sum": round(s_t / t, 3),
                }
            )
            log(f"diag {rows[-1]}")
        del x, bits
    torch._dynamo.reset()
    return {"elements": n, "results": rows}


# -- driver ------------------------------------------------------------------------------


def _meta(ctx: Ctx) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(ctx.device),
        "cuda_available": torch.cuda.is_available(),
    }
    with contextlib.suppress(Exception):
        meta["triton"] = importlib.import_module("triton").__version__
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):
            props = torch.cuda.get_device_properties(0)
            meta["gpu"] = props.name
            meta["gpu_memory_GiB"] = round(props.total_memory / 2**30, 1)
            meta["sm_count"] = props.multi_processor_count
            meta["cuda"] = torch.version.cuda
            meta["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return meta


def main() -> None:
    parser = argparse.ArgumentParser(description="The agent's GPU checks in one run.")
    parser.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="auto: CUDA if present, else every section is skipped; cpu: a small rehearsal",
    )
    parser.add_argument(
        "--sections",
        default="fingerprint_correctness,fingerprint_throughput,guard_nccl,overhead,"
        "determinism,fingerprint_large",
    )
    parser.add_argument("--budget", type=float, default=380.0, help="seconds for the run")
    parser.add_argument("--determinism-child", choices=("on", "off"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.determinism_child:
        print(json.dumps(determinism_child(args.determinism_child, args.device)))
        return
    if args.device == "cpu":
        device: torch.device | None = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
    elif args.device == "cuda":
        parser.error("--device cuda: no CUDA device")
    else:
        device = None
    ctx = Ctx(device=device, small=device is not None and device.type == "cpu", budget=args.budget)
    wanted = [s for s in args.sections.split(",") if s]
    report: dict[str, Any] = {"benchmark": "gpu_check", "meta": _meta(ctx), "sections": {}}
    out_dir = os.environ.get("OUT")

    def save() -> None:
        report["elapsed_s"] = round(ctx.elapsed(), 1)
        if out_dir:
            with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
                json.dump(report, f, indent=2, default=str)

    sections: dict[str, Callable[[Ctx], dict[str, Any]]] = {
        "fingerprint_correctness": section_fingerprint_correctness,
        "fingerprint_throughput": section_fingerprint_throughput,
        "guard_nccl": section_guard,
        "overhead": section_overhead,
        "determinism": section_determinism,
        "fingerprint_large": section_fingerprint_large,
        "compile_diag": section_compile_diag,
    }
    needs_pg = {"guard_nccl", "overhead"}
    pg_error: str | None = None
    stack = contextlib.ExitStack()
    for name in wanted:
        fn = sections[name]
        if device is None:
            report["sections"][name] = {"error": None, "skipped": "skipped: no CUDA"}
            continue
        if name in needs_pg and not ctx.pg and pg_error is None:
            try:
                stack.enter_context(process_group(ctx))
            except Exception as exc:
                pg_error = f"process group: {type(exc).__name__}: {exc}"
        if name not in needs_pg and ctx.pg:
            stack.close()
        log(f"section {name} (elapsed {ctx.elapsed():.0f} s)")
        started = time.perf_counter()
        if name in needs_pg and pg_error is not None:
            result: dict[str, Any] = {"error": pg_error}
        else:
            try:
                result = {"error": None, **fn(ctx)}
            except Exception as exc:
                result = {
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc()[-4000:],
                }
        result["seconds"] = round(time.perf_counter() - started, 1)
        report["sections"][name] = result
        log(f"section {name} done in {result['seconds']} s, error={result['error']}")
        save()
        if device is not None and device.type == "cuda":
            torch.cuda.empty_cache()
    stack.close()
    save()
    print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
