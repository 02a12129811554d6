"""Runs check 2 inside a Guard: captures the audited micro-batch, replays, compares."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .bundling import BundleSource, EvidenceWork, choose_source
from .errors import SDCError
from .evidence import (
    HEADROOM,
    LOSS,
    Comparison,
    KindDiff,
    Summary,
    Tolerance,
    attribute,
    compare,
    compiled_module,
    compute_dtype,
    layer_groups,
    noise_cap,
    output_kind,
    output_modules,
    output_stats,
    output_tensor,
    stats_scratch,
    tensor_stats,
)
from .faults import FaultInjector, FaultSpec, corrupt_
from .fingerprint import Fingerprinter
from .judging import NoiseModel, split_by_kind
from .replay import (
    WEAK_AUDITS,
    Payload,
    Recheck,
    ReplayFinding,
    RngState,
    choose_thirds,
    exchange,
    explain_mismatches,
    free_in,
    judge,
    loss_bits,
    map_tensors,
    named_on_repeat,
    pack,
    plan_ring,
    replay_complete,
    resolve,
    storm_threshold,
    suspects_by_kind,
    unpack,
)
from .topology import Topology

__all__ = [
    "MICRO_BATCH_SEED",
    "REAUDITS",
    "AuditOutcome",
    "ReplayAudit",
    "ReplayStats",
    "audit_turn",
    "audited_micro_batch",
]

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass(slots=True)
class ReplayStats:
    """Counts since the Guard started; in ``calibrate`` mode, the answer to "is my model
    deterministic?" is ``mismatches == 0``."""

    audits: int = 0
    comparisons: int = 0
    mismatches: int = 0
    """Comparisons that differed by more than the tolerance in force at the time."""
    loss_mismatches: int = 0
    differing: int = 0
    """Comparisons with any bitwise difference (noise included)."""
    mismatch_steps: list[int] = field(default_factory=list)

    @property
    def mismatch_rate(self) -> float:
        return self.mismatches / self.comparisons if self.comparisons else 0.0


@dataclass(frozen=True, slots=True)
class AuditOutcome:
    finding: ReplayFinding | None
    evidence: dict[str, Any]
    vouches: bool
    """The audit found this step's computations to agree (within the learned noise)."""
    learned: str | None = None
    """What this audit learned about the job's noise, for the once-per-job report."""
    source: BundleSource | None = None
    """Where the evidence of a localized, persistent finding is (every rank)."""
    work: EvidenceWork | None = None
    """That evidence, on the rank that holds it (:attr:`BundleSource.writer`)."""


REAUDITS = 3
"""Re-audits at most in a row after audits that left differences unseparated (no free
third node in a kind: :attr:`~sdc_agent.replay.Recheck.crowded`). Each draws the job's
run-to-run noise afresh while a persistent fault stays, so a fault that crowding hid is
named at the first of them whose kinds a free third separates; the next scheduled audit
tries again."""

MICRO_BATCH_SEED = 0x5DC
"""The seed of the audited micro-batch's permutations: the same on every rank (it needs
no secret: which micro-batch is audited is no use to a faulty GPU)."""


def audited_micro_batch(audit: int, count: int, seed: int = MICRO_BATCH_SEED) -> int:
    """The micro-batch (from 0) that the ``audit``-th audit (from 0) replays, of ``count``.

    Audits go in cycles of ``count``; the first cycle in order (so the first audit of a
    run replays the first micro-batch, whose gradients the communication hook sees whole),
    each later one a permutation drawn from ``seed`` and the cycle's number: every index is
    audited once in every cycle, the same on every rank.
    """
    if count <= 1:
        return 0
    cycle, position = divmod(audit, count)
    if cycle == 0:
        return position
    order = random.Random(seed * 1_000_003 + cycle).sample(range(count), count)
    return order[position]


def audit_turn(step: int, *, every: int, drawn: bool, again: bool) -> str | None:
    """Whether ``step`` is audited: ``scheduled`` (every ``every`` steps, or ``drawn`` by
    ``replay_probability``), ``again`` (a re-audit: the last audit left differences
    unseparated; it replays the same micro-batch index and takes no turn of its own in
    the rotation) or ``None``."""
    if (every > 0 and step % every == 0) or drawn:
        return "scheduled"
    return "again" if again else None


class _Scratch:
    """One CPU buffer for every statistic an audit computes (see
    :func:`~sdc_agent.evidence.stats_scratch`), made at the first; the computations that
    use it run one after the other, on the training thread."""

    def __init__(self) -> None:
        self._cpu: torch.Tensor | None = None

    def on(self, device: torch.device) -> torch.Tensor | None:
        if device.type != "cpu":
            return None
        if self._cpu is None:
            self._cpu = stats_scratch(device)
        return self._cpu


class _Collector:
    """Per-parameter fingerprints and statistics of one computation.

    ``reference``: the computation this one will be compared with (the partner's own,
    for its replay). On a CPU, where reading a fingerprint costs nothing, a gradient
    whose fingerprint equals the reference's has the reference's bits, so it takes the
    reference's statistics instead of computing them again (the statistics are only
    ever read where fingerprints differ, and the same bits give the same statistics).
    """

    def __init__(
        self,
        fingerprinter: Fingerprinter,
        scratch: _Scratch | None = None,
        reference: Summary | None = None,
    ) -> None:
        self.fingerprinter = fingerprinter
        self.scratch = scratch if scratch is not None else _Scratch()
        self.reference = reference
        self.fps: dict[int, torch.Tensor] = {}
        self.stats: dict[int, torch.Tensor] = {}

    def add(self, index: int, grad: torch.Tensor) -> None:
        with torch.no_grad():
            fp = self.fps[index] = self.fingerprinter(grad)
            ref = self.reference
            if (
                ref is not None
                and fp.device.type == "cpu"
                and index < len(ref.fingerprints)
                and tuple(fp.tolist()) == ref.fingerprints[index]
            ):
                self.stats[index] = torch.tensor(ref.stats[index], dtype=torch.float64)
                return
            self.stats[index] = tensor_stats(grad, self.scratch.on(grad.device))

    def summary(
        self, loss: torch.Tensor, count: int, outputs: torch.Tensor | None = None
    ) -> Summary:
        """Everything on the host, in one copy (one synchronisation per computation).
        ``outputs``: the output modules' statistics (:class:`_OutputRecorder`), if the
        forward was observed."""
        device = loss.device
        zero_fp = torch.zeros(2, dtype=torch.int64, device=device)
        zero_st = torch.zeros(2, dtype=torch.float64, device=device)
        fps = torch.stack([self.fps.get(i, zero_fp).to(device) for i in range(count)])
        stats = torch.stack([self.stats.get(i, zero_st).to(device) for i in range(count)])
        value = loss.detach().to(torch.float64).reshape(())
        bad = ~torch.isfinite(stats).all() | ~torch.isfinite(value)
        bits = int(loss_bits(loss.detach()).item())
        fp_rows, stat_rows = fps.tolist(), stats.tolist()
        out_rows = [] if outputs is None else outputs.tolist()
        return Summary(
            loss_bits=bits,
            loss=float(value.item()),
            fingerprints=tuple((int(a), int(b)) for a, b in fp_rows),
            stats=tuple((float(a), float(b)) for a, b in stat_rows),
            nonfinite=bool(bad.item()),
            outputs=tuple((float(a), float(b)) for a, b in out_rows),
        )


class _OutputRecorder:
    """The output kinds' statistics of one forward: hooks on the output modules
    (:func:`~sdc_agent.evidence.output_modules`) that exist only while an audited forward
    runs (the owner's audited micro-batch, a replay, a rerun), read the module's output
    (:func:`~sdc_agent.evidence.output_tensor`) and change nothing. A module called
    several times in one forward adds up its calls.

    Exactly one forward of ``root`` (the model the audit replays, below any DDP wrapper)
    is recorded: a forward hook on it stops the recording when its first call since
    :meth:`start` returns. The owner and the replay then see the same window: a second
    forward in one loss function (R-Drop, SimCSE) or a logging forward under
    ``no_grad`` before the loss is shown records nothing on either side."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        scratch: _Scratch | None = None,
        root: nn.Module | None = None,
    ) -> None:
        self.modules = list(modules)
        self.root = root
        self.scratch = scratch if scratch is not None else _Scratch()
        self._handles: list[Any] = []
        self._stats: dict[int, torch.Tensor] = {}
        self.started = False
        """Recording began since the last :meth:`take` (or :meth:`reset`)."""
        self.active = False
        """Hooks in place (an attribute, not a property: read at every forward)."""

    def start(self) -> None:
        """Record the forward that begins now (what an earlier start recorded is lost)."""
        self.stop()
        self._stats = {}
        self.started = True
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(self.modules)]
        if self.root is not None:
            self._handles.append(self.root.register_forward_hook(self._root_done))
        self.active = True

    def _root_done(self, _module: nn.Module, _inputs: Any, _output: Any) -> None:
        self.stop()  # the recorded forward is over: later calls are not the replay's

    def stop(self) -> None:
        """No more hooks; what was recorded is kept for :meth:`take`."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.active = False

    def reset(self) -> None:
        self.stop()
        self._stats = {}
        self.started = False

    def take(self) -> torch.Tensor | None:
        """The statistics recorded since :meth:`start` (``[modules, 2]`` float64; zeros
        for a module not called), then reset; ``None`` if nothing was started."""
        started = self.started
        stats = self._stats
        self.reset()
        if not started:
            return None
        device = next(iter(stats.values()), torch.zeros(0)).device
        zero = torch.zeros(2, dtype=torch.float64, device=device)
        if not self.modules:  # a model whose parameters are all its root's own
            return torch.zeros((0, 2), dtype=torch.float64, device=device)
        return torch.stack([stats.get(i, zero).to(device) for i in range(len(self.modules))])

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self.start()
        try:
            yield
        finally:
            self.stop()

    def _hook(self, i: int) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            t = output_tensor(output)
            if t is None:
                return
            with torch.no_grad(), torch.autocast(t.device.type, enabled=False):
                stats = output_stats(t, self.scratch.on(t.device))
            before = self._stats.get(i)
            self._stats[i] = stats if before is None else before + stats

        return hook


class ReplayAudit:
    """The per-rank side of check 2 (group ranks throughout)."""

    def __init__(
        self,
        *,
        module: nn.Module,
        loss_fn: LossFn | None,
        topology: Topology,
        group: dist.ProcessGroup | None,
        comm_device: torch.device,
        fingerprinter: Fingerprinter,
        injector: FaultInjector,
        every: int,
        probability: float,
        calibrate: bool,
        params: Sequence[nn.Parameter] | None = None,
        grads_by_hook: bool = False,
        replaying: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        """``params``, ``grads_by_hook`` and ``replaying`` come from a sharded layout
        (:class:`~sdc_agent.layout_fsdp.FSDPLayout`): the parameters a replay computes
        gradients for (FSDP2's unsharded ones, registered on the model only while
        ``replaying()`` holds them unsharded; a collective every rank enters), and the
        first micro-batch's own local gradients arrive through :meth:`observe_gradient`
        rather than the gradient buckets. A later micro-batch's are read the same way in
        every layout: by a hook on each of ``params`` (:meth:`micro_batch`)."""
        self.module = module
        self.grads_by_hook = grads_by_hook
        self._replaying = replaying if replaying is not None else contextlib.nullcontext
        self.loss_fn = loss_fn
        self.topology = topology
        self.group = group
        self.comm_device = comm_device
        self.fingerprinter = fingerprinter
        self.injector = injector
        self.every = every
        self.probability = probability
        self.calibrate = calibrate
        self.me = dist.get_rank(group)
        nodes = [r.node for r in topology.ranks]
        self.nodes = nodes
        self.replayer_of = plan_ring(nodes)
        self.partner_of = {r: p for p, r in self.replayer_of.items()}
        # A sharded layout's unsharded parameters carry the module's names, in its order.
        self.params = [
            p for p in (module.parameters() if params is None else params) if p.requires_grad
        ]
        names = [n for n, p in module.named_parameters() if p.requires_grad]
        groups = layer_groups(names) if len(names) == len(self.params) else ()
        if not groups:
            groups = (("gradients", tuple(range(len(self.params)))),)
        compiled = compiled_module(module)
        watched = () if compiled is not None else output_modules(module)
        self.outputs_unavailable = (
            None
            if compiled is None
            else f"the forward output kinds are unavailable: {compiled} is compiled by "
            "torch.compile, which does not run module hooks added or removed after its "
            "first compilation (the loss and gradient kinds keep watching)"
        )
        """Why this job has no output kinds, if it has none for a reason."""
        self.outputs = len(watched)
        """How many output kinds (the last kinds)."""
        self._scratch = _Scratch()
        self._recorder = _OutputRecorder([m for _, m in watched], self._scratch, module)
        self._own_outputs: torch.Tensor | None = None
        self.kind_names = (
            LOSS,
            *(name for name, _ in groups),
            *(output_kind(name) for name, _ in watched),
        )
        self.groups = tuple(g for _, g in groups)
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        first = next(iter(self.params), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self._dtypes = {p.dtype for p in self.params}
        dtype = compute_dtype(self._dtypes, {}, self.device.type)
        self.noise = NoiseModel(
            cap=noise_cap(dtype), kind_names=self.kind_names, dtype=_dtype_name(dtype)
        )
        self.stats = ReplayStats()
        self.max_mismatches = storm_threshold(len(nodes))
        if self.outputs_unavailable is not None and (every or probability):
            warnings.warn(f"sdc_agent: {self.outputs_unavailable}", RuntimeWarning, stacklevel=3)
        missing = sorted(set(range(len(nodes))) - set(self.replayer_of))
        if missing and (every or probability):
            warnings.warn(
                f"sdc_agent: the replay audit cannot cover rank(s) {missing}: no other node "
                "in the ring (it needs at least two nodes with the same number of ranks)",
                RuntimeWarning,
                stacklevel=3,
            )
        self._schedule = random.Random(self._shared_seed() if probability > 0 else 0)
        self._keep: set[int] = set()  # parameters accumulated twice per backward
        self._due_if_replayable = False
        self.due = False
        self.step = 0
        self.payload: Payload | None = None
        self.own_loss: torch.Tensor | None = None
        self._rng: RngState | None = None
        self._micro = 0
        self._observe_later = False
        self._in_hook = False
        self._syncing_recorded = 0  # micro-batches recorded whose backward all-reduces
        self._passes = 0  # backward passes the comm hook saw this step
        self._own = _Collector(fingerprinter, self._scratch)
        self._bucket0: list[tuple[torch.Tensor, int, int]] | None = None
        self._audits_due = 0  # audits begun so far: the position in the permutations
        self._again = False  # the last audit left differences unseparated: audit again
        self._reaudits = 0  # re-audits since the last scheduled or drawn audit
        self._reauditing = False  # this step's audit is a re-audit
        self._weak: list[set[int]] = []  # weak separations of the audits in a row so far
        self._count = 1  # micro-batches per step, as the last step had them
        self.audited = 0
        """The index of the micro-batch this step's audit replays (see
        :func:`audited_micro_batch`)."""
        self._captured = False  # the audited micro-batch was shown this step
        self._forwards = 0  # forwards begun this step
        self._grad_hooks: list[Any] = []
        self._partial: dict[int, torch.Tensor] = {}  # gradients of several passes, summed

    def _shared_seed(self) -> int:
        # Group rank 0 draws, everyone adds: the same seed on every rank.
        seed = torch.zeros(1, dtype=torch.int64, device=self.comm_device)
        if self.me == 0:
            seed[0] = int.from_bytes(os.urandom(7), "little")
        dist.all_reduce(seed, group=self.group)
        return int(seed.item())

    @property
    def blind(self) -> bool:
        """No kind of evidence can separate a faulty rank: the audit verifies nothing."""
        return self.noise.blind

    @property
    def verifies(self) -> bool:
        return not self.blind and not self.calibrate

    def compare(self, a: Summary, b: Summary) -> Comparison:
        """Two computations of one micro-batch, per kind of evidence (the loss, each
        layer's gradients)."""
        return compare(a, b, self.groups, self.outputs)

    # -- during the step -----------------------------------------------------------------

    def begin(self, step: int) -> None:
        # Draw every step, audited or not, so all ranks stay on the same sequence.
        drawn = self.probability > 0 and self._schedule.random() < self.probability
        turn = audit_turn(step, every=self.every, drawn=drawn, again=self._again)
        again = turn == "again"
        self._reauditing = again
        self._again = False
        self._due_if_replayable = turn is not None
        self.due = self._due_if_replayable and self.loss_fn is not None
        if self._micro:
            self._count = self._micro
        self._drop_grad_hooks()
        if self._recorder.started:  # an audited forward whose loss never came
            self._recorder.reset()
        self._own_outputs = None
        index = self.audited
        self.audited = 0
        if self._due_if_replayable:
            self.audited = index if again else audited_micro_batch(self._audits_due, self._count)
        if self._due_if_replayable and not again:
            self._audits_due += 1
            self._reaudits = 0
        self._captured = False
        self._forwards = 0
        self.step = step
        self.payload = None
        self.own_loss = None
        self._rng = None
        self._micro = 0
        self._observe_later = False
        self._in_hook = False
        self._syncing_recorded = 0
        self._passes = 0
        self._own = _Collector(self.fingerprinter, self._scratch)

    def set_loss_fn(self, loss_fn: LossFn) -> None:
        """The loss function, given with the first micro-batch rather than at start-up."""
        self.loss_fn = loss_fn
        self.due = self._due_if_replayable

    @property
    def micro_batches(self) -> int:
        """Micro-batches seen so far in this step."""
        return self._micro

    @property
    def ready(self) -> bool:
        """Due, and the micro-batch whose turn it is was shown this step (a step with
        fewer micro-batches than that index audits nothing)."""
        return self.due and self._captured and self.payload is not None

    def forward_starts(self) -> None:
        """From the model's forward pre-hook: the RNG state the micro-batch starts from
        (the first's, and the audited one's), and on an audited step the output kinds'
        hooks for the audited micro-batch's forward (until the model's forward returns,
        taken when its loss is shown, :meth:`micro_batch`)."""
        if self._forwards == self.audited or self._rng is None:
            self._rng = RngState.capture(self.device)
        if self._due_if_replayable and self._forwards == self.audited:
            self._recorder.start()
        elif self._recorder.active:
            self._recorder.stop()  # another forward before the audited one's loss: unseen
        self._forwards += 1

    def micro_batch(self, batch: Any, loss: torch.Tensor, *, syncs: bool, copy: bool) -> None:
        """A micro-batch's forward is done and its ``loss`` is about to be backpropagated.

        The audited one is :attr:`audited` of the step (the first when the step has one).
        ``syncs``: its backward all-reduces (no ``no_sync``), so the communication hook
        sees its local gradients (the first micro-batch's only: later ones' hook and
        ``.grad`` carry the earlier ones' too, so theirs are read by a hook on each
        parameter, as each backward hands them over, before they are added). The same
        holds for a sharded layout's ``params`` (FSDP2's unsharded parameters, whose
        gradients FSDP accumulates under ``set_requires_gradient_sync(False)``).
        """
        index = self._micro
        self._micro += 1
        self._syncing_recorded += syncs
        if index == self.audited + 1:
            self._in_hook = False  # the hook now carries later micro-batches' gradients
            self._drop_grad_hooks()  # the audited micro-batch's backward is done
            if self._observe_later:
                self.observe_grads()
        if index not in (0, self.audited):
            return
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise SDCError("loss: must be a scalar tensor (the micro-batch's loss)")
        if index != self.audited:
            # The first micro-batch stands in (unaudited) for the non-finite check's
            # replay until the audited one comes.
            if self.payload is None:
                rng = self._rng if self._rng is not None else RngState.capture(self.device)
                self.payload = Payload(batch, rng.cpu, rng.cuda, rng.autocast)
                self.own_loss = loss.detach().clone()
            return
        self._captured = True
        # Its forward's outputs, as the replay records them: up to the loss, no backward
        # (which recomputes checkpointed regions).
        self._own_outputs = self._recorder.take() if self._recorder.started else None
        rng = self._rng if self._rng is not None else RngState.capture(self.device)
        if copy and self.due:
            batch = map_tensors(batch, lambda t: t.detach().clone())
        self.payload = Payload(batch, rng.cpu, rng.cuda, rng.autocast)
        # A copy: loops scale the loss tensor in place (the Trainer multiplies it by the
        # world size when averaging tokens across devices).
        self.own_loss = loss.detach().clone()
        first = index == 0
        if self.due and not first:
            # Its own gradients, as each backward hands them over, before they are added
            # to the earlier micro-batches' in .grad.
            self._partial = {}
            self._grad_hooks = [
                p.register_hook(self._own_grad(i)) for i, p in enumerate(self.params)
            ]
        self._observe_later = self.due and first and not syncs and not self.grads_by_hook
        self._in_hook = self.due and first and (syncs or self.grads_by_hook)
        if loss.requires_grad:
            payload = self.payload

            def record(grad: torch.Tensor) -> None:
                payload.loss_grad = grad.detach()

            loss.register_hook(record)

    def _own_grad(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if i in self._keep:  # several backward passes add to it: summed, as .grad would
                before = self._partial.get(i)
                self._partial[i] = grad.detach().clone() if before is None else before + grad
            else:
                self._own.add(i, grad)

        return hook

    def _drop_grad_hooks(self) -> None:
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []
        for i, g in self._partial.items():
            self._own.add(i, g)
        self._partial = {}

    @property
    def capturing_in_hook(self) -> bool:
        return self._in_hook

    def observe_bucket(self, bucket: dist.GradBucket) -> None:
        """From the comm hook, before the all-reduce: remember each local gradient.

        Raises :class:`SDCError` when this backward belongs to a micro-batch the loop
        never showed (``before_backward`` called for the first micro-batch only): the
        audit would read accumulated gradients as the first micro-batch's own and find
        every comparison different."""
        if bucket.index() == 0 and self._micro and self._passes >= self._syncing_recorded:
            raise SDCError(
                "before_backward: a backward pass began for a micro-batch that was not "
                f"shown to the Guard ({self._micro} micro-batch(es) shown this step, "
                f"{self._passes} backward pass(es) all-reduced already): with gradient "
                "accumulation call guard.before_backward(batch, loss) for every "
                "micro-batch, after its forward and before its backward"
            )
        if bucket.is_last():
            self._passes += 1
        # Where bucket 0's gradients sit, for replaying local-gradient faults (drills only;
        # recorded every step because DDP may rebuild its buckets after the first).
        if bucket.index() == 0 and self.injector:
            base = bucket.buffer().data_ptr()
            size = bucket.buffer().element_size()
            self._bucket0 = [
                (p, (g.data_ptr() - base) // size, g.numel())
                for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)
            ]
        if self.capturing_in_hook and not self.grads_by_hook:
            for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
                i = self.index_of.get(id(p))
                if i is not None:
                    self._own.add(i, g)

    def observe_gradient(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """A sharded layout's local gradient of ``param`` (one of ``params``), complete,
        before its collective: remembered while the audited micro-batch's backward runs."""
        if self._in_hook:
            i = self.index_of.get(id(param))
            if i is not None:
                self._own.add(i, grad)

    def observe_grads(self) -> None:
        """After the audited micro-batch's backward under ``no_sync`` (accumulation)."""
        if not self._observe_later:
            return
        self._observe_later = False
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self._own.add(i, p.grad)

    # -- recomputing -----------------------------------------------------------------------

    def _recompute(self, payload: Payload, reference: Summary | None = None) -> Summary:
        """``payload`` recomputed here, summarized (``reference``: what it will be
        compared with, see :class:`_Collector`)."""
        assert self.loss_fn is not None
        active = [s for s in self.injector.pending("grad_local") if self.injector.fire(s)]
        collector = _Collector(self.fingerprinter, self._scratch, reference)

        def factory() -> Callable[[int, torch.Tensor], None]:
            nonlocal collector
            collector = _Collector(self.fingerprinter, self._scratch, reference)
            if not active:
                return collector.add
            return lambda i, g: collector.add(i, self._corrupted(i, g, active))

        loss = replay_complete(
            self.module,
            self.params,
            self.loss_fn,
            payload,
            self.device,
            factory,
            self._keep,
            forward=self._recorder.recording,
        )
        return collector.summary(loss, len(self.params), self._recorder.take())

    def _corrupted(self, i: int, grad: torch.Tensor, specs: list[FaultSpec]) -> torch.Tensor:
        # The same local-gradient faults as the comm hook applies to real gradients.
        named = dict(self.module.named_parameters())
        for spec in specs:
            if spec.target is not None:
                if self.index_of.get(id(named[spec.target])) == i:
                    grad = grad.clone()
                    corrupt_(grad, spec)
            elif self._bucket0 is not None:
                for p, off, n in self._bucket0:
                    if self.index_of.get(id(p)) != i:
                        continue
                    if spec.index is None or off <= spec.index < off + n:
                        index = None if spec.index is None else spec.index - off
                        grad = grad.clone()
                        corrupt_(grad, dataclasses.replace(spec, index=index))
        return grad

    def own_summary(self) -> Summary:
        self._drop_grad_hooks()
        self.observe_grads()
        assert self.own_loss is not None
        return self._own.summary(self.own_loss, len(self.params), self._own_outputs)

    # -- after backward ------------------------------------------------------------------

    def _tolerance(self, *ranks: int) -> Tolerance:
        return self.noise.tolerance(ranks)

    def _cap(self) -> tuple[float, str]:
        """The noise cap for this step's audited computation: by the dtype it ran in
        (autocast's, from the payload, or the parameters')."""
        assert self.payload is not None
        dtype = compute_dtype(self._dtypes, self.payload.autocast, self.device.type)
        return noise_cap(dtype), _dtype_name(dtype)

    def audit(self) -> AuditOutcome:
        """Compare this step's audited micro-batches across the ring. A collective."""
        with self._replaying():
            return self._audit()

    def _audit(self) -> AuditOutcome:
        me = self.me
        assert self.payload is not None
        own = self.own_summary()
        sends = {}
        if me in self.replayer_of:
            sends = {self.replayer_of[me]: pack((self.payload.to_bytes(), own))}
        partner = self.partner_of.get(me)
        received = exchange(
            sends, [partner] if partner is not None else [], self.group, self.comm_device
        )
        n = len(self.kind_names)
        # [present, cap, then per kind: bitwise equal, relative difference]
        row = torch.full((2 + 2 * n,), -1.0, dtype=torch.float64)
        row[1] = self._cap()[0]
        partner_payload: Payload | None = None
        replayed: Summary | None = None
        partner_own: Summary | None = None
        if partner is not None:
            raw, partner_own = unpack(received[partner])
            partner_payload = Payload.from_bytes(raw)
            replayed = self._recompute(partner_payload, partner_own)
            c = self.compare(partner_own, replayed)
            row[0] = 1.0
            for k, d in enumerate(c.kinds):
                row[2 + 2 * k] = float(d.equal)
                row[3 + 2 * k] = d.rel
        table = self._gather(row)
        # Every rank decides from the same table, with the same cap (the widest any rank
        # computed in, should autocast differ between them).
        cap = max(t[1] for t in table)
        if cap != self.noise.cap:
            self.noise.cap = cap
            self.noise.dtype = self._cap()[1] if self._cap()[0] == cap else "the widest dtype"
        comparisons = {
            p: Comparison(
                tuple(KindDiff(bool(t[2 + 2 * k]), t[3 + 2 * k]) for k in range(n)), self.outputs
            )
            for p, r in self.replayer_of.items()
            if (t := table[r])[0] == 1.0
        }
        return self._decide(comparisons, partner_payload, partner_own, replayed)

    def _decide(
        self,
        comparisons: dict[int, Comparison],
        partner_payload: Payload | None,
        partner_own: Summary | None,
        replayed: Summary | None,
    ) -> AuditOutcome:
        """Judge each kind of evidence on its own: a kind whose differences are noise
        learns them (or goes blind above the cap); a kind whose differences point at a
        rank goes to the recheck; a rank is accused on whichever kind separates it."""
        ring = self.replayer_of
        noise = self.noise
        # The weak separations of the audits right before, if this is their re-audit.
        previous_weak = self._weak if self._reauditing else []
        self._weak = []
        self.stats.audits += 1
        self.stats.comparisons += len(comparisons)
        self.stats.differing += sum(not c.bitwise_equal for c in comparisons.values())
        first = noise.audits == 0
        noise.audits += 1
        was_reproducible = noise.bit_reproducible is not False
        flagged = split_by_kind(noise, comparisons, ring)
        evidence: dict[str, Any] = {}
        if flagged:
            evidence["mismatches"] = [
                self._mismatch_evidence(p, comparisons[p], flagged)
                for p in sorted({p for ps in flagged.values() for p in ps})
            ]
        notes: list[str] = []
        # Comparisons above the cap in some kind are evidence: none of their kinds is
        # learned from them as noise.
        loud = {p for p, c in comparisons.items() if noise.loudest(c) > noise.cap}
        if not self.calibrate:
            for k in list(flagged):
                kept, note = self._noise_of_kind(k, flagged[k], comparisons, first, loud)
                if note:
                    notes.append(note)
                if kept:
                    flagged[k] = kept
                else:
                    del flagged[k]
        mismatched = sorted({p for ps in flagged.values() for p in ps})
        self.stats.mismatches += len(mismatched)
        self.stats.loss_mismatches += len(flagged.get(0, []))
        if mismatched:
            self.stats.mismatch_steps.append(self.step)
        if self.calibrate or not mismatched:
            noise.count(comparisons.values())
            return AuditOutcome(
                None, evidence if mismatched else {}, not self.blind, self._note(notes)
            )
        explanations = {
            k: explain_mismatches(ps, ring, max_mismatches=self.max_mismatches)
            for k, ps in flagged.items()
        }
        # A rank that one kind shows twice explains another kind's single mismatch that
        # involves it: that pair needs no tie-break of its own (and no third node is
        # spent on it).
        persistent = {r for e in explanations.values() for r in e.persistent}
        owners = sorted(
            (
                persistent
                | {
                    q
                    for e in explanations.values()
                    for q in e.unexplained
                    if not {q, ring[q]} & persistent
                }
            )
            & set(mismatched)
        )
        rechecks = self._recheck(
            owners, mismatched, flagged, partner_payload, partner_own, replayed
        )
        if rechecks:
            evidence["rechecks"] = [self._recheck_evidence(r) for r in rechecks[0]]
        findings: dict[int, ReplayFinding] = {}
        for k, e in explanations.items():
            mine = [r for r in rechecks.get(k, []) if r.owner in flagged[k]]
            if not mine and not e.ambiguous:
                continue  # explained by the rank another kind shows
            real = [
                r
                for r in mine
                if not self._noise_transient(k, r, flagged[k], comparisons, was_reproducible)
            ]
            if mine and not real and not e.ambiguous:
                findings[k] = ReplayFinding(
                    "nondeterministic",
                    (),
                    False,
                    None,
                    f"{noise.kinds[k].name}: a replay differed within what rounding can "
                    "produce and did not reproduce when recomputed: run-to-run noise of a "
                    "kernel that is not deterministic, not evidence against any GPU",
                )
                continue
            finding = resolve(e, real)
            if finding.classification == "rank" and finding.localized:
                finding = self._rounding_level(
                    k, finding, flagged[k], comparisons, was_reproducible
                )
            findings[k] = finding
        # Kinds that found nothing one GPU explains: their noise reached further.
        for k, f in findings.items():
            if f.classification == "nondeterministic":
                diffs = [comparisons[p] for p in flagged[k]]
                if noise.learn_job(k, diffs):
                    notes.append(
                        f"{noise.kinds[k].name}: replays differed by up to "
                        f"{max(c.kinds[k].rel for c in diffs):.3g} (relative) without a "
                        "pattern one GPU explains: learned as run-to-run noise"
                    )
                else:
                    notes.append(
                        noise.go_blind(
                            k,
                            max(c.kinds[k].rel for c in diffs),
                            "replays differ without a pattern one GPU explains",
                        )
                    )
        # Kinds whose differences the recheck could not separate accuse nobody, teach
        # nothing, and leave the step unvouched.
        unseparated = sorted(k for k, f in findings.items() if f.classification == "unseparated")
        for k in unseparated:
            notes.append(f"{noise.kinds[k].name}: {findings[k].message}")
        if unseparated:
            evidence["unseparated_kinds"] = [noise.kinds[k].name for k in unseparated]
        accusing = {k: f for k, f in findings.items() if f.classification == "rank" and f.suspects}
        # Weak separations: a rank is named when WEAK_AUDITS audits in a row (the last
        # ones re-audits) separated it, alone (fresh noise, the same persistent fault);
        # noise that sided against a healthy rank rarely repeats on the same rank, and
        # never names it once.
        weak = {k: f for k, f in findings.items() if f.classification == "weak"}
        weak_ranks = {r for f in weak.values() for r in f.suspects}
        if weak:
            evidence["weakly_separated"] = sorted(self.topology.global_rank(r) for r in weak_ranks)
        r = named_on_repeat(previous_weak, weak_ranks)
        if not accusing and r is not None:
            k = min(weak)
            accusing = {
                k: dataclasses.replace(
                    weak[k],
                    classification="rank",
                    localized=True,
                    transient=False,
                    # Rounding-level evidence: not corroborated, so the operator quarantines
                    # nothing until the same node is caught again (a persistent fault is, at
                    # the next audits) or a confirmation on the node says so; a chance
                    # repeat under noise at the cap names another rank the next time.
                    corroborated=False,
                    message=(
                        f"rank(s) {r} computed a wrong result at {WEAK_AUDITS} audits in a "
                        "row: third nodes sided against it at each, by less than a clear "
                        "separation (within a small multiple of the noise, or not many "
                        "times nearer the other side), and the fresh noise of each "
                        "re-audit left the same rank separated, alone (persistent); "
                        "not corroborated: evidence this close to the noise quarantines "
                        "nothing until the same node is caught again or confirmed"
                    ),
                )
            }
        elif not accusing and len(weak_ranks) == 1:
            self._weak = [*previous_weak, weak_ranks]
        if accusing:
            finding = _strongest(accusing, noise)
            evidence["evidence_kinds"] = sorted(
                noise.kinds[k].name
                for k, f in accusing.items()
                if set(f.suspects) & set(finding.suspects)
            )
            involved = {p for k in accusing for p in flagged[k]}
            # A hardware fault says nothing about the job's reproducibility: count the rest.
            noise.count(c for p, c in comparisons.items() if p not in involved)
            source = choose_source(finding, rechecks.get(_kind_of(accusing, finding), []), ring)
            work = None
            if source is not None and source.writer == self.me:
                work = self._evidence_work(source, partner_payload, partner_own, replayed)
            return AuditOutcome(finding, evidence, False, self._note(notes), source, work)
        # Differences no free third separated: audited again at the next step (fresh
        # noise, the same fault), up to REAUDITS times in a row.
        if (unseparated or weak) and self._reaudits < REAUDITS:
            self._again = True
            self._reaudits += 1
        # Differences the recheck could not separate are not counted either: in a job that
        # is bit for bit reproducible they would make any later difference count as noise.
        withheld = {p for k in [*unseparated, *weak] for p in flagged[k]}
        noise.count(c for p, c in comparisons.items() if p not in withheld)
        quiet = [f for f in findings.values() if f.classification == "nondeterministic"]
        return AuditOutcome(
            quiet[0] if quiet else None,
            evidence,
            not self.blind and not unseparated and not weak,
            self._note(notes),
        )

    def _note(self, notes: list[str]) -> str | None:
        """What this audit learned, for the once-per-job report and the log."""
        if not notes:
            return None
        text = "; ".join(notes)
        if self.blind:
            return (
                f"{text}. No kind of evidence can separate a faulty rank any more: the replay "
                "audit cannot verify this job (replays differ beyond any rounding in the loss "
                "and every layer's gradients: randomness outside torch's "
                "generators, such as a private generator or unseeded dropout, cannot be "
                "replayed); last_clean_step now follows the other checks. Use "
                "sdc_agent.enable_determinism() and torch's generators to restore it."
            )
        return f"{text}; threshold in force: {self.noise.describe()}"

    def _noise_of_kind(
        self,
        k: int,
        flagged: list[int],
        comparisons: dict[int, Comparison],
        first: bool,
        loud: set[int],
    ) -> tuple[list[int], str | None]:
        """Kind ``k``'s differences that are its noise, learned; the rest kept as evidence.

        Too many differing comparisons for one or two faulty GPUs (a storm) are the kind's
        run-to-run noise: learned within the cap, and above it the kind goes blind. At
        the first audit a difference within the cap cannot be told from a fault present
        from the start: it is learned too, for the ranks the ring points at.
        """
        noise, ring = self.noise, self.replayer_of
        name = noise.kinds[k].name
        small = [p for p in flagged if noise.within_cap(k, comparisons[p]) and p not in loud]
        large = [p for p in flagged if p not in small]
        notes: list[str] = []
        storm = explain_mismatches(flagged, ring, max_mismatches=self.max_mismatches).storm
        if storm and large:
            worst = max(comparisons[p].kinds[k].rel for p in large)
            if explain_mismatches(large, ring, max_mismatches=self.max_mismatches).storm:
                return [], noise.go_blind(k, worst, "too many replays differ for one GPU")
        if small and (storm or first):
            worst = max(comparisons[p].kinds[k].rel for p in small)
            if storm:
                noise.learn_job(k, (comparisons[p] for p in small))
                who = "every rank's computations"
            else:
                common, rest = attribute(small, ring)
                for r in common:
                    for p in small:
                        if r in (p, ring[p]):
                            noise.learn_rank(k, r, comparisons[p])
                for p, r in rest:
                    noise.learn_rank(k, p, comparisons[p])
                    noise.learn_rank(k, r, comparisons[p])
                ranks = sorted(common | {r for pair in rest for r in pair})
                who = "the processes of rank(s) " + ", ".join(
                    str(self.topology.global_rank(r)) for r in ranks
                )
            when = "at the first audit" if first else "in one audit"
            notes.append(
                f"{name}: {when} {who} differed from their replays by up to {worst:.3g} "
                "(relative), within what rounding can produce: learned as noise, accusing "
                "nobody"
                + (
                    " (a difference present from the start, such as a per-process kernel "
                    "choice or atomics, cannot be told from a fault present from the start)"
                    if first
                    else ""
                )
            )
            reason = noise.kinds[k].blind
            if reason is not None:
                notes.append(reason)
                return [], "; ".join(notes)
            return large, "; ".join(notes)
        return flagged, None

    def _noise_transient(
        self,
        k: int,
        recheck: Recheck,
        flagged: list[int],
        comparisons: dict[int, Comparison],
        was_reproducible: bool,
    ) -> bool:
        """A recheck naming a rank whose wrong result did not reproduce, by no more than
        rounding can make in kind ``k``, in a job whose replays have varied before: a
        kernel that is not deterministic run to run gives exactly this (noise)."""
        outcome, suspect, transient = judge(recheck)
        if outcome not in ("owner", "replayer") or not transient or was_reproducible:
            return False
        ring = self.replayer_of
        against = [comparisons[p] for p in flagged if suspect in (p, ring[p])]
        if all(self.noise.loudest(c) <= self.noise.cap for c in against):
            return True
        # Above the cap but not reproducible, in a kind whose noise is known: an outlier
        # of that noise, or a glitch that no second observation supports. Within
        # HEADROOM times the cap the kind's noise reaches the cap: it cannot separate.
        kind = self.noise.kinds[k]
        noisy = any(kind.tolerance((p, ring[p])) > 0 for p in flagged)
        worst = max(c.kinds[k].rel for c in against)
        if noisy and worst <= HEADROOM * self.noise.cap:
            self.noise.go_blind(
                k, worst, "a difference above the cap that did not reproduce, in noise"
            )
            return True
        return False

    def _rounding_level(
        self,
        k: int,
        finding: ReplayFinding,
        flagged: list[int],
        comparisons: dict[int, Comparison],
        was_reproducible: bool,
    ) -> ReplayFinding:
        """A localized finding resting only on differences rounding can make (within the
        cap) in kind ``k`` is named but not corroborated, and the difference is learned,
        so it is reported once and never quarantines by repetition.

        The recheck cannot tell such a difference from a kernel the suspect's process
        chose differently mid-run (autotuning a new shape, a library heuristic:
        reproducible on that GPU, like a broken one) or, when the rerun did not reproduce
        it, from a kernel that is not deterministic run to run. Only a recomputation by
        another process on the suspect's GPU (the confirmation run) separates them. In a
        job bit-reproducible so far, no kernel has ever varied: a transient difference is
        named (transient, not corroborated).
        """
        ring = self.replayer_of
        suspects = set(finding.suspects)
        against = [comparisons[p] for p in flagged if suspects & {p, ring[p]}]
        # Rounding level: within the cap in every kind that still works, not only in the
        # kind that accused (another may show the same fault far above it).
        if not against or not all(self.noise.loudest(c) <= self.noise.cap for c in against):
            return finding
        worst = max(c.kinds[k].rel for c in against)
        name = self.noise.kinds[k].name
        if finding.transient:
            if was_reproducible:
                return dataclasses.replace(
                    finding,
                    corroborated=False,
                    message=(
                        f"{finding.message}; the difference ({name}, {worst:.3g} relative) "
                        "is within what rounding can produce, but every replay of this job "
                        "so far matched bit for bit, so no kernel here varies run to run: "
                        "named as transient, not corroborated"
                    ),
                )
            # Not reproducible on the same GPU, and no larger than rounding: a kernel that
            # is not deterministic run to run gives exactly this. Noise (learned by the
            # caller).
            return ReplayFinding(
                "nondeterministic",
                (),
                False,
                None,
                f"a replay differed by {worst:.3g} (relative, {name}), within what rounding "
                "can produce, and did not reproduce when recomputed: run-to-run noise of a "
                "kernel that is not deterministic, not evidence against any GPU",
            )
        nodes = {self.nodes[q] for q in suspects}
        for r, node in enumerate(self.nodes):
            if node in nodes:
                # Every kind: the same rounding-level difference may show in another
                # layer or the loss next time, and must not be reported again.
                for kind in range(len(self.noise.kinds)):
                    self.noise.excuse(kind, r)
        message = (
            f"{finding.message}; but the difference ({name}, {worst:.3g} relative) is within "
            f"what rounding can produce (up to {self.noise.cap:.3g} in {self.noise.dtype}, "
            "the dtype this step computed in): a kernel the suspect's process chose "
            "differently mid-run (autotuning a new shape, a library heuristic) would look "
            "the same, and the recheck cannot tell them apart, so this is not corroborated "
            "(a confirmation run on the node decides) and is learned as the suspect node's "
            f"noise (reported once); {self.noise.describe()}"
        )
        return dataclasses.replace(finding, corroborated=False, message=message)

    def _evidence_work(
        self,
        source: BundleSource,
        partner_payload: Payload | None,
        partner_own: Summary | None,
        replayed: Summary | None,
    ) -> EvidenceWork | None:
        """What this rank, the writer, holds of ``source``'s micro-batch."""
        if source.work_of == self.me:  # the suspect replayed my work wrong
            assert self.payload is not None
            return EvidenceWork(self.payload, self.own_summary(), None)
        if partner_payload is None or replayed is None:
            return None
        # I replayed the suspect's work: my replay is the reference, its own the suspect's.
        own = partner_own if source.work_of == source.suspect else None
        return EvidenceWork(partner_payload, replayed, own)

    def _agree(self, a: Summary, b: Summary, ranks: tuple[int, int]) -> list[bool]:
        """Per kind: two computations in the recheck agree within the tolerance in
        force for ``ranks`` in that kind."""
        c = self.compare(a, b)
        t = self.noise.tolerances(ranks)
        return [
            not _differs_at(c.kinds[k], t[k], self.noise.kinds[k].measured)
            for k in range(len(c.kinds))
        ]

    def _within(self, k: int, distance: float, ranks: tuple[int, int]) -> bool:
        """A distance from :func:`_distances` is within kind ``k``'s tolerance in force
        for ``ranks`` (what :meth:`_agree` says of the two computations)."""
        tolerance = self.noise.kinds[k].tolerance(ranks)
        return distance == 0.0 or (tolerance > 0 and distance <= tolerance)

    def _mismatch_evidence(
        self, p: int, c: Comparison, flagged: dict[int, list[int]]
    ) -> dict[str, Any]:
        ranks = (p, self.replayer_of[p])
        tol = self._tolerance(*ranks)
        tols = self.noise.tolerances(ranks)
        kinds = {
            self.noise.kinds[k].name: {
                "relative_difference": _finite(c.kinds[k].rel),
                "tolerance": tols[k],
            }
            for k, ps in flagged.items()
            if p in ps
        }
        return {
            "work_of": self.topology.global_rank(p),
            "replayed_by": self.topology.global_rank(self.replayer_of[p]),
            "loss_equal": c.loss_equal,
            "gradients_equal": c.grads_equal,
            "loss_relative_difference": _finite(c.loss_rel),
            "gradient_relative_difference": _finite(c.grad_rel),
            "tolerance": tol.gradients,
            "loss_tolerance": tol.loss,
            "kinds": kinds,
        }

    def _recheck_evidence(self, r: Recheck) -> dict[str, Any]:
        return {
            "work_of": self.topology.global_rank(r.owner),
            "replayed_by": self.topology.global_rank(r.replayer),
            "third": None if r.third is None else self.topology.global_rank(r.third),
            "third_agrees_with_original": r.third_agrees_original,
            "third_agrees_with_replay": r.third_agrees_replay,
            "third_distance_to_original": _optional(r.third_to_original),
            "third_distance_to_replay": _optional(r.third_to_replay),
            "noise": r.noise,
            "owner_reproduces_its_result": r.rerun_reproduces,
            "replayer_reproduces_its_result": r.rereplay_reproduces,
        }

    def _recheck(
        self,
        owners: list[int],
        mismatched: list[int],
        flagged: dict[int, list[int]],
        partner_payload: Payload | None,
        partner_own: Summary | None,
        replayed: Summary | None,
    ) -> dict[int, list[Recheck]]:
        """Round two for each owner: rerun on the owner, replay again on its replayer, and
        once on a third node; agreement judged per kind of evidence. A collective.
        Returns the rechecks per kind (every kind, all owners)."""
        me, ring = self.me, self.replayer_of
        n = len(self.kind_names)
        involved = {r for p in mismatched for r in (p, ring[p])}
        # A third may be a rank rechecked in other kinds of evidence: its replay of q's
        # work separates q and ring[q] in the kinds where it is no suspect itself.
        third = choose_thirds(owners, ring, self.nodes, involved, flagged)
        suspects = suspects_by_kind(owners, ring, flagged)
        has_third_node = {
            q: bool(set(self.nodes) - {self.nodes[q], self.nodes[ring[q]]}) for q in owners
        }
        sends: dict[int, list[Any]] = {}
        sources: set[int] = set()
        for q in owners:
            t = third.get(q)
            if t is None:
                continue
            if me == q:
                assert self.payload is not None
                sends.setdefault(t, []).append(
                    ("work", q, self.payload.to_bytes(), self.own_summary())
                )
            if me == ring[q]:
                sends.setdefault(t, []).append(("replay", q, replayed))
            if me == t:
                sources.update((q, ring[q]))
        received = exchange(
            {d: pack(items) for d, items in sends.items()},
            sorted(sources),
            self.group,
            self.comm_device,
        )
        works: dict[int, tuple[Payload, Summary]] = {}
        replays: dict[int, Summary] = {}
        for data in received.values():
            for item in unpack(data):
                if item[0] == "work":
                    works[item[1]] = (Payload.from_bytes(item[2]), item[3])
                else:
                    replays[item[1]] = item[2]
        # Per owner and kind: [rerun reproduces, rereplay reproduces, third ~ original,
        # third ~ replay]
        row = torch.full((max(len(owners), 1), n, 4), -1.0, dtype=torch.float64)
        for k, q in enumerate(owners):
            if me == q:
                assert self.payload is not None
                again = self._recompute(self.payload)
                # At the tolerance of the comparison that flagged q's work: the noise
                # learned for q's pair (or the job) moves q's own rerun as much.
                row[k, :, 0] = _flags(self._agree(self.own_summary(), again, (q, ring[q])))
            if me == ring[q] and partner_payload is not None and replayed is not None:
                again = self._recompute(partner_payload)
                row[k, :, 1] = _flags(self._agree(replayed, again, (q, ring[q])))
            if me == third.get(q) and q in works and q in replays:
                payload, original = works[q]
                mine = self._recompute(payload)
                row[k, :, 2] = _distances(self.compare(original, mine))
                row[k, :, 3] = _distances(self.compare(replays[q], mine))
        shape = (max(len(owners), 1), n, 4)
        table = [torch.tensor(t).reshape(shape).tolist() for t in self._gather(row)]
        out: dict[int, list[Recheck]] = {}
        for kind in range(n):
            for k, q in enumerate(owners):
                t = third.get(q)
                if t is not None and not free_in(t, kind, suspects):
                    t = None
                to_original = to_replay = None
                agrees_original = agrees_replay = None
                if t is not None:
                    # -1: not computed (never, with a third chosen): agrees with nobody.
                    to_original, to_replay = (
                        math.inf if d < 0 else d for d in table[t][k][kind][2:]
                    )
                    agrees_original = self._within(kind, to_original, (t, q))
                    agrees_replay = self._within(kind, to_replay, (t, ring[q]))
                out.setdefault(kind, []).append(
                    Recheck(
                        owner=q,
                        replayer=ring[q],
                        third=t,
                        third_agrees_original=agrees_original,
                        third_agrees_replay=agrees_replay,
                        third_to_original=to_original,
                        third_to_replay=to_replay,
                        noise=self.noise.kinds[kind].tolerance((q, ring[q])),
                        rerun_reproduces=table[q][k][kind][0] == 1.0,
                        rereplay_reproduces=table[ring[q]][k][kind][1] == 1.0,
                        crowded=t is None and has_third_node[q],
                    )
                )
        return out

    def replay_nonfinite(
        self, suspects: Sequence[int], payload: Payload | None = None
    ) -> dict[int, tuple[bool, bool]]:
        """Replay each suspect's micro-batch on its ring partner's node, and on the suspect
        itself once more. A collective. ``payload``: the micro-batch of an earlier step
        whose flags are read late (default: this step's).

        Returns, per suspect that could be replayed, ``(non-finite elsewhere, non-finite
        again on the suspect)``: elsewhere too means the data or the model, not hardware.
        """
        with self._replaying():
            return self._replay_nonfinite(suspects, payload)

    def _replay_nonfinite(
        self, suspects: Sequence[int], payload: Payload | None
    ) -> dict[int, tuple[bool, bool]]:
        me = self.me
        payload = self.payload if payload is None else payload
        targets = {p: self.replayer_of[p] for p in suspects if p in self.replayer_of}
        sends = {}
        if me in targets and payload is not None:
            sends = {targets[me]: payload.to_bytes()}
        sources = [p for p, r in targets.items() if r == me]
        received = exchange(sends, sources, self.group, self.comm_device)
        row = torch.full((2,), -1.0, dtype=torch.float64)
        for p in sources:
            row[0] = float(self._recompute(Payload.from_bytes(received[p])).nonfinite)
        if me in targets and payload is not None:
            row[1] = float(self._recompute(payload).nonfinite)
        flags = self._gather(row)
        return {
            p: (bool(flags[r][0]), bool(flags[p][1]))
            for p, r in targets.items()
            if flags[r][0] >= 0 and flags[p][1] >= 0
        }

    def _gather(self, row: torch.Tensor) -> list[list[float]]:
        world = dist.get_world_size(self.group)
        mine = row.reshape(-1).to(self.comm_device)
        out = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(out, mine, group=self.group)
        return [t.tolist() for t in out]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _distances(c: Comparison) -> torch.Tensor:
    """Per kind, how far two computations in the recheck are apart (relative; 0 where
    bit for bit equal)."""
    return torch.tensor([0.0 if d.equal else d.rel for d in c.kinds], dtype=torch.float64)


def _flags(agree: list[bool]) -> torch.Tensor:
    return torch.tensor([float(a) for a in agree], dtype=torch.float64)


def _differs_at(diff: KindDiff, tolerance: float, measured: float) -> bool:
    """Disagreement in the recheck: evidence at ``tolerance`` (see
    :func:`~sdc_agent.evidence.kind_differs`)."""
    del measured
    return not diff.equal and (tolerance <= 0 or diff.rel > tolerance)


def _strength(f: ReplayFinding) -> tuple[int, int]:
    return (int(f.localized), int(bool(f.corroborated)))


def _strongest(findings: dict[int, ReplayFinding], noise: NoiseModel) -> ReplayFinding:
    """The finding accusing on the strongest evidence (localized, then corroborated, then
    the first kind: the loss, then layers in order), naming the kind."""
    k = max(findings, key=lambda k: (_strength(findings[k]), -k))
    f = findings[k]
    return dataclasses.replace(f, message=f"{f.message} (evidence: {noise.kinds[k].name})")


def _kind_of(findings: dict[int, ReplayFinding], chosen: ReplayFinding) -> int:
    for k, f in findings.items():
        if f.suspects == chosen.suspects and f.localized == chosen.localized:
            return k
    return next(iter(findings))


def _optional(x: float | None) -> float | None:
    return None if x is None else _finite(x)


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None
