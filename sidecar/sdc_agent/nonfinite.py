"""Check 1: non-finite gradients, before and after the all-reduce.

The DDP communication hook hands every bucket to :class:`NonFiniteMonitor` twice: the
local gradients before the all-reduce and the reduced ones after it. The monitor keeps
one ``aminmax`` per bucket on the device (NaN propagates into min and max, an infinity
becomes one of them, and unlike a sum it cannot overflow); the flags meet the host once
per step, after one small all-reduce that tells every rank what every other rank saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["NonFiniteFinding", "NonFiniteMonitor", "classify_nonfinite"]


@dataclass(frozen=True, slots=True)
class NonFiniteFinding:
    classification: str
    suspects: tuple[int, ...]
    """Group ranks."""
    localized: bool
    message: str


def classify_nonfinite(before: Sequence[bool], after: Sequence[bool]) -> NonFiniteFinding | None:
    """Decide from each rank's flags (non-finite before / after the all-reduce)."""
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
            f"non-finite local gradients on {_ranks(bad_before)} only, before the all-reduce",
        )
    if bad_after:
        every = len(bad_after) == world
        where = "every rank" if every else _ranks(bad_after)
        return NonFiniteFinding(
            "collective",
            () if every else bad_after,
            not every,
            f"all-reduce inputs were finite but the reduced gradients on {where} were not",
        )
    return None


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class NonFiniteMonitor:
    """Collects per-bucket flags during backward; :meth:`exchange` shares them."""

    def __init__(self) -> None:
        self._before: list[torch.Tensor] = []
        self._after: list[torch.Tensor] = []

    def reset(self) -> None:
        self._before.clear()
        self._after.clear()

    def observe_local(self, bucket: torch.Tensor) -> None:
        self._before.append(torch.stack(torch.aminmax(bucket)).float())

    def observe_reduced(self, bucket: torch.Tensor) -> None:
        self._after.append(torch.stack(torch.aminmax(bucket)).float())

    @staticmethod
    def _bad(extrema: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        if not extrema:
            return torch.zeros((), dtype=torch.int32, device=device)
        return (~torch.isfinite(torch.cat(extrema)).all()).to(device, torch.int32)

    def exchange(
        self, group: dist.ProcessGroup | None, device: torch.device, *, halt: bool = False
    ) -> tuple[list[bool], list[bool], list[bool]]:
        """Every rank's ``(before, after, halt)`` flags, by group rank. A collective.

        ``halt`` rides along for the Guard's local policy (a rank that must stop
        training); the check itself ignores it.
        """
        world = dist.get_world_size(group)
        flags = torch.zeros((world, 3), dtype=torch.int32, device=device)
        me = dist.get_rank(group)
        flags[me, 0] = self._bad(self._before, device)
        flags[me, 1] = self._bad(self._after, device)
        flags[me, 2] = int(halt)
        dist.all_reduce(flags, group=group)
        rows = flags.tolist()  # the one host synchronisation of check 1 per step
        self.reset()
        return [bool(r[0]) for r in rows], [bool(r[1]) for r in rows], [bool(r[2]) for r in rows]
