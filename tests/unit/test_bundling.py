"""Which rank writes a verdict's evidence bundle, and the reference it takes from the
audit's own summary (sdc_agent.bundling); the settings that name the directory."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from sdc_agent import GuardConfig
from sdc_agent.audit import _Collector
from sdc_agent.bundle import BundleSettings, recompute, reference_of
from sdc_agent.bundling import BundleSource, choose_source, reference_from_summary
from sdc_agent.errors import ConfigError
from sdc_agent.fingerprint import Fingerprinter
from sdc_agent.replay import Payload, Recheck, ReplayFinding

RING = {0: 1, 1: 2, 2: 0}  # three nodes, one rank each


def finding(suspects: tuple[int, ...], *, transient: bool | None = False) -> ReplayFinding:
    return ReplayFinding("rank", suspects, True, transient, "m", corroborated=True)


def recheck(owner: int, *, owner_wrong: bool, reproduces: bool = True) -> Recheck:
    # A third node agrees with the replay (the owner was wrong) or with the original.
    return Recheck(
        owner=owner,
        replayer=RING[owner],
        third=(owner + 2) % 3,
        third_agrees_original=not owner_wrong,
        third_agrees_replay=owner_wrong,
        rerun_reproduces=reproduces,
        rereplay_reproduces=reproduces,
    )


def test_the_replayer_writes_for_a_suspect_whose_own_work_was_wrong() -> None:
    source = choose_source(finding((1,)), [recheck(1, owner_wrong=True)], RING)
    assert source == BundleSource(suspect=1, writer=2, work_of=1)


def test_the_owner_writes_for_a_suspect_that_was_wrong_as_a_replayer() -> None:
    # Rank 0's work, replayed wrong by rank 1: rank 0 holds the micro-batch and the truth.
    source = choose_source(finding((1,)), [recheck(0, owner_wrong=False)], RING)
    assert source == BundleSource(suspect=1, writer=0, work_of=0)


@pytest.mark.parametrize(
    "found",
    [
        finding((1,), transient=True),  # not reproduced on the suspect: nothing to confirm
        ReplayFinding("rank", (1, 2), False, None, "m", (1, 2), corroborated=False),
        ReplayFinding("rank", (1,), True, False, "m", corroborated=False),
        ReplayFinding("nondeterministic", (), False, None, "m"),
    ],
)
def test_no_bundle_for_transient_unlocalized_or_uncorroborated_findings(
    found: ReplayFinding,
) -> None:
    transient = found.transient is True
    rechecks = [recheck(1, owner_wrong=True, reproduces=not transient)]
    assert choose_source(found, rechecks, RING) is None


def test_a_writer_that_is_itself_accused_is_passed_over() -> None:
    # Ranks 1 and 2 both persistent: rank 1's replayer is rank 2, a suspect; rank 2's
    # replayer, rank 0, is healthy and writes for rank 2.
    rechecks = [recheck(1, owner_wrong=True), recheck(2, owner_wrong=True)]
    assert choose_source(finding((1, 2)), rechecks, RING) == BundleSource(2, 0, 2)


def test_the_reference_from_the_audits_summary_is_what_reference_of_records() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3), nn.Linear(3, 3))
    net[3].requires_grad_(False)  # no gradient: not in the list at all
    unused = nn.Linear(2, 2)
    net.add_module("unused", unused)  # in the list, but gets no gradient

    def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        assert isinstance(model, nn.Sequential)
        return model[:4](batch).pow(2).mean()

    payload = Payload.capture(torch.randn(5, 6))
    result, names = recompute(net, loss_fn, payload, torch.device("cpu"))
    fp = Fingerprinter("eager")
    expected = reference_of(result, names, fp)
    collector = _Collector(fp)
    for i, g in enumerate(result.grads):
        if g is not None:
            collector.add(i, g)
    got = reference_from_summary(collector.summary(result.loss, len(names)), names)
    for key in ("version", "gradients_of", "loss_bits", "gradient_fingerprint", "per_parameter"):
        assert got[key] == expected[key], key
    assert got["per_parameter"]["unused.weight"] is None
    for name, norm in expected["gradient_norms"].items():
        if norm is None:
            assert got["gradient_norms"][name] is None
        else:
            assert math.isclose(got["gradient_norms"][name], norm, rel_tol=1e-12), name


def test_bundle_settings_in_the_guard_config(tmp_path: Path) -> None:
    assert GuardConfig().bundles == BundleSettings()
    config = GuardConfig.from_env({}, bundle_dir=tmp_path, bundle_max_bytes=1000)
    assert config.bundles == BundleSettings(bundle_dir=str(tmp_path), bundle_max_bytes=1000)
    env = {"HYPERPOD_SDC_BUNDLE_DIR": "/fsx/ckpt", "HYPERPOD_SDC_BUNDLE_MAX_BYTES": "5"}
    assert GuardConfig.from_env(env).bundles == BundleSettings(
        bundle_dir="/fsx/ckpt", bundle_max_bytes=5
    )
    # A keyword argument beats the environment, as for every other setting.
    assert GuardConfig.from_env(env, bundle_dir="/elsewhere").bundles.bundle_dir == "/elsewhere"
    with pytest.raises(ConfigError, match="HYPERPOD_SDC_BUNDLE_MAX_BYTES"):
        GuardConfig.from_env({"HYPERPOD_SDC_BUNDLE_MAX_BYTES": "lots"})
    with pytest.raises(ConfigError, match="^bundles: give either"):
        GuardConfig.from_env({}, bundles=BundleSettings(), bundle_dir="/x")
    with pytest.raises(ConfigError, match="^bundles: must be"):
        GuardConfig(bundles="/fsx")  # type: ignore[arg-type]


def test_the_output_statistics_are_an_optional_field_of_the_reference() -> None:
    """Compatible both ways: a summary without them (or no names) writes the reference as
    before; with them, ``output_stats`` is added and nothing else changes."""
    from sdc_agent.evidence import Summary

    plain = Summary(3, 1.5, ((1, 2),), ((0.5, 0.25),))
    before = reference_from_summary(plain, ["w"])
    assert "output_stats" not in before
    observed = Summary(3, 1.5, ((1, 2),), ((0.5, 0.25),), outputs=((2.0, 1.0),))
    after = reference_from_summary(observed, ["w"], ["layer"])
    assert after.pop("output_stats") == {"layer": [2.0, 1.0]}
    assert after == before
    assert "output_stats" not in reference_from_summary(observed, ["w"])
