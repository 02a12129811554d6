"""A small, seeded DDP training run with the Guard on: for drills, the demo and tests.

:func:`run_drill` trains a small MLP with dropout on synthetic data across local gloo
processes (one per entry of ``nodes``), injects the requested faults, and returns what
every rank saw. Everything is seeded, so two runs with the same arguments produce the
same bits.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .config import GuardConfig
from .errors import OperatorUnreachableError
from .faults import FaultSpec, _CorruptForward
from .fingerprint import Fingerprinter, format_fingerprint
from .guard import Guard
from .launch import spawn_local
from .verdict import StepResult

__all__ = ["Drill", "DrillRank", "make_model", "make_batch", "run_drill"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Drill:
    """One training run. ``config`` holds :class:`~sdc_agent.GuardConfig` keyword arguments."""

    steps: int = 20
    faults: tuple[FaultSpec, ...] = ()
    config: dict[str, Any] = field(default_factory=dict)
    guarded: bool = True
    """False trains the same model with plain DDP, for bitwise comparisons."""
    seed: int = 0
    width: int = 64
    batch_size: int = 8
    dropout: float = 0.1
    lr: float = 1e-2
    bucket_cap_mb: float = 0.01
    """Small, so the model's gradients travel in several buckets."""
    micro_batches: int = 1
    """Gradient accumulation: micro-batches per step."""
    poison: tuple[int, int] | None = None
    """``(rank, step)``: put a NaN into that rank's input batch at that step (bad data)."""
    low_level: bool = False
    """Drive the Guard through begin_step / check_gradients / finish_step."""
    noise: float = 0.0
    """Add noise from a private, unseeded generator to a hidden layer: a model that is
    not deterministic (its replays differ)."""
    grad_noise: bool = False
    """Every computation of the second layer's weight gradient moves three random
    elements by one unit in the last place, on every rank: run-to-run noise as atomics
    in a backward kernel give it."""
    grad_noise_everywhere: bool = False
    """With ``grad_noise``: every element of that gradient moves by ±1 ulp, not three (a
    full reduction made with atomics)."""
    reorder_rank: int | None = None
    """This rank's process computes the second layer's forward in another summation
    order from the first step: a deterministic last-bit difference, as per-process
    autotuning gives."""
    bf16: bool = False
    """Run every forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``."""
    forward_noise: float = 0.0
    """This fraction of the second layer's outputs moves by ±1 ulp (of the dtype they are
    computed in) in every computation, drawn from a private generator: a forward kernel
    that is not reproducible run to run (split-K GEMMs, autotuned tiles)."""
    grad_noise_fraction: float = 0.0
    """This fraction of the second layer's weight gradient moves by ±``grad_noise_ulps``
    ulp (of the dtype the backward computes it in) in every computation: a backward
    reduction made with atomics (FlashAttention's, the embedding's)."""
    grad_noise_ulps: int = 1
    marked_fault: tuple[int, int, float] | None = None
    """``(rank, step, relative error)``: a fault only some inputs trigger. From ``step`` on,
    that rank's first layer computes its output wrong by the relative error whenever its
    input is a marked micro-batch; micro-batch :data:`MARKED` (the third) of every step is
    marked, on every rank."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DrillRank:
    """What one rank saw."""

    rank: int
    node: str
    verdicts: list[dict[str, Any]]
    applied: list[bool]
    last_clean_step: list[int]
    losses: list[float]
    final_fingerprint: str
    seconds: float
    replay_comparisons: int
    replay_mismatches: int
    stopped: str | None = None
    """Why training stopped early (an :class:`~sdc_agent.errors.SDCError`), if it did."""
    gradient_tolerance: float | None = None
    """The replay audit's threshold in force at the end (see Guard.gradient_tolerance)."""
    bit_reproducible: bool | None = None


class _Noise(nn.Module):
    """Adds noise the replay cannot reproduce: its generator is private and unseeded."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * torch.rand(x.shape, generator=self.generator)


class _UlpNoise(torch.autograd.Function):
    """Identity forward; the backward moves three elements of the gradient by ±1 ulp."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor) -> torch.Tensor:
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        noisy = grad.clone()
        where = torch.randint(0, noisy.numel(), (3,), generator=g)
        up = torch.randint(0, 2, (3,), generator=g).bool()
        flat = noisy.view(-1)
        flat[where] = torch.nextafter(
            flat[where], torch.where(up, float("inf"), float("-inf")).to(flat.dtype)
        )
        return noisy


class _UlpNoiseEverywhere(torch.autograd.Function):
    """Identity forward; the backward moves every element of the gradient by ±1 ulp."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor) -> torch.Tensor:
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        up = torch.randint(0, 2, grad.shape, generator=g).bool()
        return torch.nextafter(grad, torch.where(up, float("inf"), float("-inf")).to(grad.dtype))


def _ulp_moved(x: torch.Tensor, fraction: float, ulps: int) -> torch.Tensor:
    """``x`` with ``fraction`` of its elements moved by ±``ulps`` units in the last place
    of its dtype, chosen by a private, unseeded generator (a replay cannot reproduce it)."""
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    hit = torch.rand(x.shape, generator=g) < fraction
    up = torch.randint(0, 2, x.shape, generator=g).bool()
    away = torch.where(up, float("inf"), float("-inf")).to(x.dtype)
    out = x.detach().clone()
    for _ in range(ulps):
        out = torch.where(hit, torch.nextafter(out, away), out)
    return out


class _ForwardNoise(torch.autograd.Function):
    """Moves some outputs by ±1 ulp; gradients pass through unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fraction: float) -> torch.Tensor:
        return _ulp_moved(x, fraction, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GradNoise(torch.autograd.Function):
    """Identity forward; the backward moves some of the gradient by ±``ulps`` ulp."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, fraction: float, ulps: int) -> torch.Tensor:
        ctx.noise = (fraction, ulps)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _ulp_moved(grad, *ctx.noise), None, None


@dataclass(frozen=True, kw_only=True, slots=True)
class DrillNoise:
    """The non-determinism one :class:`DrillLinear` carries (see :class:`Drill`)."""

    grad_noise: bool = False
    everywhere: bool = False
    reorder: bool = False
    forward_fraction: float = 0.0
    grad_fraction: float = 0.0
    grad_ulps: int = 1

    def __bool__(self) -> bool:
        return bool(self.grad_noise or self.reorder or self.forward_fraction or self.grad_fraction)


class DrillLinear(nn.Linear):
    """A Linear that can carry the drills' kinds of non-determinism."""

    def __init__(self, n_in: int, n_out: int, noise: DrillNoise) -> None:
        super().__init__(n_in, n_out)
        self.kinds = noise
        self.noise: type[torch.autograd.Function] = (
            _UlpNoiseEverywhere if noise.everywhere else _UlpNoise
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kinds = self.kinds
        weight: torch.Tensor = self.weight
        if kinds.grad_fraction:
            # In the dtype the backward kernel computes the gradient in (autocast's).
            if torch.is_autocast_enabled("cpu"):
                weight = weight.to(torch.get_autocast_dtype("cpu"))
            weight = _GradNoise.apply(weight, kinds.grad_fraction, kinds.grad_ulps)
        if kinds.grad_noise:
            weight = self.noise.apply(weight)
        if not kinds.reorder:
            out = nn.functional.linear(x, weight, self.bias)
        else:
            half = x.shape[-1] // 2  # the same sum, added in another order
            low = nn.functional.linear(x[..., :half], weight[:, :half])
            out = nn.functional.linear(x[..., half:], weight[:, half:], self.bias) + low
        if kinds.forward_fraction:
            out = _ForwardNoise.apply(out, kinds.forward_fraction)
        return out


def make_model(
    width: int, dropout: float, noise: float = 0.0, *, kinds: DrillNoise | None = None
) -> nn.Module:
    second: nn.Module = DrillLinear(width, width, kinds) if kinds else nn.Linear(width, width)
    layers: list[nn.Module] = [
        nn.Linear(16, width),
        nn.ReLU(),
        nn.Dropout(dropout),
        second,
        nn.ReLU(),
        nn.Linear(width, 4),
    ]
    if noise:
        layers.append(_Noise(noise))
    return nn.Sequential(*layers)


MARKED = 2
"""The index of the micro-batch :attr:`Drill.marked_fault` marks (the third)."""
_MARK = 4.5  # the first input feature of every row of a marked micro-batch


def _marked_fault_hook(spec: FaultSpec, step_of: list[int]) -> Any:
    def hook(_module: nn.Module, inputs: Any, output: torch.Tensor) -> Any:
        if step_of[0] < spec.step or not bool((inputs[0][..., 0] == _MARK).all()):
            return None
        return _CorruptForward.apply(output, spec)

    return hook


def make_batch(seed: int, rank: int, step: int, batch_size: int) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s batch at ``step``: a fixed function of its arguments."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(batch_size, 16, generator=g)
    y = torch.randn(batch_size, 4, generator=g)
    return x, y


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def drill_worker(rank: int, world: int, drills: Sequence[Drill]) -> list[DrillRank]:
    """Run ``drills`` one after the other on this rank (called by :func:`spawn_local`)."""
    import time

    out = []
    for drill in drills:
        torch.manual_seed(drill.seed)  # same initial weights everywhere...
        kinds = DrillNoise(
            grad_noise=drill.grad_noise,
            everywhere=drill.grad_noise_everywhere,
            reorder=drill.reorder_rank == rank,
            forward_fraction=drill.forward_noise,
            grad_fraction=drill.grad_noise_fraction,
            grad_ulps=drill.grad_noise_ulps,
        )
        model = make_model(drill.width, drill.dropout, drill.noise, kinds=kinds)
        ddp = DistributedDataParallel(model, bucket_cap_mb=drill.bucket_cap_mb)
        step_of = [0]
        if drill.marked_fault is not None and drill.marked_fault[0] == rank:
            _, first, error = drill.marked_fault
            spec = FaultSpec(
                rank=rank,
                step=first,
                site="forward",
                kind="relative",
                index=None,
                relative_error=error,
                persistent=True,
            )
            first_layer = dict(model.named_modules())["0"]
            first_layer.register_forward_hook(_marked_fault_hook(spec, step_of))
        torch.manual_seed(drill.seed * 7919 + rank + 1)  # ...and a dropout stream per rank
        optimizer = torch.optim.Adam(ddp.parameters(), lr=drill.lr)
        guard = (
            Guard(
                ddp,
                optimizer,
                mse_loss,
                GuardConfig.from_env(faults=drill.faults, **drill.config),
            )
            if drill.guarded
            else None
        )
        verdicts: list[dict[str, Any]] = []
        applied: list[bool] = []
        clean: list[int] = []
        losses: list[float] = []
        stopped: str | None = None
        start = time.perf_counter()
        for step in range(1, drill.steps + 1):
            step_of[0] = step
            micro = [
                make_batch(drill.seed, rank, step * 100 + j, drill.batch_size)
                for j in range(drill.micro_batches)
            ]
            if drill.marked_fault is not None and len(micro) > MARKED:
                micro[MARKED][0][:, 0] = _MARK
            if drill.poison == (rank, step):
                micro[0][0][0, 0] = float("nan")
            if guard is None:
                optimizer.zero_grad(set_to_none=True)
                total = 0.0
                for j, batch in enumerate(micro):
                    last = j == len(micro) - 1
                    with contextlib.nullcontext() if last else ddp.no_sync():
                        loss = mse_loss(ddp, batch)
                        (loss / len(micro) if len(micro) > 1 else loss).backward()
                    total += float(loss.item())
                optimizer.step()
                applied.append(True)
                losses.append(total / len(micro))
                continue
            autocast = (
                torch.autocast("cpu", dtype=torch.bfloat16)
                if drill.bf16
                else contextlib.nullcontext()
            )
            try:
                with autocast:
                    result = _guarded_step(guard, ddp, optimizer, micro, drill.low_level)
            except OperatorUnreachableError as exc:
                stopped = f"step {step}: {exc}"
                break
            verdicts.extend(v.to_dict() for v in result.verdicts)
            applied.append(result.applied)
            clean.append(guard.last_clean_step)
            losses.append(result.loss if result.loss is not None else float("nan"))
        seconds = time.perf_counter() - start
        if guard is not None:
            guard.close(timeout=5.0)
        final = Fingerprinter("eager").many(list(model.parameters()))[0]
        out.append(
            DrillRank(
                rank=rank,
                node=guard.topology.node_of(dist.get_rank()) if guard else "",
                verdicts=verdicts,
                applied=applied,
                last_clean_step=clean,
                losses=losses,
                final_fingerprint=format_fingerprint(final),
                seconds=seconds,
                replay_comparisons=guard.replay_stats.comparisons if guard else 0,
                replay_mismatches=guard.replay_stats.mismatches if guard else 0,
                stopped=stopped,
                gradient_tolerance=guard.gradient_tolerance if guard else None,
                bit_reproducible=guard.bit_reproducible if guard else None,
            )
        )
        dist.barrier()
    return out


def _guarded_step(
    guard: Guard,
    ddp: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro: list[tuple[torch.Tensor, ...]],
    low_level: bool,
) -> StepResult:
    if low_level:
        return _low_level_step(guard, ddp, optimizer, micro[0])
    return guard.step(micro[0]) if len(micro) == 1 else guard.step(micro_batches=micro)


def _low_level_step(
    guard: Guard, ddp: nn.Module, optimizer: torch.optim.Optimizer, batch: Any
) -> StepResult:
    optimizer.zero_grad(set_to_none=True)
    guard.begin_step()
    loss = mse_loss(ddp, batch)
    loss.backward()
    applied = guard.check_gradients()
    if applied:
        optimizer.step()
    return guard.finish_step(applied=applied, loss=loss)


def run_drill(
    nodes: Sequence[str], drills: Sequence[Drill], *, env: dict[str, str] | None = None
) -> list[list[DrillRank]]:
    """Run ``drills`` on ``len(nodes)`` local processes; result ``[drill][rank]``."""
    per_rank = spawn_local(drill_worker, nodes, (list(drills),), env=env)
    return [[per_rank[r][d] for r in range(len(nodes))] for d in range(len(drills))]
