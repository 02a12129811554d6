"""bench/generator.py's placement of the agents: the shared processes dealt out in turn,
each node set apart in a process of its own at niceness 0, every node placed once."""

from __future__ import annotations

from bench.generator import placement


def test_without_nodes_apart_node_i_lives_in_process_i_mod_processes() -> None:
    plan, where = placement(10, 4, 19, [])
    assert [nice for _, nice in plan] == [19] * 4
    assert where == [(i % 4, i // 4) for i in range(10)]


def test_each_node_apart_has_a_process_of_its_own_at_niceness_0() -> None:
    plan, where = placement(10, 3, 19, [4, 7, 4, 12])  # a repeat and an unknown node dropped
    assert plan[-2:] == [([4], 0), ([7], 0)]
    assert [nice for _, nice in plan[:-2]] == [19] * 3
    assert sorted(node for mine, _ in plan for node in mine) == list(range(10))
    for node in range(10):
        process, local = where[node]
        assert plan[process][0][local] == node
    assert where[4] == (3, 0) and where[7] == (4, 0)


def test_fewer_nodes_than_processes_leave_no_process_empty() -> None:
    plan, where = placement(3, 8, 0, [1])
    assert plan == [([0], 0), ([2], 0), ([1], 0)]
    assert where == [(0, 0), (2, 0), (1, 0)]
