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
from .faults import FaultSpec
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


class DrillLinear(nn.Linear):
    """A Linear that can carry the drills' kinds of non-determinism."""

    def __init__(
        self,
        n_in: int,
        n_out: int,
        *,
        grad_noise: bool,
        reorder: bool,
        everywhere: bool = False,
    ) -> None:
        super().__init__(n_in, n_out)
        self.grad_noise = grad_noise
        self.reorder = reorder
        self.noise: type[torch.autograd.Function] = _UlpNoiseEverywhere if everywhere else _UlpNoise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.noise.apply(self.weight) if self.grad_noise else self.weight
        if not self.reorder:
            return nn.functional.linear(x, weight, self.bias)
        half = x.shape[-1] // 2  # the same sum, added in another order
        low = nn.functional.linear(x[..., :half], weight[:, :half])
        return nn.functional.linear(x[..., half:], weight[:, half:], self.bias) + low


def make_model(
    width: int,
    dropout: float,
    noise: float = 0.0,
    *,
    grad_noise: bool = False,
    reorder: bool = False,
    noise_everywhere: bool = False,
) -> nn.Module:
    second: nn.Module = (
        DrillLinear(
            width, width, grad_noise=grad_noise, reorder=reorder, everywhere=noise_everywhere
        )
        if grad_noise or reorder
        else nn.Linear(width, width)
    )
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
        model = make_model(
            drill.width,
            drill.dropout,
            drill.noise,
            grad_noise=drill.grad_noise,
            reorder=drill.reorder_rank == rank,
            noise_everywhere=drill.grad_noise_everywhere,
        )
        ddp = DistributedDataParallel(model, bucket_cap_mb=drill.bucket_cap_mb)
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
            micro = [
                make_batch(drill.seed, rank, step * 100 + j, drill.batch_size)
                for j in range(drill.micro_batches)
            ]
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
            try:
                if drill.low_level:
                    result = _low_level_step(guard, ddp, optimizer, micro[0])
                else:
                    result = (
                        guard.step(micro[0]) if len(micro) == 1 else guard.step(micro_batches=micro)
                    )
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
