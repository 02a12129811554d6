"""The interface every check implements, and the state one step shares between them.

A check is a unit the :class:`~sdc_agent.Guard` calls at fixed points of a step, in the
order of its list (check 1, the replay audit, check 3):

- :meth:`CheckUnit.begin` when the step begins, :meth:`CheckUnit.on_forward` when each of
  its training forwards begins;
- :meth:`CheckUnit.on_gradients` for every bucket of local gradients, before its collective
  (the layout, :mod:`sdc_agent.layout`, says where they are);
- :meth:`CheckUnit.before_step` after backward, before the optimizer step: a check that
  finds the step bad sets ``state.hold`` (the step is not applied) and adds its verdict;
- :meth:`CheckUnit.after_step` after the optimizer step (or after it was held back);
- :meth:`CheckUnit.vouched` once the step is over and no check blocked it: whether the
  check verified this step, which moves ``last_clean_step`` for checks that vouch.

``before_step`` and ``after_step`` may be collectives: every rank calls every unit at the
same point. Nothing in a unit reads the device on the host in the common case.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .verdict import Verdict

if TYPE_CHECKING:
    from .layout import GradientBucket

__all__ = ["CheckUnit", "StepState"]


@dataclass(slots=True)
class StepState:
    """One step, as the checks see it."""

    step: int
    last_clean_step: int
    verdicts: list[Verdict] = field(default_factory=list)
    late_verdicts: list[Verdict] = field(default_factory=list)
    """Verdicts of the previous step whose flags were read during this one (shown in this
    step's result; they do not block it)."""
    hold: bool = False
    """A check found the step bad on the host: it is not applied."""
    applied: torch.Tensor | bool = False
    """After the optimizer step: whether it was applied (a device flag where the optimizer
    skips on the device)."""


class CheckUnit:
    """One check (see the module docstring). Every method does nothing by default."""

    name: str = ""
    """The check's name in verdicts, heartbeats (``check_seconds``) and the log."""
    vouches: bool = False
    """Whether the check has a say in ``last_clean_step``: the oldest step that every such
    check vouched for (:meth:`vouched`)."""

    @property
    def blocks_clean(self) -> bool:
        """A failure that outlives its step (check 3's diverged replicas): no step is clean
        until the job restores a checkpoint."""
        return False

    def begin(self, state: StepState) -> None:
        """The step begins (its first training forward, or ``begin_step``)."""

    def on_forward(self, state: StepState) -> None:
        """A training forward begins (every micro-batch's)."""

    def on_gradients(self, bucket: GradientBucket) -> None:
        """Local gradients, before their collective; no host read, no collective."""

    def on_local_gradient(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """One parameter's local gradient, complete, before its collective (sharded
        layouts, :mod:`sdc_agent.layout_fsdp`); no host read, no collective."""

    def before_step(self, state: StepState) -> None:
        """After backward, before the optimizer step. May be a collective."""

    def after_step(self, state: StepState) -> None:
        """After the optimizer step or after it was held back. May be a collective."""

    def vouched(self, state: StepState) -> bool:
        """Whether this check verified the step (asked only when no check blocked it)."""
        return True

    def awaits(self, state: StepState) -> bool:
        """Whether the check's verdict on ``state``'s step comes later (an exchange that
        overlaps the next step); :meth:`settled` then says how it went."""
        return False

    def settled(self) -> tuple[int, bool] | None:
        """Once, after the result of an awaited step came: ``(step, passed)``."""
        return None

    def restored(self, step: int) -> None:
        """The job restored a checkpoint of ``step``."""

    def close(self, timeout: float) -> None:
        """The Guard closes (finish what is in flight, up to ``timeout`` seconds)."""
