"""The audit's summary of one computation: a replay compared with its reference takes the
reference's statistics where the bits agree, and is the same summary either way."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import sdc_agent.audit as audit
from sdc_agent.audit import _Collector
from sdc_agent.evidence import Summary, compare
from sdc_agent.fingerprint import Fingerprinter


def _grads(seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(300, 600), nn.ReLU(), nn.Linear(600, 4))
    loss = net(torch.randn(8, 300)).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in net.parameters()]  # type: ignore[union-attr]


def _summary(
    loss: torch.Tensor, grads: list[torch.Tensor], reference: Summary | None = None
) -> Summary:
    collector = _Collector(Fingerprinter("eager"), reference=reference)
    for i, g in enumerate(grads):
        collector.add(i, g)
    return collector.summary(loss, len(grads))


@pytest.fixture
def computed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the tensors whose statistics the audit computes, in order."""
    sizes: list[int] = []
    real = audit.tensor_stats

    def counting(t: torch.Tensor, *args: Any) -> torch.Tensor:
        sizes.append(t.numel())
        return real(t, *args)

    monkeypatch.setattr(audit, "tensor_stats", counting)
    return sizes


def test_a_replay_that_agrees_takes_the_reference_statistics(computed: list[int]) -> None:
    loss, grads = _grads(0)
    own = _summary(loss, grads)
    computed.clear()
    replayed = _summary(loss, grads, reference=own)
    assert replayed == own  # the same summary, bit for bit
    assert computed == []  # and no statistic computed again

    # One gradient off by one ulp in one element: only its statistics are computed, and
    # the comparison sees the difference as it would without the reference.
    wrong = [g.clone() for g in grads]
    wrong[2].view(torch.int32)[0, 5] += 1
    replayed = _summary(loss, wrong, reference=own)
    assert computed == [wrong[2].numel()]
    assert replayed == _summary(loss, wrong)
    diff = compare(own, replayed, [[0, 1], [2, 3]])
    assert diff.kinds[1].equal and diff.kinds[1].rel == 0.0
    assert not diff.kinds[2].equal and diff.kinds[2].rel > 0.0


def test_without_a_reference_every_statistic_is_computed(computed: list[int]) -> None:
    loss, grads = _grads(1)
    _summary(loss, grads)
    assert computed == [g.numel() for g in grads]
