"""No collective of the Guard's own on the per-step path: on a step that is neither an audit
(check 2) nor a check-3 step, a guarded DDP job makes exactly the collectives plain DDP
makes, its buckets' all-reduces: check 1's flags ride in the last bucket.

Collectives are counted by the process groups themselves (each group's sequence number,
which every collective it runs advances, whatever issued it: Python, DDP's reducer or the
agent), summed over every group that exists, around each step. A non-finite local
gradient on one rank is still named at its own step (the ranks gather their flags then,
off the common path) and never applied.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdc_agent.launch import spawn_local

pytestmark = pytest.mark.distributed

NODES = ["node-a", "node-b", "node-c"]
STEPS = 22
WEIGHTS_EVERY = 10  # the default: steps 10 and 20 run check 3
COMMON = [s for s in range(1, STEPS + 1) if s % WEIGHTS_EVERY]  # 20 steps
FAULT_RANK, FAULT_STEP = 1, 7


def _collectives() -> int:
    import torch.distributed as dist

    groups = dist.distributed_c10d._world.pg_map
    return sum(g._get_sequence_number_for_group() for g in groups)  # type: ignore[attr-defined]


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _run(rank: int, guarded: bool, fault: bool) -> dict[str, Any]:
    from sdc_agent import Guard, GuardConfig
    from sdc_agent.faults import FaultSpec

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.002)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-2, fused=True)
    faults = (
        (FaultSpec(rank=FAULT_RANK, step=FAULT_STEP, site="grad_local", kind="nan"),)
        if fault
        else ()
    )
    # The defaults (check 1, check 3 every 10 steps, an audit every 50), no operator.
    config = GuardConfig(fingerprint_backend="eager", faults=faults)
    assert (config.weights_every, config.replay_every) == (WEIGHTS_EVERY, 50)
    guard = Guard(ddp, optimizer, _loss, config, reporter=None) if guarded else None
    g = torch.Generator().manual_seed(rank)
    per_step: dict[int, int] = {}
    verdicts = []
    applied = {}
    for step in range(1, STEPS + 1):
        batch = (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
        before = _collectives()
        if guard is None:
            optimizer.zero_grad(set_to_none=True)
            _loss(ddp, batch).backward()
            optimizer.step()
        else:
            result = guard.step(batch)
            verdicts += [
                (v.check, v.step, v.classification, v.suspect_ranks) for v in result.verdicts
            ]
            applied[step] = bool(result.applied)
        per_step[step] = _collectives() - before
    if guard is not None:
        guard.close()
    return {
        "per_step": per_step,
        "verdicts": verdicts,
        "applied": applied,
        "weights": [p.detach().numpy().tobytes() for p in net.parameters()],
    }


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "plain": _run(rank, False, False),
        "guarded": _run(rank, True, False),
        "fault": _run(rank, True, True),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return spawn_local(_worker, NODES)


def test_clean_steps_make_exactly_the_buckets_all_reduces(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        plain, guarded = r["plain"]["per_step"], r["guarded"]["per_step"]
        # DDP's first step uses its initial bucket, the second rebuilds them (two more
        # collectives), then each step all-reduces its buckets: several here.
        assert all(plain[s] == plain[STEPS] > 1 for s in range(3, STEPS + 1)), plain
        assert [guarded[s] for s in COMMON] == [plain[s] for s in COMMON], guarded
        # Check 3's steps have their exchange (collectives the guarded job does make).
        assert all(guarded[s] > plain[s] for s in range(WEIGHTS_EVERY, STEPS + 1, WEIGHTS_EVERY))
        assert r["guarded"]["verdicts"] == []
        assert all(r["guarded"]["applied"].values())
        assert r["guarded"]["weights"] == r["plain"]["weights"]  # bit for bit


def test_a_non_finite_rank_is_named_at_its_step_and_its_flags_gathered_then_only(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        fault, plain = r["fault"], r["plain"]["per_step"]
        assert fault["verdicts"] == [("nonfinite", FAULT_STEP, "rank", (FAULT_RANK,))]
        assert fault["applied"] == {s: s != FAULT_STEP for s in range(1, STEPS + 1)}
        # The flags are gathered at that step (with the replay on another node), at no other.
        assert fault["per_step"][FAULT_STEP] > plain[FAULT_STEP]
        others = [s for s in COMMON if s != FAULT_STEP]
        assert [fault["per_step"][s] for s in others] == [plain[s] for s in others]
