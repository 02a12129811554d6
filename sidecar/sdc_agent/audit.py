"""Runs check 2 inside a Guard: captures the audited micro-batch, replays, compares."""

from __future__ import annotations

import dataclasses
import io
import os
import random
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .bundling import BundleSource, EvidenceWork, choose_source
from .errors import SDCError
from .evidence import (
    HEADROOM,
    HEADROOM_16BIT,
    LOSS,
    Comparison,
    NoiseModel,
    Summary,
    Tolerance,
    attribute,
    compare,
    compute_dtype,
    kind_caps,
    kind_count,
    kind_name,
    noise_cap,
    tensor_stats,
)
from .faults import FaultInjector, FaultSpec, corrupt_
from .fingerprint import Fingerprinter
from .replay import (
    Payload,
    Recheck,
    ReplayFinding,
    RngState,
    choose_thirds,
    exchange,
    explain_mismatches,
    loss_bits,
    map_tensors,
    plan_ring,
    replay_complete,
    resolve,
    storm_threshold,
)
from .topology import Topology

__all__ = ["AuditOutcome", "ReplayAudit", "ReplayStats", "audited_micro_batch"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]

_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
"""The dtypes a computation's cap can come from, by code in the gathered table."""

Kinds = dict[int, frozenset[int]]
"""Per owner whose work differed from its replay: the kinds of evidence that differ."""


@dataclass(slots=True)
class ReplayStats:
    """Counts since the Guard started; in ``calibrate`` mode, the answer to "is my model
    deterministic?" is ``mismatches == 0``."""

    audits: int = 0
    comparisons: int = 0
    mismatches: int = 0
    """Comparisons that differed by more than the tolerance in force at the time."""
    loss_mismatches: int = 0
    """Mismatches in which the loss is among the kinds of evidence that differ."""
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


MICRO_BATCH_SEED = 0x5DC
"""The seed of the audited micro-batch's permutations: the same on every rank (they need
no secret: which micro-batch is audited is no use to a faulty GPU)."""


def audited_micro_batch(audit: int, count: int, seed: int = MICRO_BATCH_SEED) -> int:
    """The micro-batch the ``audit``-th audit (from 0) replays, of ``count``: audits go in
    cycles of ``count``, each a permutation drawn from ``seed`` and the cycle's number, so
    every index is audited once in every cycle."""
    if count <= 1:
        return 0
    cycle, position = divmod(audit, count)
    order = random.Random(seed * 1_000_003 + cycle).sample(range(count), count)
    return order[position]


class _Collector:
    """Per-parameter fingerprints and statistics of one computation."""

    def __init__(self, fingerprinter: Fingerprinter) -> None:
        self.fingerprinter = fingerprinter
        self.fps: dict[int, torch.Tensor] = {}
        self.stats: dict[int, torch.Tensor] = {}

    def add(self, index: int, grad: torch.Tensor) -> None:
        with torch.no_grad():
            self.fps[index] = self.fingerprinter(grad)
            self.stats[index] = tensor_stats(grad)

    def summary(self, loss: torch.Tensor, count: int) -> Summary:
        """Everything on the host, in one copy (one synchronisation per computation)."""
        device = loss.device
        zero_fp = torch.zeros(2, dtype=torch.int64, device=device)
        zero_st = torch.zeros(2, dtype=torch.float64, device=device)
        fps = torch.stack([self.fps.get(i, zero_fp).to(device) for i in range(count)])
        stats = torch.stack([self.stats.get(i, zero_st).to(device) for i in range(count)])
        value = loss.detach().to(torch.float64).reshape(())
        bad = ~torch.isfinite(stats).all() | ~torch.isfinite(value)
        bits = int(loss_bits(loss.detach()).item())
        fp_rows, stat_rows = fps.tolist(), stats.tolist()
        return Summary(
            loss_bits=bits,
            loss=float(value.item()),
            fingerprints=tuple((int(a), int(b)) for a, b in fp_rows),
            stats=tuple((float(a), float(b)) for a, b in stat_rows),
            nonfinite=bool(bad.item()),
        )


def _pack(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> Any:
    # Only ever from another rank of the same job, which runs the same code.
    return torch.load(io.BytesIO(data), weights_only=False)


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
    ) -> None:
        self.module = module
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
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        first = next(iter(self.params), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self._dtypes = {p.dtype for p in self.params}
        names = {id(p): n for n, p in module.named_parameters()}
        self._sizes = tuple(p.numel() for p in self.params)
        self.noise = NoiseModel(
            cap=0.0,
            names=tuple(names.get(id(p), f"gradient {i}") for i, p in enumerate(self.params)),
            kinds=kind_count(len(self.params)),
        )
        self._set_dtype(compute_dtype(self._dtypes, {}, self.device.type))
        self.stats = ReplayStats()
        self.blind = False
        """The job's replays differ beyond any plausible noise: the audit verifies nothing."""
        self.max_mismatches = storm_threshold(len(nodes))
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
        self._own = _Collector(fingerprinter)
        self._bucket0: list[tuple[torch.Tensor, int, int]] | None = None
        self._watch: set[int] = set()
        """Ranks a rounding-level, reproducible difference pointed at in the last audit of
        a job that is not bit-reproducible: named if the next audit points at them again."""
        self._watched: set[int] = set()
        self._watch_evidence: list[tuple[Comparison, frozenset[int]]] = []
        """What made the watched ranks watched: learned as noise if the next audit does not
        point at them again."""
        self._audits_due = 0  # audits started so far: the position in the permutations
        self._count = 1  # micro-batches per step, as the last step had them
        self.audited = 0
        """The index of the micro-batch this step's audit replays (see
        :func:`audited_micro_batch`)."""
        self._forwards = 0
        self._grad_hooks: list[Any] = []

    def _shared_seed(self) -> int:
        # Group rank 0 draws, everyone adds: the same seed on every rank.
        seed = torch.zeros(1, dtype=torch.int64, device=self.comm_device)
        if self.me == 0:
            seed[0] = int.from_bytes(os.urandom(7), "little")
        dist.all_reduce(seed, group=self.group)
        return int(seed.item())

    @property
    def verifies(self) -> bool:
        return not self.blind and not self.calibrate

    # -- during the step -----------------------------------------------------------------

    def begin(self, step: int) -> None:
        scheduled = self.every > 0 and step % self.every == 0
        # Draw every step, audited or not, so all ranks stay on the same sequence.
        drawn = self.probability > 0 and self._schedule.random() < self.probability
        self._due_if_replayable = scheduled or drawn
        self.due = self._due_if_replayable and self.loss_fn is not None
        if self._micro:
            self._count = self._micro
        self._drop_grad_hooks()
        self.audited = 0
        if self._due_if_replayable:
            self.audited = audited_micro_batch(self._audits_due, self._count)
            self._audits_due += 1
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
        self._own = _Collector(self.fingerprinter)

    def set_loss_fn(self, loss_fn: LossFn) -> None:
        """The loss function, given with the first micro-batch rather than at start-up."""
        self.loss_fn = loss_fn
        self.due = self._due_if_replayable

    @property
    def micro_batches(self) -> int:
        """Micro-batches seen so far in this step."""
        return self._micro

    def forward_starts(self) -> None:
        """From the model's forward pre-hook: the RNG state the micro-batch starts from."""
        if self._rng is None and self._forwards == self.audited:
            self._rng = RngState.capture(self.device)
        self._forwards += 1

    def micro_batch(self, batch: Any, loss: torch.Tensor, *, syncs: bool, copy: bool) -> None:
        """A micro-batch's forward is done and its ``loss`` is about to be backpropagated.

        The audited one is :attr:`audited` of the step (the first when the step has one).
        ``syncs``: its backward all-reduces (no ``no_sync``), so the communication hook
        sees its local gradients (the first micro-batch only: later ones' hook gradients
        carry the earlier ones' too).
        """
        index = self._micro
        self._micro += 1
        self._syncing_recorded += syncs
        if index == self.audited + 1:
            self._in_hook = False  # the hook now carries later micro-batches' gradients
            self._drop_grad_hooks()  # the audited micro-batch's backward is done
            if self._observe_later:
                self.observe_grads()
        if index != self.audited:
            return
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise SDCError("loss: must be a scalar tensor (the micro-batch's loss)")
        rng = self._rng if self._rng is not None else RngState.capture(self.device)
        if copy and self.due:
            batch = map_tensors(batch, lambda t: t.detach().clone())
        self.payload = Payload(batch, rng.cpu, rng.cuda, rng.autocast)
        # A copy: loops scale the loss tensor in place (the Trainer multiplies it by the
        # world size when averaging tokens across devices).
        self.own_loss = loss.detach().clone()
        if self.due and index > 0:
            # Its own gradients, as each backward hands them over, before they are added
            # to the earlier micro-batches' in .grad.
            self._grad_hooks = [
                p.register_hook(self._own_grad(i)) for i, p in enumerate(self.params)
            ]
        self._observe_later = self.due and not syncs and index == 0
        self._in_hook = self.due and syncs and index == 0
        if loss.requires_grad:
            payload = self.payload

            def record(grad: torch.Tensor) -> None:
                payload.loss_grad = grad.detach()

            loss.register_hook(record)

    def _own_grad(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._own.add(i, grad)

        return hook

    def _drop_grad_hooks(self) -> None:
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []

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
        if self.capturing_in_hook:
            for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
                i = self.index_of.get(id(p))
                if i is not None:
                    self._own.add(i, g)

    def observe_grads(self) -> None:
        """After the audited micro-batch's backward under ``no_sync`` (accumulation)."""
        if not self._observe_later:
            return
        self._observe_later = False
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self._own.add(i, p.grad)

    # -- recomputing -----------------------------------------------------------------------

    def _recompute(self, payload: Payload) -> Summary:
        """``payload`` recomputed here, summarized."""
        assert self.loss_fn is not None
        active = [s for s in self.injector.pending("grad_local") if self.injector.fire(s)]
        collector = _Collector(self.fingerprinter)

        def factory() -> Callable[[int, torch.Tensor], None]:
            nonlocal collector
            collector = _Collector(self.fingerprinter)
            if not active:
                return collector.add
            return lambda i, g: collector.add(i, self._corrupted(i, g, active))

        loss = replay_complete(
            self.module, self.params, self.loss_fn, payload, self.device, factory, self._keep
        )
        return collector.summary(loss, len(self.params))

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
        return self._own.summary(self.own_loss, len(self.params))

    # -- after backward ------------------------------------------------------------------

    def _tolerance(self, *ranks: int) -> Tolerance:
        return self.noise.tolerance(ranks)

    def _dtype(self) -> torch.dtype:
        """The dtype of this step's audited computation, for its caps: autocast's (from
        the payload) or the parameters'."""
        assert self.payload is not None
        return compute_dtype(self._dtypes, self.payload.autocast, self.device.type)

    def _set_dtype(self, dtype: torch.dtype) -> None:
        self.noise.headroom = HEADROOM if torch.finfo(dtype).bits > 16 else HEADROOM_16BIT
        self.noise.cap = noise_cap(dtype)
        self.noise.caps = kind_caps(dtype, self._sizes)
        self.noise.dtype = str(dtype).removeprefix("torch.")

    def audit(self) -> AuditOutcome:
        """Compare this step's audited micro-batches across the ring. A collective."""
        me = self.me
        assert self.payload is not None
        own = self.own_summary()
        sends = {}
        if me in self.replayer_of:
            sends = {self.replayer_of[me]: _pack((self.payload.to_bytes(), own))}
        partner = self.partner_of.get(me)
        received = exchange(
            sends, [partner] if partner is not None else [], self.group, self.comm_device
        )
        kinds = self.noise.kinds
        # [present, dtype code, equal per kind..., relative difference per kind...]
        row = torch.full((2 + 2 * kinds,), -1.0, dtype=torch.float64)
        dtype = self._dtype()
        row[1] = float(_DTYPES.index(dtype) if dtype in _DTYPES else 1)
        partner_payload: Payload | None = None
        replayed: Summary | None = None
        partner_own: Summary | None = None
        if partner is not None:
            raw, partner_own = _unpack(received[partner])
            partner_payload = Payload.from_bytes(raw)
            replayed = self._recompute(partner_payload)
            c = compare(partner_own, replayed)
            row[0] = 1.0
            row[2 : 2 + kinds] = torch.tensor([float(e) for e in c.equal], dtype=torch.float64)
            row[2 + kinds :] = torch.tensor(c.rel, dtype=torch.float64)
        table = self._gather(row)
        # Every rank decides from the same table, with the same caps (the widest any rank
        # computed in, should autocast differ between them).
        self._set_dtype(max((_DTYPES[int(t[1])] for t in table), key=noise_cap))
        comparisons = {
            p: Comparison(
                tuple(bool(e) for e in t[2 : 2 + kinds]), tuple(t[2 + kinds : 2 + 2 * kinds])
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
        ring = self.replayer_of
        self.stats.audits += 1
        self.stats.comparisons += len(comparisons)
        self.stats.differing += sum(not c.bitwise_equal for c in comparisons.values())
        first = self.noise.audits == 0
        self.noise.audits += 1
        self._watched, self._watch = self._watch, set()
        watched_evidence, self._watch_evidence = self._watch_evidence, []
        flagged: Kinds = {}
        for p, c in comparisons.items():
            if kinds := c.differing(self._tolerance(p, ring[p])):
                flagged[p] = kinds
        evidence: dict[str, Any] = {}
        if flagged:
            evidence["mismatches"] = [
                self._mismatch_evidence(p, comparisons[p], kinds) for p, kinds in flagged.items()
            ]
        notes: list[str | None] = []
        if flagged and not self.calibrate:
            if first:
                flagged, note = self._baseline(flagged, comparisons)
                notes.append(note)
            elif self.noise.headroom >= HEADROOM:
                flagged, note = self._known_noise(flagged, comparisons)
                notes.append(note)
            flagged, note = self._storms(flagged, comparisons)
            notes.append(note)
            if self.noise.headroom < HEADROOM:  # 16-bit: no widening before the recheck
                flagged = self._exact_first(flagged, comparisons)
        learned = "; ".join(n for n in notes if n) or None
        mismatched = sorted(flagged)
        pointed = {r for p in mismatched for r in (p, ring[p])}
        if self._watched and not self._watched & pointed:
            # Not pointed at again: what made them watched was the job's noise.
            for c, kinds in watched_evidence:
                self.noise.learn_job([c], kinds)
        self.stats.mismatches += len(mismatched)
        self.stats.loss_mismatches += sum(LOSS in flagged[p] for p in mismatched)
        if mismatched:
            self.stats.mismatch_steps.append(self.step)
        if self.noise.blind and not self.blind:
            self.noise.count(comparisons.values())
            return self._go_blind(evidence, learned)
        if self.calibrate or not mismatched:
            self.noise.count(comparisons.values())
            return AuditOutcome(None, evidence if mismatched else {}, True, learned)
        explanation = explain_mismatches(mismatched, ring, max_mismatches=self.max_mismatches)
        rechecks: list[Recheck] = []
        if not explanation.storm:
            owners = sorted(set(explanation.persistent) | set(explanation.unexplained))
            owners = [q for q in owners if q in flagged]
            rechecks = self._recheck(owners, flagged, partner_payload, partner_own, replayed)
            if rechecks:
                evidence["rechecks"] = [self._recheck_evidence(r) for r in rechecks]
        finding = resolve(explanation, rechecks)
        if (
            finding.classification == "rank"
            and not finding.localized
            and self._rounding_noise(flagged, comparisons)
        ):
            finding = ReplayFinding(
                "nondeterministic",
                (),
                False,
                None,
                "replays differ, by no more than rounding can produce and only in kinds of "
                "evidence known to carry this job's run-to-run noise, in a pattern no third "
                "node could settle: not evidence against any GPU",
            )
        if finding.classification == "rank" and finding.localized:
            checked = self._rounding_level(finding, flagged, comparisons)
            if checked is None:  # a second look at the next audit decides
                self.noise.count(c for p, c in comparisons.items() if p not in flagged)
                names = ", ".join(str(self.topology.global_rank(q)) for q in finding.suspects)
                note = (
                    f"rank(s) {names} computed a result that differs from two other nodes' "
                    "and reproduced it, by no more than rounding can produce, in a job whose "
                    "kernels are not bit-reproducible: watched, and named if the next audit "
                    "points at them again (this step is applied but not vouched for)"
                )
                return AuditOutcome(None, evidence, False, note)
            finding = checked
        if finding.classification != "nondeterministic":
            # A hardware fault says nothing about the job's reproducibility: count the rest.
            self.noise.count(c for p, c in comparisons.items() if p not in flagged)
            source = choose_source(finding, rechecks, ring)
            work = None
            if source is not None and source.writer == self.me:
                work = self._evidence_work(source, partner_payload, partner_own, replayed)
            return AuditOutcome(finding, evidence, False, learned, source, work)
        self.noise.count(comparisons.values())
        # Not hardware, and no single faulty GPU explains it: accuse nobody and vouch for
        # the step. Nothing is learned from it (a fault mixed into the pattern would be
        # learned as noise); the kinds it goes beyond their cap in are set aside.
        largest = max(comparisons[p].rel[k] for p, kinds in flagged.items() for k in kinds)
        beyond: dict[int, float] = {}
        for p, kinds in flagged.items():
            c = comparisons[p]
            for k in kinds:
                if not self.noise.within_cap(c, [k]):
                    beyond[k] = max(beyond.get(k, 0.0), c.rel[k])
        note = f"{finding.message} (replays differ by up to {largest:.3g}, relative)"
        if beyond:
            note += "; set aside (beyond what rounding can produce): " + self.noise.set_aside(
                beyond, beyond
            )
        if self.noise.blind:
            return self._go_blind(evidence, note)
        return AuditOutcome(finding, evidence, True, f"{note}; {self.noise.describe()}")

    def _exact_first(self, flagged: Kinds, comparisons: dict[int, Comparison]) -> Kinds:
        """Where some comparisons differ in kinds of evidence that were bit for bit for
        their pair (new evidence) or beyond their cap, those alone are explained this
        audit: exceedances within the cap in kinds known to carry noise would otherwise
        crowd the pattern into a storm."""
        ring = self.replayer_of
        exact: Kinds = {}
        for p, kinds in flagged.items():
            t = self._tolerance(p, ring[p])
            c = comparisons[p]
            if bits := frozenset(
                k for k in kinds if t.of(k) <= 0 or not self.noise.within_cap(c, [k])
            ):
                exact[p] = bits
        return exact or flagged

    def _rounding_noise(self, flagged: Kinds, comparisons: dict[int, Comparison]) -> bool:
        """Every difference flagged is within its cap, in a kind already known to carry
        noise for its pair, in a job that is not bit-reproducible."""
        ring = self.replayer_of
        return self.noise.observed > 0 and all(
            self.noise.within_cap(comparisons[p], kinds)
            and not self.noise.new_evidence(comparisons[p], (p, ring[p]), kinds)
            for p, kinds in flagged.items()
        )

    def _go_blind(self, evidence: dict[str, Any], learned: str | None) -> AuditOutcome:
        """No kind of evidence is left that could separate a faulty rank."""
        self.blind = True
        why = "; ".join(self.noise.unusable[k] for k in sorted(self.noise.unusable))
        note = (
            "the replay audit cannot verify this job: no kind of evidence is reproducible "
            f"enough to separate a faulty rank ({why}). The loss itself differs between "
            "replays beyond what rounding can produce, which is what randomness outside "
            "torch's generators (a private generator, unseeded dropout) does: it cannot be "
            "replayed. last_clean_step now follows the other checks. Use "
            "sdc_agent.enable_determinism() and torch's generators to restore it."
        )
        if LOSS not in self.noise.unusable:  # only gradient kinds left the audit
            note = (
                "the replay audit cannot verify this job: every gradient statistic is "
                f"noisier than its cap ({why}) and the loss is not compared. "
                "last_clean_step now follows the other checks."
            )
        return AuditOutcome(None, evidence, False, f"{learned}; {note}" if learned else note)

    def _storms(
        self, flagged: Kinds, comparisons: dict[int, Comparison]
    ) -> tuple[Kinds, str | None]:
        """Kinds of evidence that differ in more pairs than one or two faulty ranks make
        (see :func:`~sdc_agent.replay.storm_threshold`) separate nobody this audit:
        within the cap that is the job's noise, learned; beyond it the kind is too noisy
        to verify anything and is set aside. The other kinds keep their say."""
        ring = self.replayer_of
        out = {p: set(kinds) for p, kinds in flagged.items()}
        learned: list[int] = []
        beyond: dict[int, float] = {}
        for k in sorted({k for kinds in flagged.values() for k in kinds}):
            pairs = [p for p, kinds in flagged.items() if k in kinds]
            if not explain_mismatches(pairs, ring, max_mismatches=self.max_mismatches).storm:
                continue
            group = [comparisons[p] for p in pairs]
            if self.noise.learn_job(group, [k]):
                learned.append(k)
            else:
                beyond[k] = max(c.rel[k] for c in group)
            for p in pairs:
                out[p].discard(k)
        notes = []
        if learned:
            notes.append(
                f"{_kinds_text(learned, self.noise.names)} differed in every replay, within "
                "what rounding can produce: learned as the job's run-to-run noise"
            )
        if beyond:
            notes.append(
                "set aside, too noisy to verify anything (the other kinds of evidence are "
                "still compared): " + self.noise.set_aside(beyond, beyond)
            )
        rest = {p: frozenset(kinds) for p, kinds in out.items() if kinds}
        return rest, "; ".join(notes) or None

    def _known_noise(
        self, flagged: Kinds, comparisons: dict[int, Comparison]
    ) -> tuple[Kinds, str | None]:
        """Differences within the cap, in kinds of evidence whose noise is already known
        (their tolerance is above 0): the noise reaching further than the audits saw so
        far (one sample of it sets the first tolerance), not evidence. They widen the
        tolerance they exceeded and accuse nobody. Only with the wide headroom of float32
        and float64 (:data:`~sdc_agent.evidence.HEADROOM`), whose faults of interest stand
        far above the noise; in the 16-bit formats a one-ulp fault is within a few times
        the noise, so every exceedance goes to the recheck instead."""
        ring = self.replayer_of
        out: Kinds = {}
        grown = 0.0
        for p, kinds in flagged.items():
            c, pair = comparisons[p], (p, ring[p])
            tolerance = self._tolerance(*pair)
            known = {k for k in kinds if tolerance.of(k) > 0 and self.noise.within_cap(c, [k])}
            if known:
                self.noise.widen(pair, c, known)
                grown = max(grown, *(c.rel[k] for k in known))
            if kinds - known:
                out[p] = kinds - known
        if out == flagged:
            return flagged, None
        note = (
            f"replays differed by up to {grown:.3g} (relative), within what rounding can "
            "produce, in evidence already known to carry noise: the tolerance grows to "
            f"cover it; {self.noise.describe()}"
        )
        return out, note

    def _rounding_level(
        self, finding: ReplayFinding, flagged: Kinds, comparisons: dict[int, Comparison]
    ) -> ReplayFinding | None:
        """A localized finding resting only on differences rounding can make (within the
        cap) is named but not corroborated, and the difference is learned, so it is
        reported once and never quarantines by repetition.

        The recheck cannot tell such a difference from a kernel the suspect's process
        chose differently mid-run (autotuning a new shape, a library heuristic:
        reproducible on that GPU, like a broken one) or, when the rerun did not reproduce
        it, from a kernel that is not deterministic run to run. Only a recomputation by
        another process on the suspect's GPU (the confirmation run) separates them. A
        transient one in kinds compared bit for bit so far (a bit-reproducible job) is
        named too: no kernel of this job has ever differed in any bit.

        In a job that is not bit-reproducible, noise now and then lines up into the same
        pattern on one rank for one audit; a broken GPU does it at every audit. A
        reproducible rounding-level finding there is named only when the audit before
        pointed at the same rank (``None``: watched, decided at the next audit).
        """
        ring = self.replayer_of
        suspects = set(finding.suspects)
        against = [(p, comparisons[p], flagged[p]) for p in flagged if suspects & {p, ring[p]}]
        if not against:
            return finding
        within = all(self.noise.within_cap(c, kinds) for _, c, kinds in against)
        worst = max(c.rel[k] for _, c, kinds in against for k in kinds)
        # Bit-reproducible so far: no comparison of this job ever differed in any bit, nor
        # any of this audit's but those against the suspects.
        exact = self.noise.observed == 0 and all(
            c.bitwise_equal for p, c in comparisons.items() if not suspects & {p, ring[p]}
        )
        known = not any(self.noise.new_evidence(c, (p, ring[p]), kinds) for p, c, kinds in against)
        if finding.transient and not exact and (within or known):
            # Not reproducible on the same GPU, in a job whose kernels are not
            # bit-reproducible, and either no larger than rounding or in evidence known to
            # carry run-to-run noise: a kernel that is not deterministic gives exactly
            # this. Noise (learned, or its kind set aside beyond the cap, by the caller).
            return ReplayFinding(
                "nondeterministic",
                (),
                False,
                None,
                f"a replay differed by {worst:.3g} (relative), in evidence that carries "
                "run-to-run noise or within what rounding can produce, and did not "
                "reproduce when recomputed: run-to-run noise of a kernel that is not "
                "deterministic, not evidence against any GPU",
            )
        if not exact and not finding.transient:
            # Per suspect: resting only on rounding-level differences in kinds known to
            # carry noise, it needs a second audit.
            deferred = set()
            for q in suspects - self._watched:
                mine = [(p, c, ks) for p, c, ks in against if q in (p, ring[p])]
                if all(self.noise.within_cap(c, ks) for _, c, ks in mine) and not any(
                    self.noise.new_evidence(c, (p, ring[p]), ks) for p, c, ks in mine
                ):
                    deferred.add(q)
            self._watch = deferred
            self._watch_evidence = [(c, ks) for p, c, ks in against if deferred & {p, ring[p]}]
            named = suspects - deferred
            if not named:
                return None
            if named != suspects:
                listed = ", ".join(str(self.topology.global_rank(q)) for q in sorted(named))
                finding = dataclasses.replace(
                    finding,
                    suspects=tuple(sorted(named)),
                    message=f"rank(s) {listed} computed a wrong result and reproduced it "
                    "when recomputing its own micro-batch, while two other nodes agree with "
                    "each other (persistent)",
                )
                suspects = named
                against = [(p, c, ks) for p, c, ks in against if suspects & {p, ring[p]}]
                within = all(self.noise.within_cap(c, kinds) for _, c, kinds in against)
                worst = max(c.rel[k] for _, c, kinds in against for k in kinds)
        if not within:
            return finding
        nodes = {self.nodes[q] for q in suspects}
        for r, node in enumerate(self.nodes):
            if node in nodes:
                self.noise.excuse(r)
        differing = sorted({k for _, _, ks in against for k in ks})
        what = _kinds_text(differing, self.noise.names)
        cap = max(self.noise.cap_of(k) for k in differing)
        if finding.transient:
            message = (
                f"{finding.message}; the difference ({worst:.3g} relative, in {what}) is "
                "within what rounding can produce, in a job that has reproduced bit for bit "
                "so far: a kernel that is not deterministic would look the same the "
                "first time it differs, so this is not corroborated and is learned as the "
                f"suspect node's noise (reported once); {self.noise.describe()}"
            )
            return dataclasses.replace(finding, corroborated=False, message=message)
        message = (
            f"{finding.message}; but the difference ({worst:.3g} relative, in {what}) is "
            f"within what rounding can produce (up to {cap:.3g} there in the "
            f"{self.noise.dtype} this step computed in): a kernel the suspect's process chose "
            "differently mid-run (autotuning a new shape, a library heuristic) would look the "
            "same, and the recheck cannot tell them apart, so this is not corroborated (a "
            "confirmation run on the node decides) and is learned as the suspect node's "
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

    def _baseline(
        self, flagged: Kinds, comparisons: dict[int, Comparison]
    ) -> tuple[Kinds, str | None]:
        """The first audit: differences the job shows from the start are its noise, kind
        by kind (within each kind's cap)."""
        ring = self.replayer_of
        out = {p: set(kinds) for p, kinds in flagged.items()}
        ranks: set[int] = set()
        everyone = False
        largest = 0.0
        learned: list[int] = []
        for k in sorted({k for kinds in flagged.values() for k in kinds}):
            small = [
                p
                for p, kinds in flagged.items()
                if k in kinds and self.noise.within_cap(comparisons[p], [k])
            ]
            if not small:
                continue
            learned.append(k)
            largest = max(largest, *(comparisons[p].rel[k] for p in small))
            explanation = explain_mismatches(small, ring, max_mismatches=self.max_mismatches)
            if explanation.storm:
                self.noise.learn_job((comparisons[p] for p in small), [k])
                everyone = True
            else:
                common, rest = attribute(small, ring)
                for r in common:
                    for p in small:
                        if r in (p, ring[p]):
                            self.noise.learn_rank(r, comparisons[p], [k])
                for p, r in rest:
                    self.noise.learn_rank(p, comparisons[p], [k])
                    self.noise.learn_rank(r, comparisons[p], [k])
                ranks |= common | {r for pair in rest for r in pair}
            for p in small:
                out[p].discard(k)
        if not learned:
            return flagged, None
        who = []
        if everyone:
            who.append("every rank's computations")
        if ranks:
            who.append(
                "the processes of rank(s) "
                + ", ".join(str(self.topology.global_rank(r)) for r in sorted(ranks))
            )
        note = (
            f"at the first audit {' and '.join(who)} differed from their replays by up to "
            f"{largest:.3g} (relative) in {_kinds_text(learned, self.noise.names)}: a "
            "difference present from the start (per-process kernel choice, atomics) cannot "
            "be told from a fault present from the start, so it is learned as noise and "
            f"accuses nobody; {self.noise.describe()}"
        )
        return {p: frozenset(kinds) for p, kinds in out.items() if kinds}, note

    def _agree(self, a: Summary, b: Summary, ranks: tuple[int, int], kinds: frozenset[int]) -> bool:
        """Two computations in the recheck agree in the kinds of evidence that flagged the
        work (``kinds``): within the tolerance in force for ``ranks``."""
        return not compare(a, b).differing(self._tolerance(*ranks)) & kinds

    def _mismatch_evidence(self, p: int, c: Comparison, kinds: frozenset[int]) -> dict[str, Any]:
        tolerance = self._tolerance(p, self.replayer_of[p])
        names = [kind_name(k, self.noise.names) for k in sorted(kinds)]
        return {
            "work_of": self.topology.global_rank(p),
            "replayed_by": self.topology.global_rank(self.replayer_of[p]),
            "loss_equal": c.loss_equal,
            "gradients_equal": c.grads_equal,
            "loss_relative_difference": _finite(c.loss_rel),
            "gradient_relative_difference": _finite(c.grad_rel),
            "tolerance": tolerance.gradients,
            "loss_tolerance": tolerance.loss,
            "kinds": names[:_LISTED]
            + ([f"{len(names) - _LISTED} more"] if len(names) > _LISTED else []),
        }

    def _recheck_evidence(self, r: Recheck) -> dict[str, Any]:
        return {
            "work_of": self.topology.global_rank(r.owner),
            "replayed_by": self.topology.global_rank(r.replayer),
            "third": None if r.third is None else self.topology.global_rank(r.third),
            "third_agrees_with_original": r.third_agrees_original,
            "third_agrees_with_replay": r.third_agrees_replay,
            "owner_reproduces_its_result": r.rerun_reproduces,
            "replayer_reproduces_its_result": r.rereplay_reproduces,
        }

    def _recheck(
        self,
        owners: list[int],
        flagged: Kinds,
        partner_payload: Payload | None,
        partner_own: Summary | None,
        replayed: Summary | None,
    ) -> list[Recheck]:
        """Round two for each owner: rerun on the owner, replay again on its replayer, and
        once on a third node. A collective."""
        me, ring = self.me, self.replayer_of
        involved = {r for p in flagged for r in (p, ring[p])}
        third = choose_thirds(owners, ring, self.nodes, involved)
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
            {d: _pack(items) for d, items in sends.items()},
            sorted(sources),
            self.group,
            self.comm_device,
        )
        works: dict[int, tuple[Payload, Summary]] = {}
        replays: dict[int, Summary] = {}
        for data in received.values():
            for item in _unpack(data):
                if item[0] == "work":
                    works[item[1]] = (Payload.from_bytes(item[2]), item[3])
                else:
                    replays[item[1]] = item[2]
        # Per owner: [rerun reproduces, rereplay reproduces, third ~ original, third ~ replay]
        row = torch.full((len(owners), 4), -1.0, dtype=torch.float64)
        for k, q in enumerate(owners):
            if me == q:
                assert self.payload is not None
                again = self._recompute(self.payload)
                # At the tolerance of the comparison that flagged q's work: the noise
                # learned for q's pair (or the job) moves q's own rerun as much.
                row[k, 0] = float(self._agree(self.own_summary(), again, (q, ring[q]), flagged[q]))
            if me == ring[q] and partner_payload is not None and replayed is not None:
                again = self._recompute(partner_payload)
                row[k, 1] = float(self._agree(replayed, again, (q, ring[q]), flagged[q]))
            if me == third.get(q) and q in works and q in replays:
                payload, original = works[q]
                mine = self._recompute(payload)
                row[k, 2] = float(self._agree(original, mine, (me, q), flagged[q]))
                row[k, 3] = float(self._agree(replays[q], mine, (me, ring[q]), flagged[q]))
        table = [torch.tensor(t).reshape(len(owners), 4).tolist() for t in self._gather(row)]
        out = []
        for k, q in enumerate(owners):
            t = third.get(q)
            out.append(
                Recheck(
                    owner=q,
                    replayer=ring[q],
                    third=t,
                    third_agrees_original=None if t is None else table[t][k][2] == 1.0,
                    third_agrees_replay=None if t is None else table[t][k][3] == 1.0,
                    rerun_reproduces=table[q][k][0] == 1.0,
                    rereplay_reproduces=table[ring[q]][k][1] == 1.0,
                )
            )
        return out

    def replay_nonfinite(self, suspects: Sequence[int]) -> dict[int, tuple[bool, bool]]:
        """Replay each suspect's micro-batch on its ring partner's node, and on the suspect
        itself once more. A collective.

        Returns, per suspect that could be replayed, ``(non-finite elsewhere, non-finite
        again on the suspect)``: elsewhere too means the data or the model, not hardware.
        """
        me = self.me
        targets = {p: self.replayer_of[p] for p in suspects if p in self.replayer_of}
        sends = {}
        if me in targets and self.payload is not None:
            sends = {targets[me]: self.payload.to_bytes()}
        sources = [p for p, r in targets.items() if r == me]
        received = exchange(sends, sources, self.group, self.comm_device)
        row = torch.full((2,), -1.0, dtype=torch.float64)
        for p in sources:
            row[0] = float(self._recompute(Payload.from_bytes(received[p])).nonfinite)
        if me in targets and self.payload is not None:
            row[1] = float(self._recompute(self.payload).nonfinite)
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


_LISTED = 8
"""Kinds of evidence named per mismatch in a verdict's evidence; the rest are counted."""


def _kinds_text(kinds: Sequence[int], names: Sequence[str]) -> str:
    listed = [kind_name(k, names) for k in kinds]
    if len(listed) > 3:
        return ", ".join(listed[:3]) + f" and {len(listed) - 3} more kind(s) of evidence"
    return ", ".join(listed)


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None
