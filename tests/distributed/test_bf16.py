"""The replay audit under bf16 autocast with kernels that are not bit-reproducible (issue 21).

Six ranks on three nodes, an MLP of three layers under CPU autocast in bfloat16, and
run-to-run noise at the upper end of what such kernels show, emulated in torch from a
seeded generator per process (every computation draws afresh, so an original and its
replay differ, yet every run of this file draws the same noise):

- forward noise: ±1 bf16 ulp in 1 % of the middle layer's outputs (split-K GEMMs);
- backward noise: ±1 to 4 bf16 ulp in 10 % of the middle layer's weight gradient
  (atomics).

Faults are in every element of the middle layer's output on one rank, from step 11,
with an audit every 5 steps: named within two audit intervals (by step 20).

The same for the GPT-2 from ``transformers`` (three blocks, width 32), with the noise and
the faults in the middle block's MLP (its output; its first projection's weight gradient),
and under its forward noise faults of 1 and 2 ulp, which name no healthy rank. Under that
forward noise the 1e-3 fault (one ulp in every element there) is named by the MLP's output
kind (``outputs:transformer.h.1.mlp``), at noise seed 2 and at seed 3, where no loss or
gradient kind separated it (``bench/fault_sweep.py`` has seeds 2 to 8).

Under gradient accumulation (4 micro-batches), a fault only the third micro-batch's inputs
trigger (1e-3 relative in every output of the first layer, one rank, from step 21, in the
second, shuffled cycle of audits) is caught at the first audit whose turn that micro-batch
is (step 35), within 4 audit intervals of its start.

The clean runs under each noise train 40 steps here (8 audits: the noise learned at the
first, the re-audits, verified steps after each) and 200 in ``bench/clean_runs.py``, which runs
these same tests at that length (``HYPERPOD_SDC_LONG_CLEAN_RUNS=1``; its results are in
bench/results).
"""

from __future__ import annotations

from typing import Any

import pytest

from sdc_agent.audit import REAUDITS, audited_micro_batch
from sdc_agent.drill import GPT2_MIDDLE, MARKED, Drill, DrillRank
from sdc_agent.faults import FaultSpec

from .drills import RecordProperty, accusations, agreed, clean_steps, run_scenarios, trained

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

NODES = ["n0", "n0", "n1", "n1", "n2", "n2"]
SUSPECT = 2
EVERY = 5
CONFIG = {"replay_every": EVERY, "weights_every": 0, "fingerprint_backend": "eager"}
"""The weight check off: it changes nothing the audit sees, and last_clean_step then
follows the audit alone."""
FORWARD: dict[str, Any] = {"forward_noise": 0.01}
BACKWARD: dict[str, Any] = {"grad_noise": True, "grad_noise_fraction": 0.1, "grad_noise_ulps": 4}
NOISE: dict[str, dict[str, Any]] = {"forward": FORWARD, "backward": BACKWARD}
FAULTS: dict[str, dict[str, Any]] = {
    "ulp8": {"kind": "ulp", "ulps": 8},
    "rel1e-3": {"kind": "relative", "relative_error": 1e-3},
}
START = 11
MICRO = 4
MICRO_START = 21
"""After the first cycle of audits (in order): the fault's turn comes in a shuffled one."""
MICRO_STEPS = MICRO_START - 1 + MICRO * EVERY
CLEAN_STEPS = clean_steps(40)
"""The clean runs under each noise: 8 audit intervals in the suite, 200 steps in the bench."""


MODELS: dict[str, dict[str, Any]] = {"mlp": {}, "gpt2": {"model": "gpt2", "width": 32}}
TARGETS = {"mlp": "3", "gpt2": GPT2_MIDDLE}
SMALL: dict[str, dict[str, Any]] = {
    "ulp1": {"kind": "ulp", "ulps": 1},
    "ulp2": {"kind": "ulp", "ulps": 2},
}
"""Faults the size of the GPT-2's forward noise, whose audits see healthy pairs differ above
the bf16 cap too: bench/fault_sweep.py --model gpt2 named four healthy ranks (2 ulp) and a
healthy one beside the faulty (1 ulp) before such pairs were left unaccused (Recheck.crowded)."""


def fault(target: str = "3", **kw: Any) -> tuple[FaultSpec, ...]:
    return (
        FaultSpec(
            rank=SUSPECT,
            step=START,
            site="forward",
            target=target,
            index=None,
            persistent=True,
            **kw,
        ),
    )


SCENARIOS: dict[str, Drill] = {}
for noise_name, noise in NOISE.items():
    SCENARIOS[f"{noise_name}_clean"] = Drill(
        steps=CLEAN_STEPS, autocast=True, config=CONFIG, noise_seed=1, **noise
    )
    for fault_name, kw in FAULTS.items():
        SCENARIOS[f"{noise_name}_{fault_name}"] = Drill(
            steps=20, autocast=True, config=CONFIG, faults=fault(**kw), noise_seed=2, **noise
        )
for noise_name, noise in NOISE.items():
    gpt2 = {**MODELS["gpt2"], **noise, "autocast": True, "config": CONFIG}
    SCENARIOS[f"gpt2_{noise_name}_clean"] = Drill(steps=CLEAN_STEPS, noise_seed=1, **gpt2)
    for fault_name, kw in FAULTS.items():
        SCENARIOS[f"gpt2_{noise_name}_{fault_name}"] = Drill(
            steps=20, faults=fault(TARGETS["gpt2"], **kw), noise_seed=2, **gpt2
        )
gpt2_forward = {**MODELS["gpt2"], **FORWARD, "autocast": True, "config": CONFIG}
for fault_name, kw in SMALL.items():
    SCENARIOS[f"gpt2_forward_{fault_name}"] = Drill(
        steps=20, faults=fault(TARGETS["gpt2"], **kw), noise_seed=2, **gpt2_forward
    )
# The GPT-2's 1e-3 fault under its forward noise at a seed where no loss or gradient kind
# separated it (seeds 3, 4 and 5 before the output kinds; bench/fault_sweep.py has 2 to 8).
FORWARD_FAULT_SEEDS = (3,)
for seed in FORWARD_FAULT_SEEDS:
    SCENARIOS[f"gpt2_forward_rel1e-3_seed{seed}"] = Drill(
        steps=20,
        faults=fault(TARGETS["gpt2"], **FAULTS["rel1e-3"]),
        noise_seed=seed,
        **gpt2_forward,
    )
# The GPT-2's forward noise at other seeds, no fault: 20 steps each (bench/fault_sweep.py's
# clean runs, seeds 2 to 8), where healthy pairs differ above the bf16 cap at some audits.
# The seeds where the yes/no rule named a healthy rank within 20 steps (sdc_agent.replay.
# strength forced to "strong": at step 15 at seed 2, at step 5 at seed 3, at step 20 at seed
# 6; seeds 1, 4, 5, 7 and 8 named nobody in 40 steps under it). Seed 3's is step 5, before
# the fault of gpt2_forward_rel1e-3_seed3 begins, whose test names nobody but the faulty
# rank: that run guards it. These seeds were found on this machine's kernels: elsewhere
# other seeds may be the ones that misfire, so bench/fault_sweep.py keeps seeds 2 to 8.
CLEAN_SEEDS = (2, 6)
for seed in CLEAN_SEEDS:
    SCENARIOS[f"gpt2_forward_clean_seed{seed}"] = Drill(steps=20, noise_seed=seed, **gpt2_forward)
# Gradient accumulation: a fault that only the third micro-batch triggers, and no fault.
for noise_name, noise in NOISE.items():
    SCENARIOS[f"{noise_name}_micro"] = Drill(
        steps=MICRO_STEPS,
        micro_batches=MICRO,
        autocast=True,
        config=CONFIG,
        marked_fault=(SUSPECT, MICRO_START, 1e-3),
        noise_seed=3,
        **noise,
    )
SCENARIOS["backward_micro_clean"] = Drill(
    steps=MICRO_STEPS, micro_batches=MICRO, autocast=True, config=CONFIG, noise_seed=3, **BACKWARD
)
# Randomness outside torch's generators (a private generator): nothing can be replayed.
SCENARIOS["unreplayable"] = Drill(steps=10, autocast=True, noise=0.1, config=CONFIG)
# One ulp in every output of the middle layer, once, on an audited step of a job whose
# replays are bit for bit (float32, no emulated noise).
SCENARIOS["transient_one_ulp"] = Drill(
    steps=12,
    config=CONFIG,
    faults=(FaultSpec(rank=SUSPECT, step=10, site="forward", kind="ulp", target="3", index=None),),
)


IN_A_ROW = "audits in a row"
"""What a verdict named on weak evidence repeated says (sdc_agent.audit)."""


def assert_weak_repeats_uncorroborated(r: DrillRank) -> None:
    """A rank named on weak separations repeated is named but not corroborated: the operator
    quarantines nothing until the node is caught again or confirmed."""
    for v in accusations(r):
        if IN_A_ROW in v["message"]:
            assert v["corroborated"] is False, v["message"]


@pytest.fixture(scope="module")
def results() -> dict[str, list[DrillRank]]:
    """Every scenario in one spawn: six processes import torch (and transformers, for the
    GPT-2) once for the file, not once per group."""
    return run_scenarios(NODES, SCENARIOS)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("noise", list(NOISE))
def test_bf16_noise_alone_names_nobody_and_keeps_verifying(
    results: dict[str, list[DrillRank]], noise: str, model: str, record_property: RecordProperty
) -> None:
    """40 steps here, 200 in bench/clean_runs.py (issue 21's length): the same assertions."""
    scenario = f"{noise}_clean" if model == "mlp" else f"gpt2_{noise}_clean"
    r = agreed(results[scenario])
    trained(record_property, scenario, r)
    assert accusations(r) == [], [v["message"] for v in r.verdicts]
    assert len(r.applied) == CLEAN_STEPS
    assert sum(r.applied) >= 0.99 * len(r.applied)
    assert not any("cannot verify" in v["message"] for v in r.verdicts)
    # Reported once: the noise learned at the first audit.
    assert [v["classification"] for v in r.verdicts] == ["nondeterministic"]
    assert r.bit_reproducible is False
    # The audit keeps vouching: verified checkpoints follow the audits.
    assert r.last_clean_step[-1] >= len(r.applied) - EVERY


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("noise", list(NOISE))
@pytest.mark.parametrize("kind", list(FAULTS))
def test_a_fault_in_every_output_of_a_layer_is_named_within_two_intervals(
    results: dict[str, list[DrillRank]], noise: str, kind: str, model: str
) -> None:
    r = agreed(results[f"{noise}_{kind}" if model == "mlp" else f"gpt2_{noise}_{kind}"])
    assert all(v["step"] >= START for v in accusations(r)), "named before the fault began"
    (first, *_) = accusations(r)
    assert first["step"] <= START - 1 + 2 * EVERY, "not named within two audit intervals"
    assert (first["suspect_ranks"], first["localized"]) == ([SUSPECT], True), first["message"]
    assert first["evidence"]["evidence_kinds"], "the kind of evidence that accused is named"
    for v in accusations(r):  # later audits too: never a healthy rank
        assert v["suspect_ranks"] == [SUSPECT], (v["step"], v["suspect_ranks"], v["message"])
    assert_weak_repeats_uncorroborated(r)
    if (model, noise, kind) == ("gpt2", "forward", "rel1e-3"):
        assert_named_by_the_layers_output(first)
    assert r.applied[first["step"] - 1] is False
    assert all(r.applied[: START - 1]), "no step before the fault was held back"


def assert_named_by_the_layers_output(v: dict[str, Any]) -> None:
    """A fault of one ulp in every element of the GPT-2's middle MLP's output, under noise
    of one ulp in 1 % of them: the loss and the gradients cannot tell them apart, the
    output of that MLP (and its block's) can, within the cap (named; corroborated only
    where some kind's difference passed the cap too, as at seeds 2 and 6)."""
    kinds = v["evidence"]["evidence_kinds"]
    assert f"outputs:{GPT2_MIDDLE}" in kinds, kinds


@pytest.mark.parametrize("seed", FORWARD_FAULT_SEEDS)
def test_a_relative_fault_at_the_forward_noises_size_is_named_by_its_layers_output(
    results: dict[str, list[DrillRank]], seed: int
) -> None:
    """At the first audit after it began, right rank, that step held back; nobody named
    before it began, and never a healthy rank."""
    r = agreed(results[f"gpt2_forward_rel1e-3_seed{seed}"])
    (first, *_) = accusations(r)
    assert all(v["suspect_ranks"] == [SUSPECT] for v in accusations(r)), r.verdicts
    assert (first["step"], first["localized"]) == (START - 1 + EVERY, True), first["message"]
    assert_named_by_the_layers_output(first)
    assert r.applied[first["step"] - 1] is False
    assert all(r.applied[: START - 1])


@pytest.mark.parametrize("kind", list(SMALL))
def test_no_healthy_rank_is_named_where_noise_reaches_the_faults_size(
    results: dict[str, list[DrillRank]], kind: str
) -> None:
    """Under the GPT-2's forward noise, gradient differences between healthy ranks pass
    the bf16 cap at some audits; with a 1 or 2 ulp fault beside them, pairs on every node
    differ and no third node is free to tell them apart: nobody is named on them, and the
    fault is named alone, localized, where an audit separates it."""
    r = agreed(results[f"gpt2_forward_{kind}"])
    for v in accusations(r):
        assert v["suspect_ranks"] == [SUSPECT], (v["step"], v["suspect_ranks"], v["message"])
    assert_weak_repeats_uncorroborated(r)
    (first, *_) = accusations(r)
    assert first["step"] <= START - 1 + 2 * EVERY and first["localized"], first["message"]
    assert r.applied[first["step"] - 1] is False


@pytest.mark.parametrize("seed", list(CLEAN_SEEDS))
def test_noise_that_reaches_past_the_cap_names_no_healthy_rank_at_any_seed(
    results: dict[str, list[DrillRank]], seed: int
) -> None:
    """Under the GPT-2's forward noise a third node's replay can 'agree' with one side of a
    healthy pair and 'disagree' with the other at just past the cap: by yes/no agreement
    that named a healthy rank at seeds 2, 3 and 6 (seed 3's run is the fault run's first
    ten steps). Judged by how far it is from each side (sdc_agent.replay.strength), with
    weak separations named only when the re-audit repeats them on the same rank alone,
    nobody is named."""
    r = agreed(results[f"gpt2_forward_clean_seed{seed}"])
    assert accusations(r) == [], [v["message"] for v in r.verdicts]
    assert all(r.applied)
    assert not any("cannot verify" in v["message"] for v in r.verdicts)


def test_randomness_outside_torchs_generators_is_named_as_the_cause(
    results: dict[str, list[DrillRank]],
) -> None:
    r = agreed(results["unreplayable"])
    assert accusations(r) == []
    assert all(r.applied)
    (v,) = r.verdicts
    assert v["classification"] == "nondeterministic"
    assert "cannot verify" in v["message"]
    assert "randomness outside torch's generators" in v["message"]
    assert "loss cannot tell a fault from noise" in v["message"], "which kind failed and why"
    assert "bfloat16" in v["message"]


def test_a_transient_one_ulp_forward_fault_in_a_bit_reproducible_job_is_named(
    results: dict[str, list[DrillRank]],
) -> None:
    r = agreed(results["transient_one_ulp"])
    (v,) = r.verdicts
    assert (v["step"], v["suspect_ranks"], v["localized"], v["transient"]) == (
        10,
        [SUSPECT],
        True,
        True,
    ), v["message"]
    assert r.applied[9] is False and all(r.applied[10:])


@pytest.mark.parametrize("noise", list(NOISE))
def test_a_fault_only_one_micro_batch_triggers_is_caught_at_its_turn(
    results: dict[str, list[DrillRank]], noise: str
) -> None:
    r = agreed(results[f"{noise}_micro"])
    # Audits at EVERY, 2 EVERY, ...: the first after the fault began whose turn the marked
    # micro-batch is (every rank derives the same index from the audit's number).
    audits = [(k, (k + 1) * EVERY) for k in range(MICRO_STEPS // EVERY)]
    turn = next(
        step
        for k, step in audits
        if step >= MICRO_START and audited_micro_batch(k, MICRO) == MARKED
    )
    assert turn <= MICRO_START - 1 + MICRO * EVERY
    assert all(v["step"] >= MICRO_START for v in accusations(r)), "named before the fault began"
    (first, *_) = accusations(r)
    # At that audit, or at one of the re-audits that follow it (the same micro-batch
    # index, the next steps) where that audit's third nodes separated the rank only weakly
    # (sdc_agent.replay.strength): the "4 x replay_every plus the re-run audits".
    assert turn <= first["step"] <= turn + REAUDITS, (first["step"], turn, first["message"])
    assert (first["suspect_ranks"], first["localized"]) == ([SUSPECT], True), first["message"]
    assert_weak_repeats_uncorroborated(r)
    assert r.applied[first["step"] - 1] is False
    assert all(r.applied[: turn - 1]), "no step before it was held back"


def test_rotating_micro_batch_audits_of_a_clean_run_name_nobody(
    results: dict[str, list[DrillRank]],
) -> None:
    r = agreed(results["backward_micro_clean"])
    assert accusations(r) == [], [v["message"] for v in r.verdicts]
    assert all(r.applied)
    assert not any("cannot verify" in v["message"] for v in r.verdicts)
    assert r.replay_comparisons == len(NODES) * (MICRO_STEPS // EVERY)
    assert r.last_clean_step[-1] == MICRO_STEPS
