"""Check 1's flags in the last DDP bucket, where the ranks do not read the same element.

The reduced bucket's first element says whether some rank flagged; only then do the ranks
gather their own flags. SDC inside the all-reduce can hand the ranks different values
there (emulated here: rank 1's reduced element turns NaN after the all-reduce). The ranks
that saw it must not gather alone: they agree through the store first, and hold the step
back naming the all-reduce when not every rank saw it. And with check 1 off, where only
the operator-unreachable halt flag travels, a training NaN in that element is no flag.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdc_agent.launch import free_port, spawn_local

pytestmark = pytest.mark.distributed

STEPS, BAD_STEP, BAD_RANK = 5, 3, 1


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _disagree(rank: int, world: int, late: bool, corrupt: bool) -> dict[str, Any]:
    from sdc_agent import Guard, GuardConfig

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = DistributedDataParallel(net)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2, fused=True)
    config = GuardConfig(weights_every=0, replay_every=0, fingerprint_backend="eager")
    guard = Guard(ddp, optimizer, _loss, config, reporter=None)
    if late:
        guard._defer_flags = True  # what a fused optimizer on CUDA does
    flags = guard._layout.flags
    flags.agree_seconds = 2.0
    seen = flags.seen

    def corrupted(reduced: torch.Tensor) -> None:
        if rank == BAD_RANK and guard.step_count == BAD_STEP:
            reduced[:1].fill_(float("nan"))  # the collective handed this rank alone a NaN
        seen(reduced)

    if corrupt:
        flags.seen = corrupted  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(rank)
    results = []
    for _ in range(STEPS):
        batch = (torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
        results.append(guard.step(batch))
    guard.close()
    return {
        "applied": [bool(r.applied) for r in results],
        "verdicts": [
            (v.check, v.step, v.classification, v.suspect_ranks, v.localized, r.step)
            for r in results
            for v in r.verdicts
        ],
        "messages": [v.message for r in results for v in r.verdicts],
    }


@pytest.mark.parametrize("late", [False, True], ids=["now", "late"])
def test_a_flag_only_some_ranks_see_holds_their_step_without_a_hang(late: bool) -> None:
    clean = spawn_local(_disagree, ["n0", "n1", "n2"], (late, False), timeout=120)
    assert all(r == {"applied": [True] * STEPS, "verdicts": [], "messages": []} for r in clean)
    ranks = spawn_local(_disagree, ["n0", "n1", "n2"], (late, True), timeout=120)
    shown_at = BAD_STEP + 1 if late else BAD_STEP  # late: judged during the next step
    for rank, r in enumerate(ranks):
        if rank != BAD_RANK:  # they saw a finite element: the step is theirs, applied
            assert r["applied"] == [True] * STEPS
            assert r["verdicts"] == []
            continue
        assert r["applied"] == [s != BAD_STEP for s in range(1, STEPS + 1)]
        assert r["verdicts"] == [("nonfinite", BAD_STEP, "collective", (BAD_RANK,), True, shown_at)]
        assert "handed the ranks different results" in r["messages"][0]


def _halt_only(rank: int, world: int, nan: bool) -> dict[str, Any]:
    from sdc_agent import Guard, GuardConfig
    from sdc_agent.faults import FaultSpec

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = DistributedDataParallel(net)  # one bucket: the fault's element 0 is its first
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2, fused=True)
    faults = (FaultSpec(rank=BAD_RANK, step=BAD_STEP, site="grad_local", kind="nan"),)
    config = GuardConfig(
        nonfinite_check=False,
        weights_every=0,
        replay_every=0,
        fingerprint_backend="eager",
        faults=faults if nan else (),
    )
    guard = Guard(ddp, optimizer, _loss, config)  # the reporter from the environment
    assert guard._stop_when_unreachable
    g = torch.Generator().manual_seed(rank)
    results = []
    for _ in range(STEPS):
        batch = (torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
        results.append(guard.step(batch))
    guard.close(timeout=0)
    return {
        "applied": [bool(r.applied) for r in results],
        "verdicts": [v.check for r in results for v in r.verdicts],
        "finite": all(bool(torch.isfinite(p).all()) for p in net.parameters()),
    }


def test_with_check_1_off_a_training_nan_is_not_a_halt_flag() -> None:
    env = {  # the halt policy is on: a reporter, nobody listening, no verdict to deliver
        "HYPERPOD_SDC_OPERATOR_URL": f"http://127.0.0.1:{free_port()}",
        "HYPERPOD_SDC_TOKEN_FILE": "",
    }
    clean = spawn_local(_halt_only, ["n0", "n1"], (False,), env=env, timeout=120)
    assert clean == [{"applied": [True] * STEPS, "verdicts": [], "finite": True}] * 2
    ranks = spawn_local(_halt_only, ["n0", "n1"], (True,), env=env, timeout=120)
    # Check 1 is off: the NaN step is applied on every rank, as without the Guard.
    assert ranks == [{"applied": [True] * STEPS, "verdicts": [], "finite": False}] * 2
