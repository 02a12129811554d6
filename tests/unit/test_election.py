"""Who reports a verdict: a few nodes, chosen alike by every rank."""

from __future__ import annotations

from sdc_agent.election import elect_reporters
from sdc_agent.replay import plan_ring

NODES = [f"n{i}" for i in range(6) for _ in range(2)]  # 6 nodes of 2 ranks
RING = plan_ring(NODES)


def test_the_suspects_replay_partners_come_first() -> None:
    # Rank 5 (n2) is replayed by rank 7 (n3) and replays rank 3 (n1).
    assert RING[5] == 7 and RING[3] == 5
    assert elect_reporters([5], NODES, RING, 3) == ("n3", "n1", "n0")


def test_never_only_the_suspects_node_and_it_comes_last() -> None:
    nodes = ["a", "b"]
    ring = plan_ring(nodes)
    assert set(elect_reporters([0], nodes, ring, 3)) == {"a", "b"}  # only two nodes
    assert elect_reporters([0], nodes, ring, 1) == ("b",)
    assert "n2" not in elect_reporters([5], NODES, RING, 5)


def test_without_suspects_the_first_nodes_report() -> None:
    assert elect_reporters([], NODES, RING, 3) == ("n0", "n1", "n2")


def test_zero_means_every_node() -> None:
    assert elect_reporters([5], NODES, RING, 0) == tuple(f"n{i}" for i in range(6))


def test_several_suspects_on_two_nodes() -> None:
    chosen = elect_reporters([0, 11], NODES, RING, 3)
    assert len(chosen) == 3 and not {"n0", "n5"} & set(chosen)
    assert chosen == elect_reporters([11, 0], NODES, RING, 3), "order of suspects is irrelevant"
