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
