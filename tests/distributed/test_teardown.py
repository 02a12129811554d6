"""A closed Guard that the caller drops is freed at once, without the garbage collector,
with its model and the model's process group (DDP's comm hook holds it weakly, its parts
call it back weakly), and the model trains on exactly as plain DDP does."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sdc_agent
from sdc_agent.launch import spawn_local

pytestmark = pytest.mark.distributed


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, steps: int) -> None:
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        optimizer.zero_grad()
        _loss(model, (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))).backward()
        optimizer.step()


def _closed_after_three_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, rank: int
) -> sdc_agent.Guard:
    config = sdc_agent.GuardConfig(weights_every=1, replay_every=0, fingerprint_backend="eager")
    guard = sdc_agent.Guard(model, optimizer, _loss, config, reporter=None)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        guard.step((torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)))
    guard.close()
    return guard


def _guard_dropped_then_plain_training(rank: int, world_size: int) -> tuple[bool, bool]:
    torch.manual_seed(0)
    guarded = DistributedDataParallel(nn.Linear(16, 4))
    torch.manual_seed(0)
    plain = DistributedDataParallel(nn.Linear(16, 4))
    opt_guarded = torch.optim.SGD(guarded.parameters(), lr=0.1)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    guard = _closed_after_three_steps(guarded, opt_guarded, rank)
    gone = weakref.ref(guard)
    del guard
    gc.collect()
    freed = gone() is None
    # The same three steps on the plain model, then both train on through DDP alone.
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt_plain.zero_grad()
        _loss(plain, (torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))).backward()
        opt_plain.step()
    _train(guarded, opt_guarded, rank, 4)
    _train(plain, opt_plain, rank, 4)
    same = all(
        torch.equal(a, b) for a, b in zip(guarded.parameters(), plain.parameters(), strict=True)
    )
    return freed, same


def test_a_dropped_guard_is_freed_and_its_model_trains_on_as_plain_ddp() -> None:
    results = spawn_local(_guard_dropped_then_plain_training, ["n0", "n1"])
    assert [freed for freed, _ in results] == [True] * 2, "the comm hook kept the Guard alive"
    assert [same for _, same in results] == [True] * 2, "training after the Guard differs"


def _threads() -> dict[str, str]:
    """This process's threads: thread id -> name."""
    found = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                found[task] = f.read().strip()
        except OSError:  # the thread ended meanwhile
            pass
    return found


def _guarded_run(rank: int, group: dist.ProcessGroup) -> weakref.ref[nn.Module]:
    """Three guarded steps on a DDP model over ``group``, then close(), as a training
    function ends (the model, its optimizer and the Guard go out of scope on return)."""
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(16, 4), process_group=group)
    _closed_after_three_steps(model, torch.optim.Adam(model.parameters(), lr=1e-3), rank)
    return weakref.ref(model)


def _teardown_without_the_garbage_collector(rank: int, world_size: int) -> tuple[bool, list[str]]:
    before = set(_threads())  # by id: a thread names itself only once it runs
    group = dist.new_group(backend="gloo")
    gc.disable()  # what frees the model must be reference counting, at once
    try:
        model = _guarded_run(rank, group)
        freed = model() is None  # no wait: nothing may hold it after the function returned
        dist.barrier(group=group)
        dist.destroy_process_group(group)  # joins the group's threads, if nothing holds it
        del group
        left = [name for tid, name in _threads().items() if tid not in before]
        return freed, left
    finally:
        gc.enable()


def test_a_closed_guard_leaves_nothing_that_holds_the_model_or_its_process_group() -> None:
    # The README's loop: train in a function, guard.close(), destroy_process_group(). No
    # gc.collect() in between: the Guard is in no reference cycle and nothing of its comm
    # hook outlives the step (gloo's thread that ran the hook's callback lets go of it
    # late), so the model, its reducer and the group go when the function returns, and
    # destroying the group joins its gloo threads. Before, the Guard's callbacks made
    # cycles and the group's threads ran on to interpreter exit.
    results = spawn_local(_teardown_without_the_garbage_collector, ["n0", "n1"])
    assert [freed for freed, _ in results] == [True] * 2, "the model outlived its Guard"
    assert [left for _, left in results] == [[]] * 2, "the group's gloo threads outlived it"
