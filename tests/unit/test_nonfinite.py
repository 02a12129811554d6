"""Check 1's one pass: scaling by 1/world bit-equal to DDP's, and its verdicts."""

from __future__ import annotations

import pytest
import torch

from sdc_agent.nonfinite import StepFlags, classify_nonfinite

INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world", [2, 3, 6, 7, 1000])
def test_the_fused_pass_scales_exactly_like_mul(dtype: torch.dtype, world: int) -> None:
    torch.manual_seed(world)
    x = torch.randn(40_003)
    if dtype != torch.float16:
        x = x * torch.logspace(-40, 30, x.numel())  # subnormals to large values
    x = x.to(dtype)
    flags = StepFlags(world, 0, torch.device("cpu"))
    ours = x.clone()
    flags.scale_and_check(ours, True)
    ddp = x.clone().mul_(1.0 / world)  # what DDP's reducer does without a hook
    assert torch.equal(ours.view(INT[dtype]), ddp.view(INT[dtype]))
    assert flags.local.item() == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_fused_pass_flags_a_non_finite_element(bad: float) -> None:
    flags = StepFlags(3, 0, torch.device("cpu"))
    x = torch.randn(1000)
    flags.scale_and_check(x.clone(), True)
    assert flags.local.item() == 0.0
    x[517] = bad
    flags.scale_and_check(x, True)
    assert flags.local.item() == 1.0
    flags.reset(halt=False)
    assert flags.local.item() == 0.0


def test_classification() -> None:
    assert classify_nonfinite([False, False, False]) is None
    f = classify_nonfinite([False, True, False])
    assert f is not None and (f.classification, f.suspects, f.localized) == ("rank", (1,), True)
    f = classify_nonfinite([True, True, True])
    assert f is not None and (f.classification, f.suspects) == ("training", ())
    f = classify_nonfinite([False, False], [True, False])
    assert f is not None and (f.classification, f.suspects) == ("collective", (0,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_last_bucket_carries_the_flags_in_its_first_element(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    bucket = (torch.randn(1000) * 1e-38).to(dtype)  # subnormal first elements (float32)
    flags = StepFlags(3, 1, torch.device("cpu"))
    unflagged = bucket.clone()
    assert flags.mark(unflagged, None)
    assert torch.equal(unflagged.view(INT[dtype]), bucket.view(INT[dtype]))  # bit for bit
    flags.seen(unflagged)
    assert flags.skip_tensor().shape == () and flags.skip_tensor().item() == 0.0
    assert flags.to_host().clean()
    # A flag raised by any bucket of the step: the first element becomes NaN, nothing else.
    other = torch.randn(10)
    other[3] = float("inf")
    flags.scale_and_check(other, True)
    flagged = bucket.clone()
    assert flags.mark(flagged, None)
    assert flagged[0].isnan() and torch.equal(
        flagged[1:].view(INT[dtype]), bucket[1:].view(INT[dtype])
    )
    flags.seen(flagged)
    assert flags.skip_tensor().item() == 1.0 and not flags.to_host().clean()
    # A halting rank marks it too; an integer bucket cannot carry the flags.
    flags.reset(halt=True)
    halted = bucket.clone()
    assert flags.mark(halted, None) and halted[0].isnan()
    assert not StepFlags(3, 1, torch.device("cpu")).mark(torch.zeros(4, dtype=torch.int64), None)
