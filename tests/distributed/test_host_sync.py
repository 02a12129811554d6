"""No host sync on the per-step path: over 20 guarded steps the agent reads no tensor on
the host (CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``: every
``Tensor.item``, ``tolist``, ``__bool__``, ``__float__`` and ``__int__`` called from the
agent's own code is counted).

Two ways of reading a step's flags are run: the CPU's, where the gloo all-reduce has put
every rank's flags in host memory before the optimizer step, and the one a fused optimizer
on CUDA takes (the step is held back on the device; its flags go to host memory behind it
and are judged during the next step's checks), forced here on the CPU. In both, a step with
a non-finite gradient on one rank is caught at its own step, is never applied, and the
run ends with the same weights; a clean run is bitwise plain DDP.
"""

from __future__ import annotations

import hashlib
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdc_agent.launch import spawn_local

pytestmark = pytest.mark.distributed

NODES = ["node-a", "node-b", "node-c"]
READS = ("item", "tolist", "__bool__", "__float__", "__int__")
WARMUP, COUNTED = 3, 20
FAULT_RANK, FAULT_STEP = 1, 9
WEIGHTS_EVERY, WEIGHTS_STEP = 5, 10


@contextmanager
def _counting_host_reads() -> Iterator[Counter[str]]:
    counts: Counter[str] = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name: str, original: Any) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if "sdc_agent" in caller:
                counts[f"{name} in {caller.rsplit('/', 1)[-1]}"] += 1
            return original(self, *args, **kwargs)

        return read

    for name, original in saved.items():
        setattr(torch.Tensor, name, counted(name, original))
    try:
        yield counts
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _run(
    rank: int,
    guarded: bool,
    late: bool,
    fault: str | None,
    weights_every: int = 0,
    snapshot_dir: str | None = None,
) -> dict[str, Any]:
    from sdc_agent import Guard, GuardConfig
    from sdc_agent.faults import FaultSpec

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.001)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-2, fused=True)
    faults = {
        None: (),
        "nan": (FaultSpec(rank=FAULT_RANK, step=FAULT_STEP, site="grad_local", kind="nan"),),
        "weights": (FaultSpec(rank=0, step=WEIGHTS_STEP, site="weights", kind="bitflip", bit=9),),
    }[fault]
    # The per-step path: check 1 and the hook (the periodic checks have their own steps).
    snapshots = {"snapshot_copies": 2, "snapshot_dir": snapshot_dir} if snapshot_dir else {}
    config = GuardConfig(
        weights_every=weights_every,
        replay_every=0,
        fingerprint_backend="eager",
        faults=faults,
        **snapshots,  # type: ignore[arg-type]
    )
    guard = Guard(ddp, optimizer, _loss, config, reporter=None) if guarded else None
    if guard is not None and late:
        # What the Guard does on CUDA: a fused optimizer's flags are judged during the next
        # step, and check 3's exchange overlaps the next step's forward and backward.
        guard._defer_flags = True
        guard._weight_check.overlap = True
    g = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
        for _ in range(WARMUP + COUNTED)
    ]
    results = []
    reads: Counter[str] = Counter()
    for i, batch in enumerate(batches):
        if guard is None:
            optimizer.zero_grad(set_to_none=True)
            _loss(ddp, batch).backward()
            optimizer.step()
            continue
        if i < WARMUP:
            results.append(guard.step(batch))
            continue
        with _counting_host_reads() as counts:
            results.append(guard.step(batch))
        reads += counts
    if guard is not None:
        guard.close()
    digest = hashlib.sha256()
    for p in net.parameters():
        digest.update(p.detach().numpy().tobytes())
    return {
        "reads": dict(reads),
        "weights": digest.hexdigest(),
        "verdicts": [
            (v.check, v.step, v.classification, v.suspect_ranks, r.step)
            for r in results
            for v in r.verdicts
        ],
        "applied": [r.applied for r in results],
        "last_clean_step": guard.last_clean_step if guard is not None else None,
        "snapshot": (
            (guard.snapshot_write.step, guard.snapshot_write.complete)
            if guard is not None and guard.snapshot_write is not None
            else None
        ),
    }


def _worker(rank: int, world_size: int, snapshots: str) -> dict[str, Any]:
    runs: dict[str, tuple[bool, bool, str | None, int] | tuple[bool, bool, str, int, str]] = {
        "plain": (False, False, None, 0),
        "clean": (True, False, None, 0),
        "clean_late": (True, True, None, 0),
        "fault": (True, False, "nan", 0),
        "fault_late": (True, True, "nan", 0),
        "weights_clean": (True, False, None, WEIGHTS_EVERY),
        "weights_clean_late": (True, True, None, WEIGHTS_EVERY),
        "weights_fault": (True, False, "weights", WEIGHTS_EVERY),
        "weights_fault_late": (True, True, "weights", WEIGHTS_EVERY),
        # The verified snapshot, written at a check-3 verdict found now or a step late.
        "snapshot_now": (True, False, "weights", WEIGHTS_EVERY, f"{snapshots}/now"),
        "snapshot_late": (True, True, "weights", WEIGHTS_EVERY, f"{snapshots}/late"),
    }
    return {name: _run(rank, *how) for name, how in runs.items()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_local(_worker, NODES, (str(tmp_path_factory.mktemp("snapshots")),))


@pytest.mark.parametrize("name", ["clean", "clean_late"])
def test_no_host_read_per_step_and_bitwise_plain_ddp(
    ranks: list[dict[str, Any]], name: str
) -> None:
    for r in ranks:
        assert r[name]["reads"] == {}, f"host reads during {COUNTED} steps: {r[name]['reads']}"
        assert r[name]["verdicts"] == []
        assert r[name]["weights"] == r["plain"]["weights"]
        assert r[name]["last_clean_step"] == WARMUP + COUNTED


def test_a_step_whose_flags_are_read_late_is_caught_at_its_step_and_never_applied(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        now, late = r["fault"], r["fault_late"]
        # (check, step, classification, suspects, the step whose result shows it)
        assert [v[:4] for v in now["verdicts"]] == [("nonfinite", FAULT_STEP, "rank", (1,))]
        assert now["verdicts"][0][4] == FAULT_STEP
        assert [v[:4] for v in late["verdicts"]] == [v[:4] for v in now["verdicts"]]
        assert late["verdicts"][0][4] == FAULT_STEP + 1  # judged during the next step
        for run in (now, late):
            assert run["applied"] == [s != FAULT_STEP for s in range(1, WARMUP + COUNTED + 1)]
            assert run["last_clean_step"] == WARMUP + COUNTED
        # The held-back step is the same step either way: the same weights at the end.
        assert late["weights"] == now["weights"] != r["clean"]["weights"]


def test_check_3_overlapped_with_the_next_step_holds_that_step_back_on_a_mismatch(
    ranks: list[dict[str, Any]],
) -> None:
    steps = range(1, WARMUP + COUNTED + 1)
    last_check = (WARMUP + COUNTED) // WEIGHTS_EVERY * WEIGHTS_EVERY
    for r in ranks:
        clean, clean_late = r["weights_clean"], r["weights_clean_late"]
        for run in (clean, clean_late):
            assert run["verdicts"] == []
            assert run["weights"] == r["plain"]["weights"]
            assert run["last_clean_step"] == last_check
        now, late = r["weights_fault"], r["weights_fault_late"]
        assert [v[:4] for v in now["verdicts"]] == [("weights", WEIGHTS_STEP, "replica", (0,))]
        assert [v[:4] for v in late["verdicts"]] == [v[:4] for v in now["verdicts"]]
        assert (now["verdicts"][0][4], late["verdicts"][0][4]) == (WEIGHTS_STEP, WEIGHTS_STEP + 1)
        # Overlapped, the step after a check is not applied until the check has passed:
        # diverged weights fail every later check too (reported once), each holding its next.
        held = {s + 1 for s in range(WEIGHTS_STEP, WARMUP + COUNTED, WEIGHTS_EVERY)}
        assert now["applied"] == [True for _ in steps]
        assert late["applied"] == [s not in held for s in steps]
        assert now["last_clean_step"] == late["last_clean_step"] == WEIGHTS_STEP - WEIGHTS_EVERY


def test_a_verdict_found_a_step_late_still_writes_the_verified_snapshot(
    ranks: list[dict[str, Any]],
) -> None:
    # On CUDA check 3's verdict comes during the next step (late verdicts); the snapshot
    # the operator is told to wait for is written all the same (it was not, before).
    clean = WEIGHTS_STEP - WEIGHTS_EVERY
    for r in ranks:
        assert r["snapshot_now"]["snapshot"] == (clean, True)
        assert r["snapshot_late"]["snapshot"] == (clean, True)


def _cuda_worker(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    from sdc_agent import Guard, GuardConfig

    torch.cuda.set_device(0)
    group = dist.new_group(backend="nccl")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).cuda()
    ddp = DistributedDataParallel(net, device_ids=[0], process_group=group)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-2, fused=True)
    config = GuardConfig(weights_every=0, replay_every=0, fingerprint_backend="eager")
    guard = Guard(ddp, optimizer, _loss, config, reporter=None)
    g = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randn(8, 16, generator=g).cuda(), torch.randn(8, 4, generator=g).cuda())
        for _ in range(WARMUP + COUNTED)
    ]
    for batch in batches[:WARMUP]:
        guard.step(batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches[WARMUP:]:
            guard.step(batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    guard.close()
    return {"last_clean_step": guard.last_clean_step}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")
def test_no_host_sync_on_cuda_over_20_steps() -> None:
    (result,) = spawn_local(_cuda_worker, ["node-a"])
    assert result["last_clean_step"] == WARMUP + COUNTED
