"""The verified snapshot's pure parts: who keeps which slice, its settings, its size."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sdc_agent import GuardConfig
from sdc_agent.errors import ConfigError
from sdc_agent.snapshot import Snapshot, holders_of, load_snapshot
from sdc_agent.topology import Topology


def test_every_slice_is_kept_on_two_nodes() -> None:
    topo = Topology.from_nodes(["a", "a", "b", "b", "c", "c"])
    holders = holders_of(topo, 2)
    assert holders == [[0, 2], [1, 3], [2, 4], [3, 5], [4, 0], [5, 1]]
    for h in holders:
        assert len(set(topo.nodes_of(h))) == 2
    assert holders_of(topo, 3)[0] == [0, 2, 4]
    assert holders_of(Topology.from_nodes(["a", "b", "c", "d"]), 2)[3] == [3, 0]


def test_settings() -> None:
    c = GuardConfig()
    assert c.snapshot_copies == 0  # off by default
    assert (c.snapshot_memory_fraction, c.snapshot_write_seconds, c.snapshot_dir) == (
        0.5,
        20.0,
        None,
    )
    env = {
        "HYPERPOD_SDC_SNAPSHOT_COPIES": "2",
        "HYPERPOD_SDC_SNAPSHOT_MEMORY_FRACTION": "0.25",
        "HYPERPOD_SDC_SNAPSHOT_WRITE_SECONDS": "10",
        "HYPERPOD_SDC_SNAPSHOT_DIR": "/fsx/ckpt",
    }
    c = GuardConfig.from_env(env)
    assert (c.snapshot_copies, c.snapshot_memory_fraction) == (2, 0.25)
    assert (c.snapshot_write_seconds, c.snapshot_dir) == (10.0, "/fsx/ckpt")
    assert "snapshot_copies" in c.agreed()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"snapshot_copies": -1}, "snapshot_copies"),
        ({"snapshot_copies": 1.5}, "snapshot_copies"),
        ({"snapshot_memory_fraction": 0}, "snapshot_memory_fraction"),
        ({"snapshot_memory_fraction": 1.5}, "snapshot_memory_fraction"),
        ({"snapshot_write_seconds": 0}, "snapshot_write_seconds"),
        ({"snapshot_dir": ""}, "snapshot_dir"),
    ],
)
def test_bad_settings_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}:"):
        GuardConfig(**kwargs)  # type: ignore[arg-type]


def test_bad_environment_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="^HYPERPOD_SDC_SNAPSHOT_COPIES:"):
        GuardConfig.from_env({"HYPERPOD_SDC_SNAPSHOT_COPIES": "two"})
    with pytest.raises(ConfigError, match="^HYPERPOD_SDC_SNAPSHOT_WRITE_SECONDS:"):
        GuardConfig.from_env({"HYPERPOD_SDC_SNAPSHOT_WRITE_SECONDS": "-1"})


def _snapshot(nodes: list[str], rank: int, copies: int, available: int | None) -> Snapshot:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 4))
    return Snapshot(
        module=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        topology=Topology.from_nodes(nodes),
        group_rank=rank,
        group=None,
        comm_device=torch.device("cpu"),
        copies=copies,
        memory_fraction=0.5,
        write_seconds=10.0,
        directory=None,
        run_id="t",
        available=available,
    )


def test_size_and_fall_back() -> None:
    nodes = ["a", "b", "c", "d"]
    big = 1 << 40
    snap = _snapshot(nodes, 0, 2, big)
    total = snap.state_bytes()
    assert total == (16 * 64 + 64 + 64 * 4 + 4) * 4
    # About 2 / world of the state per rank.
    assert abs(snap.bytes_per_rank() - total * 2 / 4) <= total * 0.05
    with pytest.warns(RuntimeWarning, match="keeping 1 copy"):
        short = _snapshot(nodes, 0, 2, int(snap.bytes_per_rank() * 2 * 0.7))
    assert short.copies == 1
    with pytest.warns(RuntimeWarning, match="snapshots off"):
        assert _snapshot(nodes, 0, 2, 10).copies == 0
    with pytest.raises(ConfigError, match="^snapshot_copies: 3 copies need as many nodes"):
        _snapshot(["a", "b"], 0, 3, big)


def test_a_copy_is_of_the_step_it_was_taken_at() -> None:
    snap = _snapshot(["a"], 0, 1, 1 << 40)
    module = snap.module
    snap.take(3)
    kept = {k: v.clone() for k, v in snap._buffers.items()}
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)  # the next steps change the live state, not the copy
    assert all(torch.equal(snap._buffers[k], v) for k, v in kept.items())
    assert snap.step == 3
    assert callable(load_snapshot)
