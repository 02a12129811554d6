"""A small, seeded DDP training run with the Guard on: for drills, the demo and tests.

:func:`run_drill` trains a small MLP with dropout on synthetic data across local gloo
processes (one per entry of ``nodes``), injects the requested faults, and returns what
every rank saw. Everything is seeded, so two runs with the same arguments produce the
same bits.

Run-to-run noise (what kernels that are not bit-reproducible give) is emulated in torch
and drawn from one generator per process, seeded from :attr:`Drill.noise_seed` and the
rank: every computation draws afresh (an original and its replay on another rank, or a
rank's own rerun, differ, as on a real GPU), yet two runs of the same drill draw the same
noise, so a test that fails fails again.
"""

from __future__ import annotations

import contextlib
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
from .weights import local_tensor

__all__ = ["Drill", "DrillRank", "make_batch", "make_model", "run_drill", "seed_noise"]


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
    sync_micro_batches: bool = False
    """With ``micro_batches``: the gradient collective runs after every micro-batch's
    backward (no ``no_sync``; FSDP2 then reduce-scatters each), the loop calling the
    Guard's phases itself (``before_backward`` for each micro-batch)."""
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
    grad_noise_fraction: float = 0.0
    """With ``grad_noise``: this fraction of that gradient's elements moves, each by 1 to
    ``grad_noise_ulps`` ulp up or down (a bf16 backward with atomics: 0.1 for 10 %)."""
    grad_noise_ulps: int = 1
    forward_noise: float = 0.0
    """This fraction of the second layer's outputs moves by ±1 ulp in every computation
    (a forward kernel that is not bit-reproducible: split-K GEMMs; 0.01 for 1 %)."""
    reorder_rank: int | None = None
    """This rank's process computes the second layer's forward in another summation
    order from the first step: a deterministic last-bit difference, as per-process
    autotuning gives."""
    autocast: bool = False
    """Run every forward under CPU autocast in bfloat16 (the loss in float32)."""
    noise_seed: int = 0
    """Seeds each process's noise generator (with its rank)."""
    layout: str = "ddp"
    """``ddp``; ``fsdp``: FSDP2 (``fully_shard`` per Linear, then the root) over a 1-D
    mesh of every rank; ``hsdp``: the same over a 2-D mesh ``(replicate, shard)`` with
    ``shard`` ranks per shard group (consecutive ranks)."""
    shard: int = 2
    """With ``layout="hsdp"``: the shard dimension's size."""
    model: str = "mlp"
    """``mlp`` (three Linear layers, :func:`make_model`); ``gpt2``: a small GPT-2 from
    ``transformers`` (random weights, :func:`make_gpt2`: three blocks, ``width`` wide, a
    vocabulary of 64, 16 tokens, ``batch_size`` sequences), its loss the language-model
    loss. The noise options then act on the middle block's MLP (:data:`GPT2_MIDDLE`):
    ``forward_noise`` on its output, ``grad_noise`` (with ``grad_noise_fraction``) on its
    first projection's weight gradient; ``dropout``, ``noise``, ``reorder_rank`` and
    ``marked_fault`` are not available; DDP only."""
    marked_fault: tuple[int, int, float] | None = None
    """``(rank, step, relative error)``: a fault only some inputs trigger. From ``step`` on,
    that rank's first layer computes its output wrong by the relative error (in every
    element) whenever its input is a marked micro-batch; micro-batch :data:`MARKED` (the
    third) of every step is marked, on every rank (needs ``micro_batches`` > 2)."""


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
    """Adds noise the replay cannot reproduce: its generator is private (outside torch's
    default generators, which the replay restores), seeded per process from the drill's
    noise stream."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale
        seed = int(torch.randint(0, 2**31, (1,), generator=_noise_generator()).item())
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * torch.rand(x.shape, generator=self.generator)


_NOISE: list[torch.Generator] = []
"""This process's run-to-run noise generator (set by :func:`drill_worker`)."""


def seed_noise(seed: int, rank: int) -> None:
    """Seed this process's run-to-run noise (one stream per rank and seed)."""
    _NOISE[:] = [torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + 17)]


def _noise_generator() -> torch.Generator:
    if not _NOISE:
        seed_noise(0, 0)
    return _NOISE[0]


_SIGNIFICANT_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24, torch.float64: 53}


def _move_ulps(
    t: torch.Tensor, where: torch.Tensor, ulps: torch.Tensor, unit: torch.dtype | None = None
) -> torch.Tensor:
    """``t`` with the flat elements ``where`` moved by ``ulps`` units in the last place
    (signed) of ``unit`` (default: ``t``'s dtype; bfloat16 for a float32 gradient of a
    bf16 computation). Zeros stay."""
    out = t.detach().clone().contiguous()
    flat = out.view(-1)
    values = flat[where]
    bits = _SIGNIFICANT_BITS[unit or t.dtype]
    _, exponent = torch.frexp(values.float())
    step = torch.ldexp(torch.ones_like(values, dtype=torch.float32), exponent - bits)
    moved = (values.float() + ulps.float() * step).to(flat.dtype)
    flat[where] = torch.where(values == 0, values, moved)
    return out


def _draw(numel: int, fraction: float, max_ulps: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _noise_generator()
    count = max(1, round(fraction * numel))
    where = torch.randperm(numel, generator=g)[:count]
    size = torch.randint(1, max_ulps + 1, (count,), generator=g)
    sign = torch.randint(0, 2, (count,), generator=g) * 2 - 1
    return where, size * sign


class _UlpNoise(torch.autograd.Function):
    """Identity forward; the backward moves three elements of the gradient by ±1 ulp."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, fraction: float, ulps: int) -> torch.Tensor:
        ctx.fraction, ctx.ulps = fraction, ulps
        ctx.bf16 = torch.is_autocast_enabled("cpu")
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        unit = None
        if ctx.fraction > 0:
            where, ulps = _draw(grad.numel(), ctx.fraction, ctx.ulps)
            # The gradient of a bf16 computation: its noise is in bf16's ulps.
            unit = torch.bfloat16 if ctx.bf16 else None
        else:
            g = _noise_generator()
            where = torch.randint(0, grad.numel(), (3,), generator=g)
            ulps = torch.randint(0, 2, (3,), generator=g) * 2 - 1
        return _move_ulps(grad, where, ulps, unit).view_as(grad), None, None


class _UlpNoiseEverywhere(torch.autograd.Function):
    """Identity forward; the backward moves every element of the gradient by ±1 ulp."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, fraction: float, ulps: int) -> torch.Tensor:
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        up = torch.randint(0, 2, grad.shape, generator=_noise_generator()).bool()
        inf = torch.where(up, float("inf"), float("-inf")).to(grad.dtype)
        return torch.nextafter(grad, inf), None, None


class _ForwardNoise(torch.autograd.Function):
    """Moves a fraction of a forward output by ±1 ulp; gradients pass through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fraction: float) -> torch.Tensor:
        where, ulps = _draw(x.numel(), fraction, 1)
        return _move_ulps(x, where, ulps).view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


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
        fraction: float = 0.0,
        ulps: int = 1,
        forward_noise: float = 0.0,
    ) -> None:
        super().__init__(n_in, n_out)
        self.grad_noise = grad_noise
        self.reorder = reorder
        self.fraction = fraction
        self.ulps = ulps
        self.forward_noise = forward_noise
        self.noise: type[torch.autograd.Function] = _UlpNoiseEverywhere if everywhere else _UlpNoise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = (
            self.noise.apply(self.weight, self.fraction, self.ulps)
            if self.grad_noise
            else self.weight
        )
        if not self.reorder:
            out = nn.functional.linear(x, weight, self.bias)
        else:
            half = x.shape[-1] // 2  # the same sum, added in another order
            low = nn.functional.linear(x[..., :half], weight[:, :half])
            out = nn.functional.linear(x[..., half:], weight[:, half:], self.bias) + low
        if self.forward_noise > 0:
            out = _ForwardNoise.apply(out, self.forward_noise)
        return out


def make_model(
    width: int,
    dropout: float,
    noise: float = 0.0,
    *,
    grad_noise: bool = False,
    reorder: bool = False,
    noise_everywhere: bool = False,
    grad_noise_fraction: float = 0.0,
    grad_noise_ulps: int = 1,
    forward_noise: float = 0.0,
) -> nn.Module:
    second: nn.Module = (
        DrillLinear(
            width,
            width,
            grad_noise=grad_noise,
            reorder=reorder,
            everywhere=noise_everywhere,
            fraction=grad_noise_fraction,
            ulps=grad_noise_ulps,
            forward_noise=forward_noise,
        )
        if grad_noise or reorder or forward_noise
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


MARKED = 2
"""The index of the micro-batch :attr:`Drill.marked_fault` marks (the third)."""
_MARK = 4.5  # the first input feature of every row of a marked micro-batch


def _marked_fault_hook(spec: FaultSpec, step_of: list[int]) -> Any:
    def hook(_module: nn.Module, inputs: Any, output: torch.Tensor) -> Any:
        if step_of[0] < spec.step or not bool((inputs[0][..., 0] == _MARK).all()):
            return None
        return _CorruptForward.apply(output, spec)

    return hook


GPT2_MIDDLE = "transformer.h.1.mlp"
"""The middle block's MLP of :func:`make_gpt2`: where the drill's noise acts."""
GPT2_VOCAB = 64
GPT2_TOKENS = 16


def make_gpt2(width: int) -> nn.Module:
    """A GPT-2 of three blocks from ``transformers`` with random weights (seeded by the
    caller), nothing downloaded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=3,
        n_head=2,
        n_embd=width,
        vocab_size=GPT2_VOCAB,
        n_positions=GPT2_TOKENS,
    )
    return GPT2LMHeadModel(config)


def _add_gpt2_noise(model: nn.Module, drill: Drill) -> None:
    """The drill's run-to-run noise in the middle block's MLP (see :attr:`Drill.model`)."""
    if drill.forward_noise > 0:
        fraction = drill.forward_noise

        def forward(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
            return _ForwardNoise.apply(output, fraction)

        dict(model.named_modules())[GPT2_MIDDLE].register_forward_hook(forward)
    if drill.grad_noise:
        weight = dict(model.named_parameters())[f"{GPT2_MIDDLE}.c_fc.weight"]
        unit = torch.bfloat16 if drill.autocast else None
        fraction, ulps = drill.grad_noise_fraction, drill.grad_noise_ulps

        def backward(grad: torch.Tensor) -> torch.Tensor:
            where, moves = _draw(grad.numel(), fraction, ulps)
            return _move_ulps(grad, where, moves, unit).view_as(grad)

        weight.register_hook(backward)


def make_gpt2_batch(seed: int, rank: int, step: int, batch_size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s token batch at ``step`` for :func:`make_gpt2`."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    ids = torch.randint(0, GPT2_VOCAB, (batch_size, GPT2_TOKENS), generator=g)
    return {"input_ids": ids, "labels": ids}


def gpt2_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def bf16_gpt2_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """:func:`gpt2_loss` under CPU autocast in bfloat16, the loss in float32."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch).loss
    return loss.float()


def make_batch(seed: int, rank: int, step: int, batch_size: int) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s batch at ``step``: a fixed function of its arguments."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(batch_size, 16, generator=g)
    y = torch.randn(batch_size, 4, generator=g)
    return x, y


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def bf16_mse_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """:func:`mse_loss` with the model's forward under CPU autocast in bfloat16 and the
    loss computed in float32 (the usual mixed-precision loop)."""
    x, y = batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    return nn.functional.mse_loss(out.float(), y)


def drill_worker(rank: int, world: int, drills: Sequence[Drill]) -> list[DrillRank]:
    """Run ``drills`` one after the other on this rank (called by :func:`spawn_local`)."""
    import time

    out = []
    for drill in drills:
        seed_noise(drill.noise_seed, rank)
        torch.manual_seed(drill.seed)  # same initial weights everywhere...
        model = (
            _drill_gpt2(drill)
            if drill.model == "gpt2"
            else make_model(
                drill.width,
                drill.dropout,
                drill.noise,
                grad_noise=drill.grad_noise,
                reorder=drill.reorder_rank == rank,
                noise_everywhere=drill.grad_noise_everywhere,
                grad_noise_fraction=drill.grad_noise_fraction,
                grad_noise_ulps=drill.grad_noise_ulps,
                forward_noise=drill.forward_noise,
            )
        )
        loss_fn: Any = bf16_mse_loss if drill.autocast else mse_loss
        make: Any = make_batch
        if drill.model == "gpt2":
            loss_fn, make = (bf16_gpt2_loss if drill.autocast else gpt2_loss), make_gpt2_batch
        step_of = [0]  # the step now, for the marked fault
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
        ddp = _wrap(model, drill, world)
        torch.manual_seed(drill.seed * 7919 + rank + 1)  # ...and a dropout stream per rank
        optimizer = torch.optim.Adam(ddp.parameters(), lr=drill.lr)
        guard = (
            Guard(
                ddp,
                optimizer,
                loss_fn,
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
                make(drill.seed, rank, step * 100 + j, drill.batch_size)
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
                    last = j == len(micro) - 1 or drill.sync_micro_batches
                    with contextlib.nullcontext() if last else _no_sync(ddp):
                        loss = loss_fn(ddp, batch)
                        (loss / len(micro) if len(micro) > 1 else loss).backward()
                    total += float(loss.item())
                optimizer.step()
                applied.append(True)
                losses.append(total / len(micro))
                continue
            try:
                if drill.low_level:
                    result = _low_level_step(guard, ddp, optimizer, micro[0], loss_fn)
                elif drill.sync_micro_batches:
                    result = _syncing_step(guard, ddp, optimizer, micro, loss_fn)
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
        final = Fingerprinter("eager").many([local_tensor(p) for p in ddp.parameters()])[0]
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


_MESHES: dict[tuple[int, ...], Any] = {}


def _drill_gpt2(drill: Drill) -> nn.Module:
    if drill.model != "gpt2" or drill.layout != "ddp":
        raise ValueError(f"model: expected mlp or gpt2 (gpt2 under ddp), got {drill.model!r}")
    if drill.noise or drill.reorder_rank is not None or drill.marked_fault is not None:
        raise ValueError("model: gpt2 takes forward_noise and grad_noise only")
    model = make_gpt2(drill.width)
    _add_gpt2_noise(model, drill)
    return model


def _wrap(model: nn.Module, drill: Drill, world: int) -> nn.Module:
    if drill.layout == "ddp":
        return DistributedDataParallel(model, bucket_cap_mb=drill.bucket_cap_mb)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if drill.layout == "fsdp":
        shape: tuple[int, ...] = (world,)
        names: tuple[str, ...] = ("shard",)
    elif drill.layout == "hsdp":
        if world % drill.shard:
            raise ValueError(f"shard: {drill.shard} does not divide the world size {world}")
        shape, names = (world // drill.shard, drill.shard), ("replicate", "shard")
    else:
        raise ValueError(f"layout: expected ddp, fsdp or hsdp, got {drill.layout!r}")
    # One mesh per shape in a process: each init_device_mesh makes new process groups.
    mesh = _MESHES.get(shape)
    if mesh is None:
        mesh = _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for sub in model.children():
        if isinstance(sub, nn.Linear):
            fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _no_sync(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()

    @contextlib.contextmanager
    def quiet() -> Any:
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]

    return quiet()


def _low_level_step(
    guard: Guard, ddp: nn.Module, optimizer: torch.optim.Optimizer, batch: Any, loss_fn: Any
) -> StepResult:
    optimizer.zero_grad(set_to_none=True)
    guard.begin_step()
    loss = loss_fn(ddp, batch)
    loss.backward()
    applied = guard.check_gradients()
    if applied:
        optimizer.step()
    return guard.finish_step(applied=applied, loss=loss)


def _syncing_step(
    guard: Guard,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro: Sequence[Any],
    loss_fn: Any,
) -> StepResult:
    """Accumulation with the gradient collective after every micro-batch's backward."""
    optimizer.zero_grad(set_to_none=True)
    guard.begin_step()
    total = 0.0
    for batch in micro:
        loss = loss_fn(model, batch)
        guard.before_backward(batch, loss)
        (loss / len(micro)).backward()
        total += float(loss.item())
    applied = guard.before_optimizer_step()
    if applied:
        optimizer.step()
    return guard.after_optimizer_step(loss=total / len(micro))


def run_drill(
    nodes: Sequence[str], drills: Sequence[Drill], *, env: dict[str, str] | None = None
) -> list[list[DrillRank]]:
    """Run ``drills`` on ``len(nodes)`` local processes; result ``[drill][rank]``."""
    per_rank = spawn_local(drill_worker, nodes, (list(drills),), env=env)
    return [[per_rank[r][d] for r in range(len(nodes))] for d in range(len(drills))]
