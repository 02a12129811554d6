"""What counts as evidence: gradient statistics, comparisons, the learned noise."""

from __future__ import annotations

import math

import torch

from sdc_agent.evidence import (
    HEADROOM,
    LOSS,
    Comparison,
    NoiseModel,
    Summary,
    Tolerance,
    compare,
    compute_dtype,
    kind_caps,
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
    assert error.rel[1] > 100 * noise.rel[1], "the sum of squares, kind by kind"
    exact = Tolerance()
    learned = Tolerance((0.0, HEADROOM * noise.rel[1], HEADROOM * noise.rel[2]))
    assert compare(a, a).bitwise_equal and not compare(a, a).differs(exact)
    assert noise.differs(exact), "while the job is bit-reproducible, one ulp is evidence"
    assert not noise.differs(learned)
    assert error.differs(learned)


def test_a_different_loss_bit_is_seen_and_measured() -> None:
    a, b = summary(2.0, []), summary(float(torch.tensor(2.0).nextafter(torch.tensor(3.0))), [])
    c = compare(a, b)
    assert not c.loss_equal and 0 < c.loss_rel < 2e-7


def grads_off(rel: float) -> Comparison:
    """One gradient tensor (kinds: loss, its sum of squares, its sum) off by ``rel``."""
    return Comparison((True, False, False), (0.0, rel, rel))


def loss_off(rel: float) -> Comparison:
    return Comparison((False, True, True), (rel, 0.0, 0.0))


def both_off(loss: float, grads: float) -> Comparison:
    return Comparison((False, False, False), (loss, grads, grads))


def fp32_model() -> NoiseModel:
    return NoiseModel(cap=noise_cap(torch.float32), kinds=3)


def test_noise_model_learns_per_rank_and_for_the_job_within_a_cap() -> None:
    model = fp32_model()
    assert model.bit_reproducible is None and model.largest == 0
    assert model.describe() == "not measured yet"
    assert model.learn_rank(3, grads_off(1e-8))
    assert model.tolerance([3, 4]).values == (0.0, HEADROOM * 1e-8, HEADROOM * 1e-8)
    assert model.tolerance([0, 4]).values == (0.0, 0.0, 0.0), "other ranks stay bit-exact"
    assert "rank 3 up to 8e-08" in model.describe(), "learned is described before counting"
    assert not model.learn_job([grads_off(1.0)]), "above the cap is never noise"
    assert not model.learn_job([grads_off(2.5e-5)]), "a 2.5e-5 fault is not float32 noise"
    assert model.job == {}
    assert model.learn_job([grads_off(1e-7)])
    assert model.tolerance([0]).gradients == HEADROOM * 1e-7
    assert model.learn_job([grads_off(5e-7)])
    assert model.largest == noise_cap(torch.float32), "within the cap, never above it"
    assert noise_cap(torch.bfloat16) > noise_cap(torch.float16) > noise_cap(torch.float32)


def test_gradient_noise_never_raises_the_loss_tolerance() -> None:
    model = fp32_model()
    assert model.learn_job([grads_off(2e-7)]) and model.learn_rank(1, grads_off(2e-7))
    one_ulp_forward = both_off(7e-8, 1e-7)
    tolerance = model.tolerance([1, 2])
    assert tolerance.loss == 0 and tolerance.gradients > 1e-7
    assert one_ulp_forward.differing(tolerance) == {LOSS}, "the loss stays bit for bit"
    assert not grads_off(1e-7).differs(tolerance)
    assert "loss: compared bit for bit" in model.describe()
    # Only a loss difference (a forward that is not reproducible) raises it.
    assert model.learn_rank(2, loss_off(5e-8))
    assert model.tolerance([2]).loss == HEADROOM * 5e-8 and model.tolerance([1]).loss == 0
    assert not loss_off(5e-8).differs(model.tolerance([2]))
    assert loss_off(5e-8).differs(model.tolerance([1]))


def test_each_gradient_tensor_is_its_own_kind_of_evidence() -> None:
    # Two tensors: noise learned in the first does not hide a difference in the second.
    model = NoiseModel(cap=noise_cap(torch.float32), kinds=5)
    noisy_first = Comparison((True, False, False, True, True), (0.0, 1e-7, 1e-7, 0.0, 0.0))
    assert model.learn_job([noisy_first])
    fault_second = Comparison((True, False, False, False, False), (0.0, 1e-7, 1e-7, 5e-8, 0.0))
    assert fault_second.differing(model.tolerance([0, 1])) == {3, 4}
    assert not noisy_first.differs(model.tolerance([0, 1]))


def test_a_kind_set_aside_is_never_evidence_and_the_others_still_are() -> None:
    model = fp32_model()
    why = model.set_aside([2], {2: 3e-2})
    assert "sum of gradient 0" in why and "0.03 against a cap of 1e-06" in why and "float32" in why
    assert not model.blind
    t = model.tolerance([0, 1])
    assert not Comparison((True, True, False), (0.0, 0.0, 1.0)).differs(t)
    assert Comparison((True, False, False), (0.0, 1e-9, 1.0)).differing(t) == {1}
    assert model.thresholds() == {"loss": 0.0, "gradients": 0.0}
    model.set_aside([1], {1: 1.0})
    assert model.thresholds() == {"loss": 0.0, "gradients": None}
    model.set_aside([LOSS], {LOSS: 1.0})
    assert model.blind and model.thresholds() == {"loss": None, "gradients": None}


def test_caps_follow_the_dtype_and_the_tensor_size() -> None:
    fp32 = kind_caps(torch.float32, [4, 4096])
    assert set(fp32) == {noise_cap(torch.float32)}, "float32 keeps 8 eps everywhere"
    bf16 = kind_caps(torch.bfloat16, [4, 4096])
    eps = torch.finfo(torch.bfloat16).eps
    assert bf16[LOSS] == noise_cap(torch.bfloat16)
    assert bf16[1] == 4 * eps and bf16[3] == 2 * eps, "a bias of 4 may move further"
    assert bf16[2] == bf16[4] == 4 * eps
    # What rounding does: ±1 ulp at random in every element of a bf16 tensor stays
    # within its caps; one ulp up in every element (a coherent fault) moves the sum of
    # squares several times further (within the cap: the learned tolerance and the recheck
    # catch it, not the cap).
    torch.manual_seed(0)
    for n in (4, 64, 4096):
        g = torch.randn(n).to(torch.bfloat16)
        up = torch.randint(0, 2, (n,)).bool()
        noisy = torch.nextafter(g, torch.where(up, float("inf"), float("-inf")).bfloat16())
        fault = g.clone()
        fault.view(torch.int16).add_(1)
        a, b, c = (summary(1.0, [t.float()]) for t in (g, noisy, fault))
        caps = kind_caps(torch.bfloat16, [n])
        assert compare(a, b).rel[1] <= caps[1], n
        assert compare(a, b).rel[2] <= caps[2], n
        if n >= 64:
            assert compare(a, c).rel[1] > 4 * compare(a, b).rel[1], n


def test_a_bitwise_difference_that_moves_no_statistic_is_learned_above_zero() -> None:
    model = fp32_model()
    assert model.learn_job([grads_off(0.0)])
    assert model.largest > 0 and not grads_off(0.0).differs(model.tolerance([0]))


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
    model = fp32_model()
    model.learn_rank(1, both_off(6e-8, 7e-8))
    assert not model.new_evidence(grads_off(2e-7), [1, 2]), "rank 1's noise is known"
    assert model.new_evidence(grads_off(2e-7), [0, 2]), "ranks 0 and 2 were bit for bit"
    assert model.widen([1, 2], both_off(8e-7, 2e-7))
    assert model.per_rank[1][1] == noise_cap(torch.float32)  # 8 x 2e-7, within the cap
    assert model.per_rank[1][LOSS] == noise_cap(torch.float32)
    assert 2 not in model.per_rank and model.job == {}, "widened only where it was learned"
    assert not model.widen([1, 2], grads_off(2.5e-5)), "above the cap: never noise"
    job = fp32_model()
    job.learn_job([grads_off(1e-8)])
    assert not job.new_evidence(grads_off(5e-8), [0, 1])
    assert job.new_evidence(both_off(7e-8, 5e-8), [0, 1]), "the loss is new"
    job.widen([0, 1], grads_off(5e-8))
    assert job.job == {1: HEADROOM * 5e-8, 2: HEADROOM * 5e-8} and job.per_rank == {}


def test_an_excused_rank_takes_differences_up_to_the_cap_in_every_kind() -> None:
    model = fp32_model()
    model.excuse(1)
    assert model.tolerance([1]).loss == noise_cap(torch.float32)
    assert model.tolerance([1]).gradients == noise_cap(torch.float32), "reported once"
    assert model.tolerance([2]).values == (0.0, 0.0, 0.0)
    assert not loss_off(9e-7).differs(model.tolerance([1, 2]))
    assert loss_off(2e-6).differs(model.tolerance([1, 2])), "above the cap: still evidence"
