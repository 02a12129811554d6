"""Check 1: non-finite gradients, seen in the pass the communication hook makes anyway.

The hook must scale every bucket by 1/world size before the all-reduce (that is DDP's
arithmetic). :class:`StepFlags` does it with
``torch._amp_foreach_non_finite_check_and_unscale_``, the kernel ``torch.amp.GradScaler``
unscales with: one pass over the bucket that multiplies (bit-equal to ``mul_``, tested for
float32, bfloat16 and float16) and raises a device flag when an element is not finite.
After the step's last bucket, every rank's flag (and the halt flag of the operator-
unreachable policy) travels in one small all-reduce of ``world + 1`` floats, queued right
behind that bucket; its result stays on the device, where it can hold the optimizer step
back without the host ever waiting for it.

What this sees: a NaN or infinity in any rank's local gradients, with the rank named (the
flag vector has one slot per rank). What it does not see: the reduced gradients (that
would be a second pass). A non-finite value that the collective itself produces from
finite inputs reaches the optimizer; the rank that received it then computes non-finite
local gradients at the next step (its weights are no longer finite), which this check
names, and check 3 sees the replicas differ. A finite value corrupted inside the
collective is check 3's (replicas differ) or, where it reaches every rank alike,
nobody's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["HostFlags", "NonFiniteFinding", "StepFlags", "classify_nonfinite"]


@dataclass(frozen=True, slots=True)
class NonFiniteFinding:
    classification: str
    suspects: tuple[int, ...]
    """Group ranks."""
    localized: bool
    message: str


def classify_nonfinite(
    before: Sequence[bool], after: Sequence[bool] | None = None, collective: str = "all-reduce"
) -> NonFiniteFinding | None:
    """Decide from each rank's flags (non-finite before / after the gradient collective,
    named ``collective`` in the message; ``after`` only where the reduced gradients were
    checked)."""
    if after is None:
        after = [False] * len(before)
    if len(before) != len(after):
        raise ValueError("before and after must have one flag per rank")
    bad_before = tuple(r for r, bad in enumerate(before) if bad)
    bad_after = tuple(r for r, bad in enumerate(after) if bad)
    world = len(before)
    if bad_before and len(bad_before) == world:
        return NonFiniteFinding(
            "training",
            (),
            False,
            "every rank computed non-finite gradients: overflow or bad data, not hardware",
        )
    if bad_before:
        return NonFiniteFinding(
            "rank",
            bad_before,
            True,
            f"non-finite local gradients on {_ranks(bad_before)} only, before the {collective}",
        )
    if bad_after:
        every = len(bad_after) == world
        where = "every rank" if every else _ranks(bad_after)
        return NonFiniteFinding(
            "collective",
            () if every else bad_after,
            not every,
            f"{collective} inputs were finite but the reduced gradients on {where} were not",
        )
    return None


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class StepFlags:
    """One step's check-1 flags on the device (see the module docstring)."""

    def __init__(self, world: int, me: int, device: torch.device, *, after: bool = False) -> None:
        self.world = world
        self.me = me
        self.device = device
        self.inv_world = torch.full((1,), 1.0 / world, dtype=torch.float32, device=device)
        self.one = torch.ones(1, dtype=torch.float32, device=device)
        self.local = torch.zeros(1, dtype=torch.float32, device=device)
        self.with_after = after
        """A second slot per rank: its reduced gradients (after the collective) were not
        finite (a sharded layout, whose reduced gradients are a shard: a small pass)."""
        self.after_local = torch.zeros(1, dtype=torch.float32, device=device)
        self._sent: list[tuple[torch.Tensor, dist.Work]] = []
        self.halt = False
        # Two pinned host buffers, taken in turn: a step's flags may still be on their way
        # to one while the next step's go to the other (CUDA only).
        self._pinned: list[torch.Tensor] = []
        self._turn = 0

    def reset(self, *, halt: bool) -> None:
        self.local.zero_()
        self.after_local.zero_()
        self._sent = []
        self.halt = halt

    def scale_and_check(self, buffer: torch.Tensor, check: bool) -> None:
        """Scale ``buffer`` by 1/world in place; with ``check``, flag a non-finite element."""
        if check and buffer.is_floating_point() and not buffer.is_sparse:
            torch._amp_foreach_non_finite_check_and_unscale_([buffer], self.local, self.inv_world)
        else:
            # DDP without a hook multiplies by 1/world (dividing differs in the last bit
            # when the world size is not a power of two).
            buffer.mul_(1.0 / self.world)

    def check(self, buffer: torch.Tensor, *, after: bool = False) -> None:
        """Flag a non-finite element of ``buffer`` without changing it (the layout's
        collective does its own scaling): the same kernel, multiplying by exactly 1."""
        if buffer.is_floating_point() and not buffer.is_sparse and buffer.numel():
            flag = self.after_local if after else self.local
            torch._amp_foreach_non_finite_check_and_unscale_([buffer], flag, self.one)

    @property
    def sent(self) -> bool:
        return bool(self._sent)

    def send(self, group: dist.ProcessGroup | None) -> None:
        """Share this rank's flags with every rank (asynchronously). A collective."""
        size = 2 * self.world + 1 if self.with_after else self.world + 1
        vector = torch.zeros(size, dtype=torch.float32, device=self.device)
        vector[self.me : self.me + 1].copy_(self.local)
        if self.halt:
            vector[self.world] = 1.0
        if self.with_after:
            slot = self.world + 1 + self.me
            vector[slot : slot + 1].copy_(self.after_local)
        work = dist.all_reduce(vector, group=group, async_op=True)
        assert work is not None
        self._sent.append((vector, work))

    def gathered(self) -> torch.Tensor:
        """Every rank's flags, ``[world + 1]`` on the device (after :meth:`send`). Waiting
        makes the device wait, not the host, where the backend allows it (NCCL)."""
        total = None
        for vector, work in self._sent:
            work.wait()
            total = vector if total is None else total + vector
        assert total is not None
        return total

    def skip_tensor(self) -> torch.Tensor:
        """A 0-dim float on the device (the shape fused optimizers take): 1 when any rank
        is non-finite or halts."""
        return (self.gathered().sum() > 0).to(torch.float32)

    def to_host(self) -> HostFlags:
        """Start moving every rank's flags to host memory, without waiting: on CUDA a
        non-blocking copy into pinned memory behind the flags' all-reduce, with an event
        to wait on; on the CPU the gathered flags are host memory already (the gloo
        all-reduce has completed once :meth:`gathered` returned)."""
        total = self.gathered()
        if not total.is_cuda:
            return HostFlags(total, None, self.world)
        if not self._pinned:
            self._pinned = [
                torch.empty(total.shape, dtype=total.dtype, pin_memory=True) for _ in range(2)
            ]
        host = self._pinned[self._turn]
        self._turn = 1 - self._turn
        host.copy_(total, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(total.device))
        return HostFlags(host, event, self.world)

    def read(self) -> tuple[list[bool], bool]:
        """``(non-finite before the all-reduce, by rank; anyone halts)`` on the host."""
        return self.to_host().read()


class HostFlags:
    """A step's flags in host memory, or on their way there (:meth:`StepFlags.to_host`)."""

    def __init__(self, host: torch.Tensor, event: Any, world: int) -> None:
        self.host = host
        self.event = event
        self.world = world

    def ready(self) -> bool:
        """Whether :meth:`read` would not wait (never waits itself)."""
        return self.event is None or bool(self.event.query())

    def read(self) -> tuple[list[bool], bool]:
        """``(non-finite before the all-reduce, by rank; anyone halts)``. Waits for the
        copy's event where it is still on its way (only for the copy: work queued after
        it, the optimizer step and the next forward, keeps running); then reads host
        memory, which is no device read."""
        if self.event is not None:
            self.event.synchronize()
        rows = self.host.numpy().tolist()
        return [v > 0 for v in rows[: self.world]], rows[self.world] > 0

    def after(self) -> list[bool] | None:
        """Non-finite after the gradient collective, by rank, where the layout checks the
        reduced gradients (``None``: it does not). Call after :meth:`read`."""
        if self.event is not None:
            self.event.synchronize()
        rows = self.host.numpy().tolist()
        if len(rows) <= self.world + 1:
            return None
        return [v > 0 for v in rows[self.world + 1 : 2 * self.world + 1]]
