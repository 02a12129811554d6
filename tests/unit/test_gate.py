"""StepGate against a real fused optimizer: a step the Guard holds back is not applied,
with or without a GradScaler's own flag on the optimizer."""

from __future__ import annotations

import pytest
import torch

from sdc_agent.gate import StepGate


def _one_step(*, scaler_flag: float | None, skip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused Adam step over a parameter whose gradient is ``nan`` where the scaler (if
    any) found an overflow; returns the parameter after it and the gate's ``applied``."""
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.Adam([param], lr=0.1, fused=True)
    phase = "decided"
    gate = StepGate(optimizer, lambda: phase)
    param.grad = torch.tensor([float("nan"), 1.0, 1.0]) if skip or scaler_flag else torch.ones(3)
    if scaler_flag is not None:  # what torch.amp.GradScaler.step sets before the step
        optimizer.found_inf = torch.tensor(scaler_flag)  # type: ignore[attr-defined]
        optimizer.grad_scale = None  # type: ignore[attr-defined]
    gate.arm(skip=torch.tensor(skip), hold=False)
    optimizer.step()
    applied = gate.applied
    assert isinstance(applied, torch.Tensor)
    return param.detach().clone(), applied


@pytest.mark.parametrize("scaler_flag", [None, 0.0, 1.0])
def test_a_step_the_guard_skips_is_not_applied_whatever_the_scalers_flag(
    scaler_flag: float | None,
) -> None:
    # Scaler and Guard both flagging once made found_inf 2, which the fused kernel applies.
    after, applied = _one_step(scaler_flag=scaler_flag, skip=1.0)
    assert torch.equal(after, torch.ones(3)), after
    assert not bool(applied)


@pytest.mark.parametrize("scaler_flag", [None, 0.0])
def test_a_clean_step_is_applied(scaler_flag: float | None) -> None:
    after, applied = _one_step(scaler_flag=scaler_flag, skip=0.0)
    assert torch.isfinite(after).all() and not torch.equal(after, torch.ones(3))
    assert bool(applied)
