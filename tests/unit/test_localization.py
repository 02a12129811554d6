"""The pure decisions of checks 1 and 3."""

from __future__ import annotations

import pytest

from sdc_agent.nonfinite import classify_nonfinite
from sdc_agent.topology import Topology
from sdc_agent.weights import split_majority


def test_all_finite_is_no_finding() -> None:
    assert classify_nonfinite([False] * 4, [False] * 4) is None


def test_one_rank_before_the_allreduce_is_that_rank() -> None:
    f = classify_nonfinite([False, True, False], [True, True, True])
    assert f is not None
    assert (f.classification, f.suspects, f.localized) == ("rank", (1,), True)


def test_several_but_not_all_ranks_are_each_suspect() -> None:
    f = classify_nonfinite([True, False, True, False], [True] * 4)
    assert f is not None and f.suspects == (0, 2)


def test_every_rank_is_a_training_problem_not_hardware() -> None:
    f = classify_nonfinite([True] * 3, [True] * 3)
    assert f is not None
    assert (f.classification, f.suspects, f.localized) == ("training", (), False)


def test_only_after_the_allreduce_is_the_collective() -> None:
    f = classify_nonfinite([False] * 4, [False, False, True, False])
    assert f is not None
    assert (f.classification, f.suspects, f.localized) == ("collective", (2,), True)
    f = classify_nonfinite([False] * 4, [True] * 4)
    assert f is not None
    assert (f.classification, f.suspects, f.localized) == ("collective", (), False)


def test_flag_lists_must_match() -> None:
    with pytest.raises(ValueError, match="one flag per rank"):
        classify_nonfinite([False], [False, False])


def test_majority() -> None:
    assert split_majority(["a", "a", "a"]) is None
    s = split_majority(["a", "b", "a", "a"])
    assert s is not None and (s.suspects, s.localized, s.reference) == ((1,), True, 0)
    s = split_majority(["b", "a", "a"])
    assert s is not None and (s.suspects, s.localized, s.reference) == ((0,), True, 1)


def test_two_replicas_that_differ_name_both_and_cannot_tell() -> None:
    s = split_majority(["a", "b"])
    assert s is not None and (s.suspects, s.localized) == ((0, 1), False)


def test_an_even_split_names_everyone() -> None:
    s = split_majority(["a", "a", "b", "b"])
    assert s is not None and (s.suspects, s.localized) == ((0, 1, 2, 3), False)


def test_a_plurality_without_majority_is_not_localized() -> None:
    s = split_majority(["a", "a", "b", "c", "d"])
    assert s is not None and (s.suspects, s.localized) == ((2, 3, 4), False)


def test_topology_groups_ranks_by_node() -> None:
    t = Topology.from_nodes(["n0", "n0", "n1", "n1", "n2"])
    assert t.nodes == ("n0", "n1", "n2")
    assert [r.local_rank for r in t.ranks] == [0, 1, 0, 1, 0]
    assert t.local_world_size("n1") == 2
    assert t.nodes_of([3, 2, 4]) == ("n1", "n2")


def test_split_by_class_compares_each_shard_across_its_replicas_only() -> None:
    from sdc_agent.weights import split_by_class

    # HSDP 3 x 2: ranks 0, 2, 4 hold replicas of shard 0; 1, 3, 5 of shard 1. Shards differ
    # from each other by nature: that is no mismatch.
    classes = [0, 1, 0, 1, 0, 1]
    assert split_by_class(["a", "b", "a", "b", "a", "b"], classes) is None
    found = split_by_class(["a", "b", "x", "b", "a", "b"], classes)
    assert found is not None
    split, references = found
    assert (split.suspects, split.localized, references) == ((2,), True, {0: 0})
    # Two replicas of a shard cannot name the wrong one.
    found = split_by_class(["a", "b", "x", "b"], [0, 1, 0, 1])
    assert found is not None
    assert (found[0].suspects, found[0].localized) == ((0, 2), False)
    # Pure FSDP: every rank its own class, nothing is ever compared.
    assert split_by_class(["a", "b", "c"], [0, 1, 2]) is None
