"""The training-loop entry point: :class:`Guard`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .audit import AuditOutcome, ReplayAudit, ReplayStats
from .checkpoint import mark_checkpoint
from .config import GuardConfig
from .errors import ConfigError, OperatorUnreachableError, ProtocolError, SDCError
from .faults import FaultInjector, FaultSpec, corrupt_
from .fingerprint import Fingerprinter
from .nonfinite import NonFiniteFinding, NonFiniteMonitor, classify_nonfinite
from .protocol import (
    MAX_MESSAGE,
    MAX_SUSPECTS,
    HeartbeatReport,
    ReporterIdentity,
    ResumeReport,
    Suspect,
    VerdictReport,
    encode_report,
)
from .replay import Payload
from .reporter import Reporter, ReporterConfig
from .topology import Topology, discover_topology, local_node_name
from .verdict import StepResult, Verdict
from .weights import WeightFingerprints

__all__ = ["Guard"]

log = logging.getLogger("sdc_agent")

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class Guard:
    """Runs the checks around every training step of a DDP model.

    The simple form does the whole step::

        guard = sdc_agent.Guard(ddp_model, optimizer, loss_fn)
        for batch in loader:
            result = guard.step(batch)   # forward, backward, checks, optimizer step if clean

    A custom loop calls the three phases itself::

        guard.begin_step()
        loss = ...; loss.backward()
        if guard.check_gradients():
            optimizer.step()
        result = guard.finish_step(applied=..., loss=loss)

    Creating a Guard is a collective (the ranks exchange their node names), as are
    :meth:`check_gradients` and :meth:`finish_step`: every rank of the data-parallel
    group must call them, in the same order. The Guard registers the model's DDP
    communication hook; a model can have only one.
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
        if not dist.is_initialized():
            raise SDCError("torch.distributed is not initialized: call init_process_group first")

        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.config = config if config is not None else GuardConfig.from_env()
        self.group: dist.ProcessGroup | None = getattr(model, "process_group", None)
        self.rank = dist.get_rank()
        self.group_rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        backend = str(dist.get_backend(self.group))
        self.comm_device = (
            torch.device("cuda", torch.cuda.current_device())
            if "nccl" in backend
            else torch.device("cpu")
        )
        self.topology: Topology = discover_topology(
            self.group, local_node_name(self.config.node_name)
        )

        self._fingerprinter = Fingerprinter(self.config.fingerprint_backend)
        self._nonfinite = NonFiniteMonitor()
        self._weights = WeightFingerprints(
            model.module,
            optimizer,
            self._fingerprinter,
            self.config.weights_include_optimizer_state,
        )
        if self.config.weights_every > 0:
            # Compile the fingerprint kernels now, not in the middle of training.
            first = next(model.module.parameters(), None)
            if first is not None:
                dtypes = {p.dtype for p in model.module.parameters()} | {torch.float32}
                self._fingerprinter.warm_up(dtypes, first.device)
        self._injector = FaultInjector(self.config.faults, self.rank)
        self._injector.attach(model.module)
        self._grad_targets = self._resolve_grad_targets()
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
        model.register_comm_hook(state=None, hook=self._comm_hook)

        # One rank per node reports, so the operator can ask several nodes to agree.
        me = self.topology.ranks[self.group_rank]
        self.reports = me.local_rank == 0
        if reporter == "auto":
            reporter_config = ReporterConfig.from_env()
            reporter = Reporter(reporter_config) if reporter_config is not None else None
        elif reporter is not None and not isinstance(reporter, Reporter):
            raise ConfigError(f"reporter: must be a Reporter, None or 'auto', got {reporter!r}")
        # Whether check_gradients carries the halt flag must be the same on every rank,
        # or some ranks would call a collective the others skip.
        wants_halt = torch.tensor(
            [int(reporter is not None and self.config.unreachable_policy == "stop")],
            device=self.comm_device,
        )
        dist.all_reduce(wants_halt, op=dist.ReduceOp.MAX, group=self.group)
        self._stop_when_unreachable = bool(wants_halt.item())
        self.reporter: Reporter | None = reporter if self.reports else None
        if reporter is not None and not self.reports:
            reporter.close(timeout=0)
        self._identity = ReporterIdentity(rank=me.rank, node=me.node, pod=me.pod)
        self._check_seconds: dict[str, float] = {"nonfinite": 0.0, "replay": 0.0, "weights": 0.0}

        self.step_count = start_step
        """Steps begun so far; the current step while one is running."""
        self.last_clean_step = start_step
        """The newest step at which every check passed and, with the weight check on,
        the replicas' weights were verified identical. A checkpoint of that step or an
        earlier one is safe to resume from."""
        self.weights_diverged = False
        """Set when check 3 failed: the replicas' weights differ, and no later step can
        be clean until the job restores a checkpoint (see :meth:`restore`)."""
        self._in_step = False
        self._settling = False  # in _settle: the hook only all-reduces
        # A resumed job (start_step, restore): the next step first settles DDP's buckets.
        self._settle_buckets = start_step > 0
        self._grad_verdicts: list[Verdict] = []
        self._audited_clean = False
        self._replay_unavailable = False
        self._simple_step = False
        self._reported_weight_suspects: tuple[int, ...] = ()
        # The newest step each verifying check vouched for; last_clean_step is the oldest.
        self._verified = {"weights": start_step, "replay": start_step}

    @property
    def replay_stats(self) -> ReplayStats:
        """How many replays were compared and how many differed (see ``replay_mode``)."""
        return self._audit.stats

    # -- the simple form -----------------------------------------------------------------

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
        self._simple_step = True
        try:
            self.begin_step()
        finally:
            self._simple_step = False
        total: torch.Tensor | None = None  # stays on the device: one host sync per step
        for j, micro in enumerate(micro_batches):
            last = j == count - 1
            if j == 0:
                self._audit.payload = Payload.capture(micro, count, copy=self._audit.due)
            with contextlib.nullcontext() if last else self.model.no_sync():
                loss = self.loss_fn(self.model, micro)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise SDCError("loss_fn must return a scalar tensor")
                if j == 0:
                    self._audit.own_loss = loss.detach()
                (loss / count if count > 1 else loss).backward()
            if j == 0 and not last:
                self._audit.observe_grads()
            total = loss.detach().float() if total is None else total + loss.detach().float()
        applied = self.check_gradients()
        if applied:
            self.optimizer.step()
        assert total is not None
        return self.finish_step(applied=applied, loss=total / count)

    # -- the phases ----------------------------------------------------------------------

    def begin_step(self) -> int:
        """Start a step (before its forward pass); returns the step number."""
        if self._in_step:
            raise SDCError("begin_step called twice without finish_step")
        if not self._simple_step and not self._replay_unavailable:
            # The low-level form never shows the audit a micro-batch to replay.
            self._replay_unavailable = True
            if self.config.replay_enabled:
                warnings.warn(
                    "sdc_agent: the replay audit needs Guard.step (it must see the "
                    "micro-batch); with begin_step/check_gradients/finish_step it is "
                    "skipped and last_clean_step follows the other checks",
                    RuntimeWarning,
                    stacklevel=2,
                )
        self._in_step = True
        self.step_count += 1
        self._injector.step = self.step_count
        self._nonfinite.reset()
        self._grad_verdicts = []
        self._audited_clean = False
        self._audit.begin(self.step_count)
        return self.step_count

    def check_gradients(self) -> bool:
        """After backward: run checks 1 and 2 across ranks; true when the step is safe to
        apply. A collective."""
        self._require_step("check_gradients")
        if self.config.nonfinite_check or self._stop_when_unreachable:
            started = time.perf_counter()
            overdue = self.reporter is not None and self.reporter.verdict_overdue(
                self.config.report_deadline_seconds
            )
            before, after, halt = self._nonfinite.exchange(
                self.group, self.comm_device, halt=overdue and self._stop_when_unreachable
            )
            self._check_seconds["nonfinite"] += time.perf_counter() - started
            if any(halt):
                raise OperatorUnreachableError(
                    f"a verdict could not be delivered to the operator within "
                    f"{self.config.report_deadline_seconds:g} s (reporting rank(s) "
                    f"{', '.join(map(str, self._global(halt)))}); unreachable_policy='stop' "
                    "stops training here, before another step is applied"
                )
            finding = classify_nonfinite(before, after) if self.config.nonfinite_check else None
            if finding is not None:
                self._grad_verdicts.append(self._nonfinite_verdict(finding, before, after))
                return False
        else:
            self._nonfinite.reset()
        if self._audit.due:
            if self._audit.payload is None:
                return True  # the low-level form gave the audit no micro-batch
            started = time.perf_counter()
            outcome = self._audit.audit()
            self._check_seconds["replay"] += time.perf_counter() - started
            if outcome.finding is not None:
                self._grad_verdicts.append(self._replay_verdict(outcome))
                return False
            self._audited_clean = not outcome.evidence
        return True

    def _nonfinite_verdict(
        self, finding: NonFiniteFinding, before: list[bool], after: list[bool]
    ) -> Verdict:
        evidence: dict[str, Any] = {
            "nonfinite_before_allreduce": self._global(before),
            "nonfinite_after_allreduce": self._global(after),
        }
        classification, suspects, localized, message = (
            finding.classification,
            finding.suspects,
            finding.localized,
            finding.message,
        )
        payload = self._audit.payload
        if classification == "rank" and payload is not None and payload.divisor > 1:
            # Only the first micro-batch travels: a replay of it says nothing about the rest.
            evidence["replayed_elsewhere_nonfinite"] = "not replayed: gradient accumulation"
        elif classification == "rank" and payload is not None:
            # Replay the suspects' micro-batches on other nodes: bad data stays bad there.
            replayed = self._audit.replay_nonfinite(suspects)
            evidence["replayed_elsewhere_nonfinite"] = {
                str(self.topology.global_rank(p)): bad for p, bad in replayed.items()
            }
            if replayed and len(replayed) == len(suspects) and all(replayed.values()):
                classification, suspects, localized = "training", (), False
                message += "; replayed on another node and non-finite again: the data or "
                message += "the model, not hardware"
            elif replayed:
                message += "; a replay on another node was finite"
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
        )

    def finish_step(self, *, applied: bool, loss: torch.Tensor | float | None = None) -> StepResult:
        """After the optimizer step (or after skipping it): weight check and bookkeeping."""
        self._require_step("finish_step")
        step = self.step_count
        if applied:
            for spec in self._injector.pending("weights"):
                if self._injector.fire(spec):
                    corrupt_(self._weight_target(spec), spec)
        verdicts = list(self._grad_verdicts)
        weights_checked = self.config.weights_every > 0 and step % self.config.weights_every == 0
        if weights_checked:
            started = time.perf_counter()
            verdict = self._check_weights(step)
            self._check_seconds["weights"] += time.perf_counter() - started
            if verdict is not None:
                # Diverged weights stay diverged: report each new split once.
                if verdict.suspect_ranks != self._reported_weight_suspects:
                    verdicts.append(verdict)
                    self._reported_weight_suspects = verdict.suspect_ranks
                self.weights_diverged = True
        if not verdicts and not self.weights_diverged:
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
        self._report(step, verdicts)
        self._in_step = False
        loss_value = float(loss.detach().float().item()) if isinstance(loss, torch.Tensor) else loss
        return StepResult(step=step, loss=loss_value, applied=applied, verdicts=tuple(verdicts))

    def restore(self, step: int, location: str | None = None) -> None:
        """The job reloaded a checkpoint of ``step``: count from there, weights trusted.

        With a reporter, tells the operator (a ``resume`` report, with the checkpoint's
        ``location`` if given): that is how an incident learns its job is running again.
        """
        if self._in_step:
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
        if self.reporter is not None:
            self.reporter.submit(
                ResumeReport(
                    reporter=self._identity, sent_at=time.time(), step=step, location=location
                )
            )

    def mark_checkpoint(self, path: str | os.PathLike[str], step: int | None = None) -> bool:
        """Record the checkpoint just written at ``path`` for ``step`` (default: the current
        step): verified when every check vouched for it. Writes the marker
        :func:`~sdc_agent.checkpoint.select_checkpoint` reads and, on a reporting rank,
        tells the operator, which resumes a job only if it knows a verified checkpoint old
        enough. Call it on the rank that wrote the checkpoint; returns ``verified``."""
        step = self.step_count if step is None else step
        verified = step <= self.last_clean_step
        mark_checkpoint(
            path, step, verified=verified, reporter=self.reporter, identity=self._identity
        )
        return verified

    @property
    def _replay_verifies(self) -> bool:
        # Only audits that can run vouch for steps: without a loss function, or in the
        # low-level form (no micro-batch to replay), the audit never runs.
        return (
            self.config.replay_enabled
            and self.config.replay_mode == "audit"
            and self.loss_fn is not None
            and not self._replay_unavailable
        )

    def close(self, timeout: float = 10.0) -> None:
        """Deliver queued reports (up to ``timeout`` seconds) and remove the forward hooks
        of injected faults (the comm hook stays with DDP)."""
        self._injector.detach()
        if self.reporter is not None:
            self.reporter.close(timeout)

    def _report(self, step: int, verdicts: list[Verdict]) -> None:
        if self.reporter is None:
            return
        now = time.time()
        for v in verdicts:
            self.reporter.submit(self._verdict_report(v, now))
        every = self.config.heartbeat_every
        if every and step % every == 0:
            self.reporter.submit(
                HeartbeatReport(
                    reporter=self._identity,
                    sent_at=now,
                    step=step,
                    last_clean_step=self.last_clean_step,
                    check_seconds=dict(self._check_seconds),
                )
            )
            self._check_seconds = dict.fromkeys(self._check_seconds, 0.0)

    def _verdict_report(self, v: Verdict, now: float) -> VerdictReport:
        by_rank = {r.rank: r for r in self.topology.ranks}
        suspects = tuple(
            Suspect(
                rank=r,
                node=by_rank[r].node,
                local_rank=by_rank[r].local_rank,
                pod=by_rank[r].pod,
                gpu_uuid=by_rank[r].gpu_uuid,
            )
            for r in v.suspect_ranks
        )
        report = VerdictReport(
            reporter=self._identity,
            sent_at=now,
            check=v.check,
            classification=v.classification,
            step=v.step,
            last_clean_step=v.last_clean_step,
            localized=v.localized,
            transient=v.transient,
            suspects=suspects,
            message=v.message,
            evidence=v.evidence,
        )
        try:
            encode_report(report)
        except ProtocolError:  # too large or too long: keep the verdict, trim the details
            report = dataclasses.replace(
                report,
                message=report.message[: MAX_MESSAGE - 20] + " [truncated]"
                if len(report.message) > MAX_MESSAGE
                else report.message,
                suspects=report.suspects[:MAX_SUSPECTS],
                evidence={
                    "truncated": True,
                    "keys": sorted(v.evidence),
                    "suspects": len(report.suspects),
                },
            )
        return report

    # -- internals -----------------------------------------------------------------------

    def _require_step(self, what: str) -> None:
        if not self._in_step:
            raise SDCError(f"{what} called outside a step: call begin_step first")

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
        )

    def _resolve_grad_targets(self) -> dict[FaultSpec, nn.Parameter]:
        params = dict(self.model.module.named_parameters())
        return {
            spec: params[spec.target]
            for spec in self._injector.specs
            if spec.site in ("grad_local", "grad_reduced") and spec.target is not None
        }

    def _weight_target(self, spec: FaultSpec) -> torch.Tensor:
        params = dict(self.model.module.named_parameters())
        name = spec.target if spec.target is not None else next(iter(params))
        return params[name].data

    def _inject_grad(self, site: str, bucket: dist.GradBucket, tensor: torch.Tensor) -> None:
        for spec in self._injector.pending(site):
            param = self._grad_targets.get(spec)
            if param is None:
                if bucket.index() == 0 and self._injector.fire(spec):
                    corrupt_(tensor, spec)
                continue
            for p, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
                if p is param and self._injector.fire(spec):
                    # bucket.gradients() are views of the bucket buffer before the
                    # all-reduce; afterwards, hit the same span of the reduced tensor.
                    start = grad.data_ptr() - bucket.buffer().data_ptr()
                    offset = start // tensor.element_size()
                    corrupt_(tensor.view(-1)[offset : offset + grad.numel()], spec)

    def _settle(self, batch: Any) -> None:
        """One forward and backward that is not a step, so DDP rebuilds its buckets before
        the first real step after :meth:`restore`: gradients, RNG and buffers (BatchNorm
        statistics) are put back, no check runs, no step is counted."""
        cpu = torch.get_rng_state()
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        buffers = [b.detach().clone() for b in self.model.buffers()]
        self._settling = True
        try:
            assert self.loss_fn is not None  # Guard.step checked it
            self.optimizer.zero_grad(set_to_none=True)
            self.loss_fn(self.model, batch).backward()
        finally:
            self._settling = False
            self.optimizer.zero_grad(set_to_none=True)
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda)
            with torch.no_grad():
                for b, saved in zip(self.model.buffers(), buffers, strict=True):
                    b.copy_(saved)

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
        if self._injector:
            self._inject_grad("grad_local", bucket, buffer)
        self._audit.observe_bucket(bucket)
        if self.config.nonfinite_check:
            self._nonfinite.observe_local(buffer)
        # The same arithmetic as DDP without a hook (its reducer multiplies by 1/world
        # size; dividing differs in the last bit when the world size is not a power of
        # two), so guarded training gives bit-identical weights.
        buffer.mul_(1.0 / self.world_size)
        fut = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()

        def after(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            reduced = f.value()[0]
            if self._injector:
                self._inject_grad("grad_reduced", bucket, reduced)
            if self.config.nonfinite_check:
                self._nonfinite.observe_reduced(reduced)
            return reduced

        return fut.then(after)


# DDP checks a hook's annotations by identity with the real types, and postponed
# evaluation (``from __future__ import annotations``) left strings there.
Guard._comm_hook.__annotations__.update(
    bucket=dist.GradBucket, _state=object, **{"return": torch.futures.Future[torch.Tensor]}
)
