"""The pure decisions of the replay audit, and replay() without side effects."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import torch
from torch import nn

from sdc_agent.replay import (
    Payload,
    choose_tiebreakers,
    explain_mismatches,
    plan_ring,
    replay,
    resolve,
    storm_threshold,
)


def test_ring_shifts_by_the_ranks_per_node() -> None:
    assert plan_ring(["a", "b", "c"]) == {0: 1, 1: 2, 2: 0}
    assert plan_ring(["a", "a", "b", "b", "c", "c"]) == {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}
    # Ranks listed out of node order still go to the same local rank of the next node.
    assert plan_ring(["a", "b", "a", "b"]) == {0: 1, 2: 3, 1: 0, 3: 2}


def test_ring_never_pairs_a_node_with_itself() -> None:
    assert plan_ring(["a", "a"]) == {}
    ring = plan_ring(["a", "a", "b"])
    nodes = ["a", "a", "b"]
    assert all(nodes[p] != nodes[r] for p, r in ring.items())
    assert set(ring) != {0, 1, 2}  # uneven nodes leave someone out


RING4 = plan_ring(["n0", "n1", "n2", "n3"])  # p -> p + 1


def test_one_persistent_rank_is_in_two_mismatches() -> None:
    # Rank 2 is wrong: its own work (replayed by 3) and its replay of rank 1's work.
    e = explain_mismatches([2, 1], RING4, max_mismatches=4)
    assert (e.persistent, e.ambiguous, e.unexplained, e.storm) == ((2,), (), (), False)
    f = resolve(e, RING4, {})
    assert (f.classification, f.suspects, f.localized, f.transient) == ("rank", (2,), True, False)


def test_a_single_mismatch_needs_a_third_node() -> None:
    e = explain_mismatches([1], RING4, max_mismatches=4)
    assert e.unexplained == (1,)
    tb = choose_tiebreakers(e.unexplained, RING4, ["n0", "n1", "n2", "n3"], {1, 2})
    assert tb == {1: 0}
    # The third rank agrees with the replay: rank 1's own result was wrong, once.
    f = resolve(e, RING4, {1: "replay"})
    assert (f.suspects, f.localized, f.transient) == ((1,), True, True)
    # It agrees with rank 1: the replayer (rank 2) was wrong.
    assert resolve(e, RING4, {1: "original"}).suspects == (2,)
    # It agrees with neither: not deterministic, nobody accused.
    f = resolve(e, RING4, {1: "neither"})
    assert (f.classification, f.suspects) == ("nondeterministic", ())


def test_no_third_node_means_no_localization() -> None:
    ring = plan_ring(["a", "a", "b", "b"])  # 0 <-> 2, 1 <-> 3
    e = explain_mismatches([1, 3], ring, max_mismatches=4)
    assert e.ambiguous == (1, 3)
    f = resolve(e, ring, {})
    assert (f.suspects, f.localized, f.transient) == ((1, 3), False, None)
    assert "three nodes" in f.message
    e = explain_mismatches([0], ring, max_mismatches=4)
    assert choose_tiebreakers(e.unexplained, ring, ["a", "a", "b", "b"], {0, 2}) == {}
    assert resolve(e, ring, {}).localized is False


def test_tiebreakers_avoid_involved_ranks_and_both_nodes() -> None:
    nodes = ["n0", "n1", "n2", "n3", "n4"]
    ring = plan_ring(nodes)
    tb = choose_tiebreakers([1, 3], ring, nodes, involved={1, 2, 3, 4})
    assert tb == {1: 0}  # rank 0 is taken for the first tie; none left for the second


def test_storms_accuse_nobody() -> None:
    ring = plan_ring([f"n{i}" for i in range(8)])
    e = explain_mismatches(list(range(8)), ring, max_mismatches=storm_threshold(8))
    assert e.storm
    assert resolve(e, ring, {}).classification == "nondeterministic"
    e = explain_mismatches([0, 2, 4, 6, 7], ring, max_mismatches=4)
    assert e.storm
    assert storm_threshold(4) == 4
    assert storm_threshold(1000) == 250


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.bn(self.lin(x)))


Batch = namedtuple("Batch", "x y")


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    inner = batch["inputs"]
    assert isinstance(inner, list)
    b = inner[0]
    return ((model(b.x) - b.y) ** 2).mean()


def test_replay_reproduces_bits_and_leaves_no_trace() -> None:
    torch.manual_seed(0)
    model = TinyNet()
    batch = {"inputs": [Batch(torch.randn(8, 4), torch.randn(8, 4))], "meta": "anything"}
    payload = Payload.capture(batch, divisor=1)
    loss = loss_fn(model, batch)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    rng_after, buffers_after = torch.get_rng_state(), [b.clone() for b in model.buffers()]

    shipped = Payload.from_bytes(payload.to_bytes())
    params = list(model.parameters())
    result = replay(model, params, loss_fn, shipped, torch.device("cpu"))

    assert torch.equal(result.loss.view(torch.int32), loss.detach().view(torch.int32))
    for g, r in zip(grads, result.grads, strict=True):
        assert r is not None
        assert torch.equal(g, r)
    assert torch.equal(torch.get_rng_state(), rng_after)
    assert all(torch.equal(a, b) for a, b in zip(buffers_after, model.buffers(), strict=True))
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, params, strict=True))  # type: ignore[arg-type]
