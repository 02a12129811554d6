"""Fingerprint properties: every bit flip and every swap changes it; kernels agree."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

from sdc_agent import fingerprint_native
from sdc_agent.errors import SDCError
from sdc_agent.fingerprint import (
    _COMPILE_MIN,
    _EAGER_CHUNK,
    _EAGER_SHAPE_CPU,
    _PACK_BELOW_CPU,
    TORCH_COMPILE,
    Fingerprinter,
    _as_flat_bits,
    _eager_words,
    _fused_words,
    _packed_words,
    _PackedLayout,
    _probe,
    combine_fingerprints,
    format_fingerprint,
)

EAGER = Fingerprinter("eager")
NATIVE = Fingerprinter("compile")  # on CPU: the C kernel
# The fast kernels need a C compiler (the C kernel; Inductor on CPU). Without one the agent
# falls back to eager, which the tests below check with a compiler that does not exist.
needs_cc = pytest.mark.skipif(
    not any(shutil.which(c) for c in fingerprint_native._compilers()),
    reason="no C compiler (cc, gcc, clang or $CC) here",
)
KERNELS = [EAGER, pytest.param(NATIVE, marks=needs_cc)]
CPU = torch.device("cpu")
INTS = [torch.int8, torch.int16, torch.int32, torch.int64]
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_INT = {2: torch.int16, 4: torch.int32}


def reference(tensor: torch.Tensor) -> tuple[int, int]:
    """The definition, in Python integers."""
    bits = _as_flat_bits(tensor).tolist()
    weighted = sum((2 * i + 1) * v for i, v in enumerate(bits)) % 2**64
    plain = sum(bits) % 2**64
    return weighted, plain


def as_unsigned(words: torch.Tensor) -> tuple[int, int]:
    a, b = words.tolist()
    return a % 2**64, b % 2**64


@pytest.mark.parametrize("fp", KERNELS, ids=["eager", "native"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 1000, 1001])
def test_matches_the_definition(fp: Fingerprinter, dtype: torch.dtype, n: int) -> None:
    t = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 100).to(dtype)
    assert as_unsigned(fp(t)) == reference(t)


@pytest.mark.parametrize("fp", KERNELS, ids=["eager", "native"])
@pytest.mark.parametrize("dtype", INTS)
def test_every_width_matches_the_definition_at_the_extremes(
    fp: Fingerprinter, dtype: torch.dtype
) -> None:
    t = _probe(3001, dtype, CPU)
    assert as_unsigned(fp(t)) == reference(t)


ROW = _EAGER_SHAPE_CPU[1]


@pytest.mark.parametrize(
    "n",
    [
        ROW - 1,
        ROW,
        ROW + 1,
        2 * ROW,
        2 * ROW + 3,
        _EAGER_CHUNK - 1,
        _EAGER_CHUNK,
        _EAGER_CHUNK + 1,
        3 * _EAGER_CHUNK + 5,
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_eager_equals_single_pass(n: int, dtype: torch.dtype) -> None:
    t = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert torch.equal(EAGER(t), _fused_words(_as_flat_bits(t)))


@needs_cc
@pytest.mark.parametrize("dtype", INTS)
@pytest.mark.parametrize("extreme", ["min", "max"])
def test_narrow_accumulators_are_exact_at_the_extremes(dtype: torch.dtype, extreme: str) -> None:
    # Every element at the type's extreme fills the 32-bit accumulators of the eager row
    # sums and of the C kernel's blocks as far as they go.
    info = torch.iinfo(dtype)
    n = 3 * _EAGER_CHUNK + 4099
    t = torch.full((n,), getattr(info, extreme), dtype=dtype)
    want = _fused_words(t)
    assert torch.equal(_eager_words(t), want)
    assert torch.equal(NATIVE(t), want)


@needs_cc
@pytest.mark.parametrize("dtype", INTS)
def test_native_block_and_lane_boundaries(dtype: torch.dtype) -> None:
    # Lanes of 8 to 64 elements, blocks of 256 to 1024 lanes, scalar tails.
    base = _probe(70 * 1024 + 77, dtype, CPU)
    for n in (1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 8191, 8192, 8193, 32768 + 5, base.numel()):
        assert torch.equal(NATIVE(base[:n]), _fused_words(base[:n])), n


@needs_cc
@pytest.mark.parametrize("threads", [2, 3, 5])
def test_native_split_over_threads_equals_one_thread(threads: int) -> None:
    kernel = fingerprint_native.native_kernel()
    bits = [
        _probe(n, d, CPU)
        for n, d in (
            (3_000_001, torch.int32),
            (5, torch.int16),
            (4_000_003, torch.int16),
            (1, torch.int8),
            (1_500_001, torch.int64),
        )
    ]
    want = torch.stack([_fused_words(b) for b in bits])
    assert torch.equal(kernel.words(bits, 1), want)
    assert torch.equal(kernel.words(bits, threads), want)


@needs_cc
def test_indices_past_2_to_the_31_are_64_bit() -> None:
    # A piece of a tensor of more than 2**31 elements: the C kernel is told where it
    # starts and must weight element i by 2*(start + i) + 1 without overflowing.
    kernel = fingerprint_native.native_kernel()
    piece = _probe(5003, torch.int32, CPU)
    out = torch.zeros((1, 2), dtype=torch.int64)
    for start in (2**31 - 7, 2**32 + 1, 2**40 + 12345):
        out.zero_()
        kernel._run([(piece.data_ptr(), piece.numel(), 4, start, 0)], out)
        values = piece.tolist()
        weighted = sum((2 * (start + i) + 1) * v for i, v in enumerate(values)) % 2**64
        assert as_unsigned(out[0]) == (weighted, sum(values) % 2**64), start


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_every_single_bit_flip_changes_it(dtype: torch.dtype) -> None:
    t = torch.randn(37, generator=torch.Generator().manual_seed(2)).to(dtype)
    base = EAGER(t)
    width = t.element_size() * 8
    seen = {format_fingerprint(base)}
    for index in range(t.numel()):
        for bit in range(width):
            flipped = t.clone()
            mask = 1 << bit
            if mask >= 1 << (width - 1):
                mask -= 1 << width
            flipped.view(_INT[t.element_size()])[index] ^= mask
            fp = format_fingerprint(EAGER(flipped))
            assert fp not in seen, (index, bit)
            seen.add(fp)


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=2, max_size=300),
    data=st.data(),
)
def test_swapping_two_different_elements_changes_it(values: list[int], data: st.DataObject) -> None:
    t = torch.tensor(values, dtype=torch.int32).view(torch.float32)
    i = data.draw(st.integers(0, len(values) - 1))
    j = data.draw(st.integers(0, len(values) - 1))
    swapped = t.clone()
    swapped[i], swapped[j] = t[j].clone(), t[i].clone()
    same_bits = values[i] == values[j]
    assert torch.equal(EAGER(t), EAGER(swapped)) == same_bits
    # The order-free word does not move: same values, other order.
    assert EAGER(t)[1] == EAGER(swapped)[1]


def test_swapping_a_value_with_its_negation_changes_it() -> None:
    # Differences of exactly the sign bit carry 31 factors of two: the hardest case.
    t = torch.tensor([1.0, 2.0, -1.0, 3.0, 5.0, -5.0])
    for i, j in [(0, 2), (4, 5)]:
        swapped = t.clone()
        swapped[i], swapped[j] = t[j].clone(), t[i].clone()
        assert not torch.equal(EAGER(t), EAGER(swapped))


def test_non_contiguous_and_shaped_tensors_use_logical_order() -> None:
    t = torch.randn(6, 5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(EAGER(t.t()), EAGER(t.t().contiguous()))
    assert torch.equal(EAGER(t), EAGER(t.reshape(-1)))


def test_other_dtypes() -> None:
    cases = [
        (torch.arange(10, dtype=torch.int64), torch.tensor(99)),
        (torch.ones(5, dtype=torch.bool), torch.tensor(False)),
        (torch.randn(4, dtype=torch.float64), torch.tensor(0.5)),
        (torch.randn(3, dtype=torch.complex64), torch.tensor(1j)),
    ]
    for t, other in cases:
        fp = EAGER(t)
        assert fp.dtype == torch.int64 and fp.shape == (2,)
        changed = t.clone()
        changed[0] = other
        assert not torch.equal(fp, EAGER(changed)), t.dtype


def test_combine_is_order_sensitive() -> None:
    a = EAGER(torch.tensor([1.0, 2.0]))
    b = EAGER(torch.tensor([3.0]))
    ab = combine_fingerprints(torch.stack([a, b]))
    ba = combine_fingerprints(torch.stack([b, a]))
    assert not torch.equal(ab, ba)
    combined, per = EAGER.many([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    assert torch.equal(combined, ab) and per.shape == (2, 2)


def test_format() -> None:
    assert format_fingerprint(torch.tensor([-1, 1])) == "ffffffffffffffff:0000000000000001"


def test_unknown_backend_is_rejected() -> None:
    with pytest.raises(ValueError, match="fingerprint_backend"):
        Fingerprinter("fast")


@needs_cc
def test_compiled_backend_equals_eager() -> None:
    # A real torch.compile on CPU: the fused kernel gives the same words as eager.
    compiled = Fingerprinter("compile")
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 1000, 12345):
            t = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
            assert torch.equal(compiled(t), EAGER(t)), (dtype, n)


@needs_cc
def test_compiled_16_bit_pairs_equal_eager_for_odd_lengths_and_offsets() -> None:
    compiled = Fingerprinter("compile")
    base = torch.randn(2001, generator=torch.Generator().manual_seed(5))
    for dtype in (torch.bfloat16, torch.float16):
        t = base.to(dtype)
        for view in (t, t[1:], t[:-1], t[3:1500]):
            assert torch.equal(compiled(view), EAGER(view)), (dtype, view.numel())


# -- many tensors at once ------------------------------------------------------------------


def _mixed_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    big = torch.randn(300, 301, generator=g)
    return [
        torch.randn(7, generator=g),
        big,
        big.t(),  # not contiguous
        big[1:, 3:],  # a slice of the same storage
        torch.randn(5, generator=g).bfloat16(),
        torch.randn(2001, generator=g).half()[1:],  # odd offset
        torch.zeros(0),
        torch.tensor(1000.0),  # Adam's step
        torch.randn(1000, dtype=torch.float64, generator=g),
        torch.randn(3, dtype=torch.complex64, generator=g),
        torch.ones(9, dtype=torch.bool),
        torch.arange(70000, dtype=torch.int64),
        torch.randn(1, generator=g).expand(4100),  # stride 0
        torch.randn(_PACK_BELOW_CPU - 1, generator=g),
        torch.randn(_PACK_BELOW_CPU, generator=g),
    ]


@pytest.mark.parametrize("fp", KERNELS, ids=["eager", "native"])
def test_many_equals_one_by_one(fp: Fingerprinter) -> None:
    tensors = _mixed_tensors()
    combined, per = fp.many(tensors)
    want = torch.stack(
        [torch.tensor(reference(t), dtype=torch.uint64).view(torch.int64) for t in tensors]
    )
    assert torch.equal(per, want)
    assert torch.equal(combined, combine_fingerprints(want))
    # Order matters, and so does every tensor.
    assert not torch.equal(fp.many(tensors[::-1])[0], combined)
    changed = [t.clone() for t in tensors]
    changed[4].view(torch.int16)[2] ^= 1
    assert not torch.equal(fp.many(changed)[0], combined)


@needs_cc
def test_many_of_nothing() -> None:
    combined, per = NATIVE.many([])
    assert per.shape == (0, 2) and torch.equal(combined, torch.zeros(2, dtype=torch.int64))


def test_packed_small_tensors_equal_one_by_one() -> None:
    # The packed path runs for small tensors off the CPU (and on CPU when eager); it is
    # device-agnostic PyTorch, so its arithmetic is checked here.
    bits = [_probe(n, torch.int16, CPU) for n in (0, 1, 5, 1000, 3, 0, 65535)]
    layout = _PackedLayout([b.numel() for b in bits], CPU)
    want = torch.stack([_fused_words(b) for b in bits])
    assert torch.equal(_packed_words(bits, layout), want)


@needs_cc
def test_strided_and_misaligned_inputs_use_logical_order() -> None:
    base = torch.randn(4099, generator=torch.Generator().manual_seed(9))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = base.to(dtype)
        for view in (t[1:], t[3:-2], t[::2], t[1::3], t.view(-1)[:4096].view(64, 64).t()):
            want = reference(view)
            assert as_unsigned(NATIVE(view)) == want
            assert as_unsigned(EAGER(view)) == want


# -- kernels: which one runs, and what happens when one cannot be built --------------------


@needs_cc
def test_the_native_kernel_is_reported() -> None:
    fp = Fingerprinter("auto")
    assert fp.kernel == "compiled" and fp.kernels == {}
    fp(torch.randn(10))
    assert fp.kernels == {"cpu": "native"}
    assert fp.kernel == "compiled"
    assert EAGER.kernel == "eager"


def test_no_compiler_falls_back_to_eager_with_a_warning_log(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(fingerprint_native.COMPILER_ENV, "/nonexistent/sdc-test-cc")
    fp = Fingerprinter("auto")
    t = torch.randn(5000)
    with (
        caplog.at_level(logging.WARNING, logger="sdc_agent.fingerprint"),
        pytest.warns(RuntimeWarning, match="eager fingerprint kernel"),
    ):
        got = fp(t)
    assert torch.equal(got, EAGER(t))
    assert fp.kernel == "eager" and fp.kernels == {"cpu": "eager"}
    logged = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(logged) == 1 and "/nonexistent/sdc-test-cc" in logged[0].getMessage()
    fp(torch.randn(3))  # decided once: no second warning
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    with pytest.raises(SDCError, match="fingerprint_backend 'compile'.*cannot be built"):
        Fingerprinter("compile")(t)


def test_a_kernel_that_disagrees_is_never_used(monkeypatch: pytest.MonkeyPatch) -> None:
    class Wrong:
        def words(self, bits: list[torch.Tensor], threads: int = 1) -> torch.Tensor:
            return torch.ones((len(bits), 2), dtype=torch.int64)

    monkeypatch.setattr("sdc_agent.fingerprint.native_kernel", lambda: Wrong())
    fp = Fingerprinter("auto")
    t = torch.randn(100)
    with pytest.warns(RuntimeWarning, match="disagrees"):
        assert torch.equal(fp(t), EAGER(t))
    assert fp.kernel == "eager"
    with pytest.raises(SDCError, match="disagrees"):
        Fingerprinter("compile")(t)


# -- torch.compile (CUDA's kernel), exercised on this CPU ----------------------------------


def _inductor() -> Fingerprinter:
    fp = Fingerprinter("compile")
    fp._cpu_kernel = TORCH_COMPILE
    return fp


@pytest.fixture
def inductor_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's compiled kernels (its FX graph cache) kept with the project's other
    build caches, ${HYPERPOD_SDC_CACHE:-~/.cache/hyperpod-sdc}/torchinductor, not under
    /tmp: a later run, or a fresh clone on the same machine, loads them. Each kernel is
    still traced, loaded and run, and compared bit for bit with eager below; the cache is
    keyed by torch's version, the graph and Inductor's settings, so a changed kernel
    compiles again."""
    default = Path.home() / ".cache" / "hyperpod-sdc"
    cache = Path(os.environ.get("HYPERPOD_SDC_CACHE") or default) / "torchinductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))


# Inductor's C++ compile of the two kernels, paid by the first of these two tests (the
# second reuses the process's kernels), so both are in the full suite only. The first
# test, twice one after the other with inductor_cache's directory empty before the first
# (loaded, load about 10): 48 s cold, 9.6 s warm (under 1 MB of cache).
@pytest.mark.slow
@needs_cc
@pytest.mark.usefixtures("inductor_cache")
def test_inductor_kernel_equals_eager_for_odd_lengths_and_offsets() -> None:
    fp = _inductor()
    base = torch.randn(3 * _COMPILE_MIN + 7, generator=torch.Generator().manual_seed(5))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = base.to(dtype)
        for view in (t, t[1:], t[:-1], t[3 : 2 * _COMPILE_MIN + 1], t[:5]):
            assert torch.equal(fp(view), EAGER(view)), (dtype, view.numel())
    assert fp.kernels == {"cpu/int16": "torch.compile", "cpu/int32": "torch.compile"}


@pytest.mark.slow
@needs_cc
@pytest.mark.usefixtures("inductor_cache")
def test_inductor_kernel_compiles_once_per_dtype() -> None:
    # The review found recompiles inside backward at the first audit (grad mode off there)
    # and on Adam's CPU step tensor at the first weight check; new sizes and slices of a
    # bigger tensor recompiled too. After warm-up (grad mode on, as at Guard creation)
    # none of these may compile anything.
    fp = _inductor()
    fp.warm_up({torch.float32, torch.bfloat16}, CPU)
    compiled = counters["stats"]["unique_graphs"]
    w = torch.randn(300, 300, requires_grad=True)
    in_backward: list[torch.Tensor] = []
    w.register_hook(lambda g: in_backward.append(fp(g)))
    (w * 2).sum().backward()
    assert torch.equal(in_backward[0], EAGER(torch.full((300, 300), 2.0)))
    for n in (_COMPILE_MIN, 70001, 3 * _COMPILE_MIN + 1):
        x = torch.randn(n)
        for view in (x, x[1:], x[3:].bfloat16(), x.bfloat16()[5:]):
            assert torch.equal(fp(view), EAGER(view))
    step = torch.tensor(7.0)
    assert torch.equal(fp(step), EAGER(step))
    assert torch.equal(fp.many([w, step, w.detach().bfloat16()])[1][1], EAGER(step))
    with torch.no_grad():
        fp(torch.randn(_COMPILE_MIN + 3))
    assert counters["stats"]["unique_graphs"] == compiled
