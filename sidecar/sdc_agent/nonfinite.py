"""Check 1: non-finite gradients, seen in the pass the communication hook makes anyway.

The hook must scale every bucket by 1/world size before the all-reduce (that is DDP's
arithmetic). :class:`StepFlags` does it with
``torch._amp_foreach_non_finite_check_and_unscale_``, the kernel ``torch.amp.GradScaler``
unscales with: one pass over the bucket that multiplies (bit-equal to ``mul_``, tested for
float32, bfloat16 and float16) and raises a device flag when an element is not finite.

The flags need no collective of their own under DDP, where every rank receives the same
reduced buckets: a NaN or infinity survives the sum (and the division by the world
size), so a non-finite local gradient anywhere is non-finite in every rank's reduced
bucket. :meth:`StepFlags.mark` makes that a single element: the step's last bucket, once
every bucket has been checked, gets a NaN in its first element on each rank that flagged
one (or halts, the operator-unreachable policy), on the device, before its all-reduce;
after it, every rank reads the same first element (:meth:`StepFlags.seen`), which holds
the step back on the device where the optimizer skips there (fused), without the host
waiting. Only naming the rank needs each rank's own flag: it stays on the device until
the ranks learn (all of them, from the same element) that some rank flagged, and is then
gathered in one small all-reduce, off the common path. A clean step's first element is
left bit for bit, so guarded training stays bitwise plain DDP.

A sharded layout (FSDP2, HSDP) gives each rank its own reduced shard: the ranks could
disagree on what they received, so there every rank's flags (before and after its
collective) and the halt flag travel in one small all-reduce of their own, queued right
behind the step's last collective (:meth:`StepFlags.send`). So do they under DDP where
check 1 is off and only the halt flag travels: a training NaN in the bucket's first
element would otherwise hold the step back with no check to judge it.

What this sees under DDP: a NaN or infinity in any rank's local gradients, with the rank
named, and one the all-reduce makes in the first element of the last bucket (named the
collective's, on every rank). What it does not see: the rest of the reduced gradients
(that would be a second pass). A non-finite value that the collective itself produces
from finite inputs elsewhere reaches the optimizer; the rank that received it then
computes non-finite local gradients at the next step (its weights are no longer finite),
which this check names, and check 3 sees the replicas differ. A finite value corrupted
inside the collective is check 3's (replicas differ) or, where it reaches every rank
alike, nobody's. The ranks agree because they read the same reduced element, as they
agreed before because they read the same all-reduced flag vector. A collective that hands
ranks different values there (SDC inside it, after the reduction) leaves only some ranks
knowing that a rank flagged: those gather the ranks' own flags alone and wait until the
process group's timeout ends the job with an error, where a corrupted flag vector left
the ranks disagreeing about the step. Agreeing first through the store was tried and
taken back: a rank that reached the agreement late (a long rank-0 save between a step and
the next step's checks, where the flags are read late) turned an ordinary non-finite step
into verdicts against healthy ranks, and the ranks that held the step skipped an audit
step's collectives that the others ran.
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
    """One step's check-1 flags on the device (see the module docstring).

    Two ways to share them. A layout whose ranks all receive the same reduced gradients
    (DDP) puts them in the step's last bucket (:meth:`mark`, :meth:`seen`): no collective
    of their own. One whose ranks each receive a shard (``after=True``, FSDP2/HSDP) sends
    them in a small all-reduce behind its last collective (:meth:`send`)."""

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
        self._marked = False
        self._found: torch.Tensor | None = None
        self.halt = False
        self.group: dist.ProcessGroup | None = None
        # Two pinned host buffers per size, taken in turn: a step's flags may still be on
        # their way to one while the next step's go to the other (CUDA only).
        self._pinned: dict[int, list[torch.Tensor]] = {}
        self._turn = 0

    def reset(self, *, halt: bool) -> None:
        self.local.zero_()
        self.after_local.zero_()
        self._sent = []
        self._marked = False
        self._found = None
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

    def mark(self, buffer: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
        """The step's last bucket, scaled and checked, before its all-reduce: where this
        rank flagged a non-finite local gradient (in any bucket, all checked by now) or
        halts, its first element becomes NaN, on the device. A NaN survives the sum, so
        every rank's reduced bucket then starts with a NaN: each rank knows, with no
        collective, that some rank did (:meth:`seen`). Unflagged, the element is left
        bit for bit. False where the bucket cannot carry it (not floating point)."""
        if not buffer.is_floating_point() or buffer.is_sparse or not buffer.numel():
            return False
        head = buffer[:1]
        if self.halt:
            head.fill_(float("nan"))
        else:
            head.masked_fill_(self.local > 0, float("nan"))
        self._marked = True
        self.group = group
        return True

    def seen(self, reduced: torch.Tensor) -> None:
        """The marked bucket's all-reduce result, before anything else touches it: its
        first element not finite means some rank flagged (or the collective made it so),
        and every rank sees the same."""
        self._found = torch.isfinite(reduced[0]).logical_not().to(torch.float32)

    @property
    def sent(self) -> bool:
        """The step's flags are on their way (marked in a bucket, or sent)."""
        return self._marked or bool(self._sent)

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

    @property
    def _riding(self) -> bool:
        return self._marked and not self._sent

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
        if self._riding:
            assert self._found is not None, "the marked bucket's all-reduce has not completed"
            return self._found
        return (self.gathered().sum() > 0).to(torch.float32)

    def to_host(self) -> HostFlags:
        """Start moving the step's flags to host memory, without waiting: on CUDA a
        non-blocking copy into pinned memory, with an event to wait on; on the CPU they
        are host memory already (the gloo all-reduce has completed). Marked in a bucket,
        that is one float (some rank flagged) and this rank's own flags stay on the
        device until :meth:`HostFlags.read` gathers them, only when it is set."""
        if self._riding:
            assert self._found is not None, "the marked bucket's all-reduce has not completed"
            total = self._found.reshape(1)
            mine: _Mine | None = _Mine(self.local.clone(), self.halt, self.group, self.me)
        else:
            total = self.gathered()
            mine = None
        if not total.is_cuda:
            return HostFlags(total, None, self.world, mine)
        pinned = self._pinned.get(total.numel())
        if pinned is None:
            pinned = self._pinned[total.numel()] = [
                torch.empty(total.shape, dtype=total.dtype, pin_memory=True) for _ in range(2)
            ]
        host = pinned[self._turn]
        self._turn = 1 - self._turn
        host.copy_(total, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(total.device))
        return HostFlags(host, event, self.world, mine)

    def read(self) -> tuple[list[bool], bool]:
        """``(non-finite before the all-reduce, by rank; anyone halts)`` on the host."""
        return self.to_host().read()


@dataclass(frozen=True, slots=True)
class _Mine:
    """A rank's own flags of one step, kept on the device until they are gathered."""

    local: torch.Tensor
    halt: bool
    group: dist.ProcessGroup | None
    me: int


class HostFlags:
    """A step's flags in host memory, or on their way there (:meth:`StepFlags.to_host`)."""

    def __init__(
        self, host: torch.Tensor, event: Any, world: int, mine: _Mine | None = None
    ) -> None:
        self.host = host
        self.event = event
        self.world = world
        self._mine = mine
        self._rows: list[float] | None = None

    def ready(self) -> bool:
        """Whether :meth:`clean` would not wait (never waits itself)."""
        return self.event is None or bool(self.event.query())

    def _host_rows(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy().tolist()

    def clean(self) -> bool:
        """No rank flagged or halts (no collective; waits for the copy's event only)."""
        if self._mine is not None:
            return not self._host_rows()[0] > 0
        return not any(v > 0 for v in self._host_rows())

    def read(self) -> tuple[list[bool], bool]:
        """``(non-finite before the all-reduce, by rank; anyone halts)``. Waits for the
        copy's event where it is still on its way (only for the copy: work queued after
        it, the optimizer step and the next forward, keeps running); then reads host
        memory, which is no device read.

        Flags marked in a bucket that say some rank flagged: a collective (every rank
        read the same reduced bucket, so every rank is here), which gathers each rank's
        own flags of the step."""
        if self._rows is None:
            self._rows = self._gather() if self._mine is not None else self._host_rows()
        rows = self._rows
        return [v > 0 for v in rows[: self.world]], rows[self.world] > 0

    def _gather(self) -> list[float]:
        mine = self._mine
        assert mine is not None
        found = self._host_rows()[0] > 0
        rows = [0.0] * (self.world + 1)
        if not found:
            return rows
        vector = torch.zeros(self.world + 1, dtype=torch.float32, device=mine.local.device)
        vector[mine.me : mine.me + 1].copy_(mine.local)
        if mine.halt:
            vector[self.world] = 1.0
        dist.all_reduce(vector, group=mine.group)
        rows = vector.cpu().numpy().tolist()
        if not any(v > 0 for v in rows):
            rows.append(1.0)  # every input finite, the reduced bucket not: the collective
        return rows

    def after(self) -> list[bool] | None:
        """Non-finite after the gradient collective, by rank, where the layout checks the
        reduced gradients or the flags rode in a bucket (``None``: not known). Call after
        :meth:`read`."""
        if self._mine is not None:
            assert self._rows is not None, "read() first"
            # The reduced bucket is every rank's: non-finite on every rank alike.
            return [True] * self.world if len(self._rows) > self.world + 1 else None
        rows = self._host_rows()
        if len(rows) <= self.world + 1:
            return None
        return [v > 0 for v in rows[self.world + 1 : 2 * self.world + 1]]
