"""The pure decisions of the replay audit, and replay() without side effects."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch
from torch import nn

from sdc_agent.audit import REAUDITS, audit_turn, audited_micro_batch
from sdc_agent.errors import SDCError
from sdc_agent.replay import (
    NOISE_MULTIPLE,
    SEPARATION_RATIO,
    WEAK_AUDITS,
    Payload,
    Recheck,
    RngState,
    choose_thirds,
    explain_mismatches,
    free_in,
    judge,
    named_on_repeat,
    plan_ring,
    replay,
    resolve,
    storm_threshold,
    strength,
    suspects_by_kind,
)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7])
def test_each_micro_batch_is_audited_once_in_every_cycle(count: int) -> None:
    for cycle in range(6):
        indices = [audited_micro_batch(cycle * count + k, count) for k in range(count)]
        assert sorted(indices) == list(range(count)), (cycle, indices)
    # The first cycle in order: the first audit replays the first micro-batch.
    assert [audited_micro_batch(k, count) for k in range(count)] == list(range(count))
    # A function of the audit's number and the shared seed alone: the same on every rank.
    assert [audited_micro_batch(k, count) for k in range(30)] == [
        audited_micro_batch(k, count) for k in range(30)
    ]


def test_later_cycles_are_shuffled() -> None:
    cycles = {tuple(audited_micro_batch(c * 4 + k, 4) for k in range(4)) for c in range(1, 9)}
    assert len(cycles) > 1


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
    # The recheck of rank 2's work: rank 0 (a third node) agrees with the replay, and
    # rank 2 reproduces its own wrong result.
    third = choose_thirds([2], RING4, ["n0", "n1", "n2", "n3"], {1, 2, 3})
    assert third == {2: 0}
    recheck = Recheck(
        owner=2,
        replayer=3,
        third=0,
        third_agrees_original=False,
        third_agrees_replay=True,
        rerun_reproduces=True,
        rereplay_reproduces=True,
    )
    assert judge(recheck) == ("owner", 2, False)
    f = resolve(e, [recheck])
    assert (f.classification, f.suspects, f.localized, f.transient, f.corroborated) == (
        "rank",
        (2,),
        True,
        False,
        True,
    )


def _recheck(**kw: Any) -> Recheck:
    base: dict[str, Any] = {
        "owner": 1,
        "replayer": 2,
        "third": 0,
        "third_agrees_original": False,
        "third_agrees_replay": True,
        "rerun_reproduces": True,
        "rereplay_reproduces": True,
    }
    return Recheck(**{**base, **kw})


def test_a_single_mismatch_is_rechecked_on_a_third_node() -> None:
    e = explain_mismatches([1], RING4, max_mismatches=4)
    assert e.unexplained == (1,)
    # The third node agrees with the replay and rank 1's own rerun is right: a glitch.
    f = resolve(e, [_recheck(rerun_reproduces=False)])
    assert (f.suspects, f.localized, f.transient, f.corroborated) == ((1,), True, True, True)
    # It agrees with rank 1's original: the replayer (rank 2) was wrong, and reproduces it.
    f = resolve(e, [_recheck(third_agrees_original=True, third_agrees_replay=False)])
    assert (f.suspects, f.transient) == ((2,), False)
    # It agrees with neither side, or with both: not one GPU; nobody accused.
    for kw in ({"third_agrees_replay": False}, {"third_agrees_original": True}):
        f = resolve(e, [_recheck(**kw)])
        assert (f.classification, f.suspects, f.corroborated) == ("nondeterministic", (), None)


def test_no_third_node_means_no_localization() -> None:
    ring = plan_ring(["a", "a", "b", "b"])  # 0 <-> 2, 1 <-> 3
    e = explain_mismatches([1, 3], ring, max_mismatches=4)
    assert e.ambiguous == (1, 3)
    f = resolve(e, [])
    assert (f.suspects, f.localized, f.transient, f.corroborated) == ((1, 3), False, None, False)
    assert "three nodes" in f.message
    e = explain_mismatches([0], ring, max_mismatches=4)
    assert choose_thirds(e.unexplained, ring, ["a", "a", "b", "b"], {0, 2}) == {}
    no_third = _recheck(owner=0, replayer=2, third=None, third_agrees_original=None)
    assert resolve(e, [no_third]).localized is False


def test_pairs_no_free_third_node_can_tell_apart_accuse_nobody() -> None:
    # Three nodes (0 1 | 2 3 | 4 5): rank 2 faulty (pairs 0-2, 2-4) and noise above the
    # tolerance between healthy ranks (1-3, 4-0, 5-1). Every rank on a third node is in a
    # rechecked pair, so none is left to tell the sides apart: naming the pairs' ranks
    # would name healthy ones (four of the five, as the GPT-2 under forward noise did).
    nodes = ["n0", "n0", "n1", "n1", "n2", "n2"]
    ring = plan_ring(nodes)
    e = explain_mismatches([0, 1, 4], ring, max_mismatches=storm_threshold(6))
    assert (e.persistent, e.unexplained, e.storm) == ((0,), (1,), False)
    owners = [0, 1, 2, 5]
    assert choose_thirds(owners, ring, nodes, {0, 1, 2, 3, 4, 5}) == {}
    crowded = [
        _recheck(owner=q, replayer=ring[q], third=None, third_agrees_original=None, crowded=True)
        for q in (0, 1)
    ]
    f = resolve(e, crowded)
    assert (f.classification, f.suspects, f.localized) == ("unseparated", (), False)
    assert "0 and 2" in f.message and "no hardware is accused" in f.message
    # Without a third node in the ring at all (two nodes), the pair is still named.
    assert resolve(e, [_recheck(owner=0, replayer=2, third=None)]).suspects == (0, 2)


def test_a_crowded_pair_never_hides_what_a_free_third_separated() -> None:
    # The same ring: rank 2 faulty, its work's recheck had a free third (rank 1) that
    # agreed with the replay; the noise pair 1-3 had none. Rank 2 is named alone, the
    # crowded pair names nobody, and the message says so.
    nodes = ["n0", "n0", "n1", "n1", "n2", "n2"]
    ring = plan_ring(nodes)
    e = explain_mismatches([0, 1, 2], ring, max_mismatches=storm_threshold(6))
    localized = _recheck(owner=2, replayer=4, third=1)
    crowded = _recheck(owner=1, replayer=3, third=None, third_agrees_original=None, crowded=True)
    f = resolve(e, [localized, crowded])
    assert (f.classification, f.suspects, f.localized, f.corroborated) == (
        "rank",
        (2,),
        True,
        True,
    )
    assert "1 and 3" in f.message and "accuse nobody" in f.message
    # A third the crowded pair's noise made a neither-nor: still nobody (noise).
    neither = _recheck(owner=2, replayer=4, third=1, third_agrees_replay=False)
    assert resolve(e, [neither, crowded]).classification == "nondeterministic"


def test_a_rank_rechecked_in_other_kinds_serves_as_third_where_it_is_no_suspect() -> None:
    # Rank 2's work differs in the loss (kind 0) and a layer (kind 1); noise in kind 1
    # alone puts both ranks of node n0 in rechecked pairs (owner 1 -> 3, owner 4 -> 0).
    # Without the kinds there is no third for rank 2 at all; with them, rank 0 or 1
    # replays it, and separates it in the loss, where neither is a suspect.
    nodes = ["n0", "n0", "n1", "n1", "n2", "n2"]
    ring = plan_ring(nodes)
    owners = [1, 2, 4]
    involved = {0, 1, 2, 3, 4}
    assert choose_thirds(owners, ring, nodes, involved).get(2) is None
    flagged = {0: [0, 2], 1: [0, 1, 2, 4]}
    third = choose_thirds(owners, ring, nodes, involved, flagged)
    t = third[2]
    assert nodes[t] == "n0"
    by_kind = suspects_by_kind(owners, ring, flagged)
    assert free_in(t, 0, by_kind) and not free_in(t, 1, by_kind)
    # Where a rank is free everywhere it is preferred, as without the kinds.
    assert choose_thirds([2], ring, nodes, {0, 2, 4}, {0: [0, 2]}) == choose_thirds(
        [2], ring, nodes, {0, 2, 4}
    )


def test_thirds_avoid_both_nodes_and_prefer_uninvolved_ranks() -> None:
    nodes = ["n0", "n1", "n2", "n3", "n4"]
    ring = plan_ring(nodes)
    # Owners 1 and 3 (replayed by 2 and 4): never those four; rank 0 is free for both.
    assert choose_thirds([1, 3], ring, nodes, involved={1, 2, 3, 4}) == {1: 0, 3: 0}
    # A rank in an explained mismatch is used when nothing else is on a third node.
    assert choose_thirds([1], plan_ring(nodes[:3]), nodes[:3], involved={0, 1, 2}) == {1: 0}


def test_storms_accuse_nobody() -> None:
    ring = plan_ring([f"n{i}" for i in range(8)])
    e = explain_mismatches(list(range(8)), ring, max_mismatches=storm_threshold(8))
    assert e.storm
    assert resolve(e, []).classification == "nondeterministic"
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


def _replayed(
    model: nn.Module, batch: Any, payload: Payload, fn: Any = None
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    params = list(model.parameters())
    grads: dict[int, torch.Tensor] = {}
    loss = replay(
        model,
        params,
        fn or loss_fn,
        Payload.from_bytes(payload.to_bytes()),
        torch.device("cpu"),
        lambda i, g: grads.__setitem__(i, g.clone()),
    )
    return loss, grads


def test_replay_reproduces_bits_and_leaves_no_trace() -> None:
    torch.manual_seed(0)
    model = TinyNet()
    batch = {"inputs": [Batch(torch.randn(8, 4), torch.randn(8, 4))], "meta": "anything"}
    payload = Payload.capture(batch)
    loss = loss_fn(model, batch)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    rng_after, buffers_after = torch.get_rng_state(), [b.clone() for b in model.buffers()]

    replayed_loss, replayed = _replayed(model, batch, payload)

    assert torch.equal(replayed_loss.view(torch.int32), loss.detach().view(torch.int32))
    assert sorted(replayed) == list(range(len(grads)))
    for i, g in enumerate(grads):
        assert torch.equal(g, replayed[i])
    assert torch.equal(torch.get_rng_state(), rng_after)
    assert all(torch.equal(a, b) for a, b in zip(buffers_after, model.buffers(), strict=True))
    params = list(model.parameters())
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, params, strict=True))  # type: ignore[arg-type]


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.a = nn.Linear(4, 8)
        self.b = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Tanh())
        self.c = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = torch.utils.checkpoint.checkpoint(self.b, h, use_reentrant=self.reentrant)
        return self.c(h)


@pytest.mark.parametrize("reentrant", [True, False])
def test_replay_works_under_activation_checkpointing(reentrant: bool) -> None:
    # torch.autograd.grad refuses reentrant checkpointing; the replay runs backward.
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    x, y = torch.randn(8, 4, requires_grad=False), torch.randn(8, 4)

    def fn(m: nn.Module, b: Any) -> torch.Tensor:
        return ((m(b[0]) - b[1]) ** 2).mean()

    payload = Payload.capture((x, y))
    loss = fn(model, (x, y))
    (loss * 0.25).backward()  # the loop scales its loss: the replay must know by how much
    payload.loss_grad = torch.tensor(0.25)
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    replayed_loss, replayed = _replayed(model, (x, y), payload, fn)
    assert torch.equal(replayed_loss, loss.detach())
    assert all(torch.equal(grads[i], replayed[i]) for i in range(len(grads)))
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))  # type: ignore[arg-type]


def test_replay_frees_each_gradient_as_it_completes() -> None:
    # At no time do more replayed gradients exist than the one being handed over.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    x = torch.randn(4, 64)
    payload = Payload.capture((x,))
    params = list(model.parameters())
    alive: list[int] = []

    def sink(i: int, g: torch.Tensor) -> None:
        alive.append(sum(p.grad is not None for p in params))

    replay(model, params, lambda m, b: m(b[0]).sum(), payload, torch.device("cpu"), sink)
    assert len(alive) == len(params)
    assert max(alive) == 0  # the sink sees the gradient after it left .grad
    assert all(p.grad is None for p in params)


def test_a_collective_in_the_replayed_forward_raises_instead_of_hanging() -> None:
    class Gathering(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch.distributed.all_reduce(x)  # an MoE all-to-all would do the same
            return self.lin(x)

    model = Gathering()
    payload = Payload.capture((torch.randn(2, 4),))
    with pytest.raises(SDCError, match="all_reduce, a collective"):
        replay(
            model,
            list(model.parameters()),
            lambda m, b: m(b[0]).sum(),
            payload,
            torch.device("cpu"),
            lambda i, g: None,
        )
    assert torch.distributed.all_reduce.__name__ == "all_reduce"  # put back


class _CudaGenerators:
    """Stands in for torch.cuda's generator calls: one state per device, and a record of
    which device each call named (no GPU needed)."""

    def __init__(self, current: int = 0) -> None:
        self.current = current
        self.states: dict[int, torch.Tensor] = {}
        self.calls: list[tuple[str, int]] = []

    def _index(self, device: Any) -> int:
        d = torch.device(device)
        return self.current if d.index is None else d.index

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        i = self._index(device)
        self.calls.append(("get", i))
        return self.states.setdefault(i, torch.tensor([i], dtype=torch.uint8)).clone()

    def set_rng_state(self, state: torch.Tensor, device: Any = "cuda") -> None:
        i = self._index(device)
        self.calls.append(("set", i))
        self.states[i] = state.clone()


@pytest.fixture
def cuda_generators(monkeypatch: pytest.MonkeyPatch) -> _CudaGenerators:
    fake = _CudaGenerators(current=0)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", fake.get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", fake.set_rng_state)
    return fake


def test_the_cuda_generator_captured_and_restored_is_the_models_not_the_current_one(
    cuda_generators: _CudaGenerators,
) -> None:
    # device_ids=[3] without set_device: the current device is cuda:0, the model's cuda:3.
    model_device = torch.device("cuda", 3)
    state = RngState.capture(model_device)
    assert cuda_generators.calls == [("get", 3)]
    assert state.cuda is not None and state.cuda.tolist() == [3]
    cuda_generators.states[3] = torch.tensor([99], dtype=torch.uint8)  # dropout drew
    state.restore(model_device)
    assert cuda_generators.calls[-1] == ("set", 3)
    assert cuda_generators.states[3].tolist() == [3]
    assert 0 not in cuda_generators.states, "cuda:0's generator was never touched"
    assert Payload.capture((), device=model_device).rng_cuda.tolist() == [3]  # type: ignore[union-attr]


def test_a_model_on_the_cpu_carries_no_cuda_state(cuda_generators: _CudaGenerators) -> None:
    state = RngState.capture(torch.device("cpu"))
    assert state.cuda is None and cuda_generators.calls == []
    RngState(state.cpu, torch.tensor([7], dtype=torch.uint8), {}).restore(torch.device("cpu"))
    assert cuda_generators.calls == []


def test_the_replay_restores_the_payloads_cuda_state_on_the_models_device(
    cuda_generators: _CudaGenerators, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The replay itself runs on the CPU here; only the generator calls are checked.
    torch.manual_seed(0)
    model = TinyNet()
    batch = {"inputs": [Batch(torch.randn(8, 4), torch.randn(8, 4))], "meta": "x"}
    payload = Payload.capture(batch, device=torch.device("cuda", 2))
    cuda_generators.calls.clear()
    import sdc_agent.replay as replay_module

    # The batch stays where it is (no GPU), while the replay is told the model's device.
    monkeypatch.setattr(replay_module, "_map_tensors", lambda obj, fn: obj)
    device = torch.device("cuda", 2)
    replay(model, list(model.parameters()), loss_fn, payload, device, lambda i, g: None)
    assert cuda_generators.calls == [("get", 2), ("set", 2), ("set", 2)]
    assert 0 not in cuda_generators.states


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA devices (the model on cuda:1, the current device cuda:0)",
)
def test_on_two_gpus_a_dropout_model_on_cuda_1_replays_bit_for_bit() -> None:
    device = torch.device("cuda", 1)
    assert torch.cuda.current_device() == 0
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1)).to(device)
    batch = (torch.randn(8, 4, device=device),)
    payload = Payload.capture(batch, device=device)

    def fn(m: nn.Module, b: Any) -> torch.Tensor:
        return m(b[0]).square().mean()

    loss = fn(model, batch)
    replayed = replay(model, list(model.parameters()), fn, payload, device, lambda i, g: None)
    assert torch.equal(replayed.view(torch.int32), loss.detach().view(torch.int32))


def test_an_unseparated_audit_is_followed_by_re_audits_of_the_same_micro_batch() -> None:
    # Every 5 steps; after an unseparated audit at step 5, step 6 is audited again (no turn
    # of its own in the rotation); _decide stops asking after REAUDITS in a row.
    assert audit_turn(5, every=5, drawn=False, again=False) == "scheduled"
    assert audit_turn(6, every=5, drawn=False, again=True) == "again"
    assert audit_turn(6, every=5, drawn=False, again=False) is None
    assert audit_turn(6, every=5, drawn=True, again=True) == "scheduled"  # its own turn
    assert audit_turn(10, every=5, drawn=False, again=True) == "scheduled"
    assert audit_turn(7, every=0, drawn=False, again=True) == "again"
    assert REAUDITS >= 1


BF16_CAP = 2**-7
"""The tolerance in force once a kind's noise reaches the bf16 cap (the GPT-2's forward
noise)."""


def _measured(to_original: float, to_replay: float, noise: float = BF16_CAP) -> Recheck:
    """A recheck of rank 1's work (replayed by 2) with the third's distances to each
    side, its yes/no agreement as the audit judges it at the tolerance ``noise``."""
    return _recheck(
        third_agrees_original=to_original <= noise,
        third_agrees_replay=to_replay <= noise,
        third_to_original=to_original,
        third_to_replay=to_replay,
        noise=noise,
    )


def test_a_third_barely_past_the_noise_on_one_side_names_nobody_at_once() -> None:
    """Clean GPT-2 runs under forward noise (bench/fault_sweep.py, seeds 2-8): a third
    'agreed' with one side and 'disagreed' with the other at 1.0-1.8 times the tolerance,
    1.5 to 8.4 times nearer one side, and named a healthy rank. Each is weak now."""
    e = explain_mismatches([1], RING4, max_mismatches=4)
    # Measured, seed 3's first audit: rank 3 named, 0.00924 against 0.00217 (4.25 times).
    # seed 7 at step 20: 0.00991 against 0.00119 (8.36 times), within twice the noise.
    for to_original, to_replay in ((0.00924, 0.00217), (0.00991, 0.00119), (0.0144, 0.0078)):
        r = _measured(to_original, to_replay)
        assert judge(r)[:2] == ("owner", 1)  # the yes/no rule names the owner
        assert strength(r) == "weak"
        f = resolve(e, [r])
        assert (f.classification, f.suspects, f.localized) == ("weak", (1,), False), f.message
        assert "re-audit" in f.message
    # The replayer's side alike.
    f = resolve(e, [_measured(0.001, 0.0095)])
    assert (f.classification, f.suspects) == ("weak", (2,))


def test_a_clear_separation_names_the_rank_at_once() -> None:
    """A persistent 8 ulp or 1e-3 fault: the third 5 to 120 times nearer the healthy side,
    at 2 to 5 times the tolerance (the same sweep). Named at once, as before."""
    e = explain_mismatches([1], RING4, max_mismatches=4)
    r = _measured(0.0192, 0.000157)
    assert strength(r) == "strong"
    f = resolve(e, [r])
    assert (f.classification, f.suspects, f.localized, f.corroborated) == ("rank", (1,), True, True)
    # Both conditions: far enough past the noise, and that many times nearer the other side.
    at = NOISE_MULTIPLE * BF16_CAP
    assert strength(_measured(1.01 * at, 1.01 * at / SEPARATION_RATIO)) == "strong"
    assert strength(_measured(0.99 * at, 0.0)) == "strong"  # bit for bit with the other side
    assert strength(_measured(0.99 * at, 0.001)) == "weak"
    assert strength(_measured(0.02, 0.02 / SEPARATION_RATIO * 1.01)) == "weak"


def test_a_bit_reproducible_job_names_a_one_ulp_difference_at_once() -> None:
    # No noise learned (tolerance 0) and the third bit for bit with the replay: any
    # difference from the owner's result separates it, however small.
    e = explain_mismatches([1], RING4, max_mismatches=4)
    r = _measured(1.2e-7, 0.0, noise=0.0)
    assert strength(r) == "strong"
    assert resolve(e, [r]).suspects == (1,)
    # Without distances (agreement alone) the old rule stands.
    assert strength(_recheck()) == "strong"


def test_a_clear_separation_is_named_and_a_weak_one_beside_it_is_not() -> None:
    nodes = ["n0", "n0", "n1", "n1", "n2", "n2"]
    ring = plan_ring(nodes)
    e = explain_mismatches([2, 1], ring, max_mismatches=storm_threshold(6))
    clear = _recheck(
        owner=2,
        replayer=4,
        third=1,
        third_to_original=0.0374,
        third_to_replay=0.000593,
        noise=BF16_CAP,
    )
    # Noise beside it sided, weakly, against rank 3 (the replayer of rank 1's work).
    weak = _recheck(
        owner=1,
        replayer=3,
        third=4,
        third_agrees_original=True,
        third_agrees_replay=False,
        third_to_original=0.00683,
        third_to_replay=0.01,
        noise=BF16_CAP,
    )
    f = resolve(e, [clear, weak])
    assert (f.classification, f.suspects, f.localized) == ("rank", (2,), True), f.message


def test_weak_separations_name_a_rank_only_when_re_audits_repeat_it_alone() -> None:
    assert WEAK_AUDITS == 2
    assert named_on_repeat([{2}], {2}) == 2  # the same rank, alone, twice in a row
    assert named_on_repeat([{5}, {2}], {2}) == 2  # the last two count
    assert named_on_repeat([], {2}) is None  # once: nobody
    assert named_on_repeat([{3}], {2}) is None  # another rank: noise moved
    assert named_on_repeat([{2}], {1, 2}) is None  # several ranks at once: noise
    assert named_on_repeat([{1, 2}], {2}) is None
    assert named_on_repeat([{2}], set()) is None
    # Three in a row, where asked for.
    assert named_on_repeat([{2}], {2}, audits=3) is None
    assert named_on_repeat([{2}, {2}], {2}, audits=3) == 2
    assert named_on_repeat([{2}, {3}], {2}, audits=3) is None
