"""Check 3's fingerprinting on three real gloo ranks: parameters and Adam state, with the
native (C) kernel and the eager one, a corrupted optimizer-state element on one rank."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch
from torch import nn

from sdc_agent import fingerprint_native
from sdc_agent.fingerprint import Fingerprinter
from sdc_agent.launch import spawn_local
from sdc_agent.weights import WeightFingerprints

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        not any(shutil.which(c) for c in fingerprint_native._compilers()),
        reason="no C compiler for the native kernel here",
    ),
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 300), nn.LayerNorm(300), nn.ReLU(), nn.Linear(300, 7), nn.LayerNorm(7)
    )


CASES = [None, "3.weight:exp_avg_sq", "1.bias", "4.weight:step"]


def _compare_ranks(rank: int, world: int) -> dict[str | None, dict[str, Any]]:
    out: dict[str | None, dict[str, Any]] = {c: _compare(rank, c) for c in CASES}
    out["overlapped"] = _overlapped(rank)
    return out


def _train(model: nn.Module, opt: torch.optim.Optimizer, g: torch.Generator) -> None:
    opt.zero_grad()
    model(torch.randn(8, 64, generator=g)).square().mean().backward()
    opt.step()


def _overlapped(rank: int) -> dict[str, Any]:
    # start() fingerprints now; the loop trains on while the words travel; finish() judges
    # the state start() saw: a bit flipped on rank 1 and repaired before finish() is found.
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    _train(model, opt, g)
    weights = WeightFingerprints(model, opt, Fingerprinter("auto"), include_optimizer_state=True)
    clean = weights.start(None, torch.device("cpu"))
    _train(model, opt, g)
    clean_result = clean.finish()
    target = dict(zip(*weights.tensors(), strict=True))["0.weight:exp_avg"]
    if rank == 1:
        _flip(target)
    pending = weights.start(None, torch.device("cpu"))
    if rank == 1:
        _flip(target)
    _train(model, opt, g)
    split, evidence = pending.finish()
    return {
        "clean": clean_result[0],
        "split": None if split is None else (split.suspects, split.localized),
        "differing": evidence.get("differing_tensors"),
    }


def _flip(tensor: torch.Tensor) -> None:
    bits = tensor.view(-1).view(torch.int32)
    bits[min(3, bits.numel() - 1)] ^= 1 << 7


def _compare(rank: int, corrupt: str | None) -> dict[str, Any]:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)  # the same data everywhere: replicas agree
    for _ in range(2):
        _train(model, opt, g)
    out: dict[str, Any] = {}
    for backend in ("auto", "eager"):
        fp = Fingerprinter(backend)
        weights = WeightFingerprints(model, opt, fp, include_optimizer_state=True)
        names, tensors = weights.tensors()
        if rank == 1 and corrupt is not None:
            _flip(dict(zip(names, tensors, strict=True))[corrupt])  # one bit, one replica
        split, evidence = weights.compare(None, torch.device("cpu"))
        if rank == 1 and corrupt is not None:
            _flip(dict(zip(names, tensors, strict=True))[corrupt])  # undo it
        out[backend] = {
            "kernel": fp.kernels,
            "split": None if split is None else (split.suspects, split.localized),
            "differing": evidence.get("differing_tensors"),
            "per_tensor": fp.many(tensors)[1].tolist(),
            "count": len(tensors),
        }
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str | None, dict[str, Any]]]:
    return spawn_local(_compare_ranks, ["a", "b", "c"])


@pytest.mark.parametrize("corrupt", CASES)
def test_compare_finds_the_replica_and_the_tensor(
    ranks: list[dict[str | None, dict[str, Any]]], corrupt: str | None
) -> None:
    for r in (by_case[corrupt] for by_case in ranks):
        assert r["auto"]["kernel"] == {"cpu": "native"}
        assert r["eager"]["kernel"] == {"cpu": "eager"}
        # Both kernels give the same words for every tensor, Adam's CPU step included.
        assert r["auto"]["per_tensor"] == r["eager"]["per_tensor"]
        assert r["auto"]["count"] == 8 * 4  # 8 parameters, each with step and two moments
        for backend in ("auto", "eager"):
            got = r[backend]
            if corrupt is None:
                assert got["split"] is None and got["differing"] is None
            else:
                assert got["split"] == ((1,), True)
                assert got["differing"] == {"1": [corrupt]}


def test_a_comparison_judges_the_state_it_started_from(
    ranks: list[dict[str | None, dict[str, Any]]],
) -> None:
    for r in (by_case["overlapped"] for by_case in ranks):
        assert r["clean"] is None
        assert r["split"] == ((1,), True)
        assert r["differing"] == {"1": ["0.weight:exp_avg"]}
