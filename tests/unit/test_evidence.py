"""What counts as evidence: gradient statistics, comparisons, the learned noise."""

from __future__ import annotations

import math

import torch

from sdc_agent.evidence import HEADROOM, NoiseModel, Summary, compare, noise_cap, tensor_stats


def summary(loss: float, grads: list[torch.Tensor]) -> Summary:
    from sdc_agent.fingerprint import Fingerprinter

    fp = Fingerprinter("eager")
    loss_t = torch.tensor(loss, dtype=torch.float32)
    return Summary(
        loss_bits=int(loss_t.view(torch.int32).item()),
        loss=float(loss_t),
        fingerprints=tuple(tuple(fp(g).tolist()) for g in grads),
        stats=tuple(tuple(tensor_stats(g).tolist()) for g in grads),
    )


def test_stats_are_float64_and_chunked_like_one_pass() -> None:
    g = torch.randn(1 << 19 | 7)
    s = tensor_stats(g)
    assert s.dtype == torch.float64
    ref = g.double()
    assert math.isclose(s[0].item(), ref.sum().item(), rel_tol=1e-12, abs_tol=1e-9)
    assert math.isclose(s[1].item(), (ref * ref).sum().item(), rel_tol=1e-12)
    assert torch.equal(tensor_stats(g.clone()), s)  # same bits, same statistics


def test_last_bit_noise_is_far_below_a_real_error() -> None:
    torch.manual_seed(0)
    g = torch.randn(4096)
    noisy = g.clone()
    bits = noisy.view(torch.int32)
    bits[[3, 700, 2000]] += torch.tensor([1, -1, 1], dtype=torch.int32)  # ±1 ulp, 3 elements
    wrong = g * (1 + 2.5e-5)
    a, b, c = summary(1.0, [g]), summary(1.0, [noisy]), summary(1.0, [wrong])
    noise = compare(a, b)
    error = compare(a, c)
    assert not noise.grads_equal and noise.loss_equal
    assert 0 < noise.grad_rel < 1e-7
    assert error.grad_rel > 4e-5  # the sum of squares moves by twice the error
    assert error.grad_rel > 100 * noise.grad_rel
    assert compare(a, a).bitwise_equal and not compare(a, a).differs(0.0)
    assert noise.differs(0.0), "while the job is bit-reproducible, one ulp is evidence"
    assert not noise.differs(HEADROOM * noise.grad_rel)
    assert error.differs(HEADROOM * noise.grad_rel)


def test_a_different_loss_bit_is_seen_and_measured() -> None:
    a, b = summary(2.0, []), summary(float(torch.tensor(2.0).nextafter(torch.tensor(3.0))), [])
    c = compare(a, b)
    assert not c.loss_equal and 0 < c.loss_rel < 2e-7


def test_noise_model_learns_per_rank_and_for_the_job_within_a_cap() -> None:
    model = NoiseModel(cap=noise_cap(torch.float32))
    assert model.bit_reproducible is None and model.largest == 0
    assert model.learn_rank(3, 1e-7)
    assert model.tolerance([3, 4]) == HEADROOM * 1e-7
    assert model.tolerance([0, 4]) == 0.0, "other ranks stay bit-exact"
    assert not model.learn_job(1.0), "above the cap is never noise"
    assert model.learn_job(1e-6)
    assert model.tolerance([0]) == HEADROOM * 1e-6
    assert model.largest == HEADROOM * 1e-6
    assert noise_cap(torch.bfloat16) > noise_cap(torch.float32)
    assert "rank" not in model.describe() or "rank 3" not in model.describe()
