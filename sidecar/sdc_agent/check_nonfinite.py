"""Check 1 as a unit: the verdict on the step's non-finite flags.

The flags are raised on the device while the layout scales each bucket before its
collective and travel behind the step's last one (:mod:`sdc_agent.nonfinite`); the Guard
reads them where its gate allows and hands them to :meth:`NonFiniteCheck.judge`. A rank
alone non-finite is replayed on another node (the audit's ring) before it is accused: the
same micro-batch non-finite there too is the data or the model, not hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .audit import ReplayAudit
from .checks import CheckUnit, StepState
from .nonfinite import NonFiniteFinding, classify_nonfinite
from .replay import Payload
from .topology import Topology
from .verdict import Verdict

__all__ = ["LateMicroBatch", "NonFiniteCheck"]


@dataclass(frozen=True, slots=True)
class LateMicroBatch:
    """The micro-batch of a step whose flags are judged during the next step."""

    payload: Payload | None
    micro_batches: int


class NonFiniteCheck(CheckUnit):
    name = "nonfinite"

    def __init__(
        self,
        *,
        enabled: bool,
        topology: Topology,
        audit: ReplayAudit,
        scaled: bool,
        collective: str = "all-reduce",
    ) -> None:
        self.enabled = enabled
        self.collective = collective
        """The layout's gradient collective, as verdicts name it."""
        self.topology = topology
        self.audit = audit
        self.scaled = scaled
        """A GradScaler drives the steps: an overflow on every rank is its business."""

    def judge(
        self,
        state: StepState,
        before: list[bool],
        late: LateMicroBatch | None = None,
        after: list[bool] | None = None,
    ) -> None:
        """The flags of ``state``'s step reached the host: ``before[r]``, rank ``r``'s
        local gradients were not finite; ``after[r]`` (where the layout checks them), its
        reduced gradients were not. A collective when one rank alone was (the replay on
        another node). ``late``: the step's micro-batch, where its flags are read during
        the next step (the audit holds that step's by then)."""
        if not self.enabled:
            return
        finding = classify_nonfinite(before, after, self.collective)
        if finding is None:
            return
        state.hold = True
        verdict = self._verdict(state, finding, before, late, after)
        if verdict is not None:
            state.verdicts.append(verdict)

    def _verdict(
        self,
        state: StepState,
        finding: NonFiniteFinding,
        before: list[bool],
        late: LateMicroBatch | None,
        after: list[bool] | None = None,
    ) -> Verdict | None:
        topology = self.topology
        evidence: dict[str, Any] = {
            "nonfinite_before_allreduce": [
                topology.global_rank(r) for r, bad in enumerate(before) if bad
            ]
        }
        if after is not None:
            # A sharded layout: each rank's reduced shard was checked too.
            evidence["gradient_collective"] = self.collective
            evidence["nonfinite_after_collective"] = [
                topology.global_rank(r) for r, bad in enumerate(after) if bad
            ]
        classification, suspects, localized, message = (
            finding.classification,
            finding.suspects,
            finding.localized,
            finding.message,
        )
        corroborated: bool | None = None
        transient: bool | None = None
        audit = self.audit
        payload = audit.payload if late is None else late.payload
        micro_batches = audit.micro_batches if late is None else late.micro_batches
        if classification == "rank":
            corroborated = False
            if payload is None:
                evidence["replayed_elsewhere_nonfinite"] = "not replayed: no micro-batch"
            elif micro_batches > 1:
                # Only one micro-batch travels: a replay of it says nothing about the rest.
                evidence["replayed_elsewhere_nonfinite"] = "not replayed: gradient accumulation"
            elif audit.loss_fn is not None:
                replayed = audit.replay_nonfinite(suspects, payload)
                evidence["replayed_elsewhere_nonfinite"] = {
                    str(topology.global_rank(p)): bad for p, (bad, _) in replayed.items()
                }
                if (
                    replayed
                    and len(replayed) == len(suspects)
                    and all(bad for bad, _ in replayed.values())
                ):
                    classification, suspects, localized = "training", (), False
                    corroborated = None
                    message += "; replayed on another node and non-finite again: the data or "
                    message += "the model, not hardware"
                elif replayed and len(replayed) == len(suspects):
                    corroborated = True
                    transient = not all(again for _, again in replayed.values())
                    message += "; a replay on another node was finite"
                    message += (
                        " and the suspect's own recomputation was finite too (transient)"
                        if transient
                        else ", the suspect's own recomputation non-finite again (persistent)"
                    )
        if classification == "training" and self.scaled:
            return None  # overflow: GradScaler's business (it skips the step and backs off)
        return Verdict(
            check="nonfinite",
            step=state.step,
            classification=classification,  # type: ignore[arg-type]
            suspect_ranks=tuple(topology.global_rank(r) for r in suspects),
            suspect_nodes=topology.nodes_of(suspects),
            localized=localized,
            last_clean_step=state.last_clean_step,
            message=message,
            evidence=evidence,
            transient=transient,
            corroborated=corroborated,
        )
