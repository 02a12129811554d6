"""The verified snapshot under HSDP (replicate 3 x shard 2) and pure FSDP (over 6), 6 ranks
on 3 emulated nodes (``n0, n0, n1, n1, n2, n2``): a persistent fault caught at step t costs
at most one audit interval.

The job audits every 4 steps; a persistent forward fault from step 10 is caught by the audit
of step 12, when ``last_clean_step`` is 8. The healthy ranks write the snapshot of step 8 as
a DCP checkpoint from their own shards, while a node is lost (its ranks never answer the
write's roll call).

- HSDP, the fault on rank 1: rank 1's shard (shard coordinate 1) is written by a replica of
  it on another node; node n1 (ranks 2 and 3) is lost during the write, so the shard comes
  from n2's replica (rank 5), its third copy.
- Pure FSDP, the fault on rank 4: no shard has a replica; each rank's shards cross the
  network to the rank at the same local index on the next node at every take. The suspect's
  node n2 (ranks 4 and 5) is lost during the write, so both its slices are written from
  their second copies, on n0 (ranks 0 and 1). (With two copies on three nodes that is the
  only node whose loss leaves every slice a healthy holder: n0 and n1 hold the suspect's
  second copy or have theirs on it.)

Restarted from the snapshot at 6 ranks, each job ends bitwise equal to the uninterrupted
clean run; at 2 nodes x 2 ranks (HSDP 2 x 2, FSDP over 4) the loaded state equals the clean
run's at step 8, and the job ends bitwise equal to a clean run that changed size at step 8
(the clean run's own DCP checkpoint of step 8 loaded there). The clean runs write no
snapshot and accuse nobody. Both layouts share one spawn per size: each process makes two
writes at detection.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sdc_agent.launch import spawn_local

# slow: two spawns (6 and 4 ranks) of six and four short runs each
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SIX = ["n0", "n0", "n1", "n1", "n2", "n2"]
FOUR = ["n0", "n0", "n1", "n1"]
# The clean run's last step: the audit of step 12 vouches for it, and a run resumed from
# step 8 trains 4 steps past its snapshot, that audit included.
STEPS = 12
CLEAN = 8  # last_clean_step when the fault is caught
CAUGHT = 12
SUSPECT = {"hsdp": 1, "fsdp": 4}
LOST = {"hsdp": (2, 3), "fsdp": (4, 5)}  # a node's ranks, lost during the write

MODES = ("clean", "fault", "resume")
_MESHES: dict[tuple[int, ...], Any] = {}


def _mesh(layout: str, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    shape = (world // 2, 2) if layout == "hsdp" else (world,)
    names = ("replicate", "shard") if layout == "hsdp" else ("shard",)
    if shape not in _MESHES:  # each init_device_mesh makes new process groups
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[shape]


def _run(rank: int, world: int, root: str, layout: str, mode: str) -> dict[str, Any]:
    """``mode``: ``clean`` (steps 1..STEPS; the state's digest and a DCP checkpoint at
    CLEAN), ``fault`` (the persistent fault, until it is caught), ``resume`` (from the
    verified snapshot at or before CLEAN), ``resized`` (from the clean run's DCP checkpoint
    of CLEAN)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from sdc_agent import FaultSpec, Guard, GuardConfig
    from sdc_agent.checkpoint import load_dcp, save_dcp, select_checkpoint, state_digest
    from sdc_agent.snapshot import load_snapshot

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    mesh = _mesh(layout, world)
    for sub in (net[0], net[2]):
        fully_shard(sub, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    start = 0
    out: dict[str, Any] = {}
    position = {"step": 0}
    if mode == "resume":
        found = select_checkpoint(Path(root) / layout, max_step=CLEAN)
        assert found.layout == "dcp" and found.verified, found
        start, extras = load_snapshot(found.path, net, optimizer)
        assert start == found.step == CLEAN, (start, found)
        assert extras["position"] == {"step": CLEAN}
        out["loaded"] = state_digest(net, optimizer)
    elif mode == "resized":
        load_dcp(Path(root) / f"clean-{layout}-{CLEAN}", net, optimizer)
        start = CLEAN
    position["step"] = start

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(m(batch[0]), batch[1])

    faults: tuple[FaultSpec, ...] = ()
    if mode == "fault":
        faults = (
            # A small relative error in the hidden layer's whole output, at every forward
            # (the replay's too: a broken GPU).
            FaultSpec(
                rank=SUSPECT[layout],
                step=10,
                site="forward",
                kind="relative",
                persistent=True,
                target="0",
                index=None,
            ),
        )
    config = GuardConfig(
        replay_every=4,
        weights_every=4,
        fingerprint_backend="eager",
        snapshot_copies=2,
        snapshot_dir=str(Path(root) / layout),
        # The roll call waits a quarter of it for the lost node: margin for a loaded machine.
        snapshot_write_seconds=20.0,
        faults=faults,
    )
    guard = Guard(net, optimizer, loss_fn, config=config, reporter=None, start_step=start)
    guard.snapshot_state("position", lambda: dict(position))
    if start:
        guard.restore(start)
    if mode == "fault" and rank in LOST[layout]:
        snapshot = guard.snapshot
        assert snapshot is not None
        snapshot.write_at_detection = lambda *a, **k: None  # type: ignore[method-assign, assignment]
    verdicts: list[dict[str, Any]] = []
    for step in range(start + 1, STEPS + 1):
        g = torch.Generator().manual_seed(step * 101 + rank)
        x = torch.randn(8, 16, generator=g)
        position["step"] = step  # the data position: this step's batch is taken
        result = guard.step((x, x[:, :4] * 3.0))
        verdicts.extend(v.to_dict() for v in result.verdicts)
        if mode == "clean" and step == CLEAN:
            out["digest_at_clean"] = state_digest(net, optimizer)
            save_dcp(Path(root) / f"clean-{layout}-{CLEAN}", net, optimizer)
        if verdicts:
            break
    snapshot = guard.snapshot
    assert snapshot is not None
    out |= {
        "digest": state_digest(net, optimizer),
        "verdicts": verdicts,
        "last_clean_step": guard.last_clean_step,
        "snapshot_step": snapshot.step,
        "bytes_per_rank": snapshot.bytes_per_rank(),
        "state_bytes": snapshot.state_bytes(),
        "held": list(snapshot.held),
        "write": None,
    }
    if guard.snapshot_write is not None:
        w = guard.snapshot_write
        out["write"] = {
            "step": w.step,
            "path": w.path,
            "complete": w.complete,
            "writers": list(w.writers),
            "written_by": w.written_by,
            "wrote": list(w.wrote),
            "reason": w.reason,
        }
    guard.close()
    dist.barrier()
    return out


def _six(rank: int, world: int, root: str) -> dict[str, Any]:
    return {
        f"{layout}/{mode}": _run(rank, world, root, layout, mode)
        for layout in ("hsdp", "fsdp")
        for mode in MODES
    }


def _four(rank: int, world: int, root: str) -> dict[str, Any]:
    return {
        f"{layout}/{mode}": _run(rank, world, root, layout, mode)
        for layout in ("hsdp", "fsdp")
        for mode in ("resized", "resume")
    }


def test_a_persistent_fault_under_hsdp_and_fsdp_costs_one_audit_interval(
    tmp_path: Path,
) -> None:
    root = str(tmp_path)
    six = spawn_local(_six, SIX, (root,))
    for layout in ("hsdp", "fsdp"):
        clean = [r[f"{layout}/clean"] for r in six]
        fault = [r[f"{layout}/fault"] for r in six]
        same = [r[f"{layout}/resume"] for r in six]
        assert all(not r["verdicts"] for r in clean), f"{layout}: the clean run accused someone"
        assert all(r["snapshot_step"] == STEPS for r in clean)
        # Memory: HSDP keeps the rank's own shards (1 / shard of the state), FSDP its own
        # and its neighbour's (2 / world).
        share = 1 / 2 if layout == "hsdp" else 2 / len(SIX)
        assert all(r["bytes_per_rank"] <= r["state_bytes"] * share * 1.2 for r in clean), layout

        v = fault[0]["verdicts"]
        assert v and v[0]["step"] == CAUGHT and v[0]["suspect_ranks"] == [SUSPECT[layout]], v
        assert all(r["last_clean_step"] == CLEAN for r in fault)
        assert all(fault[r]["write"] is None for r in LOST[layout])  # never took part
        done = fault[0]["write"]
        assert done["complete"] and done["step"] == CLEAN, done
        if layout == "hsdp":
            assert fault[SUSPECT["hsdp"]]["write"]["wrote"] == []  # the suspect writes nothing
            assert done["writers"] == [0, 4, 5]
            # Shard 1 (the suspect's): its replica on n1 is lost, n2's (rank 5) writes it.
            assert done["written_by"] == {0: 0, 1: 5}
        else:
            assert done["writers"] == [0, 1, 2, 3]
            # n2's slices 4 (the suspect's) and 5 came over the network to n0 at each take
            # and are written from there.
            assert fault[0]["held"] == [0, 4] and fault[1]["held"] == [1, 5]
            assert done["written_by"] == {0: 0, 1: 1, 2: 2, 3: 3, 4: 0, 5: 1}
        path = Path(done["path"])
        assert path.name == f"sdc-snapshot-step_{CLEAN}"
        marker = json.loads((path.parent / (path.name + ".sdc.json")).read_text())
        assert marker == {"step": CLEAN, "verified": True}
        assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + ".sdc.json"]

        # Restarted from the snapshot at the same size: the loaded state is step 8's, and
        # the job ends bitwise equal to the uninterrupted clean run.
        assert {r["loaded"] for r in same} == {clean[0]["digest_at_clean"]}, layout
        assert all(not r["verdicts"] for r in same)
        assert {r["digest"] for r in same} == {clean[0]["digest"]}, layout

    # On 2 nodes x 2 ranks from the same snapshots (HSDP 2 x 2, FSDP over 4).
    four = spawn_local(_four, FOUR, (root,))
    for layout in ("hsdp", "fsdp"):
        clean = six[0][f"{layout}/clean"]
        resume = [r[f"{layout}/resume"] for r in four]
        resized = [r[f"{layout}/resized"] for r in four]
        assert {r["loaded"] for r in resume} == {clean["digest_at_clean"]}, layout
        assert all(not r["verdicts"] for r in resume + resized), layout
        assert {r["digest"] for r in resume} == {resized[0]["digest"]}, layout
        assert resized[0]["digest"] != clean["digest"], layout  # the size change mattered
