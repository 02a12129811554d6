"""Bad use gets a clear error naming the problem, before any step is applied."""

from __future__ import annotations

from typing import Any

import pytest

from sdc_agent.launch import spawn_local

pytestmark = pytest.mark.distributed


def _model_and_optimizer(sync_bn: bool = False) -> tuple[Any, Any]:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(4, 4)))
    if sync_bn:  # DDP refuses SyncBatchNorm on CPU: put it in afterwards, as on a GPU
        ddp.module.append(nn.SyncBatchNorm(4))
    return ddp, torch.optim.Adam(ddp.parameters(), lr=0.1)


def _loss(model: Any, batch: Any) -> Any:
    return model(batch).pow(2).mean()


def _phases_out_of_order(rank: int, world: int) -> dict[str, str]:
    import torch

    from sdc_agent import Guard, GuardConfig, SDCError

    ddp, opt = _model_and_optimizer()
    guard = Guard(ddp, opt, _loss, GuardConfig(fingerprint_backend="eager"), reporter=None)
    before = [p.detach().clone() for p in ddp.parameters()]
    errors: dict[str, str] = {}
    x = torch.randn(2, 4)

    def expect(name: str, fn: Any) -> None:
        try:
            fn()
        except SDCError as exc:
            errors[name] = str(exc)

    expect("before_optimizer_step first", guard.before_optimizer_step)
    expect("after_optimizer_step first", guard.after_optimizer_step)
    loss = _loss(ddp, x)
    guard.before_backward(x, loss)
    loss.backward()
    expect("optimizer.step before the checks", opt.step)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, ddp.parameters(), strict=True))
    errors["unchanged"] = str(unchanged)
    assert guard.before_optimizer_step()
    expect("before_optimizer_step twice", guard.before_optimizer_step)
    expect("backward after the checks", lambda: _loss(ddp, x).backward())
    opt.step()
    guard.after_optimizer_step()
    expect("before_backward outside a step", lambda: guard.before_backward(x, loss))
    guard.close()
    return errors


def test_phases_out_of_order_raise_before_anything_is_applied() -> None:
    errors = spawn_local(_phases_out_of_order, ["n0"])[0]
    assert "outside a step" in errors["before_optimizer_step first"]
    assert "outside a step" in errors["after_optimizer_step first"]
    assert "before guard.before_optimizer_step()" in errors["optimizer.step before the checks"]
    assert errors["unchanged"] == "True"
    assert "twice" in errors["before_optimizer_step twice"]
    assert "before guard.after_optimizer_step()" in errors["backward after the checks"]
    assert "no step is running" in errors["before_backward outside a step"]


def _accumulation_shown_once(rank: int, world: int) -> dict[str, Any]:
    """A loop with gradient accumulation that calls before_backward for the first
    micro-batch only: with no_sync (the usual form), and with every micro-batch
    all-reduced; then the same loops done right, which must raise nothing. The error
    comes from inside backward, which leaves DDP's reducer mid-pass: a new model each."""
    import contextlib

    import torch

    from sdc_agent import Guard, GuardConfig, SDCError

    out: dict[str, Any] = {}
    micro = [torch.randn(2, 4) for _ in range(3)]

    def accumulate(name: str, *, use_no_sync: bool, show_all: bool, steps: int = 1) -> None:
        ddp, opt = _model_and_optimizer()
        config = GuardConfig(fingerprint_backend="eager", replay_every=1, weights_every=1)
        guard = Guard(ddp, opt, _loss, config, reporter=None)
        before = [p.detach().clone() for p in ddp.parameters()]
        applied = []
        try:
            for _ in range(steps):
                opt.zero_grad(set_to_none=True)
                for j, x in enumerate(micro):
                    quiet = use_no_sync and j < len(micro) - 1
                    with ddp.no_sync() if quiet else contextlib.nullcontext():
                        loss = _loss(ddp, x)
                        if show_all or j == 0:
                            guard.before_backward(x, loss)
                        (loss / len(micro)).backward()
                if guard.before_optimizer_step():
                    opt.step()
                applied.append(guard.after_optimizer_step().applied)
            out[name] = "no error"
        except SDCError as exc:
            out[name] = str(exc)
        out[name + " applied"] = applied
        out[name + " unchanged"] = all(
            torch.equal(a, p) for a, p in zip(before, ddp.parameters(), strict=True)
        )
        out[name + " audits"] = guard.replay_stats.audits
        out[name + " mismatches"] = guard.replay_stats.mismatches
        guard.close()

    accumulate("no_sync, shown once", use_no_sync=True, show_all=False)
    accumulate("all-reduced, shown once", use_no_sync=False, show_all=False)
    accumulate("no_sync, every one shown", use_no_sync=True, show_all=True, steps=3)
    accumulate("all-reduced, every one shown", use_no_sync=False, show_all=True, steps=3)
    return out


def test_accumulation_with_before_backward_for_the_first_micro_batch_only_is_refused() -> None:
    out = spawn_local(_accumulation_shown_once, ["n0", "n1"])[0]
    for name in ("no_sync, shown once", "all-reduced, shown once"):
        assert "call guard.before_backward(batch, loss) for every micro-batch" in out[name]
        assert out[name + " unchanged"] is True and out[name + " applied"] == []
    # Done right, the same loops raise nothing, apply every step and audit cleanly.
    for name in ("no_sync, every one shown", "all-reduced, every one shown"):
        assert out[name] == "no error"
        assert out[name + " applied"] == [True, True, True]
        assert (out[name + " audits"], out[name + " mismatches"]) == (3, 0)


def _differing_settings(rank: int, world: int) -> str:
    from sdc_agent import ConfigError, Guard, GuardConfig

    ddp, opt = _model_and_optimizer()
    config = GuardConfig(fingerprint_backend="eager", replay_every=50 if rank else 25)
    try:
        Guard(ddp, opt, _loss, config, reporter=None)
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_settings_that_differ_between_ranks_fail_on_every_rank_without_hanging() -> None:
    messages = spawn_local(_differing_settings, ["n0", "n1", "n2"], timeout=120)
    assert all("settings differ between ranks (replay_every)" in m for m in messages)
    assert "rank 0=25" in messages[0] and "rank 1=50" in messages[0]


def _sync_batch_norm(rank: int, world: int) -> str:
    from sdc_agent import ConfigError, Guard, GuardConfig

    ddp, opt = _model_and_optimizer(sync_bn=True)
    try:
        Guard(ddp, opt, _loss, GuardConfig(fingerprint_backend="eager"), reporter=None)
    except ConfigError as exc:
        message = str(exc)
    else:
        message = "no error"
    # With the audit off the same model is fine.
    Guard(ddp, opt, _loss, GuardConfig(replay_every=0, fingerprint_backend="eager"), reporter=None)
    return message


def test_sync_batch_norm_with_the_replay_audit_is_refused_at_creation() -> None:
    (message,) = spawn_local(_sync_batch_norm, ["n0"])
    assert message.startswith("replay_every: the model has SyncBatchNorm")
