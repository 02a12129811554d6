"""The training-loop entry point: :class:`Guard`."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .audit import AuditOutcome, ReplayAudit, ReplayStats
from .bundling import EvidenceKeeper, name_replay_bundle
from .checkpoint import mark_checkpoint
from .config import GuardConfig
from .errors import ConfigError, OperatorUnreachableError, SDCError
from .fault_sites import FaultSites
from .faults import FaultInjector
from .fingerprint import Fingerprinter
from .gate import StepGate
from .nonfinite import NonFiniteFinding, StepFlags, classify_nonfinite
from .replay import RngState, map_tensors
from .reporter import Reporter
from .reporting import GuardReporting
from .topology import Topology, exchange_identities, local_node_name
from .verdict import StepResult, Verdict
from .weights import WeightFingerprints, keeps_replicas_apart

__all__ = ["Guard"]

log = logging.getLogger("sdc_agent")

LossFn = Callable[[nn.Module, Any], torch.Tensor]

IDLE, STEP, DECIDED = "idle", "backward", "decided"

NONDETERMINISM_GUIDANCE = (
    " Nothing is accused and no step is held back for it. To make the audit sharper, call "
    "sdc_agent.enable_determinism() at start-up and draw all randomness from torch's "
    "generators; guard.gradient_tolerance shows the threshold in force."
)


class Guard:
    """Runs the checks around every training step of a DDP model.

    The shortest form does the whole step::

        guard = sdc_agent.Guard(ddp_model, optimizer, loss_fn)
        for batch in loader:
            result = guard.step(batch)   # forward, backward, checks, optimizer step if clean

    A loop that owns its backward and optimizer step calls the phases (every check, the
    replay audit included, works there)::

        loss = loss_fn(ddp_model, batch)           # the forward pass
        guard.before_backward(batch, loss)         # what the audit replays
        scaler.scale(loss).backward()              # anything: accumulation, GradScaler...
        if guard.before_optimizer_step():          # checks 1 and 2; False: hold back
            scaler.step(optimizer)                 # (a fused optimizer skips on the device)
        scaler.update()
        result = guard.after_optimizer_step()      # check 3, bookkeeping, reports

    Creating a Guard is a collective (the ranks exchange identities and settings), as are
    :meth:`before_optimizer_step`, :meth:`after_optimizer_step` and :meth:`close`: every
    rank of the data-parallel group must call them, in the same order. The Guard registers
    the model's DDP communication hook (a model has only one), a forward pre-hook on the
    DDP model and step hooks on the optimizer.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn | None = None,
        config: GuardConfig | None = None,
        *,
        start_step: int = 0,
        reporter: Reporter | Literal["auto"] | None = "auto",
        scaler: Any = None,
    ) -> None:
        self._validate_arguments(model, optimizer, loss_fn, config, start_step, scaler)
        assert isinstance(model, DistributedDataParallel)
        self._phase = IDLE
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scaler = scaler
        self.config = config if config is not None else GuardConfig.from_env()
        self.group: dist.ProcessGroup | None = getattr(model, "process_group", None)
        self.rank = dist.get_rank()
        self.group_rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        first = next(model.module.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        """The model's device: where the step's flags live (not the current CUDA device,
        which is ``cuda:0`` on every rank that never called ``set_device``)."""
        backend = str(dist.get_backend(self.group))
        if "nccl" in backend and self.device.type != "cuda":
            raise ConfigError(f"model: an NCCL group needs the model on CUDA, got {self.device}")
        self.comm_device = self.device if "nccl" in backend else torch.device("cpu")
        self._check_model(model.module)

        self._gate = StepGate(optimizer, lambda: self._phase)
        try:
            self.topology, self.run_id = self._start_up_exchange()
            self._build_checks(model, loss_fn)
        except BaseException:
            self._gate.remove()  # a Guard that failed to start leaves nothing behind
            raise
        model.register_comm_hook(state=None, hook=_held_weakly(self))
        self._forward_handle = model.register_forward_pre_hook(self._forward_pre)
        self._reporting = GuardReporting(
            reporter,
            config=self.config,
            topology=self.topology,
            group_rank=self.group_rank,
            group=self.group,
            comm_device=self.comm_device,
            run_id=self.run_id,
            replayer_of=lambda: self._audit.replayer_of,
        )
        self.reports = self._reporting.reports
        self.reporter = self._reporting.reporter
        self._stop_when_unreachable = self._reporting.stop_when_unreachable
        self._evidence = EvidenceKeeper(
            self.config.bundles, self.group, self.comm_device, self.group_rank
        )

        self.step_count = start_step
        """Steps begun so far; the current step while one is running."""
        self.last_clean_step = start_step
        """The newest step at which every check passed and, with the weight check on,
        the replicas' weights were verified identical. A checkpoint of that step or an
        earlier one is safe to resume from."""
        self.weights_diverged = False
        """Set when check 3 failed: the replicas' weights differ, and no later step can
        be clean until the job restores a checkpoint (see :meth:`restore`)."""
        self._settling = False  # in _settle: the hook only all-reduces
        # A resumed job (start_step, restore): the next step first settles DDP's buckets.
        self._settle_buckets = start_step > 0
        self._grad_verdicts: list[Verdict] = []
        self._hold = False
        self._flags_read = False
        self._audited_clean = False
        self._replay_unavailable = False
        self._nondeterminism_reported = False
        self._reported_weight_suspects: tuple[int, ...] = ()
        self._tolerance_logged: str | None = None
        # The newest step each verifying check vouched for; last_clean_step is the oldest.
        self._verified = {"weights": start_step, "replay": start_step}

    # -- construction ----------------------------------------------------------------------

    def _build_checks(self, model: DistributedDataParallel, loss_fn: LossFn | None) -> None:
        self._fingerprinter = Fingerprinter(self.config.fingerprint_backend)
        self._flags = StepFlags(self.world_size, self.group_rank, self.device)
        self._weights = WeightFingerprints(
            model.module,
            self.optimizer,
            self._fingerprinter,
            self.config.weights_include_optimizer_state,
        )
        self._warm_up(model.module)
        self._injector = FaultInjector(self.config.faults, self.rank)
        self._injector.attach(model.module)
        self._faults = FaultSites(self._injector, model.module)
        self._audit = ReplayAudit(
            module=model.module,
            loss_fn=loss_fn,
            topology=self.topology,
            group=self.group,
            comm_device=self.comm_device,
            fingerprinter=self._fingerprinter,
            injector=self._injector,
            every=self.config.replay_every,
            probability=self.config.replay_probability,
            calibrate=self.config.replay_mode == "calibrate",
        )

    @staticmethod
    def _validate_arguments(
        model: nn.Module,
        optimizer: object,
        loss_fn: object,
        config: object,
        start_step: object,
        scaler: object,
    ) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise ConfigError(
                f"model: must be wrapped in torch.nn.parallel.DistributedDataParallel, "
                f"got {type(model).__name__}"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer: must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if loss_fn is not None and not callable(loss_fn):
            raise ConfigError("loss_fn: must be callable as loss_fn(model, batch)")
        if config is not None and not isinstance(config, GuardConfig):
            raise ConfigError(f"config: must be a GuardConfig, got {type(config).__name__}")
        if not isinstance(start_step, int) or start_step < 0:
            raise ConfigError(f"start_step: must be an integer >= 0, got {start_step!r}")
        if scaler is not None and not hasattr(scaler, "get_scale"):
            raise ConfigError(
                f"scaler: must be a torch.amp.GradScaler, got {type(scaler).__name__}"
            )
        if not dist.is_initialized():
            raise SDCError("torch.distributed is not initialized: call init_process_group first")

    def _check_model(self, module: nn.Module) -> None:
        if self.config.replay_enabled and any(
            isinstance(m, nn.SyncBatchNorm) for m in module.modules()
        ):
            raise ConfigError(
                "replay_every: the model has SyncBatchNorm, whose forward all-reduces across "
                "ranks, and the replay audit recomputes micro-batches on some ranks only (it "
                "would hang); set replay_every=0 and replay_probability=0, or use BatchNorm"
            )
        if self.config.weights_every > 0 and keeps_replicas_apart(self.optimizer):
            raise ConfigError(
                "weights_every: PostLocalSGDOptimizer keeps the replicas apart between its "
                "averaging steps, so check 3 would accuse every rank; set weights_every=0"
            )

    def _start_up_exchange(self) -> tuple[Topology, str]:
        """One all-gather: identities, the settings that must agree, the run id."""
        agreed = {
            **self.config.agreed(),
            "optimizer": type(self.optimizer).__name__,
            "device_skip": self._gate.device_skip,
            "scaler": self.scaler is not None,
        }
        extra = {"agreed": agreed, "run_id": uuid.uuid4().hex[:16]}
        topology, extras = exchange_identities(
            self.group, local_node_name(self.config.node_name), self.comm_device, extra
        )
        differing = sorted(
            name
            for name in agreed
            if len({json.dumps(e["agreed"].get(name), sort_keys=True) for e in extras}) > 1
        )
        if differing:
            values = "; ".join(
                f"{name}: "
                + ", ".join(
                    f"rank {topology.global_rank(r)}={e['agreed'].get(name)!r}"
                    for r, e in enumerate(extras)
                )
                for name in differing[:4]
            )
            self._gate.remove()
            raise ConfigError(
                f"settings differ between ranks ({', '.join(differing)}), so ranks would run "
                f"different collectives and hang: {values}. Give every rank (the Master and "
                "the Worker templates) the same HYPERPOD_SDC_* settings"
            )
        return topology, str(extras[0]["run_id"])

    def _warm_up(self, module: nn.Module) -> None:
        if self.config.weights_every <= 0 and not self.config.replay_enabled:
            return
        params = list(module.parameters())
        if not params:
            return
        # Compile the fingerprint kernels now, not in the middle of training, and under
        # no_grad: the hooks and the weight check fingerprint without grad mode, and
        # torch.compile guards on it (a kernel warmed up with grad mode on recompiles).
        dtypes = {p.dtype for p in params} | {torch.float32}
        with torch.no_grad():
            self._fingerprinter.warm_up(dtypes, self.device)

    # -- what the Guard knows ------------------------------------------------------------

    @property
    def replay_stats(self) -> ReplayStats:
        """How many replays were compared and how many differed (see ``replay_mode``)."""
        return self._audit.stats

    @property
    def gradient_tolerance(self) -> float | None:
        """The replay audit's detection threshold in force for the gradients: relative
        differences of a gradient tensor's statistics up to it are taken for the job's
        run-to-run noise. 0: bit-reproducible so far, any difference is evidence.
        ``None``: no audit yet. The loss has its own threshold, raised only by loss
        differences (0 unless the forward itself varies); the agent log gives both."""
        noise = self._audit.noise
        return None if noise.bit_reproducible is None else noise.largest

    @property
    def bit_reproducible(self) -> bool | None:
        """Whether every replay so far matched its original bit for bit (``None``: no
        audit yet)."""
        return self._audit.noise.bit_reproducible

    @property
    def fingerprint_kernel(self) -> str:
        """``compiled`` or ``eager``: the fingerprint kernel that runs (eager is the slow
        path; see :attr:`sdc_agent.Fingerprinter.kernel`)."""
        return self._fingerprinter.kernel

    # -- the shortest form ---------------------------------------------------------------

    def step(self, batch: Any = None, *, micro_batches: Sequence[Any] | None = None) -> StepResult:
        """Forward, backward, checks, and the optimizer step when the checks pass.

        With ``micro_batches`` (gradient accumulation) every micro-batch's loss is divided
        by their number before backward, gradients are all-reduced once, after the last,
        and the replay audit checks the first micro-batch. ``result.loss`` is then the mean.
        """
        if self.loss_fn is None:
            raise ConfigError("loss_fn: Guard.step needs one; pass loss_fn(model, batch)")
        if micro_batches is None:
            micro_batches = [batch]
        elif batch is not None:
            raise ConfigError("micro_batches: pass either batch or micro_batches, not both")
        elif len(micro_batches) == 0:
            raise ConfigError("micro_batches: must hold at least one micro-batch")
        count = len(micro_batches)
        if self._settle_buckets:
            self._settle_buckets = False
            self._settle(micro_batches[0])
        self.optimizer.zero_grad(set_to_none=True)
        self.begin_step()
        total: torch.Tensor | None = None  # stays on the device
        for j, micro in enumerate(micro_batches):
            last = j == count - 1
            audited = micro
            if j == 0 and self._audit.due:  # before the forward, which may change it
                audited = map_tensors(micro, lambda t: t.detach().clone())
            with contextlib.nullcontext() if last else self.model.no_sync():
                loss = self.loss_fn(self.model, micro)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise SDCError("loss_fn must return a scalar tensor")
                self._record_micro_batch(audited, loss, copy=False)
                (loss / count if count > 1 else loss).backward()
            total = loss.detach().float() if total is None else total + loss.detach().float()
        applied = self.before_optimizer_step()
        if applied:
            self.optimizer.step()
        assert total is not None
        return self.after_optimizer_step(loss=total / count)

    # -- the phases ----------------------------------------------------------------------

    def begin_step(self) -> int:
        """Start a step explicitly (optional: the model's first forward starts one).
        Returns the step number."""
        if self._phase != IDLE:
            raise SDCError("begin_step called twice without finish_step")
        return self._begin()

    def _begin(self) -> int:
        self._phase = STEP
        self.step_count += 1
        self._injector.step = self.step_count
        halt = self._reporting.verdict_overdue()
        self._flags.reset(halt=halt and self._stop_when_unreachable)
        self._grad_verdicts = []
        self._hold = False
        self._flags_read = False
        self._audited_clean = False
        self._audit.begin(self.step_count)
        return self.step_count

    def before_backward(
        self, batch: Any, loss: torch.Tensor, *, loss_fn: LossFn | None = None
    ) -> None:
        """A micro-batch's forward is done: ``batch`` is what ``loss_fn(model, batch)``
        computes ``loss`` from, and ``loss`` (the loss function's value, before any
        division for accumulation or GradScaler's scaling) is about to be backpropagated.

        Call it once per micro-batch; the first of the step is the one the replay audit
        may recompute on another node. The RNG and autocast state it needs were recorded
        when the forward began; the factor the loop applies between ``loss`` and
        ``backward()`` is recorded during backward. Not a collective.
        """
        if self._phase == IDLE:
            raise SDCError(
                "before_backward: no step is running; call it after the step's forward "
                "pass through the DDP model (the forward starts the step)"
            )
        if self._phase == DECIDED:
            raise SDCError(
                "before_backward called after before_optimizer_step: a step's backward "
                "passes come before its checks"
            )
        if loss_fn is not None:
            if not callable(loss_fn):
                raise ConfigError("loss_fn: must be callable as loss_fn(model, batch)")
            self.loss_fn = loss_fn
            self._audit.set_loss_fn(loss_fn)
        self._record_micro_batch(batch, loss, copy=True)

    def _record_micro_batch(self, batch: Any, loss: torch.Tensor, *, copy: bool) -> None:
        syncs = bool(getattr(self.model, "require_backward_grad_sync", True))
        self._audit.micro_batch(batch, loss, syncs=syncs, copy=copy)

    def before_optimizer_step(self) -> bool:
        """After backward: checks 1 and 2 across ranks; false when the step must be held
        back. A collective.

        Where the optimizer skips on the device (``fused=True``), a non-finite gradient
        holds the step back there, with no host synchronisation, and this returns true:
        call ``optimizer.step()`` (or ``scaler.step``) as usual. Calling it after a false
        return is safe too: the step then changes nothing. With ``scaler=`` a held step
        has its gradients unscaled here, so ``scaler.update()`` works without
        ``scaler.step()`` (and backs off only if the scaler itself found an overflow).
        """
        if self._phase == IDLE:
            raise SDCError(
                "before_optimizer_step called outside a step: the step's forward and "
                "backward come first"
            )
        if self._phase == DECIDED:
            raise SDCError("before_optimizer_step called twice in one step")
        started = time.perf_counter()
        if self._flags_wanted and not self._flags.sent:
            self._flags.send(self.group)  # no bucket went through the hook (no_sync?)
        skip = self._flags.skip_tensor() if self._flags_wanted else None
        # The host reads the flags now unless the optimizer skips on the device and the
        # device is a GPU (then after the optimizer step is queued, in after_optimizer_step).
        if self._flags_wanted and (
            not self._gate.device_skip or self.device.type != "cuda" or self._audit.due
        ):
            self._read_flags()
        self._reporting.check_seconds["nonfinite"] += time.perf_counter() - started
        self._note_replay_availability()
        if self._audit.due and self._audit.payload is not None and not self._hold:
            self._run_audit()
        self._gate.arm(skip=skip, hold=self._hold)
        if self._hold and self.scaler is not None:
            self._let_the_scaler_keep_its_books()
        self._phase = DECIDED
        return not self._hold

    def _let_the_scaler_keep_its_books(self) -> None:
        # A loop that skips scaler.step() still calls scaler.update(), which needs the
        # scaler to have checked this step's gradients: unscale them (the step is held
        # back, so nothing uses them). Already unscaled (clipping): nothing to do.
        with contextlib.suppress(RuntimeError):
            self.scaler.unscale_(self.optimizer)

    def _read_flags(self) -> None:
        self._flags_read = True
        before, halt = self._flags.read()
        if halt:
            self._phase = IDLE
            raise OperatorUnreachableError(
                f"a verdict could not be delivered to the operator within "
                f"{self.config.report_deadline_seconds:g} s; unreachable_policy='stop' stops "
                "training here, before another step is applied"
            )
        if not self.config.nonfinite_check:
            return
        finding = classify_nonfinite(before)
        if finding is None:
            return
        self._hold = True
        verdict = self._nonfinite_verdict(finding, before)
        if verdict is not None:
            self._grad_verdicts.append(verdict)

    @property
    def _flags_wanted(self) -> bool:
        return self.config.nonfinite_check or self._stop_when_unreachable

    def _note_replay_availability(self) -> None:
        if self._audit.payload is not None or self._replay_unavailable:
            return
        # The loop never shows the audit a micro-batch (before_backward not called).
        self._replay_unavailable = True
        if self.config.replay_enabled:
            warnings.warn(
                "sdc_agent: the replay audit needs the micro-batch and its loss: call "
                "guard.before_backward(batch, loss) after the forward (or use Guard.step); "
                "without it the audit is skipped and last_clean_step follows the other checks",
                RuntimeWarning,
                stacklevel=3,
            )

    def _run_audit(self) -> None:
        started = time.perf_counter()
        outcome = self._audit.audit()
        self._reporting.check_seconds["replay"] += time.perf_counter() - started
        self._log_tolerance()
        finding = outcome.finding
        if finding is not None and finding.classification != "nondeterministic":
            verdict = self._replay_verdict(outcome)
            if outcome.source is not None:
                started = time.perf_counter()
                bundle = name_replay_bundle(
                    self._evidence,
                    outcome,
                    audit=self._audit,
                    topology=self.topology,
                    module=self.model.module,
                    step=self.step_count,
                    run_id=self.run_id,
                    loss_scale=self._loss_scale,
                )
                verdict = dataclasses.replace(verdict, bundle=bundle)
                self._reporting.check_seconds["replay"] += time.perf_counter() - started
            self._grad_verdicts.append(verdict)
            self._hold = True
            return
        self._audited_clean = outcome.vouches
        note = outcome.learned or (finding.message if finding is not None else None)
        if note is not None:
            self._report_nondeterminism(note, outcome)

    def _loss_scale(self) -> float | None:
        return None if self.scaler is None else float(self.scaler.get_scale())

    def _report_nondeterminism(self, note: str, outcome: AuditOutcome) -> None:
        if self._nondeterminism_reported:
            log.log(logging.INFO if self.group_rank == 0 else logging.DEBUG, "sdc_agent: %s", note)
            return
        self._nondeterminism_reported = True
        self._grad_verdicts.append(
            Verdict(
                check="replay",
                step=self.step_count,
                classification="nondeterministic",
                suspect_ranks=(),
                suspect_nodes=(),
                localized=False,
                last_clean_step=self.last_clean_step,
                message=note + NONDETERMINISM_GUIDANCE,
                evidence=outcome.evidence,
            )
        )

    def _log_tolerance(self) -> None:
        if self.gradient_tolerance is None:
            return
        now = self._audit.noise.describe()  # the loss's threshold and the gradients'
        if now == self._tolerance_logged:
            return
        self._tolerance_logged = now
        log.log(
            logging.INFO if self.group_rank == 0 else logging.DEBUG,
            "sdc_agent: replay audit threshold: %s",
            now,
        )

    def after_optimizer_step(self, *, loss: torch.Tensor | float | None = None) -> StepResult:
        """After the optimizer step (or after skipping it): check 3, bookkeeping, reports.
        A collective. ``loss``: what ``result.loss`` shows (default: the audited
        micro-batch's loss)."""
        if self._phase != DECIDED:
            raise SDCError(
                "after_optimizer_step called before before_optimizer_step: the checks of "
                "this step have not run"
                if self._phase == STEP
                else "after_optimizer_step called outside a step"
            )
        if self._flags_wanted and not self._flags_read:
            self._read_flags()  # the optimizer step is already queued on the device
        applied = self._gate.applied if self._gate.stepped else False
        if loss is None:
            loss = self._audit.own_loss
        return self._finish(applied, loss)

    def _finish(
        self, applied: torch.Tensor | bool, loss: torch.Tensor | float | None
    ) -> StepResult:
        step = self.step_count
        self._faults.weights(applied)
        verdicts = list(self._grad_verdicts)
        weights_checked = self.config.weights_every > 0 and step % self.config.weights_every == 0
        if weights_checked:
            started = time.perf_counter()
            verdict = self._check_weights(step)
            self._reporting.check_seconds["weights"] += time.perf_counter() - started
            if verdict is not None:
                # Diverged weights stay diverged: report each new split once.
                if verdict.suspect_ranks != self._reported_weight_suspects:
                    verdicts.append(verdict)
                    self._reported_weight_suspects = verdict.suspect_ranks
                self.weights_diverged = True
        blocking = [v for v in verdicts if v.classification != "nondeterministic"]
        if not blocking and not self.weights_diverged:
            if weights_checked or self.config.weights_every == 0:
                self._verified["weights"] = step
            if self._audited_clean or not self._replay_verifies:
                self._verified["replay"] = step
            self.last_clean_step = min(self._verified.values())
        for v in verdicts:
            log.log(
                logging.WARNING if self.group_rank == 0 else logging.DEBUG,
                "sdc_agent verdict at step %d (%s check): %s",
                step,
                v.check,
                v.message,
            )
        self._reporting.step_done(
            step,
            verdicts,
            last_clean_step=self.last_clean_step,
            fingerprint_kernel=self.fingerprint_kernel,
            gradient_tolerance=self.gradient_tolerance,
            bit_reproducible=self.bit_reproducible,
        )
        self._phase = IDLE
        return StepResult(step=step, loss=loss, applied=applied, verdicts=tuple(verdicts))

    # The phases under their first names.

    def check_gradients(self) -> bool:
        """After backward: :meth:`before_optimizer_step`, under its first name."""
        return self.before_optimizer_step()

    def finish_step(self, *, applied: bool, loss: torch.Tensor | float | None = None) -> StepResult:
        """:meth:`after_optimizer_step`, under its first name. ``applied``: whether the
        loop ran the optimizer step (the Guard also sees it through the optimizer)."""
        if self._phase != DECIDED:
            raise SDCError("finish_step called outside a step: call begin_step first")
        if self._flags_wanted and not self._flags_read:
            self._read_flags()
        seen = self._gate.applied if self._gate.stepped else False
        return self._finish(seen if applied else False, loss)

    # -- verdicts --------------------------------------------------------------------------

    def _nonfinite_verdict(self, finding: NonFiniteFinding, before: list[bool]) -> Verdict | None:
        evidence: dict[str, Any] = {"nonfinite_before_allreduce": self._global(before)}
        classification, suspects, localized, message = (
            finding.classification,
            finding.suspects,
            finding.localized,
            finding.message,
        )
        corroborated: bool | None = None
        transient: bool | None = None
        payload = self._audit.payload
        if classification == "rank":
            corroborated = False
            if payload is None:
                evidence["replayed_elsewhere_nonfinite"] = "not replayed: no micro-batch"
            elif self._audit.micro_batches > 1:
                # Only the first micro-batch travels: a replay of it says nothing about the rest.
                evidence["replayed_elsewhere_nonfinite"] = "not replayed: gradient accumulation"
            elif self._audit.loss_fn is not None:
                replayed = self._audit.replay_nonfinite(suspects)
                evidence["replayed_elsewhere_nonfinite"] = {
                    str(self.topology.global_rank(p)): bad for p, (bad, _) in replayed.items()
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
        if classification == "training" and self.scaler is not None:
            return None  # overflow: GradScaler's business (it skips the step and backs off)
        return Verdict(
            check="nonfinite",
            step=self.step_count,
            classification=classification,  # type: ignore[arg-type]
            suspect_ranks=tuple(self.topology.global_rank(r) for r in suspects),
            suspect_nodes=self.topology.nodes_of(suspects),
            localized=localized,
            last_clean_step=self.last_clean_step,
            message=message,
            evidence=evidence,
            transient=transient,
            corroborated=corroborated,
        )

    def _replay_verdict(self, outcome: AuditOutcome) -> Verdict:
        finding = outcome.finding
        assert finding is not None
        return Verdict(
            check="replay",
            step=self.step_count,
            classification=finding.classification,  # type: ignore[arg-type]
            suspect_ranks=tuple(self.topology.global_rank(r) for r in finding.suspects),
            suspect_nodes=self.topology.nodes_of(finding.suspects),
            localized=finding.localized,
            last_clean_step=self.last_clean_step,
            message=finding.message,
            evidence=outcome.evidence,
            transient=finding.transient,
            corroborated=finding.corroborated,
        )

    # -- checkpoints, resume ---------------------------------------------------------------

    def restore(self, step: int, location: str | None = None) -> None:
        """The job reloaded a checkpoint of ``step``: count from there, weights trusted.

        With a reporter, tells the operator (a ``resume`` report, with the checkpoint's
        ``location`` if given): that is how an incident learns its job is running again.
        """
        if self._phase != IDLE:
            raise SDCError("restore called during a step")
        self.step_count = step
        self.last_clean_step = step
        self.weights_diverged = False
        self._reported_weight_suspects = ()
        self._verified = {"weights": step, "replay": step}
        # A fresh DDP model reduces its first step's gradients in its initial bucket layout,
        # then rebuilds the buckets in the order gradients became ready. The all-reduce
        # sums element by element in an order that depends on the element's place in the
        # bucket, so (with more than two ranks) that first step is not bitwise the step an
        # uninterrupted run took at this point. The next Guard.step settles the layout
        # first (see _settle), so a resumed run reproduces an uninterrupted one exactly.
        self._settle_buckets = True
        self._reporting.resumed(step, location)

    def mark_checkpoint(self, path: str | os.PathLike[str], step: int | None = None) -> bool:
        """Record the checkpoint just written at ``path`` for ``step`` (default: the current
        step): verified when every check vouched for it. Writes the marker
        :func:`~sdc_agent.checkpoint.select_checkpoint` reads and, on a reporting rank,
        tells the operator, which resumes a job only if it knows a verified checkpoint old
        enough. Call it on the rank that wrote the checkpoint; returns ``verified``.

        The directory holding ``path`` is also where evidence bundles go, unless
        ``bundle_dir`` says otherwise (:class:`~sdc_agent.bundle.BundleSettings`)."""
        step = self.step_count if step is None else step
        verified = step <= self.last_clean_step
        mark_checkpoint(
            path, step, verified=verified, reporter=self.reporter, identity=self._reporting.identity
        )
        self._evidence.note_checkpoint(path)  # evidence bundles go next to checkpoints
        return verified

    @property
    def _replay_verifies(self) -> bool:
        # Only audits that can run vouch for steps: without a loss function, without the
        # micro-batch, or on a job whose replays are not reproducible, the audit never
        # vouches, and last_clean_step follows the other checks.
        return (
            self.config.replay_enabled
            and self._audit.verifies
            and self._audit.loss_fn is not None
            and not self._replay_unavailable
        )

    def close(self, timeout: float = 10.0) -> None:
        """Deliver queued reports (up to ``timeout`` seconds), remove the forward hooks of
        injected faults and the Guard's hooks on the model and optimizer (the comm hook
        stays with DDP). An evidence bundle still being written is finished first (up to
        ``timeout`` seconds too)."""
        self._injector.detach()
        self._forward_handle.remove()
        self._gate.remove()
        self._evidence.close(timeout)  # a bundle still being written is finished first
        self._reporting.close(timeout)

    # -- internals -----------------------------------------------------------------------

    def _global(self, flags: list[bool]) -> list[int]:
        return [self.topology.global_rank(r) for r, bad in enumerate(flags) if bad]

    def _check_weights(self, step: int) -> Verdict | None:
        split, evidence = self._weights.compare(self.group, self.comm_device)
        if split is None:
            return None
        suspects = tuple(self.topology.global_rank(r) for r in split.suspects)
        differing = evidence.get("differing_tensors")
        if isinstance(differing, dict):
            evidence["differing_tensors"] = {
                str(self.topology.global_rank(int(r))): names for r, names in differing.items()
            }
        if split.localized:
            message = (
                f"weights of rank(s) {', '.join(map(str, suspects))} differ from the "
                f"majority of {self.world_size} replicas"
            )
        else:
            message = (
                f"replica weights differ and no majority agrees (ranks "
                f"{', '.join(map(str, suspects))}): cannot tell which is wrong"
            )
        # A strict majority on at least two other nodes is independent evidence.
        majority_nodes = {
            self.topology.node_of(r) for r in range(self.world_size) if r not in split.suspects
        } - set(self.topology.nodes_of(split.suspects))
        return Verdict(
            check="weights",
            step=step,
            classification="replica",
            suspect_ranks=suspects,
            suspect_nodes=self.topology.nodes_of(split.suspects),
            localized=split.localized,
            last_clean_step=self.last_clean_step,
            message=message,
            evidence=evidence,
            corroborated=split.localized and len(majority_nodes) >= 2,
        )

    def _settle(self, batch: Any) -> None:
        """One forward and backward that is not a step, so DDP rebuilds its buckets before
        the first real step after :meth:`restore`: gradients, RNG and buffers (BatchNorm
        statistics) are put back, no check runs, no step is counted."""
        rng = RngState.capture(self.device)  # the model's generator, not cuda:0's
        buffers = [b.detach().clone() for b in self.model.buffers()]
        self._settling = True
        try:
            assert self.loss_fn is not None  # Guard.step checked it
            self.optimizer.zero_grad(set_to_none=True)
            self.loss_fn(self.model, batch).backward()
        finally:
            self._settling = False
            self.optimizer.zero_grad(set_to_none=True)
            rng.restore(self.device)
            with torch.no_grad():
                for b, saved in zip(self.model.buffers(), buffers, strict=True):
                    b.copy_(saved)

    def _inject_grad(self, site: str, bucket: dist.GradBucket, tensor: torch.Tensor) -> None:
        self._faults.gradients(
            site,
            index=bucket.index(),
            buffer=bucket.buffer(),
            parameters=bucket.parameters(),
            gradients=bucket.gradients(),
            tensor=tensor,
        )

    def _forward_pre(self, _module: nn.Module, _args: Any) -> None:
        if self._settling or not torch.is_grad_enabled():
            return  # evaluation forwards are not steps
        if self._phase == DECIDED:
            raise SDCError(
                "a training forward began before guard.after_optimizer_step(): finish the "
                "previous step first"
            )
        if self._phase == IDLE:
            self._begin()
        self._audit.forward_starts()

    def _comm_hook(
        self, _state: object, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if self._settling:  # the same arithmetic, nothing observed or injected
            buffer.mul_(1.0 / self.world_size)
            return (
                dist.all_reduce(buffer, group=self.group, async_op=True)
                .get_future()
                .then(lambda f: f.value()[0])
            )
        if self._phase == DECIDED:
            raise SDCError(
                "a backward pass after before_optimizer_step(): the step's checks have run; "
                "call after_optimizer_step() first"
            )
        if self._faults:
            self._inject_grad("grad_local", bucket, buffer)
        self._audit.observe_bucket(bucket)
        # The same arithmetic as DDP without a hook (its reducer multiplies by 1/world
        # size), fused with check 1's look at every element: one pass over the bucket.
        self._flags.scale_and_check(buffer, self.config.nonfinite_check)
        fut = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()
        if bucket.is_last() and self._flags_wanted:
            self._flags.send(self.group)  # rides right behind the step's last bucket

        if not self._faults:
            return fut.then(lambda f: f.value()[0])

        def after(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            reduced = f.value()[0]
            self._inject_grad("grad_reduced", bucket, reduced)
            return reduced

        return fut.then(after)


def _held_weakly(
    guard: Guard,
) -> Callable[[object, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """The comm hook DDP keeps: :meth:`Guard._comm_hook` through a weak reference.

    DDP holds its hook from C++, where the garbage collector cannot see it. A hook that held
    the Guard would make Guard -> model -> reducer -> hook -> Guard a cycle nothing frees: the
    reducer, and with it the process group, would outlive ``destroy_process_group()``, and
    gloo's worker threads would still be running when the interpreter exits (where torch
    2.13 sometimes aborts the process: "terminate called without an active exception").
    Once the Guard is gone the hook does what DDP does without one.
    """
    ref = weakref.ref(guard)
    group, world_size = guard.group, guard.world_size

    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        alive = ref()
        if alive is not None:
            return alive._comm_hook(state, bucket)
        buffer = bucket.buffer()
        buffer.mul_(1.0 / world_size)
        return (
            dist.all_reduce(buffer, group=group, async_op=True)
            .get_future()
            .then(lambda f: f.value()[0])
        )

    # DDP checks a hook's annotations by identity with the real types, and postponed
    # evaluation (``from __future__ import annotations``) left strings there.
    hook.__annotations__.update(
        bucket=dist.GradBucket, state=object, **{"return": torch.futures.Future[torch.Tensor]}
    )
    return hook
