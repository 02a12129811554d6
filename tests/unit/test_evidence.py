"""What counts as evidence: gradient statistics, comparisons, the learned noise."""

from __future__ import annotations

import math

import torch

from sdc_agent.evidence import (
    HEADROOM,
    Comparison,
    NoiseModel,
    Summary,
    Tolerance,
    compare,
    compute_dtype,
    noise_cap,
    tensor_stats,
)


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
    exact = Tolerance()
    learned = Tolerance(gradients=HEADROOM * noise.grad_rel)
    assert compare(a, a).bitwise_equal and not compare(a, a).differs(exact)
    assert noise.differs(exact), "while the job is bit-reproducible, one ulp is evidence"
    assert not noise.differs(learned)
    assert error.differs(learned)


def test_a_different_loss_bit_is_seen_and_measured() -> None:
    a, b = summary(2.0, []), summary(float(torch.tensor(2.0).nextafter(torch.tensor(3.0))), [])
    c = compare(a, b)
    assert not c.loss_equal and 0 < c.loss_rel < 2e-7


def grads_off(rel: float) -> Comparison:
    return Comparison(loss_equal=True, grads_equal=False, loss_rel=0.0, grad_rel=rel)


def loss_off(rel: float) -> Comparison:
    return Comparison(loss_equal=False, grads_equal=True, loss_rel=rel, grad_rel=0.0)


def test_noise_model_learns_per_rank_and_for_the_job_within_a_cap() -> None:
    model = NoiseModel(cap=noise_cap(torch.float32))
    assert model.bit_reproducible is None and model.largest == 0
    assert model.describe() == "not measured yet"
    assert model.learn_rank(3, grads_off(1e-8))
    assert model.tolerance([3, 4]) == Tolerance(loss=0.0, gradients=HEADROOM * 1e-8)
    assert model.tolerance([0, 4]) == Tolerance(), "other ranks stay bit-exact"
    assert "rank 3 up to 8e-08" in model.describe(), "learned is described before counting"
    assert not model.learn_job([grads_off(1.0)]), "above the cap is never noise"
    assert not model.learn_job([grads_off(2.5e-5)]), "a 2.5e-5 fault is not float32 noise"
    assert model.job == 0
    assert model.learn_job([grads_off(1e-7)])
    assert model.tolerance([0]).gradients == HEADROOM * 1e-7
    assert model.learn_job([grads_off(5e-7)])
    assert model.largest == noise_cap(torch.float32), "within the cap, never above it"
    assert noise_cap(torch.bfloat16) > noise_cap(torch.float16) > noise_cap(torch.float32)


def test_gradient_noise_never_raises_the_loss_tolerance() -> None:
    model = NoiseModel(cap=noise_cap(torch.float32))
    assert model.learn_job([grads_off(2e-7)]) and model.learn_rank(1, grads_off(2e-7))
    one_ulp_forward = Comparison(False, False, 7e-8, 1e-7)
    tolerance = model.tolerance([1, 2])
    assert tolerance.loss == 0 and tolerance.gradients > 1e-7
    assert one_ulp_forward.differs(tolerance), "the loss stays a bitwise comparison"
    assert not grads_off(1e-7).differs(tolerance)
    assert "loss: compared bit for bit" in model.describe()
    # Only a loss difference (a forward that is not reproducible) raises it.
    assert model.learn_rank(2, loss_off(5e-8))
    assert model.tolerance([2]).loss == HEADROOM * 5e-8 and model.tolerance([1]).loss == 0
    assert not loss_off(5e-8).differs(model.tolerance([2]))
    assert loss_off(5e-8).differs(model.tolerance([1]))


def test_a_bitwise_difference_that_moves_no_statistic_is_learned_above_zero() -> None:
    model = NoiseModel(cap=noise_cap(torch.float32))
    assert model.learn_job([grads_off(0.0)])
    assert model.job > 0 and not grads_off(0.0).differs(model.tolerance([0]))


def test_the_cap_follows_the_dtype_the_computation_ran_in() -> None:
    fp32 = [torch.float32, torch.int64]
    assert compute_dtype(fp32, {}, "cpu") == torch.float32
    assert compute_dtype([], {}, "cpu") == torch.float32
    # bf16 autocast with fp32 weights: bf16's cap, not fp32's.
    assert compute_dtype(fp32, {"cpu": (True, torch.bfloat16)}, "cpu") == torch.bfloat16
    assert compute_dtype(fp32, {"cuda": (True, torch.float16)}, "cpu") == torch.float32
    assert compute_dtype(fp32, {"cuda": (True, torch.float16)}, "cuda") == torch.float16
    assert compute_dtype(fp32, {"cuda": (False, torch.float16)}, "cuda") == torch.float32
    # The least precise parameter dtype decides (a model with some bf16 parameters).
    assert compute_dtype([torch.float32, torch.bfloat16], {}, "cpu") == torch.bfloat16
    assert compute_dtype([torch.bfloat16], {"cpu": (True, torch.float16)}, "cpu") == (
        torch.bfloat16
    )


def test_known_noise_widens_where_it_was_learned_and_new_evidence_is_told_apart() -> None:
    model = NoiseModel(cap=noise_cap(torch.float32))
    model.learn_rank(1, Comparison(False, False, 6e-8, 7e-8))
    assert not model.new_evidence(grads_off(2e-7), [1, 2]), "rank 1's noise is known"
    assert model.new_evidence(grads_off(2e-7), [0, 2]), "ranks 0 and 2 were bit for bit"
    assert model.widen([1, 2], Comparison(False, False, 8e-7, 2e-7))
    assert model.per_rank[1] == noise_cap(torch.float32)  # 8 x 2e-7, within the cap
    assert model.loss_per_rank[1] == noise_cap(torch.float32)
    assert 2 not in model.per_rank and model.job == 0, "widened only where it was learned"
    assert not model.widen([1, 2], grads_off(2.5e-5)), "above the cap: never noise"
    job = NoiseModel(cap=noise_cap(torch.float32))
    job.learn_job([grads_off(1e-8)])
    assert not job.new_evidence(grads_off(5e-8), [0, 1])
    assert job.new_evidence(Comparison(False, False, 7e-8, 5e-8), [0, 1]), "the loss is new"
    job.widen([0, 1], grads_off(5e-8))
    assert job.job == HEADROOM * 5e-8 and job.per_rank == {}


def test_an_excused_rank_takes_differences_up_to_the_cap_in_the_parts_that_differed() -> None:
    model = NoiseModel(cap=noise_cap(torch.float32))
    model.excuse(1, loss_off(8e-8))
    assert model.tolerance([1]).loss == noise_cap(torch.float32)
    assert model.tolerance([1]).gradients == 0, "the gradients were not part of it"
    assert not loss_off(9e-7).differs(model.tolerance([1, 2]))
    assert loss_off(2e-6).differs(model.tolerance([1, 2])), "above the cap: still evidence"
