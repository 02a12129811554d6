"""Holding an optimizer step back, on the device where the optimizer allows it.

The fused optimizers (``Adam``/``AdamW``/``SGD`` with ``fused=True``) take the
``found_inf`` tensor ``torch.amp.GradScaler`` gives them and skip the update on the device
when it is non-zero: the host never waits. :class:`StepGate` hands them the Guard's flag
the same way, through an optimizer step pre-hook (the larger of it and the GradScaler's own
flag when a scaler drives the step). Other optimizers cannot skip on the device: for them the Guard
reads the flag on the host (one synchronisation at the end of backward) and a step it
holds back is neutralized, should the loop call ``optimizer.step()`` anyway, by setting
every gradient aside for that call (optimizers skip parameters without a gradient).

The pre-hook also enforces the order of the phases: ``optimizer.step()`` inside a guarded
step before :meth:`Guard.before_optimizer_step` raises, before anything is applied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .errors import SDCError

__all__ = ["StepGate", "supports_device_skip"]


def supports_device_skip(optimizer: torch.optim.Optimizer) -> bool:
    """The optimizer skips its update on the device given ``found_inf`` (fused ones)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _removed() -> str:
    return "removed"


class StepGate:
    """Applies one step's decision to the optimizer (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, phase: Callable[[], str]) -> None:
        self.optimizer = optimizer
        self.device_skip = supports_device_skip(optimizer)
        self._phase = phase
        self._skip: torch.Tensor | None = None  # device flag for fused optimizers
        self._hold = False  # the host knows: hold this step back
        self._set_found_inf = False
        self._stashed: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None
        self.stepped = False
        self.applied: torch.Tensor | bool = False
        self._handles = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_step_post_hook(self._post),
        ]

    def arm(self, *, skip: torch.Tensor | None, hold: bool) -> None:
        """The decision of the current step: ``hold`` (known on the host), or ``skip`` (a
        device flag, for optimizers that skip on the device)."""
        self._skip = skip if self.device_skip else None
        self._hold = hold
        self.stepped = False
        self.applied = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        # The phase function is the Guard's: holding it on would keep the Guard, its model
        # and the model's process group alive until the garbage collector finds the cycle
        # (see sdc_agent.layout._held_weakly).
        self._phase = _removed

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        phase = self._phase()
        if phase == "backward":
            raise SDCError(
                "optimizer.step() was called before guard.before_optimizer_step(): the "
                "checks of this step have not run, so nothing may be applied yet; call "
                "before_optimizer_step() after backward (it returns whether to step)"
            )
        if phase != "decided":
            return  # not a guarded step (or after after_optimizer_step): not ours
        if self._hold:
            self._stashed = []
            for group in optimizer.param_groups:
                for p in group["params"]:
                    self._stashed.append((p, p.grad))
                    p.grad = None
            return
        if self._skip is not None:
            theirs = getattr(optimizer, "found_inf", None)
            if theirs is None:
                optimizer.found_inf = self._skip  # type: ignore[attr-defined]
                self._set_found_inf = True
            else:
                # A GradScaler drives the step: the larger of its flag and ours. Not their
                # sum: the fused kernels skip only where found_inf is exactly 1 (2 would
                # apply the update and take 2 off the step count).
                ours = self._skip.to(theirs.device, theirs.dtype)
                optimizer.found_inf = torch.maximum(theirs, ours)  # type: ignore[attr-defined]

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._phase() != "decided":
            return
        self.stepped = True
        if self._stashed is not None:
            for p, g in self._stashed:
                p.grad = g
            self._stashed = None
            self.applied = False
            return
        found = getattr(optimizer, "found_inf", None)
        self.applied = (found == 0).reshape(()) if isinstance(found, torch.Tensor) else True
        if self._set_found_inf:
            del optimizer.found_inf  # type: ignore[attr-defined]
            self._set_found_inf = False
