"""The checks under FSDP2 (``fully_shard`` over one mesh dimension) and HSDP (a 2-D mesh,
replicate 3 x shard 2), on real gloo process groups: 6 ranks on 3 emulated nodes.

Each layout runs its scenarios in one spawn (a module-scoped world per layout). Ranks are
consecutive on their node (``n0, n0, n1, n1, n2, n2``), so in HSDP each replica group is
one node and the replicas of a shard are on three different nodes. The clean run with every
check every step trains 6 steps (the update check's 4 slices and two more); the long clean
runs train 10 steps here (2 audit intervals, every slice of the update check twice) and 200
in ``bench/clean_runs.py``, which runs the same test at that length (results in
bench/results). A clean run that names somebody or trains differently from its unguarded
twin does so from its first audit on, which both lengths include.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from sdc_agent.audit import audited_micro_batch
from sdc_agent.drill import MARKED, Drill, DrillRank
from sdc_agent.faults import FaultSpec
from sdc_agent.launch import spawn_local

from . import drills

# slow: two worlds of six ranks (set-up 27 s HSDP, 59 s FSDP, loaded, before the runs were cut)
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

NODES = ["n0", "n0", "n1", "n1", "n2", "n2"]
EVERY_STEP = {"weights_every": 1, "replay_every": 0, "fingerprint_backend": "eager"}
AUDIT = {"weights_every": 1, "replay_every": 1, "fingerprint_backend": "eager"}
# The clean run with every check every step: one round of the update check's 4 slices and
# two more steps.
CLEAN_STEPS = 6
# The long clean runs: check 3 (HSDP) or the update check (FSDP) every step, an audit every
# 5 steps (2 audits and 12 replay comparisons in the suite; 40 and 240 in the bench).
LONG_STEPS = drills.clean_steps(10)
LONG_REPLAY_EVERY = 5
LONG = {"weights_every": 1, "replay_every": LONG_REPLAY_EVERY, "fingerprint_backend": "eager"}
# A small relative error in a whole hidden layer's output (4.0001 instead of 4.0000).
FORWARD_ERROR: dict[str, Any] = {"target": "3", "index": None}
# Gradient accumulation, an audit every step: the faulty runs train two cycles of audits
# over 3 micro-batches (the first in order, the second shuffled), so every micro-batch is
# audited twice, and every comparison but the suspect's is asserted bit for bit; the clean
# run and its unguarded twin train the first cycle (every micro-batch audited once).
MICRO = 3
MICRO_STEPS = 2 * MICRO
MICRO_CLEAN_STEPS = MICRO
MICRO_START = MICRO + 1
MARKED_SUSPECT = 3


def fault(rank: int, step: int, site: str, kind: str, **kw: Any) -> FaultSpec:
    return FaultSpec(rank=rank, step=step, site=site, kind=kind, **kw)  # type: ignore[arg-type]


def scenarios(layout: str) -> dict[str, Drill]:
    def drill(**kw: Any) -> Drill:
        return Drill(layout=layout, **kw)

    out = {
        "clean": drill(steps=CLEAN_STEPS, config=AUDIT),
        "plain": drill(steps=CLEAN_STEPS, guarded=False),
        "long_clean": drill(steps=LONG_STEPS, config=LONG),
        "long_plain": drill(steps=LONG_STEPS, guarded=False),
    }
    # Gradient accumulation both ways a loop does it under FSDP2: one reduce-scatter after
    # the last micro-batch (set_requires_gradient_sync(False) before, what Guard.step does;
    # no fault, and unguarded) and one after every micro-batch ("syncing"); in both, a fault
    # only the third micro-batch's inputs trigger, from the second cycle of audits on.
    for mode, sync in (("accumulation", False), ("accumulation_syncing", True)):
        micro = {"steps": MICRO_STEPS, "micro_batches": MICRO, "sync_micro_batches": sync}
        if not sync:
            one_cycle = {**micro, "steps": MICRO_CLEAN_STEPS}
            out[f"{mode}_clean"] = drill(**one_cycle, config=AUDIT)
            out[f"{mode}_plain"] = drill(**one_cycle, guarded=False)
        out[f"{mode}_marked"] = drill(
            **micro, marked_fault=(MARKED_SUSPECT, MICRO_START, 1e-4), config=AUDIT
        )
    out |= {
        "grad_local_nan": drill(steps=5, faults=(fault(3, 3, "grad_local", "nan"),), config=AUDIT),
        "grad_reduced_nan": drill(
            steps=6, faults=(fault(2, 5, "grad_reduced", "nan"),), config=EVERY_STEP
        ),
        "forward_persistent": drill(
            steps=5,
            faults=(fault(1, 3, "forward", "relative", persistent=True, **FORWARD_ERROR),),
            config=AUDIT,
        ),
        "forward_transient": drill(
            steps=5, faults=(fault(1, 4, "forward", "relative", **FORWARD_ERROR),), config=AUDIT
        ),
    }
    # Faults in the weights or optimizer state after the update: HSDP's check 3 compares
    # each shard across its replicas; pure FSDP's update check recomputes slice
    # (step // weights_every) % 4 of every shard on two other nodes (element 0 is in
    # slice 0: steps 4, 8, ... at weights_every=1 and the default update_slices=4).
    out |= {
        "weights_bitflip": drill(
            steps=6, faults=(fault(2, 4, "weights", "bitflip", bit=9),), config=EVERY_STEP
        ),
        "optimizer_state_bitflip": drill(
            steps=6,
            faults=(fault(4, 4, "weights", "bitflip", bit=9, target="3.weight:exp_avg"),),
            config=EVERY_STEP,
        ),
        "weights_outside_the_slice": drill(
            steps=6, faults=(fault(2, 5, "weights", "bitflip", bit=9),), config=EVERY_STEP
        ),
        # The same wrong update at step 5 with update_slices=1: every check recomputes the
        # whole update, so it is named at its step.
        "weights_whole_update": drill(
            steps=6,
            faults=(fault(2, 5, "weights", "bitflip", bit=9),),
            config={**EVERY_STEP, "update_slices": 1},
        ),
        "weights_persistent": drill(
            steps=8,
            faults=(fault(1, 5, "weights", "relative", persistent=True),),
            config=EVERY_STEP,
        ),
        # Corrupted at step 6, between the checks of steps 4 and 8.
        "weights_between_checks": drill(
            steps=8,
            faults=(fault(5, 6, "weights", "relative"),),
            config={**EVERY_STEP, "weights_every": 4},
        ),
    }
    if layout == "hsdp":
        # HSDP has no update check (check 3 compares whole shards every step), so
        # update_slices changes nothing there: this run would be weights_outside_the_slice
        # bit for bit (see SAME_RUN).
        del out["weights_whole_update"]
    else:
        for name in HSDP_ONLY:
            del out[name]
    return out


HSDP_ONLY = ("forward_persistent", "forward_transient")
"""A forward fault caught by the replay, persistent or transient: the layouts' replay is
one code path (FSDP2's unsharded parameters; the mesh has one dimension or two), so HSDP
alone runs these. Under pure FSDP the replay still names a persistent forward fault
(``accumulation_marked``, ``accumulation_syncing_marked``), and the suspect's own
recomputation calls a one-step fault transient (``grad_local_nan``)."""


# Scenarios that are the same run in a layout, by name -> the name of the run that stands
# for them.
SAME_RUN = {"hsdp": {"weights_whole_update": "weights_outside_the_slice"}, "fsdp": {}}


# name -> (check, step, classification, suspects, transient); None: nothing is caught
Expected = tuple[str, int, str, tuple[int, ...], bool | None] | None
COMMON: dict[str, Expected] = {
    "grad_local_nan": ("nonfinite", 3, "rank", (3,), True),
    "grad_reduced_nan": ("nonfinite", 5, "collective", (2,), None),
    "forward_persistent": ("replay", 3, "rank", (1,), False),
    "forward_transient": ("replay", 4, "rank", (1,), True),
}
EXPECTED: dict[str, dict[str, Expected]] = {
    "hsdp": {
        **COMMON,
        "weights_bitflip": ("weights", 4, "replica", (2,), None),
        "optimizer_state_bitflip": ("weights", 4, "replica", (4,), None),
        "weights_outside_the_slice": ("weights", 5, "replica", (2,), None),
        "weights_whole_update": ("weights", 5, "replica", (2,), None),
        "weights_persistent": ("weights", 5, "replica", (1,), None),
        "weights_between_checks": ("weights", 8, "replica", (5,), None),
    },
    "fsdp": {
        **{name: want for name, want in COMMON.items() if name not in HSDP_ONLY},
        # The update check: a wrong update in the slice checked at its step is named there.
        "weights_bitflip": ("weights", 4, "rank", (2,), None),
        "optimizer_state_bitflip": ("weights", 4, "rank", (4,), None),
        # Its documented gaps: another slice is checked at step 5 (a transient wrong update
        # of element 0 there is missed); a persistent one is caught when slice 0 comes
        # round again (step 8); a weight corrupted between checks is recomputed from as it
        # is (missed).
        "weights_outside_the_slice": None,
        # update_slices=1: the whole update at every check, so the same fault is named.
        "weights_whole_update": ("weights", 5, "rank", (2,), None),
        "weights_persistent": ("weights", 8, "rank", (1,), None),
        "weights_between_checks": None,
    },
}


@pytest.fixture(scope="module", params=["hsdp", "fsdp"])
def world(request: pytest.FixtureRequest) -> tuple[str, dict[str, list[DrillRank]]]:
    layout = request.param
    results = drills.run_scenarios(NODES, scenarios(layout))
    return layout, results | {name: results[run] for name, run in SAME_RUN[layout].items()}


def agreed(ranks: list[DrillRank]) -> DrillRank:
    r = drills.agreed(ranks)
    assert all(o.last_clean_step == r.last_clean_step for o in ranks[1:])
    return r


def mesh_coordinates(layout: str, rank: int) -> dict[str, int]:
    if layout == "hsdp":
        return {"replicate": rank // 2, "shard": rank % 2}
    return {"shard": rank}


def test_clean_runs_name_nobody_and_train_bitwise_like_plain_fsdp(
    world: tuple[str, dict[str, list[DrillRank]]],
) -> None:
    layout, results = world
    for name, steps in (("clean", CLEAN_STEPS), ("accumulation_clean", MICRO_CLEAN_STEPS)):
        r = agreed(results[name])
        assert r.verdicts == [], name
        assert all(r.applied)
        assert r.replay_mismatches == 0
        # Every comparison bit for bit, the rotated micro-batches' included.
        assert r.bit_reproducible is True, name
        assert r.replay_comparisons == len(NODES) * steps, name
        assert r.last_clean_step == list(range(1, steps + 1)), name
    for guarded, plain in (("clean", "plain"), ("accumulation_clean", "accumulation_plain")):
        assert [r.final_fingerprint for r in results[guarded]] == [
            r.final_fingerprint for r in results[plain]
        ], guarded
    # (With accumulation the guarded loop averages its losses in float32, the plain one
    # in Python floats: only the unaccumulated losses compare bit for bit.)
    assert results["clean"][0].losses == results["plain"][0].losses
    assert agreed(results["clean"]).last_clean_step == list(range(1, CLEAN_STEPS + 1))
    # HSDP: the three replicas of each shard end alike; FSDP: every rank its own shard.
    shards = {r.final_fingerprint for r in results["clean"]}
    assert len(shards) == (2 if layout == "hsdp" else len(NODES))


def test_long_clean_runs_name_nobody_and_train_bitwise_like_plain_fsdp(
    world: tuple[str, dict[str, list[DrillRank]]], record_property: drills.RecordProperty
) -> None:
    """10 steps here, 200 in bench/clean_runs.py (issue 26's length): the same assertions."""
    layout, results = world
    r = agreed(results["long_clean"])
    drills.trained(record_property, f"{layout}_long_clean", r)
    drills.trained(record_property, f"{layout}_long_plain", agreed(results["long_plain"]))
    assert r.verdicts == []
    assert r.applied == [True] * LONG_STEPS
    # The audit vouches for its own steps: last_clean_step reaches each audited step and
    # holds there until the next audit.
    every = LONG_REPLAY_EVERY
    audited = [s for s, c in enumerate(r.last_clean_step, 1) if c == s]
    assert len(audited) == LONG_STEPS // every
    assert all(b - a == every for a, b in itertools.pairwise(audited))
    assert r.last_clean_step == [
        max((a for a in audited if a <= s), default=0) for s in range(1, LONG_STEPS + 1)
    ]
    assert r.replay_mismatches == 0
    assert r.replay_comparisons == len(NODES) * len(audited)
    for guarded, plain in zip(results["long_clean"], results["long_plain"], strict=True):
        assert guarded.final_fingerprint == plain.final_fingerprint, (layout, guarded.rank)
        assert guarded.losses == plain.losses, (layout, guarded.rank)
    # Training moved the weights: the comparison is not of two untouched models.
    assert results["long_clean"][0].final_fingerprint != results["clean"][0].final_fingerprint


@pytest.mark.parametrize("name", sorted(EXPECTED["hsdp"]))
def test_fault_is_caught_at_its_step_and_rank(
    world: tuple[str, dict[str, list[DrillRank]]], name: str
) -> None:
    layout, results = world
    if name not in EXPECTED[layout]:
        pytest.skip(f"{name}: run under HSDP only (see HSDP_ONLY)")
    expected = EXPECTED[layout][name]
    r = agreed(results[name])
    if expected is None:
        assert r.verdicts == [], f"{name}: outside what the {layout} checks cover"
        assert all(r.applied)
        return
    check, step, classification, suspects, transient = expected
    assert r.verdicts, f"{name}: nothing caught"
    v = r.verdicts[0]
    assert (v["check"], v["step"], v["classification"]) == (check, step, classification)
    assert tuple(v["suspect_ranks"]) == suspects
    assert v["suspect_nodes"] == sorted({NODES[s] for s in suspects})
    assert v["evidence"]["layout"] == layout
    assert v["evidence"]["mesh_coordinates"] == {
        str(s): mesh_coordinates(layout, s) for s in suspects
    }
    if check != "weights":
        assert v["transient"] is transient
        # The corrupted step is held back.
        assert r.applied[step - 1] is False
        assert r.last_clean_step[step - 1] == step - 1
    else:
        # Check 3 and the update check see a step once it was applied: no later step is
        # clean until a restore.
        assert v["localized"] and v["corroborated"]
        assert r.last_clean_step[-1] < step
    assert all(x["step"] >= step for x in r.verdicts)


@pytest.mark.parametrize("mode", ["accumulation", "accumulation_syncing"])
def test_a_fault_only_a_later_micro_batch_triggers_is_named_at_its_turn(
    world: tuple[str, dict[str, list[DrillRank]]], mode: str
) -> None:
    """The audited micro-batch rotates under FSDP2 and HSDP as under DDP: the replay of
    the third micro-batch compares its own gradients (read as its backward hands them to FSDP's
    unsharded parameters, before FSDP adds them to the earlier micro-batches')."""
    layout, results = world
    r = agreed(results[f"{mode}_marked"])
    # An audit every step: the k-th audit (from 0) is step k + 1.
    turn = next(
        step
        for step in range(MICRO_START, MICRO_STEPS + 1)
        if audited_micro_batch(step - 1, MICRO) == MARKED
    )
    assert r.verdicts, "nothing caught"
    v = r.verdicts[0]
    assert (v["check"], v["step"], v["classification"]) == ("replay", turn, "rank")
    assert (v["suspect_ranks"], v["localized"], v["transient"]) == ([MARKED_SUSPECT], True, False)
    assert v["evidence"]["mesh_coordinates"] == {
        str(MARKED_SUSPECT): mesh_coordinates(layout, MARKED_SUSPECT)
    }
    # Before it, the same run audited every micro-batch (the marked one at step 3, before
    # the fault began) and named nobody; the step it was named at is held back.
    assert all(r.applied[: turn - 1])
    # Only the two comparisons that involve the suspect at its turn differed (its work,
    # and its replay of its partner's marked micro-batch): every other, at every
    # micro-batch's turn, bit for bit.
    assert r.replay_comparisons == len(NODES) * MICRO_STEPS
    assert r.replay_mismatches == 2
    assert r.bit_reproducible is True
    assert r.applied[turn - 1] is False
    assert r.last_clean_step[turn - 1] == turn - 1
    assert all(x["step"] >= turn for x in r.verdicts)


def test_the_update_check_recomputes_the_slice_its_setting_says(
    world: tuple[str, dict[str, list[DrillRank]]],
) -> None:
    layout, results = world
    if layout != "fsdp":
        pytest.skip("HSDP compares replicas: update_slices applies to pure FSDP only")
    v = agreed(results["weights_bitflip"]).verdicts[0]
    assert v["evidence"]["update_check"]["slices"] == 4
    assert v["evidence"]["update_check"]["slice"] == 0  # (step 4 // 1) % 4
    assert "slice 0 of 4" in v["message"]
    whole = agreed(results["weights_whole_update"]).verdicts[0]
    assert (
        whole["evidence"]["update_check"]["slice"],
        whole["evidence"]["update_check"]["slices"],
    ) == (0, 1)
    assert "slice 0 of 1" in whole["message"]


def test_what_check_one_says_about_a_sharded_collective(
    world: tuple[str, dict[str, list[DrillRank]]],
) -> None:
    layout, results = world
    local = agreed(results["grad_local_nan"]).verdicts[0]
    reduced = agreed(results["grad_reduced_nan"]).verdicts[0]
    collective = "reduce-scatter and all-reduce" if layout == "hsdp" else "reduce-scatter"
    assert f"before the {collective}" in local["message"]
    assert local["evidence"]["nonfinite_before_allreduce"] == [3]
    assert f"{collective} inputs were finite" in reduced["message"]
    assert reduced["evidence"]["nonfinite_after_collective"] == [2]
    assert reduced["evidence"]["gradient_collective"] == collective


def _refusals(rank: int, world: int) -> list[str]:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from sdc_agent import Guard, GuardConfig
    from sdc_agent.errors import ConfigError

    messages = []
    config = GuardConfig(fingerprint_backend="eager")
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    tp_model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    parallelize_module(tp_model, mesh["tp"], {"0": ColwiseParallel()})
    fully_shard(tp_model, mesh=mesh["dp"])
    narrow = nn.Sequential(nn.Linear(4, 2))
    fully_shard(narrow, mesh=mesh["dp"])  # one of the two ranks
    # Pipeline stages: each rank its own stage, FSDP over a dimension of one rank.
    pp_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
    stage = nn.Sequential(nn.Linear(4, 2))
    fully_shard(stage, mesh=pp_mesh["dp"])
    # Two meshes over the same ranks, one per fully_shard call.
    two_meshes = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(two_meshes[0], mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("a",)))
    fully_shard(two_meshes, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("b",)))
    # Per-parameter meshes (experts sharded over their own, smaller mesh): one fully_shard,
    # two parameter groups.
    dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    ep_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ep", "edp"))
    experts = FSDPMeshInfo(ep_mesh["edp"], 0)
    grouped = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    expert_params = set(grouped[1].parameters())
    fully_shard(
        grouped,
        mesh=dp,
        shard_placement_fn=lambda p: (
            ShardPlacementResult(placement=Shard(0), mesh_info=experts)
            if p in expert_params
            else None
        ),
    )
    for model in (tp_model, narrow, stage, two_meshes, grouped):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            Guard(model, optimizer, None, config, reporter=None)
        except ConfigError as exc:
            messages.append(str(exc))
        else:
            messages.append("accepted")
    return messages


def test_layouts_it_cannot_guard_are_refused_naming_the_dimension() -> None:
    tp, narrow, stage, two_meshes, grouped = spawn_local(_refusals, ["n0", "n1"])[0]
    assert tp.startswith("model: parameter '0.weight' is also sharded over mesh dimension 'tp'")
    assert "tensor- or pipeline-parallel" in tp
    assert narrow.startswith(
        "model: the FSDP mesh ('dp',) spans 1 of 2 ranks; the other ranks belong to mesh "
        "dimension 'tp'"
    ), narrow
    assert stage.startswith(
        "model: the FSDP mesh ('dp',) spans 1 of 2 ranks; the other ranks belong to mesh "
        "dimension 'pp'"
    ), stage
    assert two_meshes.startswith(
        "model: fully_shard was given different meshes for different modules"
    ), two_meshes
    assert grouped.startswith("model: the root module has 2 FSDP parameter groups"), grouped
