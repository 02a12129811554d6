"""Every loop form the Guard supports, on real gloo processes (3 emulated nodes).

Faults here are injected the way the held-out campaigns do it: by monkeypatching torch
(``torch.nn.functional.gelu`` on one rank), not through ``sdc_agent.faults``. Each form
runs clean (no verdict, bitwise equal to the same loop without the Guard) and with a
finite forward error and a NaN on one rank: caught at its step, the right rank named,
the step not applied on any rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import warnings
from typing import Any

import pytest

from sdc_agent.launch import spawn_local

# slow: one world runs every loop form (setup about 45 s on 2 cores)
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

NODES = ["n0", "n1", "n2"]
SUSPECT = 1
FAULT_STEP = 4


@dataclasses.dataclass(frozen=True)
class Loop:
    form: str = "phases"  # "step": Guard.step; "phases": the loop owns backward and step
    guarded: bool = True
    steps: int = 7
    micro: int = 1
    scaler: bool = False
    fused: bool = True
    clip: bool = False
    scheduler: bool = False
    checkpoint: str | None = None  # "reentrant" or "non_reentrant"
    compile: bool = False
    fault: str | None = None  # "error" (finite, persistent) or "nan" (once)
    replay_every: int = 1
    init_scale: float = 1024.0


class _State:
    step = 0
    step_tensor: Any = None
    """The step as a tensor, filled in place: what the ``error`` fault reads, so that a
    compiled module traces it once, not once per step (dynamo guards on a Python int's
    value: every new step recompiled, to the cache limit)."""


def _patch_gelu(rank: int, kind: str) -> None:
    """Rank ``rank``'s GELU goes wrong from FAULT_STEP: 2.5e-5 relative for ``error``
    (every call: forward and replays, a broken GPU), a NaN once for ``nan``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    original = F.gelu
    fired: list[bool] = []

    def gelu(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        y = original(x, *args, **kwargs)
        if dist.get_rank() != rank:
            return y
        if kind == "error":
            wrong = (y.float() * (1 + 2.5e-5)).to(y.dtype)
            # In float16 the error can round back: move such elements by one ulp instead.
            bits = wrong.view(torch.int16 if y.element_size() == 2 else torch.int32)
            wrong = (bits + (wrong == y).to(bits.dtype)).view(y.dtype)
            # Before FAULT_STEP, y + -0.0: every element as it is, bit for bit.
            delta = torch.where(_State.step_tensor >= FAULT_STEP, wrong - y, -0.0)
            return y + delta.detach()  # gradients pass as through the right GELU
        return nan_once(y)

    # Run as Python, not traced: a compiled module would guard on the step and on
    # ``fired`` and recompile as they change.
    @torch.compiler.disable
    def nan_once(y: torch.Tensor) -> torch.Tensor:
        if _State.step < FAULT_STEP or fired:
            return y
        fired.append(True)
        nan = torch.zeros_like(y)
        nan.view(-1)[0] = float("nan")
        return y + nan

    F.gelu = gelu  # type: ignore[assignment]


def _model(loop: Loop) -> Any:
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if loop.checkpoint is None:
                return self.inner(x)
            return checkpoint(self.inner, x, use_reentrant=loop.checkpoint == "reentrant")

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Sequential(nn.Linear(16, 32), nn.GELU())
            self.block = Block()
            self.out = nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.block(self.head(x)))

    return Net()


def _loss(model: Any, batch: Any) -> Any:
    import torch

    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _worker(rank: int, world: int, loops: list[Loop]) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sdc_agent import Guard, GuardConfig

    out = []
    for loop in loops:
        _State.step = 0
        _State.step_tensor = torch.zeros((), dtype=torch.int64)
        torch.manual_seed(0)
        net = _model(loop)
        inner = torch.compile(net, backend="aot_eager") if loop.compile else net
        ddp = DistributedDataParallel(inner, static_graph=loop.checkpoint == "reentrant")
        torch.manual_seed(100 + rank)  # a dropout stream per rank
        optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-2, fused=loop.fused)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5) if loop.scheduler else None
        scaler = torch.amp.GradScaler("cpu", init_scale=loop.init_scale) if loop.scaler else None
        guard = None
        warned: list[str] = []
        if loop.guarded:
            config = GuardConfig(
                replay_every=loop.replay_every, weights_every=1, fingerprint_backend="eager"
            )
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                guard = Guard(ddp, optimizer, _loss, config, reporter=None, scaler=scaler)
            warned = [str(w.message) for w in caught]
        if loop.fault is not None:
            import torch.nn.functional as F

            saved_gelu = F.gelu
            _patch_gelu(SUSPECT, loop.fault)
        verdicts: list[dict[str, Any]] = []
        applied: list[bool] = []
        try:
            for step in range(1, loop.steps + 1):
                _State.step = step
                _State.step_tensor.fill_(step)
                g = torch.Generator().manual_seed(step * 31 + rank)
                micro = [
                    (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
                    for _ in range(loop.micro)
                ]
                if loop.form == "step":
                    assert guard is not None
                    result = (
                        guard.step(micro[0]) if loop.micro == 1 else guard.step(micro_batches=micro)
                    )
                    verdicts += [v.to_dict() for v in result.verdicts]
                    applied.append(result.applied)
                    continue
                _, result = _owned_step(loop, ddp, optimizer, scaler, guard, micro)
                if scheduler is not None:
                    scheduler.step()
                if result is not None:
                    verdicts += [v.to_dict() for v in result.verdicts]
                    applied.append(result.applied)
        finally:
            if loop.fault is not None:
                F.gelu = saved_gelu
        if guard is not None:
            guard.close()
        digest = hashlib.sha256()
        for p in net.parameters():
            digest.update(p.detach().numpy().tobytes())
        out.append(
            {
                "verdicts": verdicts,
                "applied": applied,
                "weights": digest.hexdigest(),
                "warned": warned,
            }
        )
        dist.barrier()
    return out


def _owned_step(
    loop: Loop, ddp: Any, optimizer: Any, scaler: Any, guard: Any, micro: list[Any]
) -> tuple[bool, Any]:
    """One optimizer step the way a user's own loop writes it."""
    import torch

    optimizer.zero_grad(set_to_none=True)
    for j, batch in enumerate(micro):
        last = j == len(micro) - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            autocast = (
                torch.autocast("cpu", dtype=torch.float16)
                if loop.scaler
                else contextlib.nullcontext()
            )
            with autocast:
                loss = _loss(ddp, batch)
            if guard is not None:
                guard.before_backward(batch, loss)
            scaled = loss / len(micro)
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
    if scaler is not None and loop.clip:
        scaler.unscale_(optimizer)
    if loop.clip:
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
    go = guard.before_optimizer_step() if guard is not None else True
    if go:
        if scaler is not None:
            scaler.step(optimizer)
        else:
            optimizer.step()
    if scaler is not None:
        scaler.update()
    return go, guard.after_optimizer_step() if guard is not None else None


FORMS: dict[str, Loop] = {
    "step": Loop(form="step"),
    "step_accumulation": Loop(form="step", micro=3),
    "phases_clip_scheduler": Loop(clip=True, scheduler=True),
    "phases_foreach_adam": Loop(fused=False, clip=True),
    "phases_accumulation": Loop(micro=3, clip=True),
    "phases_grad_scaler_fp16": Loop(scaler=True, clip=True),
    "checkpoint_reentrant": Loop(checkpoint="reentrant"),
    "checkpoint_non_reentrant": Loop(checkpoint="non_reentrant", micro=2),
    "compiled_inner_module": Loop(compile=True),
}
# A loss scale far too large: GradScaler's own skipped steps (every rank overflows).
OVERFLOW = Loop(scaler=True, init_scale=2.0**24, steps=12)


def _runs() -> list[Loop]:
    loops = []
    for form in FORMS.values():
        loops.append(form)
        if form.form != "step":
            loops.append(dataclasses.replace(form, guarded=False))
        loops.append(dataclasses.replace(form, fault="error"))
        loops.append(dataclasses.replace(form, fault="nan"))
    return [*loops, OVERFLOW, dataclasses.replace(OVERFLOW, guarded=False)]


@pytest.fixture(scope="module")
def results() -> dict[Loop, list[dict[str, Any]]]:
    loops = _runs()
    per_rank = spawn_local(_worker, NODES, (loops,))
    return {loop: [per_rank[r][i] for r in range(len(NODES))] for i, loop in enumerate(loops)}


def _agreed(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    for r in ranks[1:]:
        assert r["verdicts"] == ranks[0]["verdicts"], "ranks disagree on the verdicts"
        assert r["applied"] == ranks[0]["applied"], "ranks disagree on what was applied"
    return ranks[0]


@pytest.mark.parametrize("name", list(FORMS))
def test_clean_loop_raises_nothing_and_equals_plain_ddp(
    results: dict[Loop, list[dict[str, Any]]], name: str
) -> None:
    loop = FORMS[name]
    r = _agreed(results[loop])
    assert r["verdicts"] == []
    assert all(r["applied"]) and len(r["applied"]) == loop.steps
    assert len({x["weights"] for x in results[loop]}) == 1, "replicas differ"
    # A compiled model runs no hook added after its compilation: no output kinds, said so.
    unavailable = any("forward output kinds are unavailable" in w for w in r["warned"])
    assert unavailable == loop.compile, r["warned"]
    if loop.form != "step":
        plain = results[dataclasses.replace(loop, guarded=False)]
        assert plain[0]["weights"] == r["weights"], "guarded training differs from plain DDP"


@pytest.mark.parametrize("name", list(FORMS))
def test_finite_forward_error_is_caught_at_its_step(
    results: dict[Loop, list[dict[str, Any]]], name: str
) -> None:
    r = _agreed(results[dataclasses.replace(FORMS[name], fault="error")])
    assert r["verdicts"], "nothing caught"
    first = r["verdicts"][0]
    assert (first["check"], first["step"], first["suspect_ranks"]) == (
        "replay",
        FAULT_STEP,
        [SUSPECT],
    )
    assert first["localized"] and first["corroborated"] and first["transient"] is False
    assert r["applied"][: FAULT_STEP - 1] == [True] * (FAULT_STEP - 1)
    assert r["applied"][FAULT_STEP - 1] is False, "the corrupted step was applied"


@pytest.mark.parametrize("name", list(FORMS))
def test_nan_on_one_rank_is_caught_at_its_step(
    results: dict[Loop, list[dict[str, Any]]], name: str
) -> None:
    loop = dataclasses.replace(FORMS[name], fault="nan")
    r = _agreed(results[loop])
    assert r["applied"][FAULT_STEP - 1] is False, "the corrupted step was applied"
    assert all(r["applied"][FAULT_STEP:]), "a one-off NaN must not stop later steps"
    first = r["verdicts"][0]
    assert (first["check"], first["step"], first["suspect_ranks"]) == (
        "nonfinite",
        FAULT_STEP,
        [SUSPECT],
    )
    # The suspect's micro-batch was finite on another node, and on the suspect when it
    # recomputed it (the NaN came once): a transient fault, corroborated. Under
    # accumulation only the first micro-batch could travel: not corroborated.
    if loop.micro == 1:
        assert (first["corroborated"], first["transient"]) == (True, True)
    else:
        assert first["corroborated"] is False


def test_grad_scaler_overflow_steps_are_the_scalers_not_verdicts(
    results: dict[Loop, list[dict[str, Any]]],
) -> None:
    r = _agreed(results[OVERFLOW])
    assert r["verdicts"] == [], "an overflow on every rank is not hardware"
    skipped = r["applied"].count(False)
    assert 0 < skipped < OVERFLOW.steps, "the scaler skipped its first steps, then trained"
    assert r["applied"][-1] is True
    plain = results[dataclasses.replace(OVERFLOW, guarded=False)]
    assert plain[0]["weights"] == r["weights"], "guarded training differs from plain DDP"
