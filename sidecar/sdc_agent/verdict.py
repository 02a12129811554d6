"""What a check concluded: :class:`Verdict`, and what a guarded step did: :class:`StepResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

__all__ = ["CHECKS", "CLASSIFICATIONS", "NOT_HARDWARE", "StepResult", "Verdict"]

Check = Literal["nonfinite", "replay", "weights"]
CHECKS: tuple[str, ...] = ("nonfinite", "replay", "weights")

Classification = Literal["rank", "collective", "training", "replica", "nondeterministic"]
CLASSIFICATIONS: dict[str, str] = {
    "rank": "one or more ranks computed something the others did not: suspect hardware",
    "collective": "every input to the all-reduce was finite but a reduced result was not",
    "training": "the data or the model, not hardware (every rank at once, or a replay on "
    "another node reproduced it)",
    "replica": "model replicas that must be identical are not",
    "nondeterministic": "replays differ in a way no faulty GPU explains: the model is not "
    "deterministic",
}
# Classifications that must never lead to a quarantined node.
NOT_HARDWARE = frozenset({"training", "nondeterministic"})


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """A failed check.

    ``suspect_ranks`` are global ranks. ``localized`` is false when the check saw the fault
    but cannot tell which of the named ranks caused it (two replicas that differ, a tie);
    then ``suspect_ranks`` lists every candidate. ``accuses_hardware`` is false for
    classifications that point at the training itself, which must never quarantine a node.
    """

    check: Check
    step: int
    classification: Classification
    suspect_ranks: tuple[int, ...]
    suspect_nodes: tuple[str, ...]
    localized: bool
    last_clean_step: int
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    transient: bool | None = None
    """True when the suspect recomputed its own work and got the right result this time
    (a glitch), false when it reproduced the wrong result (a broken GPU), else unknown."""
    corroborated: bool | None = None
    """True when an independent recomputation on another node supports accusing the
    suspects (two other nodes agree with each other and not with the suspect; the
    suspect's micro-batch was finite elsewhere); false when the verdict rests on one
    observation that cannot separate hardware from data (one collective, one
    computation); ``None`` for verdicts that accuse nobody."""
    bundle: str | None = None
    """Where the evidence bundle that recomputes the failing micro-batch is, or is being,
    written (``<dir>/sdc-evidence/<run>-<step>-r<rank>``; see :mod:`sdc_agent.bundle`):
    named on localized, persistent replay verdicts when a directory is known, before
    the bundle is complete (the confirmation waits for it). ``None``: no bundle."""

    @property
    def accuses_hardware(self) -> bool:
        return self.classification not in NOT_HARDWARE and bool(self.suspect_ranks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "step": self.step,
            "classification": self.classification,
            "suspect_ranks": list(self.suspect_ranks),
            "suspect_nodes": list(self.suspect_nodes),
            "localized": self.localized,
            "last_clean_step": self.last_clean_step,
            "message": self.message,
            "evidence": self.evidence,
            "transient": self.transient,
            "corroborated": self.corroborated,
            "bundle": self.bundle,
        }


class StepResult:
    """What a guarded step did.

    ``applied`` is false when the optimizer step was held back (a check failed, or a
    GradScaler skipped it). ``clean`` is true when no check failed at this step. ``loss``
    and ``applied`` may live on the device until read: reading them is what waits for
    the device, so a loop that never reads them never synchronises for them.
    """

    __slots__ = ("_applied", "_loss", "step", "verdicts")

    def __init__(
        self,
        *,
        step: int,
        loss: torch.Tensor | float | None,
        applied: torch.Tensor | bool,
        verdicts: tuple[Verdict, ...],
    ) -> None:
        self.step = step
        self.verdicts = verdicts
        self._loss = loss
        self._applied = applied

    @property
    def loss(self) -> float | None:
        """The step's loss (the mean over micro-batches in :meth:`Guard.step`)."""
        if isinstance(self._loss, torch.Tensor):
            self._loss = float(self._loss.detach().float().item())
        return self._loss

    @property
    def applied(self) -> bool:
        if isinstance(self._applied, torch.Tensor):
            self._applied = bool(self._applied.item())
        return self._applied

    @property
    def clean(self) -> bool:
        return not self.verdicts

    def __repr__(self) -> str:
        return (
            f"StepResult(step={self.step}, loss={self.loss}, applied={self.applied}, "
            f"verdicts={self.verdicts!r})"
        )
