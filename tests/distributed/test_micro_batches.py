"""Every micro-batch can be audited (issue 21): the audited index follows a permutation per
cycle of audits, so with N micro-batches each index is audited once in every N audits.

Three emulated nodes of one rank, four micro-batches per step, float32. The fault is one
only some inputs trigger: rank 1's first layer computes wrong (1e-4 relative) on the third
micro-batch of a step and on nothing else.
"""

from __future__ import annotations

import pytest

from sdc_agent.audit import audited_micro_batch
from sdc_agent.drill import Drill, DrillRank

from .drills import accusations, agreed, run_scenarios

NODES = ["n0", "n1", "n2"]
SUSPECT = 1
EVERY = 2
MICRO = 4
CONFIG = {"replay_every": EVERY, "weights_every": 1, "fingerprint_backend": "eager"}
STEPS = MICRO * EVERY + EVERY
"""Four audits to reach every micro-batch, and one more for the re-run rounds' margin."""


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7])
def test_each_micro_batch_is_audited_once_in_every_cycle(count: int) -> None:
    for cycle in range(5):
        indices = [audited_micro_batch(cycle * count + k, count) for k in range(count)]
        assert sorted(indices) == list(range(count)), (cycle, indices)
    # The same on every rank: a function of the audit's number alone.
    assert [audited_micro_batch(k, count) for k in range(12)] == [
        audited_micro_batch(k, count) for k in range(12)
    ]


@pytest.fixture(scope="module")
def results() -> dict[str, list[DrillRank]]:
    drills = {
        "marked": Drill(
            steps=STEPS, micro_batches=MICRO, config=CONFIG, marked_fault=(SUSPECT, 1, 1e-4)
        ),
        "clean": Drill(steps=STEPS, micro_batches=MICRO, config=CONFIG),
    }
    return run_scenarios(NODES, drills)


@pytest.mark.distributed
def test_a_fault_only_the_third_micro_batch_triggers_is_caught_within_four_audits(
    results: dict[str, list[DrillRank]],
) -> None:
    r = agreed(results["marked"])
    audit = next(k for k in range(MICRO) if audited_micro_batch(k, MICRO) == 2)
    first = accusations(r)[0]
    assert first["step"] == (audit + 1) * EVERY, first
    assert first["suspect_ranks"] == [SUSPECT] and first["localized"], first["message"]
    assert r.applied[first["step"] - 1] is False
    assert first["step"] <= MICRO * EVERY


@pytest.mark.distributed
def test_micro_batch_audits_of_a_clean_run_accuse_nobody(
    results: dict[str, list[DrillRank]],
) -> None:
    r = results["clean"][0]
    assert r.verdicts == [] and all(r.applied)
    assert r.replay_comparisons == 3 * (STEPS // EVERY) and r.replay_mismatches == 0
