"""The verified snapshot: a persistent fault caught at step t costs at most one audit
interval, not a checkpoint interval.

A four-node job (one rank per node) audits every 4 steps; a persistent gradient fault on
rank 1 from step 10 is caught by the audit of step 12, when ``last_clean_step`` is 8. The
healthy ranks write the snapshot of step 8 as a DCP checkpoint, rank 1's slice written by
its second holder, while node 3 is lost (it never answers the write's roll call), so its
slice is written by its second holder too. Restarted in the same processes from that
snapshot, the job is caught again and writes it a second time. Restarted from it, the job ends
bitwise equal to an uninterrupted clean run at the same world size, and, at three nodes,
to a clean run that changed size at step 8. The clean run writes nothing and accuses
nobody.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from sdc_agent.launch import spawn_local

# slow: five spawns of three or four ranks
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FOUR = ["n0", "n1", "n2", "n3"]
THREE = ["n0", "n1", "n2"]
STEPS = 16
CLEAN = 8  # last_clean_step when the fault is caught
CAUGHT = 12
SUSPECT = 1
LOST = 3  # node n3's rank: lost during the write


def _digest(net: Any) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(net.state_dict().items()):
        digest.update(name.encode() + tensor.numpy().tobytes())
    return digest.hexdigest()


def _train(rank: int, world: int, root: str, mode: str, start: int) -> dict[str, Any]:
    """``mode``: ``clean`` (steps 1..STEPS, saving step CLEAN with torch.save),
    ``fault`` (the persistent fault, until it is caught), ``resume`` (from the verified
    snapshot at or before CLEAN), ``resized`` (from the torch.save of step CLEAN)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from sdc_agent import FaultSpec, Guard, GuardConfig
    from sdc_agent.checkpoint import select_checkpoint
    from sdc_agent.snapshot import load_snapshot

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    extras: dict[str, Any] = {}
    position = {"step": start}
    if mode == "resume":
        found = select_checkpoint(root, max_step=CLEAN)
        assert found.layout == "dcp" and found.verified, found
        step, extras = load_snapshot(found.path, net, optimizer)
        assert step == found.step == start, (step, found)
        assert extras["position"] == {"step": start}
    elif mode == "resized":
        state = torch.load(Path(root) / f"clean_{CLEAN}.pt")
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    model = DistributedDataParallel(net)

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(m(batch[0]), batch[1])

    faults: tuple[FaultSpec, ...] = ()
    if mode == "fault":
        faults = (
            FaultSpec(rank=SUSPECT, step=10, site="grad_local", kind="relative", persistent=True),
        )
    elif mode == "transient":  # a glitch at an audited step: held, not applied
        faults = (FaultSpec(rank=SUSPECT, step=CAUGHT, site="grad_local", kind="relative"),)
    config = GuardConfig(
        replay_every=4,
        weights_every=4,
        fingerprint_backend="eager",
        snapshot_copies=2,
        snapshot_dir=root,
        # The roll call waits a quarter of it for the lost node: margin for a loaded machine
        # (a healthy rank that answers late is left out of the writers).
        snapshot_write_seconds=20.0,
        faults=faults,
    )
    guard = Guard(model, optimizer, loss_fn, config=config, reporter=None, start_step=start)
    guard.snapshot_state("position", lambda: dict(position))
    if start:
        guard.restore(start)
    if mode == "fault" and rank == LOST:
        snapshot = guard.snapshot
        assert snapshot is not None
        snapshot.write_at_detection = lambda *a, **k: None  # type: ignore[method-assign, assignment]
    verdicts: list[dict[str, Any]] = []

    def train_from(start: int) -> None:
        for step in range(start + 1, STEPS + 1):
            g = torch.Generator().manual_seed(step * 101 + rank)
            x = torch.randn(8, 16, generator=g)
            position["step"] = step  # the data position: this step's batch is taken
            result = guard.step((x, x[:, :4] * 3.0))
            verdicts.extend(v.to_dict() for v in result.verdicts)
            if mode == "clean" and step == CLEAN and rank == 0:
                torch.save(
                    {"model": net.state_dict(), "optimizer": optimizer.state_dict()},
                    Path(root) / f"clean_{CLEAN}.pt",
                )
            if verdicts and mode != "transient":
                break

    train_from(start)
    first_write = _written(guard.snapshot_write)
    if mode == "fault":
        # Restarted in the same processes from the snapshot just written: the fault is
        # caught again and the same snapshot written a second time (its own store keys).
        dist.barrier()  # the marker is written
        step, _ = load_snapshot(select_checkpoint(root, max_step=CLEAN).path, net, optimizer)
        position["step"] = step
        guard.restore(step)
        verdicts.clear()
        train_from(step)
    snapshot = guard.snapshot
    out = {
        "digest": _digest(net),
        "verdicts": verdicts,
        "last_clean_step": guard.last_clean_step,
        "snapshot_step": None if snapshot is None else snapshot.step,
        "bytes_per_rank": None if snapshot is None else snapshot.bytes_per_rank(),
        "state_bytes": None if snapshot is None else snapshot.state_bytes(),
        "write": _written(guard.snapshot_write),
        "first_write": first_write,
    }
    guard.close()
    return out


def _written(w: Any) -> dict[str, Any] | None:
    if w is None:
        return None
    return {
        "step": w.step,
        "path": w.path,
        "complete": w.complete,
        "writers": list(w.writers),
        "written_by": w.written_by,
        "wrote": list(w.wrote),
        "seconds": w.seconds,
        "reason": w.reason,
    }


def test_a_persistent_fault_costs_one_audit_interval(tmp_path: Path) -> None:
    root = str(tmp_path)
    clean = spawn_local(_train, FOUR, (root, "clean", 0))
    assert len({r["digest"] for r in clean}) == 1  # replicas agree
    assert all(not r["verdicts"] for r in clean), "the clean run accused someone"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"clean_{CLEAN}.pt"]  # no snapshot
    assert all(r["snapshot_step"] == STEPS for r in clean)
    # About 2 / world of the state per rank (each slice on two nodes).
    assert all(r["bytes_per_rank"] <= r["state_bytes"] * 2 / 4 * 1.2 for r in clean)

    fault = spawn_local(_train, FOUR, (root, "fault", 0))
    v = fault[0]["verdicts"]
    assert v and v[0]["step"] == CAUGHT and v[0]["suspect_ranks"] == [SUSPECT]
    assert all(r["last_clean_step"] == CLEAN for r in fault)
    for key in ("first_write", "write"):  # before and after the in-process restart
        writes = {r: fault[r][key] for r in range(4)}
        assert writes[LOST] is None  # lost: it never took part
        done = writes[0]
        assert done["complete"] and done["step"] == CLEAN, (key, done)
        assert done["writers"] == [0, 2]  # the suspect and the lost node wrote nothing
        # Slice 1 (the suspect's) and slice 3 (the lost node's): their second holders.
        assert done["written_by"] == {0: 0, 1: 2, 2: 2, 3: 0}
        assert writes[SUSPECT]["wrote"] == []
    path = Path(done["path"])
    assert path.name == f"sdc-snapshot-step_{CLEAN}"
    marker = json.loads((path.parent / (path.name + ".sdc.json")).read_text())
    assert marker == {"step": CLEAN, "verified": True}

    same = spawn_local(_train, FOUR, (root, "resume", CLEAN))
    assert all(not r["verdicts"] for r in same)
    assert {r["digest"] for r in same} == {clean[0]["digest"]}

    resized = spawn_local(_train, THREE, (root, "resized", CLEAN))
    resumed = spawn_local(_train, THREE, (root, "resume", CLEAN))
    assert len({r["digest"] for r in resized}) == 1
    assert {r["digest"] for r in resumed} == {resized[0]["digest"]}
    assert resized[0]["digest"] != clean[0]["digest"]  # the size change mattered


def test_a_transient_fault_writes_nothing_and_holds_nothing(tmp_path: Path) -> None:
    root = str(tmp_path)
    ranks = spawn_local(_train, FOUR, (root, "transient", 0))
    v = ranks[0]["verdicts"]
    assert v and v[0]["step"] == CAUGHT and v[0]["transient"] is True, v
    assert all(r["write"] is None for r in ranks)  # no snapshot, so no restart from one
    assert list(tmp_path.iterdir()) == []
    assert all(r["last_clean_step"] == STEPS for r in ranks)  # training went on, clean
