"""Fingerprint properties: every bit flip and every swap changes it; backends agree."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdc_agent.fingerprint import (
    _EAGER_CHUNK,
    Fingerprinter,
    _as_flat_bits,
    _fused_words,
    combine_fingerprints,
    format_fingerprint,
)

EAGER = Fingerprinter("eager")
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


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 1000, 1001])
def test_matches_the_definition(dtype: torch.dtype, n: int) -> None:
    t = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 100).to(dtype)
    assert as_unsigned(EAGER(t)) == reference(t)


@pytest.mark.parametrize(
    "n", [_EAGER_CHUNK - 1, _EAGER_CHUNK, _EAGER_CHUNK + 1, 3 * _EAGER_CHUNK + 5]
)
def test_chunked_eager_equals_single_pass(n: int) -> None:
    t = torch.randn(n, generator=torch.Generator().manual_seed(1))
    assert torch.equal(EAGER(t), _fused_words(_as_flat_bits(t)))


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


def test_compiled_backend_equals_eager() -> None:
    # A real torch.compile on CPU: the fused kernel gives the same words as eager.
    compiled = Fingerprinter("compile")
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 1000, 12345):
            t = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
            assert torch.equal(compiled(t), EAGER(t)), (dtype, n)


def test_compiled_16_bit_pairs_equal_eager_for_odd_lengths_and_offsets() -> None:
    compiled = Fingerprinter("compile")
    base = torch.randn(2001, generator=torch.Generator().manual_seed(5))
    for dtype in (torch.bfloat16, torch.float16):
        t = base.to(dtype)
        for view in (t, t[1:], t[:-1], t[3:1500]):
            assert torch.equal(compiled(view), EAGER(view)), (dtype, view.numel())
