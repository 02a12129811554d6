"""What a check concluded: :class:`Verdict`, and what a guarded step did: :class:`StepResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

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
    """Replay audit only: true when the suspect's other computation at the same audit was
    right (a glitch), false when it was wrong in both (a broken GPU), else unknown."""

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
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    """What :meth:`sdc_agent.Guard.step` did.

    ``applied`` is false when a check failed before the optimizer step, which was then
    skipped. ``clean`` is true when no check failed at this step.
    """

    step: int
    loss: float | None
    applied: bool
    verdicts: tuple[Verdict, ...]

    @property
    def clean(self) -> bool:
        return not self.verdicts
