"""Never accuse healthy hardware on kernels that are not bit-reproducible (issue 13).

Three emulated nodes of one rank, dropout on, replayed by the ring. The noise is made the
way real kernels make it: every computation of one layer's weight gradient moves three
random elements by one ulp (atomics), or one rank's process sums one layer in another
order from the first step (per-process autotuning). Nobody runs a calibration first.

The clean runs under noise train 60 steps here (20 audits) and 200 (issue 13's length) in
``bench/clean_runs.py``, which runs the same tests at that length (results in bench/results).
"""

from __future__ import annotations

from typing import Any

import pytest

from sdc_agent.drill import Drill, DrillRank
from sdc_agent.faults import FaultSpec

from .drills import RecordProperty, accusations, agreed, clean_steps, run_scenarios, trained

# slow: long runs under emulated noise (setup about 90 s on 2 cores). Not timing: the drill's
# noise comes from a generator seeded per rank, so what is detected does not depend on load.
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

NODES = ["n0", "n1", "n2"]
SUSPECT = 1
EVERY = {"replay_every": 3, "weights_every": 1, "fingerprint_backend": "eager"}
CLEAN_STEPS = clean_steps(60)


def fault(step: int, site: str, **kw: Any) -> FaultSpec:
    return FaultSpec(rank=SUSPECT, step=step, site=site, kind="relative", persistent=True, **kw)  # type: ignore[arg-type]


SCENARIOS: dict[str, Drill] = {
    "noise_clean": Drill(steps=CLEAN_STEPS, grad_noise=True, config=EVERY),
    # A finite forward error of 2.5e-5 in a hidden layer's output from step 31.
    "noise_forward_fault": Drill(
        steps=36,
        grad_noise=True,
        config=EVERY,
        faults=(fault(31, "forward", target="3", index=None),),
    ),
    # The first layer's whole weight gradient 2.5e-5 off, from step 31.
    "noise_gradient_fault": Drill(
        steps=36,
        grad_noise=True,
        config=EVERY,
        faults=(fault(31, "grad_local", target="0.weight", index=None),),
    ),
    # Every element of a layer's weight gradient ±1 ulp on every rank, every time (a
    # reduction made with atomics): the learned gradient tolerance rises to the cap,
    # and the loss must still be compared bit for bit.
    "dense_noise_clean": Drill(
        steps=CLEAN_STEPS, grad_noise=True, grad_noise_everywhere=True, config=EVERY
    ),
    # One ulp in every output of the model from step 31. The loss shows it only where
    # the ulps do not round away in the mean, and its trace in the gradients is below the
    # noise. Before the drill's noise was seeded it was first caught at steps 33 to 63 in
    # six runs (once not within 120 steps); seeded, every run draws the same noise and it
    # is named at step 33. Ten audits follow, where rounding-level evidence must never
    # name it again: without the excuse (sdc_agent.audit's _rounding_level) it is named
    # again at every one of them (36, 39, ...). 90 steps: where other kernels draw other
    # roundings (another CPU), a first catch as late as step 60 still has ten after it
    # (the drill's noise is seeded, its arithmetic is the machine's).
    "dense_noise_one_ulp_forward": Drill(
        steps=90,
        grad_noise=True,
        grad_noise_everywhere=True,
        config=EVERY,
        faults=(fault(31, "forward", target="5", index=None, relative_error=1e-12),),
    ),
    # Faults present from step 1, under noise: the first audit must not take them for
    # noise (2.5e-5 is far above float32's cap), and the suspect's rerun must be compared
    # at the noise of the comparison that flagged it (or it "does not reproduce").
    "noise_forward_fault_from_start": Drill(
        steps=9,
        grad_noise=True,
        config=EVERY,
        faults=(fault(1, "forward", target="3", index=None),),
    ),
    "noise_gradient_fault_from_start": Drill(
        steps=9,
        grad_noise=True,
        config=EVERY,
        faults=(fault(1, "grad_local", target="0.weight", index=None),),
    ),
    "reordered_rank": Drill(steps=60, reorder_rank=SUSPECT, config=EVERY),
    # One ulp in every output of a layer from step 31, in a bit-reproducible job.
    "one_ulp_mid_run": Drill(
        steps=36,
        config=EVERY,
        faults=(fault(31, "forward", target="3", index=None, relative_error=1e-12),),
    ),
    "transient": Drill(
        steps=12,
        config=EVERY,
        faults=(
            FaultSpec(
                rank=SUSPECT, step=6, site="forward", kind="relative", target="3", index=None
            ),
        ),
    ),
    # Dropout from a private generator: replays cannot reproduce it at all.
    "unreplayable": Drill(steps=40, noise=1e-3, config={**EVERY, "weights_every": 5}),
}


@pytest.fixture(scope="module")
def results() -> dict[str, list[DrillRank]]:
    return run_scenarios(NODES, SCENARIOS)


def test_run_to_run_noise_accuses_nobody_and_drops_no_step(
    results: dict[str, list[DrillRank]], record_property: RecordProperty
) -> None:
    r = agreed(results["noise_clean"])
    trained(record_property, "noise_clean", r)
    assert accusations(r) == []
    assert sum(r.applied) >= 0.95 * len(r.applied)
    # Reported once per job, not once per audit.
    assert [v["classification"] for v in r.verdicts] == ["nondeterministic"]
    # Checkpoints are still verified: the clean step follows the audits.
    assert len(r.applied) == CLEAN_STEPS
    assert r.last_clean_step[-1] >= CLEAN_STEPS - 2
    assert r.bit_reproducible is False
    assert r.gradient_tolerance is not None and 0 < r.gradient_tolerance < 1e-5


@pytest.mark.parametrize("name", ["noise_forward_fault", "noise_gradient_fault"])
def test_a_fault_above_the_noise_is_localized_within_one_interval(
    results: dict[str, list[DrillRank]], name: str
) -> None:
    r = agreed(results[name])
    (first, *_) = accusations(r)
    assert first["step"] <= 33, "not caught within one audit interval"
    assert (first["suspect_ranks"], first["localized"], first["corroborated"]) == (
        [SUSPECT],
        True,
        True,
    )
    assert first["transient"] is False
    assert r.applied[first["step"] - 1] is False


def test_dense_gradient_noise_is_quiet_and_every_step_applied(
    results: dict[str, list[DrillRank]], record_property: RecordProperty
) -> None:
    r = agreed(results["dense_noise_clean"])
    trained(record_property, "dense_noise_clean", r)
    assert accusations(r) == []
    assert all(r.applied), f"{r.applied.count(False)} of {len(r.applied)} steps dropped"
    assert [v["classification"] for v in r.verdicts] == ["nondeterministic"]
    assert len(r.applied) == CLEAN_STEPS
    assert r.last_clean_step[-1] >= CLEAN_STEPS - 2
    assert r.gradient_tolerance is not None and 0 < r.gradient_tolerance <= 1e-6


def test_a_one_ulp_forward_fault_shows_through_dense_gradient_noise(
    results: dict[str, list[DrillRank]],
) -> None:
    r = agreed(results["dense_noise_one_ulp_forward"])
    (first, *_) = accusations(r)
    assert first["step"] >= 33 and first["suspect_ranks"] == [SUSPECT] and first["localized"]
    assert first["transient"] is False
    mismatches = first["evidence"]["mismatches"]
    assert all(m["loss_tolerance"] == 0.0 for m in mismatches), "gradient noise raised it"
    assert any(m["tolerance"] > 0 for m in mismatches), "the gradients' noise was learned"
    if first["corroborated"]:
        # The fault's trace in the gradients rose above the cap before any rounding-level
        # sign (1 run in about 15): evidence, corroborated.
        assert any(
            m["gradient_relative_difference"] > 1e-6 or m["loss_relative_difference"] > 1e-6
            for m in mismatches
        ), mismatches
    else:
        # Rounding-level evidence only (a last-bit difference in the loss, or a layer's
        # gradients within the cap: in this run gradients:0 at 3.4e-7 with the loss bit for
        # bit), which a per-process kernel choice could make too: named, not corroborated (a
        # confirmation decides), reported once, never by repetition.
        assert all(
            k["relative_difference"] is not None and k["relative_difference"] <= 1e-6
            for m in mismatches
            for k in m["kinds"].values()
        ), mismatches
        assert "kernel" in first["message"]
    # Never again on rounding-level evidence (a repeat would quarantine); the same fault
    # may later show above the cap (its trace in the gradients plus the noise), which is
    # evidence, corroborated.
    for later in accusations(r)[1:]:
        assert later["suspect_ranks"] == [SUSPECT] and later["corroborated"] is True
        assert any(
            m["gradient_relative_difference"] > 1e-6 or m["loss_relative_difference"] > 1e-6
            for m in later["evidence"]["mismatches"]
        )
    assert r.applied[first["step"] - 1] is False
    assert r.applied.count(False) == len(accusations(r))


@pytest.mark.parametrize(
    "name", ["noise_forward_fault_from_start", "noise_gradient_fault_from_start"]
)
def test_a_fault_present_from_the_first_step_is_persistent_and_localized(
    results: dict[str, list[DrillRank]], name: str
) -> None:
    r = agreed(results[name])
    assert [v["step"] for v in accusations(r)] == [3, 6, 9], r.verdicts
    for v in accusations(r):
        assert (v["suspect_ranks"], v["localized"], v["transient"], v["corroborated"]) == (
            [SUSPECT],
            True,
            False,
            True,
        ), v["message"]
        assert r.applied[v["step"] - 1] is False


def test_a_rank_that_sums_in_another_order_is_never_accused(
    results: dict[str, list[DrillRank]],
) -> None:
    r = agreed(results["reordered_rank"])
    assert accusations(r) == []
    assert all(r.applied)
    assert [v["classification"] for v in r.verdicts] == ["nondeterministic"]
    assert "first audit" in r.verdicts[0]["message"]
    assert r.last_clean_step[-1] == 60


def test_one_ulp_mid_run_in_a_bit_reproducible_job_is_caught(
    results: dict[str, list[DrillRank]],
) -> None:
    r = agreed(results["one_ulp_mid_run"])
    first = r.verdicts[0]
    assert (first["step"], first["suspect_ranks"], first["localized"]) == (33, [SUSPECT], True)
    assert first["evidence"]["mismatches"][0]["tolerance"] == 0.0
    assert r.last_clean_step[30] == 30


def test_a_transient_fault_is_reported_as_transient(results: dict[str, list[DrillRank]]) -> None:
    r = agreed(results["transient"])
    (v,) = r.verdicts
    assert (v["step"], v["suspect_ranks"], v["transient"], v["corroborated"]) == (
        6,
        [SUSPECT],
        True,
        True,
    )
    assert r.applied[5] is False and all(r.applied[6:])


def test_a_job_the_audit_cannot_replay_still_gets_verified_checkpoints(
    results: dict[str, list[DrillRank]],
) -> None:
    r = agreed(results["unreplayable"])
    assert accusations(r) == []
    assert all(r.applied)
    assert [v["classification"] for v in r.verdicts] == ["nondeterministic"]
    # The audit vouches for nothing here; check 3 still does, every 5 steps.
    assert r.last_clean_step[-1] == 40
