"""The training-loop entry point: :class:`Guard`, a thin coordinator.

The Guard keeps the phases of a step (idle, backward, decided) and the gate that holds a
bad step back (:mod:`sdc_agent.gate`); everything else is delegated: the layout
(:mod:`sdc_agent.layout`: where gradients, replicas and collectives are, DDP here), the
check units (:mod:`sdc_agent.checks`: check 1 :mod:`~sdc_agent.check_nonfinite`, check 2
:mod:`~sdc_agent.check_replay`, check 3 :mod:`~sdc_agent.check_weights`), when the host
reads check 1's flags (:mod:`sdc_agent.flag_reading`), the reports
(:mod:`sdc_agent.reporting`), the evidence bundles (:mod:`sdc_agent.bundling`) and the
verified snapshot (:mod:`sdc_agent.snapshotting`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from .audit import ReplayStats
from .check_replay import ReplayCheck
from .check_set import build_checks
from .check_weights import WeightCheck
from .checkpoint import mark_checkpoint
from .checks import StepState
from .clean_steps import CleanSteps
from .config import GuardConfig
from .errors import ConfigError, SDCError
from .flag_reading import FlagReading
from .gate import StepGate
from .layout import DDPLayout, GradientBucket, ParallelLayout
from .layout_fsdp import FSDPLayout, is_fsdp
from .replay import map_tensors
from .reporter import Reporter
from .reporting import GuardReporting
from .snapshot import Snapshot, SnapshotWrite
from .snapshotting import SnapshotKeeper
from .startup import start_up_exchange, validate_arguments
from .verdict import StepResult

__all__ = ["Guard"]

log = logging.getLogger("sdc_agent")

LossFn = Callable[[nn.Module, Any], torch.Tensor]

IDLE, STEP, DECIDED = "idle", "backward", "decided"


class Guard:
    """Runs the checks around every training step of a DDP, FSDP2 or HSDP model.

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
        validate_arguments(model, optimizer, loss_fn, config, start_step, scaler)
        self._phase = IDLE
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.scaler = scaler
        self.config = config if config is not None else GuardConfig.from_env()
        self._layout = layout = _layout_of(model, self.config)
        self.layout = layout.name
        """``ddp``, ``fsdp`` (FSDP2 over one mesh dimension) or ``hsdp``."""
        layout.faults.optimizer = optimizer
        self.group: dist.ProcessGroup | None = layout.group
        self.rank = layout.rank
        self.group_rank = layout.group_rank
        self.world_size = layout.world_size
        self.device = layout.device
        """The model's device: where the step's flags live (not the current CUDA device,
        which is ``cuda:0`` on every rank that never called ``set_device``)."""
        self.comm_device = layout.comm_device
        ReplayCheck.refuse(layout.module, self.config.replay_enabled)
        WeightCheck.refuse(optimizer, self.config.weights_every)

        self._gate = StepGate(optimizer, _weakly(self._current_phase, gone=lambda: "removed"))
        try:
            self.topology, self.run_id = start_up_exchange(
                config=self.config,
                group=self.group,
                comm_device=self.comm_device,
                model_device=self.device,
                agreed={
                    "optimizer": type(optimizer).__name__,
                    "device_skip": self._gate.device_skip,
                    "scaler": scaler is not None,
                },
            )
            checks = build_checks(
                layout=layout,
                optimizer=optimizer,
                loss_fn=loss_fn,
                config=self.config,
                topology=self.topology,
                run_id=self.run_id,
                scaled=scaler is not None,
                loss_scale=_weakly(self._loss_scale),
            )
        except BaseException:
            self._gate.remove()  # a Guard that failed to start leaves nothing behind
            raise
        self._seconds = checks.seconds
        self._fingerprinter = checks.fingerprinter
        self._injector = layout.injector
        self._audit = checks.audit
        self._evidence = checks.evidence
        self._nonfinite = checks.nonfinite
        self._weight_check = checks.weights
        self._update_check = checks.update
        self._units = checks.units
        layout.attach(self)
        self._reporting = GuardReporting(
            reporter,
            config=self.config,
            topology=self.topology,
            group_rank=self.group_rank,
            group=self.group,
            comm_device=self.comm_device,
            run_id=self.run_id,
            replayer_of=self._audit.replayer_of,
            check_seconds=self._seconds,
        )
        self.reports = self._reporting.reports
        self.reporter = self._reporting.reporter
        self._stop_when_unreachable = self._reporting.stop_when_unreachable
        layout.flags_wanted = flags_wanted = (
            self.config.nonfinite_check or self._stop_when_unreachable
        )

        self.step_count = start_step
        """Steps begun so far; the current step while one is running."""
        # A resumed job (start_step, restore): the next step first settles the layout.
        self._settle_buckets = start_step > 0
        self._state = StepState(step=start_step, last_clean_step=start_step)
        self._weight_check.overlap = self.device.type == "cuda"
        self._clean = CleanSteps((u.name for u in self._units if u.vouches), start_step)
        # On CUDA a fused optimizer holds a bad step back on the device: the host reads the
        # step's flags during the next step's checks, behind work already queued.
        self._flags = FlagReading(
            layout=layout,
            check=self._nonfinite,
            audit=self._audit,
            reporting=self._reporting,
            clean=self._clean,
            wanted=flags_wanted,
            defer=self._gate.device_skip and self.device.type == "cuda",
            stop=_weakly(self._stop),
        )
        self._snapshots = SnapshotKeeper(
            config=self.config,
            layout=layout,
            optimizer=optimizer,
            topology=self.topology,
            run_id=self.run_id,
            clean=self._clean,
            start=start_step,
            held=_weakly(self._held_step),
        )
        self.snapshot_write: SnapshotWrite | None = None
        """What the snapshot's write at detection did (``None``: none happened)."""

    def _current_phase(self) -> str:
        return self._phase

    def _held_step(self) -> int:
        # The model holds the state after the previous step during a step's checks, after
        # the current one once it was decided.
        return self._state.step - 1 if self._phase == STEP else self._state.step

    def snapshot_state(self, name: str, source: Any) -> None:
        """Register what the verified snapshot keeps beside the model and the optimizer:
        ``source`` has ``state_dict()`` (a scheduler) or is a callable returning a dict
        (``lambda: {"step": step, "position": loader_position}``). It must be equal on
        every rank of the data-parallel group; it is copied whole, by value, as the
        snapshot's step returns (before the loop's code after ``guard.step()``, such as
        ``scheduler.step()``), on CPU and CUDA alike.
        :func:`sdc_agent.snapshot.load_snapshot` returns it by ``name``."""
        self._snapshots.register(
            name, source, idle_step=self.step_count if self._phase == IDLE else None
        )

    @property
    def snapshot(self) -> Snapshot | None:
        """The verified snapshot in host memory (``None``: ``snapshot_copies`` is 0 or
        host memory too short): :attr:`Snapshot.step`, :meth:`Snapshot.bytes_per_rank`."""
        return self._snapshots.snapshot

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

    @property
    def last_clean_step(self) -> int:
        """The newest step at which every check passed and, with the weight check on,
        the replicas' weights were verified identical. A checkpoint of that step or an
        earlier one is safe to resume from."""
        return self._clean.last

    @property
    def weights_diverged(self) -> bool:
        """Set when check 3 failed: the replicas' weights differ, and no later step can
        be clean until the job restores a checkpoint (see :meth:`restore`)."""
        update = self._update_check
        return self._weight_check.diverged or (update is not None and update.diverged)

    # -- the shortest form ---------------------------------------------------------------

    def step(self, batch: Any = None, *, micro_batches: Sequence[Any] | None = None) -> StepResult:
        """Forward, backward, checks, and the optimizer step when the checks pass.

        With ``micro_batches`` (gradient accumulation) every micro-batch's loss is divided
        by their number before backward, gradients are all-reduced once, after the last,
        and the replay audit checks one micro-batch per audit, each index once in every
        ``len(micro_batches)`` audits (:func:`~sdc_agent.audit.audited_micro_batch`).
        ``result.loss`` is then the mean.
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
            self._layout.settle(micro_batches[0], self.loss_fn, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.begin_step()
        total: torch.Tensor | None = None  # stays on the device
        for j, micro in enumerate(micro_batches):
            last = j == count - 1
            audited = micro
            if j == self._audit.audited and self._audit.due:  # before its forward changes it
                audited = map_tensors(micro, lambda t: t.detach().clone())
            with contextlib.nullcontext() if last else self._layout.no_sync():
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
        self._layout.flags.reset(halt=halt and self._stop_when_unreachable)
        self._state = state = StepState(step=self.step_count, last_clean_step=self.last_clean_step)
        self._flags.begin()
        for unit in self._units:
            unit.begin(state)
        return self.step_count

    def before_backward(
        self, batch: Any, loss: torch.Tensor, *, loss_fn: LossFn | None = None
    ) -> None:
        """A micro-batch's forward is done: ``batch`` is what ``loss_fn(model, batch)``
        computes ``loss`` from, and ``loss`` (the loss function's value, before any
        division for accumulation or GradScaler's scaling) is about to be backpropagated.

        Call it once per micro-batch; the replay audit may recompute one of them on
        another node (a different one each audit, see
        :func:`~sdc_agent.audit.audited_micro_batch`). The RNG and autocast state it
        needs were recorded when the forward began; the factor the loop applies between ``loss`` and
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
        self._audit.micro_batch(batch, loss, syncs=self._layout.syncs_gradients(), copy=copy)

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
        state = self._state
        started = time.perf_counter()
        self._flags.judge_late(collective=True, current=state)  # the previous step's
        skip = self._flags.decide(state, self.group)
        self._seconds["nonfinite"] += time.perf_counter() - started
        for unit in self._units:
            unit.before_step(state)
            settled = unit.settled()  # an exchange of the previous step, overlapped
            if settled is not None:
                self._resolved(settled[0], unit.name, passed=settled[1])
        self._snapshots.before_update(state)
        self._gate.arm(skip=skip, hold=state.hold)
        if state.hold and self.scaler is not None:
            self._let_the_scaler_keep_its_books()
        self._phase = DECIDED
        return not state.hold

    def _let_the_scaler_keep_its_books(self) -> None:
        # A loop that skips scaler.step() still calls scaler.update(), which needs the
        # scaler to have checked this step's gradients: unscale them (the step is held
        # back, so nothing uses them). Already unscaled (clipping): nothing to do.
        with contextlib.suppress(RuntimeError):
            self.scaler.unscale_(self.optimizer)

    def _resolved(self, step: int, what: str, *, passed: bool) -> None:
        self._clean.resolved(step, what, passed=passed)

    @property
    def _defer_flags(self) -> bool:
        return self._flags.defer

    @_defer_flags.setter
    def _defer_flags(self, defer: bool) -> None:
        self._flags.defer = defer  # what tests emulate CUDA with (test_host_sync)

    def _stop(self) -> BaseException:
        self._phase = IDLE  # a halt flag: training stops before this step is applied
        return self._reporting.unreachable()

    def _loss_scale(self) -> float | None:
        return None if self.scaler is None else float(self.scaler.get_scale())

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
        self._flags.after_step(self._state)  # the optimizer step is queued on the device
        applied = self._gate.applied if self._gate.stepped else False
        if loss is None:
            loss = self._audit.own_loss
        return self._finish(applied, loss)

    def _finish(
        self, applied: torch.Tensor | bool, loss: torch.Tensor | float | None
    ) -> StepResult:
        state = self._state
        step = state.step
        state.applied = applied
        self._layout.faults.weights(applied)
        for unit in self._units:
            unit.after_step(state)
        state.verdicts[:] = [self._layout.locate(v) for v in state.verdicts]
        state.late_verdicts[:] = [self._layout.locate(v) for v in state.late_verdicts]
        verdicts = list(state.verdicts)
        blocking = [v for v in verdicts if v.classification != "nondeterministic"]
        if not blocking and not any(u.blocks_clean for u in self._units):
            waiting = {u.name for u in self._units if u.awaits(state)}
            vouched = {
                u.name: step
                for u in self._units
                if u.vouches and (u.vouched(state) or u.name in waiting)
            }
            if self._flags.pending(state):
                waiting.add("flags")
            self._clean.step_ended(step, vouched, waiting)
        for v in state.late_verdicts:
            self._reporting.log_verdicts(v.step, [v])
        self._reporting.report_verdicts(state.late_verdicts)
        self._reporting.log_verdicts(step, verdicts)
        self._reporting.step_done(
            step,
            verdicts,
            last_clean_step=self.last_clean_step,
            fingerprint_kernel=self.fingerprint_kernel,
            gradient_tolerance=self.gradient_tolerance,
            bit_reproducible=self.bit_reproducible,
            noise=self._audit.noise,
            snapshot_step=self._snapshots.to_write(),
        )
        # After the verdicts went to the reporter. The late ones count too: on CUDA, check
        # 3's overlapped exchange and check 1's late flags find a fault a step later, and
        # step_done has already announced the snapshot the operator is to wait for.
        late = [v for v in state.late_verdicts if v.classification != "nondeterministic"]
        written = self._snapshots.write(
            [*late, *blocking], reporter=self.reporter, identity=self._reporting.identity
        )
        if written is not None:
            self.snapshot_write = written
        self._phase = IDLE
        shown = (*state.late_verdicts, *verdicts)
        return StepResult(step=step, loss=loss, applied=applied, verdicts=shown)

    # The phases under their first names.

    def check_gradients(self) -> bool:
        """After backward: :meth:`before_optimizer_step`, under its first name."""
        return self.before_optimizer_step()

    def finish_step(self, *, applied: bool, loss: torch.Tensor | float | None = None) -> StepResult:
        """:meth:`after_optimizer_step`, under its first name. ``applied``: whether the
        loop ran the optimizer step (the Guard also sees it through the optimizer)."""
        if self._phase != DECIDED:
            raise SDCError("finish_step called outside a step: call begin_step first")
        self._flags.after_step(self._state)
        seen = self._gate.applied if self._gate.stepped else False
        return self._finish(seen if applied else False, loss)

    # -- checkpoints, resume ---------------------------------------------------------------

    def restore(self, step: int, location: str | None = None) -> None:
        """The job reloaded a checkpoint of ``step``: count from there, weights trusted.

        With a reporter, tells the operator (a ``resume`` report, with the checkpoint's
        ``location`` if given): that is how an incident learns its job is running again.
        """
        if self._phase != IDLE:
            raise SDCError("restore called during a step")
        self._flags.forget()  # the checkpoint replaces whatever that step did
        self.step_count = step
        for unit in self._units:
            unit.restored(step)
        self._clean.restore(step)
        self._snapshots.restored(step)
        # The next Guard.step settles the layout first (DDPLayout.settle: DDP's buckets),
        # so a resumed run reproduces an uninterrupted one exactly.
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
        self._settle_locally()
        verified = step <= self._flags.last_clean_if_counted()
        mark_checkpoint(
            path, step, verified=verified, reporter=self.reporter, identity=self._reporting.identity
        )
        self._evidence.note_checkpoint(path)  # evidence bundles go next to checkpoints
        self._snapshots.checkpoint_marked(path)
        return verified

    def _settle_locally(self) -> None:
        """Count a step whose overlapped check-3 exchange came back clean (waiting for it
        here; no collective: anything else waits for the next step). Check 3 has replicas
        to compare only where a snapshot's take is no exchange (DDP, HSDP)."""
        self._weight_check.agree_pending()
        settled = self._weight_check.settled()
        if settled is not None:
            self._resolved(settled[0], "weights", passed=settled[1])

    def close(self, timeout: float = 10.0) -> None:
        """Deliver queued reports (up to ``timeout`` seconds), remove the forward hooks of
        injected faults and the Guard's hooks on the model and optimizer (the comm hook
        stays with DDP). An evidence bundle still being written is finished first (up to
        ``timeout`` seconds too)."""
        if self._phase == IDLE:
            self._flags.judge_late(collective=False, current=None)
            found = self._weight_check.finish_pending()  # a collective on a mismatch
            settled = self._weight_check.settled()
            if settled is not None:
                self._resolved(settled[0], "weights", passed=settled[1])
            if found:
                found = [self._layout.locate(v) for v in found]
                self._reporting.log_verdicts(found[0].step, found)
                self._reporting.report_verdicts(found)
        self._layout.detach()
        self._gate.remove()
        self._evidence.close(timeout)  # a bundle still being written is finished first
        self._reporting.close(timeout)

    # -- what the layout calls ---------------------------------------------------------------

    def forward_begins(self) -> None:
        if self._phase == DECIDED:
            raise SDCError(
                "a training forward began before guard.after_optimizer_step(): finish the "
                "previous step first"
            )
        if self._phase == IDLE:
            self._begin()
        for unit in self._units:
            unit.on_forward(self._state)

    def local_gradient(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        if self._phase == DECIDED:
            raise SDCError(
                "a backward pass after before_optimizer_step(): the step's checks have run; "
                "call after_optimizer_step() first"
            )
        for unit in self._units:
            unit.on_local_gradient(param, grad)

    def gradients_ready(self, bucket: GradientBucket) -> None:
        if self._phase == DECIDED:
            raise SDCError(
                "a backward pass after before_optimizer_step(): the step's checks have run; "
                "call after_optimizer_step() first"
            )
        if self._layout.faults:
            self._layout.inject("grad_local", bucket, bucket.buffer())
        for unit in self._units:
            unit.on_gradients(bucket)


_T = TypeVar("_T")


def _weakly(method: Callable[[], _T], *, gone: Callable[[], _T] | None = None) -> Callable[[], _T]:
    """A method of the Guard for one of its parts to call back, holding the Guard weakly.

    Held strongly, every such callback would make a cycle (Guard -> part -> Guard), and a
    Guard in a cycle outlives the scope that dropped it until the garbage collector runs:
    with it its model, the model's reducer and the process group, which
    ``destroy_process_group()`` then cannot end. gloo's worker threads would still be
    running when the interpreter exits, where torch 2.13 sometimes aborts the process
    ("terminate called without an active exception"). The layout's back-reference ends at
    ``close()`` (``ParallelLayout.detach``). ``gone``: what the call returns once the Guard
    was freed (by default it raises)."""
    ref = weakref.WeakMethod(method)

    def call() -> _T:
        bound = ref()
        if bound is None:
            if gone is not None:
                return gone()
            raise SDCError("the Guard was dropped while its model or optimizer still ran")
        return bound()

    return call


def _layout_of(model: nn.Module, config: GuardConfig) -> ParallelLayout:
    if is_fsdp(model):
        return FSDPLayout(model, config)
    return DDPLayout(model, config)
