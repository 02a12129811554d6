"""Check 2 as a unit: the ring replay audit's verdicts (the audit itself is
:mod:`sdc_agent.audit`; its evidence bundle, :mod:`sdc_agent.bundling`).

Before the optimizer step of an audited step: a localized or unresolved finding holds the
step back and becomes a verdict (with its bundle named); non-determinism is reported
once and holds nothing back. The audit vouches for the step when its replays matched.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from .audit import AuditOutcome, ReplayAudit
from .bundling import EvidenceKeeper, name_replay_bundle
from .checks import CheckUnit, StepState
from .errors import ConfigError
from .layout import GradientBucket
from .topology import Topology
from .verdict import Verdict

__all__ = ["NONDETERMINISM_GUIDANCE", "ReplayCheck"]

log = logging.getLogger("sdc_agent")

NONDETERMINISM_GUIDANCE = (
    " Nothing is accused and no step is held back for it. To make the audit sharper, call "
    "sdc_agent.enable_determinism() at start-up and draw all randomness from torch's "
    "generators; guard.gradient_tolerance shows the threshold in force."
)


class ReplayCheck(CheckUnit):
    name = "replay"
    vouches = True

    def __init__(
        self,
        audit: ReplayAudit,
        *,
        enabled: bool,
        topology: Topology,
        module: nn.Module,
        group_rank: int,
        evidence: EvidenceKeeper,
        run_id: str,
        loss_scale: Callable[[], float | None],
        seconds: dict[str, float],
    ) -> None:
        self.audit = audit
        self.enabled = enabled
        self.topology = topology
        self.module = module
        self.group_rank = group_rank
        self.evidence = evidence
        self.run_id = run_id
        self._loss_scale = loss_scale
        self._seconds = seconds
        self.unavailable = False
        """The loop never showed the audit a micro-batch: it never runs."""
        self._audited_clean = False
        self._nondeterminism_reported = False
        self._tolerance_logged: str | None = None

    @staticmethod
    def refuse(module: nn.Module, enabled: bool) -> None:
        """Raise where the audit cannot run on ``module`` at all."""
        if enabled and any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()):
            raise ConfigError(
                "replay_every: the model has SyncBatchNorm, whose forward all-reduces across "
                "ranks, and the replay audit recomputes micro-batches on some ranks only (it "
                "would hang); set replay_every=0 and replay_probability=0, or use BatchNorm"
            )

    @property
    def verifies(self) -> bool:
        # Only audits that can run vouch for steps: without a loss function, without the
        # micro-batch, or on a job whose replays are not reproducible, the audit never
        # vouches, and last_clean_step follows the other checks.
        return (
            self.enabled
            and self.audit.verifies
            and self.audit.loss_fn is not None
            and not self.unavailable
        )

    def begin(self, state: StepState) -> None:
        self._audited_clean = False
        self.audit.begin(state.step)

    def on_forward(self, state: StepState) -> None:
        self.audit.forward_starts()  # the RNG and autocast state the replay needs

    def on_gradients(self, bucket: GradientBucket) -> None:
        self.audit.observe_bucket(bucket)  # type: ignore[arg-type]

    def on_local_gradient(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        self.audit.observe_gradient(param, grad)

    def before_step(self, state: StepState) -> None:
        self._note_availability()
        if self.audit.ready and not state.hold:
            self._run(state)

    def vouched(self, state: StepState) -> bool:
        return self._audited_clean or not self.verifies

    def _note_availability(self) -> None:
        if self.audit.payload is not None or self.unavailable:
            return
        # The loop never shows the audit a micro-batch (before_backward not called).
        self.unavailable = True
        if self.enabled:
            warnings.warn(
                "sdc_agent: the replay audit needs the micro-batch and its loss: call "
                "guard.before_backward(batch, loss) after the forward (or use Guard.step); "
                "without it the audit is skipped and last_clean_step follows the other checks",
                RuntimeWarning,
                stacklevel=4,
            )

    def _run(self, state: StepState) -> None:
        started = time.perf_counter()
        outcome = self.audit.audit()
        self._seconds["replay"] += time.perf_counter() - started
        self._log_tolerance()
        finding = outcome.finding
        if finding is not None and finding.classification != "nondeterministic":
            verdict = self._verdict(state, outcome)
            if outcome.source is not None:
                started = time.perf_counter()
                bundle = name_replay_bundle(
                    self.evidence,
                    outcome,
                    audit=self.audit,
                    topology=self.topology,
                    module=self.module,
                    step=state.step,
                    run_id=self.run_id,
                    loss_scale=self._loss_scale,
                )
                verdict = dataclasses.replace(verdict, bundle=bundle)
                self._seconds["replay"] += time.perf_counter() - started
            state.verdicts.append(verdict)
            state.hold = True
            return
        self._audited_clean = outcome.vouches
        note = outcome.learned or (finding.message if finding is not None else None)
        if note is not None:
            self._report_nondeterminism(state, note, outcome)

    def _report_nondeterminism(self, state: StepState, note: str, outcome: AuditOutcome) -> None:
        if self._nondeterminism_reported:
            log.log(logging.INFO if self.group_rank == 0 else logging.DEBUG, "sdc_agent: %s", note)
            return
        self._nondeterminism_reported = True
        state.verdicts.append(
            Verdict(
                check="replay",
                step=state.step,
                classification="nondeterministic",
                suspect_ranks=(),
                suspect_nodes=(),
                localized=False,
                last_clean_step=state.last_clean_step,
                message=note + NONDETERMINISM_GUIDANCE,
                evidence=outcome.evidence,
            )
        )

    def _log_tolerance(self) -> None:
        noise = self.audit.noise
        if noise.bit_reproducible is None:
            return
        now = noise.describe()  # the loss's threshold and the gradients'
        if now == self._tolerance_logged:
            return
        self._tolerance_logged = now
        log.log(
            logging.INFO if self.group_rank == 0 else logging.DEBUG,
            "sdc_agent: replay audit threshold: %s",
            now,
        )

    def _verdict(self, state: StepState, outcome: AuditOutcome) -> Verdict:
        finding = outcome.finding
        assert finding is not None
        return Verdict(
            check="replay",
            step=state.step,
            classification=finding.classification,  # type: ignore[arg-type]
            suspect_ranks=tuple(self.topology.global_rank(r) for r in finding.suspects),
            suspect_nodes=self.topology.nodes_of(finding.suspects),
            localized=finding.localized,
            last_clean_step=state.last_clean_step,
            message=finding.message,
            evidence=outcome.evidence,
            transient=finding.transient,
            corroborated=finding.corroborated,
        )
