"""Fault kinds do what they say, on every training dtype."""

from __future__ import annotations

import math

import pytest
import torch

from sdc_agent.errors import ConfigError
from sdc_agent.faults import FaultSpec, corrupt_, parse_faults


def spec(**kw: object) -> FaultSpec:
    base: dict[str, object] = {"rank": 0, "step": 1, "site": "grad_local", "kind": "nan"}
    base.update(kw)
    return FaultSpec(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["nan", "inf", "bitflip", "relative", "ulp"])
def test_each_kind_changes_exactly_the_chosen_element(dtype: torch.dtype, kind: str) -> None:
    t = torch.full((5,), 4.0, dtype=dtype)
    corrupt_(t, spec(kind=kind, index=2, bit=3))
    assert t[2].item() != 4.0
    assert torch.equal(t[[0, 1, 3, 4]], torch.full((4,), 4.0, dtype=dtype))


def test_relative_error_is_small_and_as_described() -> None:
    t = torch.tensor([4.0])
    corrupt_(t, spec(kind="relative"))
    assert t.item() == pytest.approx(4.0001, abs=1e-6)


def test_relative_error_always_bites() -> None:
    # Zero has no relative error and bf16 rounds 1.000025 back to 1: both move one ulp.
    for t in (torch.zeros(3), torch.tensor([1.0, 2.0], dtype=torch.bfloat16)):
        before = t.clone()
        corrupt_(t, spec(kind="relative", index=None))
        assert (t != before).all()


def test_ulp_moves_each_element_that_many_units_away_from_zero() -> None:
    t = torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16)
    corrupt_(t, spec(kind="ulp", ulps=8, index=None))
    # bf16 has 8 significant bits: one ulp of 1.0 is 2**-7.
    assert t.tolist() == [1.0 + 8 * 2**-7, -2.0 - 8 * 2**-6, 0.5 + 8 * 2**-8]
    assert parse_faults("rank=1,step=2,site=forward,kind=ulp,ulps=8")[0].ulps == 8
    with pytest.raises(ConfigError, match="faults.ulps"):
        spec(kind="ulp", ulps=0)


def test_bitflip_sign_and_exponent() -> None:
    t = torch.tensor([1.0, 1.0])
    corrupt_(t, spec(kind="bitflip", bit=31, index=0))
    corrupt_(t, spec(kind="bitflip", bit=30, index=1))
    assert t[0].item() == -1.0
    assert math.isinf(t[1].item()) or t[1].item() > 1e30


def test_every_element() -> None:
    t = torch.ones(4)
    corrupt_(t, spec(kind="nan", index=None))
    assert torch.isnan(t).all()


def test_bad_bit_and_index() -> None:
    with pytest.raises(ConfigError, match="faults.bit"):
        corrupt_(torch.ones(2, dtype=torch.bfloat16), spec(kind="bitflip", bit=20))
    with pytest.raises(ConfigError, match="faults.index"):
        corrupt_(torch.ones(2), spec(index=5))


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"site": "loss"}, "faults.site"),
        ({"kind": "zero"}, "faults.kind"),
        ({"rank": -1}, "faults.rank"),
        ({"step": 0}, "faults.step"),
        ({"bit": 64}, "faults.bit"),
        ({"relative_error": 0.0}, "faults.relative_error"),
    ],
)
def test_spec_validation_names_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        spec(**kw)


def test_active_steps() -> None:
    once, always = spec(step=3), spec(step=3, persistent=True)
    assert [once.active(s) for s in (2, 3, 4)] == [False, True, False]
    assert [always.active(s) for s in (2, 3, 4)] == [False, True, True]


def test_parse() -> None:
    specs = parse_faults(
        "rank=1,step=5,site=forward,kind=relative,persistent=true,target=0;"
        " rank=2,step=3,site=grad_local,kind=bitflip,bit=7,index=all"
    )
    assert specs == (
        spec(rank=1, step=5, site="forward", kind="relative", persistent=True, target="0"),
        spec(rank=2, step=3, kind="bitflip", bit=7, index=None),
    )


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("rank=1,step=2,site=forward", "lacks kind"),
        ("rank=1,step=2,site=forward,kind=nan,colour=red", "unknown field 'colour'"),
        ("rank=one,step=2,site=forward,kind=nan", "faults.rank"),
        ("rank=1,step", "expected key=value"),
        ("rank=1,step=2,site=forward,kind=nan,persistent=maybe", "faults.persistent"),
    ],
)
def test_parse_errors(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_faults(text)
