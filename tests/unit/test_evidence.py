"""What counts as evidence: gradient statistics, comparisons, the learned noise."""

from __future__ import annotations

import math
import struct
import sys
from typing import cast

import torch

from sdc_agent.evidence import (
    HEADROOM,
    Comparison,
    KindDiff,
    Summary,
    Tolerance,
    compare,
    compiled_module,
    compute_dtype,
    is_output_kind,
    layer_groups,
    noise_cap,
    output_kind,
    output_modules,
    output_stats,
    output_tensor,
    stats_scratch,
    tensor_stats,
)
from sdc_agent.judging import NoiseModel, split_by_kind
from sdc_agent.protocol import (
    HeartbeatReport,
    ReplayKind,
    ReporterIdentity,
    encode_report,
    parse_report,
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


def test_stats_widened_in_a_scratch_are_bit_for_bit_the_same() -> None:
    torch.manual_seed(0)
    scratch = stats_scratch(torch.device("cpu"))
    assert scratch is not None
    assert stats_scratch(torch.device("meta")) is None  # off the CPU: fresh chunks
    cases = [
        torch.randn(3 << 18 | 5),  # chunks, and a short last one
        torch.randn(1000, 7)[:, 2],  # not contiguous
        torch.randn(5 << 17).to(torch.bfloat16) * 1e3,
        torch.randn(777).to(torch.float16),
        torch.randn(1 << 18 | 1, dtype=torch.float64),  # widened by nothing
        torch.randn(300, dtype=torch.complex64),
        torch.randint(-(2**20), 2**20, (4099,), dtype=torch.int32),
        torch.tensor([1.0, float("nan"), float("inf")]),
        torch.empty(0),
    ]
    for g in cases:
        # Its last use left other values in the scratch: nothing of them leaks in.
        scratch.normal_()
        got, fresh = tensor_stats(g, scratch), tensor_stats(g)
        assert torch.equal(got.view(torch.int64), fresh.view(torch.int64)), g.dtype


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
    return Comparison.of(loss_equal=True, grads_equal=False, loss_rel=0.0, grad_rel=rel)


def loss_off(rel: float) -> Comparison:
    return Comparison.of(loss_equal=False, grads_equal=True, loss_rel=rel, grad_rel=0.0)


LOSS, GRADS = 0, 1
FP32 = noise_cap(torch.float32)


def test_noise_model_learns_per_rank_and_for_the_job_within_a_cap() -> None:
    model = NoiseModel(cap=FP32)
    assert model.bit_reproducible is None and model.largest == 0
    assert model.describe() == "not measured yet"
    assert model.learn_rank(GRADS, 3, grads_off(1e-8))
    assert model.tolerance([3, 4]) == Tolerance(loss=0.0, gradients=HEADROOM * 1e-8)
    assert model.tolerance([0, 4]) == Tolerance(), "other ranks stay bit-exact"
    assert "rank 3 up to 8e-08" in model.describe(), "learned is described before counting"
    assert not model.learn_job(GRADS, [grads_off(1.0)]), "above the cap is never noise"
    assert not model.learn_job(GRADS, [grads_off(2.5e-5)]), "a 2.5e-5 fault is not fp32 noise"
    assert model.kinds[GRADS].job == 0
    assert model.learn_job(GRADS, [grads_off(1e-7)])
    assert model.tolerance([0]).gradients == HEADROOM * 1e-7
    assert model.learn_job(GRADS, [grads_off(5e-7)])
    assert model.largest == FP32, "within the cap, never above it"
    assert noise_cap(torch.bfloat16) > noise_cap(torch.float16) > FP32


def test_gradient_noise_never_raises_the_loss_tolerance() -> None:
    model = NoiseModel(cap=FP32)
    assert model.learn_job(GRADS, [grads_off(2e-7)])
    assert model.learn_rank(GRADS, 1, grads_off(2e-7))
    one_ulp_forward = Comparison.of(False, False, 7e-8, 1e-7)
    assert model.tolerances([1, 2])[LOSS] == 0 and model.tolerances([1, 2])[GRADS] > 1e-7
    assert model.differs(LOSS, one_ulp_forward, [1, 2]), "the loss stays bit for bit"
    assert not model.differs(GRADS, one_ulp_forward, [1, 2])
    assert "loss: compared bit for bit" in model.describe()
    # Only a loss difference (a forward that is not reproducible) raises it.
    assert model.learn_rank(LOSS, 2, loss_off(5e-8))
    assert model.tolerances([2])[LOSS] == HEADROOM * 5e-8 and model.tolerances([1])[LOSS] == 0
    assert not model.differs(LOSS, loss_off(5e-8), [2])
    assert model.differs(LOSS, loss_off(5e-8), [1])


def test_a_bitwise_difference_that_moves_no_statistic_is_learned_above_zero() -> None:
    model = NoiseModel(cap=FP32)
    assert model.learn_job(GRADS, [grads_off(0.0)])
    assert model.kinds[GRADS].job > 0 and not model.differs(GRADS, grads_off(0.0), [0])


def test_each_layer_is_a_kind_and_noise_in_one_never_hides_another() -> None:
    names = ["0.weight", "0.bias", "3.weight", "3.bias", "5.weight", "5.bias"]
    groups = layer_groups(names)
    assert [k for k, _ in groups] == ["gradients:0", "gradients:3", "gradients:5"]
    assert [g for _, g in groups] == [(0, 1), (2, 3), (4, 5)]
    torch.manual_seed(0)
    grads = [torch.randn(8, 8), torch.randn(8), torch.randn(8, 8), torch.randn(8)] * 1
    grads += [torch.randn(4, 8), torch.randn(4)]
    noisy = [g.clone() for g in grads]
    noisy[2] = noisy[2] * (1 + 1e-2)  # layer 3's weight gradient: loud noise
    wrong = [g.clone() for g in noisy]
    wrong[4] = wrong[4] * (1 + 1e-4)  # layer 5 off by 1e-4: a fault
    base = summary(1.0, grads)
    c_noise = compare(base, summary(1.0, noisy), [g for _, g in groups])
    c_fault = compare(base, summary(1.0, wrong), [g for _, g in groups])
    assert len(c_noise.kinds) == 4 and c_noise.kinds[0] == KindDiff(True, 0.0)
    assert c_noise.kinds[2].rel > 1e-2 and c_noise.kinds[3].equal
    assert c_fault.kinds[3].rel > 1e-4
    # One global statistic: the fault is lost in layer 3's noise.
    assert compare(base, summary(1.0, wrong)).grad_rel == c_noise.kinds[2].rel
    cap = noise_cap(torch.bfloat16)
    model = NoiseModel(cap=cap, kind_names=["loss", *(k for k, _ in groups)], dtype="bfloat16")
    reason = model.go_blind(2, c_noise.kinds[2].rel, "too many replays differ for one GPU")
    assert "gradients:3" in reason and "bfloat16" in reason and "0.0078125" in reason
    assert not model.blind and model.working == [0, 1, 3]
    assert model.thresholds() == {
        "loss": 0.0,
        "gradients:0": 0.0,
        "gradients:3": None,
        "gradients:5": 0.0,
    }
    # What a heartbeat carries: the loss, the blind kinds, then the noisiest working ones.
    model.kinds[3].job = 1e-3
    assert model.in_force(3) == [
        ("loss", 0.0, 0.0, False),
        ("gradients:3", None, c_noise.kinds[2].rel, True),
        ("gradients:5", 1e-3, 0.0, False),
    ]
    assert len(model.in_force(64)) == 4 and model.in_force(1)[0][0] == "loss"
    model.kinds[3].job = 0.0
    ring = {0: 1, 1: 2, 2: 0}
    flagged = split_by_kind(model, {0: c_noise, 1: c_fault, 2: c_noise}, ring)
    assert flagged == {3: [1]}, "the blind layer says nothing, the faulty layer speaks"
    for k in model.working:
        model.go_blind(k, 1.0, "test")
    assert model.blind and "blind" in model.describe()


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


def test_an_excused_rank_takes_differences_up_to_the_cap_in_the_kind_that_differed() -> None:
    model = NoiseModel(cap=FP32)
    model.excuse(LOSS, 1)
    assert model.tolerances([1]) == [FP32, 0.0], "the gradients were not part of it"
    assert not model.differs(LOSS, loss_off(9e-7), [1, 2])
    assert model.differs(LOSS, loss_off(2e-6), [1, 2]), "above the cap: still evidence"


# -- the forward output kinds ---------------------------------------------------------------


def _bf16(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _outputs(*tensors: torch.Tensor) -> Summary:
    return Summary(0, 0.0, (), (), outputs=tuple(tuple(output_stats(t).tolist()) for t in tensors))


def _ulp_away_from_zero(t: torch.Tensor, where: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    bits = out.view(torch.int16)
    bits[where] += sign.to(torch.int16)  # sign-magnitude: +1 moves away from zero
    return out


def test_one_ulp_in_every_element_stands_far_above_one_ulp_in_one_percent() -> None:
    """Why the output kinds use the sum of absolute values and the norm: the GPT-2's 1e-3
    fault is one bf16 ulp in every element of a layer's output (every magnitude up), the
    forward noise one ulp in 1 % of them, either way, on both computations. The fault
    moves the statistics by about an ulp's relative size, the noise by a hundredth of
    that; both stay within the cap (rounding-level differences)."""
    x = _bf16(4096)
    everywhere = torch.arange(x.numel())
    fault = compare(
        _outputs(x), _outputs(_ulp_away_from_zero(x, everywhere, torch.ones(4096))), outputs=1
    )
    g = torch.Generator().manual_seed(1)
    noisy = []
    for _ in range(2):
        where = torch.randperm(x.numel(), generator=g)[:41]
        sign = torch.randint(0, 2, (41,), generator=g) * 2 - 1
        noisy.append(_ulp_away_from_zero(x, where, sign))
    noise = compare(_outputs(noisy[0]), _outputs(noisy[1]), outputs=1)
    cap = noise_cap(torch.bfloat16)
    assert 2e-3 < fault.kinds[-1].rel <= cap
    assert 0 < noise.kinds[-1].rel < 1e-4
    assert fault.kinds[-1].rel > 50 * noise.kinds[-1].rel
    # The absolute values taken in place in the stats scratch: the same statistics.
    big = torch.randn(700_001).to(torch.bfloat16)
    assert torch.equal(output_stats(big), output_stats(big, stats_scratch(big.device)))
    # The plain sum cancels: it would not tell them apart.
    plain = [
        float(tensor_stats(t)[0]) for t in (x, _ulp_away_from_zero(x, everywhere, torch.ones(4096)))
    ]
    assert abs(plain[0] - plain[1]) / float(output_stats(x)[0]) < 1e-3


def test_output_kinds_follow_the_gradient_kinds_and_compare_equal_where_unobserved() -> None:
    a = Summary(0, 1.0, ((1, 1),), ((1.0, 1.0),), outputs=((4.0, 4.0), (2.0, 1.0)))
    b = Summary(0, 1.0, ((1, 1),), ((1.0, 1.0),), outputs=((4.0, 4.0), (2.0, 1.21)))
    c = compare(a, b, [[0]], outputs=2)
    assert len(c.kinds) == 4 and c.outputs == 2
    assert c.kinds[2] == KindDiff(True, 0.0)
    assert not c.kinds[3].equal and math.isclose(c.kinds[3].rel, 0.1 / 1.1)
    assert c.grads_equal and c.grad_rel == 0.0  # the output kinds are not gradients
    unobserved = Summary(0, 1.0, ((1, 1),), ((1.0, 1.0),))
    assert compare(a, unobserved, [[0]], outputs=2).kinds[2:] == (KindDiff(True, 0.0),) * 2


def test_a_nan_in_an_output_on_both_sides_is_no_evidence_and_never_reaches_a_heartbeat() -> None:
    """A healthy module whose output holds NaN (masked positions a later torch.where
    replaces) on both sides: its statistics cannot be told apart. Two NaNs created apart
    (and a NaN of another sign or payload) compare equal; a NaN on one side only is
    evidence. A kind gone blind on an infinite difference still reports a finite noise,
    as the protocol demands (a non-finite one would have dropped every later heartbeat)."""
    nan, other_nan = float("nan"), -struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0]
    out = output_stats(torch.tensor([1.0, float("nan")]))
    a = Summary(1, 1.0, ((1, 1),), ((1.0, 1.0),), outputs=((nan, nan), (2.0, 4.0)))
    b = Summary(1, 1.0, ((1, 1),), ((1.0, 1.0),), outputs=((other_nan, float("nan")), (2.0, 4.0)))
    real = Summary(1, 1.0, ((1, 1),), ((1.0, 1.0),), outputs=(tuple(out.tolist()), (2.0, 4.0)))
    for x, y in ((a, b), (a, real), (real, a)):
        assert compare(x, y, [[0]], outputs=2).kinds[2:] == (KindDiff(True, 0.0),) * 2
    c = compare(a, b, [[0]], outputs=2)
    names = ["loss", "gradients:0", "outputs:a", "outputs:b"]
    model = NoiseModel(cap=7.8e-3, kind_names=names)
    assert split_by_kind(model, {0: c, 1: c}, {0: 1, 1: 0}) == {}
    one_side = Summary(1, 1.0, ((1, 1),), ((1.0, 1.0),), outputs=((3.0, 5.0), (2.0, 4.0)))
    assert compare(a, one_side, [[0]], outputs=2).kinds[2] == KindDiff(False, math.inf)
    model.go_blind(2, math.inf, "too many replays differ for one GPU")
    rows = model.in_force(64)
    assert rows[1] == ("outputs:a", None, sys.float_info.max, True)
    assert all(math.isfinite(noise) for _, _, noise, _ in rows)
    me = ReporterIdentity(rank=0, node="n", pod="p")
    beat = HeartbeatReport(
        reporter=me,
        sent_at=1.0,
        step=1,
        last_clean_step=1,
        bit_reproducible=True,
        replay_dtype="float32",
        replay_cap=7.8e-3,
        replay_kinds=tuple(ReplayKind(*r) for r in rows),
    )
    parsed = parse_report(encode_report(beat))
    assert isinstance(parsed, HeartbeatReport)
    assert parsed.replay_kinds[1].noise == sys.float_info.max


def test_the_tensor_that_is_a_modules_result() -> None:
    hidden = torch.ones(2)
    assert output_tensor(hidden) is hidden
    assert output_tensor((hidden, torch.zeros(3))) is hidden  # attention: (output, weights)
    assert output_tensor((None, [torch.arange(3), hidden])) is hidden  # integers skipped
    assert output_tensor({"last_hidden_state": hidden, "past": object()}) is hidden
    assert output_tensor(object()) is None and output_tensor(torch.arange(2)) is None


def test_output_modules_are_the_parameterized_modules_and_their_blocks() -> None:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = torch.nn.LayerNorm(4)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())

    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.ModuleList([Block()])
    )
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    model.append(frozen)
    names = [n for n, _ in output_modules(model)]
    assert names == ["0", "2.0", "2.0.ln", "2.0.mlp", "2.0.mlp.0"]
    assert [output_kind(n) for n in names[:1]] == ["outputs:0"] and is_output_kind("outputs:0")


def test_the_output_kinds_alone_never_keep_the_audit_vouching() -> None:
    """They see the forward only: with the loss and every gradient kind blind the audit is
    blind, and the gradient tolerance ignores them."""
    model = NoiseModel(cap=FP32, kind_names=["loss", "gradients:0", "outputs:0"])
    model.kinds[2].job = 5e-7
    model.kinds[1].job = 1e-7
    assert model.tolerance((0, 1)).gradients == 1e-7 and model.largest == 1e-7
    model.go_blind(0, 1.0, "noise")
    assert not model.blind
    model.go_blind(1, 1.0, "noise")
    assert model.blind and model.working == [2]


def test_the_output_recorder_hooks_only_while_recording_and_changes_nothing() -> None:
    from sdc_agent.audit import _OutputRecorder

    shared = torch.nn.Linear(3, 3)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)  # called twice
    x = torch.randn(2, 3)
    plain = model(x)
    recorder = _OutputRecorder([shared])
    assert recorder.take() is None  # nothing started
    with recorder.recording():
        assert len(shared._forward_hooks) == 1
        recorded = model(x)
    assert not shared._forward_hooks and not recorder.active
    assert torch.equal(recorded, plain)
    first = shared(x)
    both = output_stats(first) + output_stats(model[2](model[1](first)))
    rows = recorder.take()
    assert rows is not None and torch.equal(rows[0], both)
    assert recorder.take() is None  # taken once


def test_the_owner_and_the_replay_record_the_same_single_forward() -> None:
    """The owner records from the wrapper's forward pre-hook (as ``forward_starts`` does
    under DDP: the audited forward starts it, a later forward of the wrapper stops it),
    the replay around the whole loss function; both stop when the model's first forward
    returns. A logging forward under ``no_grad`` before the loss is shown (a custom loop,
    one rank only), and a loss function with two forwards (R-Drop), leave the owner's
    statistics equal to the replay's."""
    from sdc_agent.audit import _OutputRecorder

    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    watched = [m for _, m in output_modules(inner)]
    assert len(watched) == 2

    class Wrapper(torch.nn.Module):  # stands in for DDP: calls the model once
        def __init__(self) -> None:
            super().__init__()
            self.module = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.module(x)

    ddp = Wrapper()
    recorder = _OutputRecorder(watched, root=inner)
    forwards = 0

    def forward_starts(_m: torch.nn.Module, _a: object) -> None:
        nonlocal forwards
        if forwards == 0:
            recorder.start()
        elif recorder.active:
            recorder.stop()
        forwards += 1

    ddp.register_forward_pre_hook(forward_starts)
    x, sample = torch.randn(5, 3), torch.randn(7, 3)

    def single(model: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        return model(b).square().mean()

    def r_drop(model: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        return model(b).square().mean() + model(2 * b).abs().mean()

    for loss_fn, logging in ((single, True), (r_drop, False)):
        forwards = 0
        loss_fn(ddp, x)
        if logging:
            with torch.no_grad():
                inner(sample)  # rank 0 only, between the loss and before_backward
        owner = recorder.take()
        with recorder.recording():
            loss_fn(inner, x)
        replay = recorder.take()
        assert owner is not None and replay is not None
        assert torch.equal(owner, replay), loss_fn.__name__
        assert torch.equal(owner[1], output_stats(inner(x)))
        assert not inner._forward_hooks and not any(m._forward_hooks for m in watched)


def test_a_compiled_model_is_found_wherever_it_is_compiled() -> None:
    """``torch.compile`` (torch 2.13: no guards on module hooks) runs no hook added after
    its first compilation: the recorder sees nothing, on the owner and the replay alike
    (zeros compared equal, as if bit for bit). So a compiled model has no output kinds
    (``ReplayAudit.outputs_unavailable`` says why)."""
    from sdc_agent.audit import _OutputRecorder

    def net() -> torch.nn.Sequential:
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))

    plain = net()
    assert compiled_module(plain) is None
    whole = net()
    compiled = cast(torch.nn.Module, torch.compile(whole, backend="eager"))
    x = torch.randn(2, 3)
    compiled(x)  # compiled without hooks: a later audit's hooks never run
    recorder = _OutputRecorder([m for _, m in output_modules(whole)], root=whole)
    with recorder.recording():
        compiled(x)
    rows = recorder.take()
    assert rows is not None and not rows.any(), "the hooks ran: the check below is moot"
    assert compiled_module(compiled) == "the model"
    part = net()
    part[2] = cast(torch.nn.Module, torch.compile(part[2], backend="eager"))
    assert compiled_module(part) == "2"
    in_place = net()
    in_place[0].compile(backend="eager")
    assert compiled_module(in_place) == "0"


def test_a_model_without_output_modules_records_an_empty_table() -> None:
    """A bare ``nn.Linear`` as the model: its parameters are the root's own, so no module
    below it is watched; a recorded forward gives no rows (and no error)."""
    from sdc_agent.audit import _OutputRecorder

    model = torch.nn.Linear(3, 3)
    assert output_modules(model) == ()
    recorder = _OutputRecorder([])
    with recorder.recording():
        model(torch.randn(2, 3))
    rows = recorder.take()
    assert rows is not None and rows.shape == (0, 2)
