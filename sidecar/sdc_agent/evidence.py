"""What counts as evidence in the replay audit, on kernels that are not bit-reproducible.

Each comparison of two computations of one micro-batch is judged on each **kind** of
evidence separately, each with its own cap and its own learned noise:

* the **loss** (the forward pass): bit for bit, and by its relative difference;
* per gradient tensor, its **sum of squares** and its **sum** (float64 statistics of the
  elements), each by its relative difference, behind a bitwise fingerprint of the tensor.

Run-to-run noise (atomics, split-K GEMMs, autotuned kernels) moves individual elements by
an ulp or so, at random; a hardware fault moves a whole layer's outputs one way, which
moves the next layer's weight gradient's sum of squares by about twice the fault's
relative size. Judging each kind apart keeps noise in one layer (an atomic backward) from
masking a fault in another, and the loss, which backward noise never touches, compared
bit for bit however noisy the gradients are.

:class:`NoiseModel` learns, from the audits themselves, how far each kind differs when
nothing is wrong: a tolerance per rank (differences one rank's process always makes,
such as a kernel it autotuned differently) and one for the whole job (run-to-run noise
everywhere). A kind is evidence in a comparison when it differs by more than its
tolerance, or by anything at all while that tolerance is 0. Tolerances are capped per
kind by the dtype the computation ran in and the tensor's size (:func:`kind_caps`): a
difference above the cap is never noise. A kind whose noise goes beyond its cap in a
pattern no faulty GPU makes can verify nothing and is set aside, with the measured noise
and the cap as the reason; the others are still compared. Every rank updates the model
from the same gathered table, so every rank holds the same tolerances.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "HEADROOM",
    "HEADROOM_16BIT",
    "LOSS",
    "NOISE_CAPS",
    "Comparison",
    "NoiseModel",
    "Summary",
    "Tolerance",
    "compare",
    "compute_dtype",
    "kind_caps",
    "kind_count",
    "kind_name",
    "noise_cap",
    "tensor_stats",
]

LOSS = 0
"""The kind of evidence that is the loss; gradient tensor ``i`` gives kinds ``1 + 2i``
(its sum of squares) and ``2 + 2i`` (its sum)."""

NOISE_CAPS: dict[torch.dtype, float] = {
    torch.float64: 2e-15,
    torch.float32: 1e-6,
    torch.float16: 1.25e-4,
    torch.bfloat16: 1e-3,
}
"""Largest relative difference (of the loss, or of a gradient statistic) ever taken for
noise, by the dtype the computation ran in (see :func:`compute_dtype`). Above it a
difference is evidence even on the first audit, and a difference at or below it that
reproduces on the suspect is one a per-process kernel choice could make too. It is the
loss's cap, and the gradient statistics' floor (see :func:`kind_caps`).

Run-to-run noise (atomics, reordered or split reductions, autotuned kernels) moves
individual elements by an ulp or so; a statistic over a tensor moves by about the unit
roundoff or less (measured in the drills: 2e-8 to 2e-7 in float32, eps being 1.2e-7).
float32 and float64: 8 eps. The 16-bit formats carry their rounding in the computation
(bf16 matmuls, fp32 accumulation): bfloat16 takes Megatron-LM's tolerance for
FlashAttention's non-deterministic backward in bf16, 1e-3, and float16 the same
fraction of its eps (3 fewer mantissa bits than fp16, 8 times smaller)."""

SUM_OF_SQUARES_EPS = 2.0
"""Cap of a gradient tensor's sum of squares, in units of the dtype's eps (with
:data:`SMALL_TENSOR_EPS`). Elements moved by an ulp at random move it by about
``2 eps sqrt(sum x^4) / sum x^2``, which the few large elements of a trained model's
gradient make far more than ``2 eps / sqrt(n)``: measured in bf16 (width 256, batch 32,
trained with Adam), noise of ±1 ulp in 1 % of a layer's outputs moved it by up to 1.1e-2,
±4 ulp in 10 % of a layer's gradient by up to 1.5e-2. A fault that shifts every input of
a layer by one ulp moves that layer's weight gradient's by 4.5e-3 to 1.7e-2: within the
cap, so such a fault is caught by the learned tolerance and the recheck, not the cap."""

SMALL_TENSOR_EPS = 8.0  # bf16, n = 4: 3.1e-2
"""A tensor of ``n`` elements may move by ``SMALL_TENSOR_EPS * eps / sqrt(n)``: one ulp in
one of four elements is a large part of their sum of squares (a bias of 4 measured up
to 1.1e-2 in bf16); from 16 elements on :data:`SUM_OF_SQUARES_EPS` decides."""

SUM_EPS = 4.0
"""Cap of a gradient tensor's sum (relative to its norm), in eps: ulp-sized changes of
random sign in every element move it by about ``eps`` each, ±4 ulp by about ``4 eps``
(measured in bf16: up to 1.9e-2)."""

HEADROOM = 8.0
"""The tolerance in force is this many times the largest noise seen, within the cap:
noise that was 1e-7 in the audits so far may be 4e-7 in the next."""

HEADROOM_16BIT = 2.0
"""The headroom for computations in the 16-bit formats, where a fault of one ulp in a
layer's output is only a few times the noise: the tolerance stays close to the noise
seen, and the exceedances noise still makes are settled by the recheck (a recomputation
does not reproduce them)."""

_TINY = 1e-300
_CHUNK = {"cpu": 1 << 18, "cuda": 1 << 24}


def noise_cap(dtype: torch.dtype) -> float:
    return NOISE_CAPS.get(dtype, NOISE_CAPS[torch.float32])


def kind_count(tensors: int) -> int:
    """Kinds of evidence for a model of ``tensors`` gradient tensors."""
    return 1 + 2 * tensors


def kind_name(kind: int, names: Sequence[str] = ()) -> str:
    """``loss``, ``sum of squares of <tensor>`` or ``sum of <tensor>``."""
    if kind == LOSS:
        return "loss"
    i = (kind - 1) // 2
    tensor = names[i] if i < len(names) else f"gradient {i}"
    return ("sum of squares of " if kind % 2 else "sum of ") + tensor


def kind_caps(dtype: torch.dtype, sizes: Sequence[int]) -> tuple[float, ...]:
    """The cap of each kind for a computation in ``dtype`` of gradient tensors of
    ``sizes`` elements (see :data:`NOISE_CAPS`, :data:`SUM_OF_SQUARES_EPS`,
    :data:`SUM_EPS`): float32 and float64 keep their 8 eps everywhere, the 16-bit formats,
    whose gradients carry their rounding, get caps their rounding can reach."""
    floor = noise_cap(dtype)
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    caps = [floor]
    for n in sizes:
        small = SMALL_TENSOR_EPS * eps / math.sqrt(max(n, 1))
        caps.append(max(floor, SUM_OF_SQUARES_EPS * eps, small))
        caps.append(max(floor, SUM_EPS * eps))
    return tuple(caps)


def compute_dtype(
    dtypes: Iterable[torch.dtype],
    autocast: Mapping[str, tuple[bool, torch.dtype]],
    device_type: str,
) -> torch.dtype:
    """The dtype a computation ran in, for its noise cap: autocast's dtype where autocast
    was on for ``device_type``, and the least precise floating dtype of the parameters
    (``dtypes``) otherwise or if that is less precise still (float32 with none)."""
    candidates = [d for d in dtypes if d.is_floating_point]
    enabled, dtype = autocast.get(device_type, (False, torch.float32))
    if enabled:
        candidates.append(dtype)
    if not candidates:
        return torch.float32
    return max(candidates, key=noise_cap)


def tensor_stats(tensor: torch.Tensor) -> torch.Tensor:
    """``[sum, sum of squares]`` of ``tensor``'s elements in float64, on its device.

    Computed in chunks, so no float64 copy of a large tensor is ever made; the same bits
    always give the same statistics on one kind of device.
    """
    flat = tensor.detach().reshape(-1)
    out = torch.zeros(2, dtype=torch.float64, device=flat.device)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if not flat.is_floating_point():
        flat = flat.to(torch.float64)
    step = _CHUNK.get(flat.device.type, _CHUNK["cuda"])
    for start in range(0, flat.numel(), step):
        chunk = flat[start : start + step].to(torch.float64)
        out[0] += chunk.sum()
        out[1] += torch.dot(chunk, chunk)
    return out


@dataclass(frozen=True, slots=True)
class Summary:
    """One computation of a micro-batch, as the audit compares it (host values)."""

    loss_bits: int
    loss: float
    fingerprints: tuple[tuple[int, int], ...]
    """Per gradient tensor, in parameter order (``(0, 0)`` for a missing gradient)."""
    stats: tuple[tuple[float, float], ...]
    """Per gradient tensor: ``(sum, sum of squares)`` in float64."""
    nonfinite: bool = False


@dataclass(frozen=True, slots=True)
class Tolerance:
    """The relative differences taken for noise, per kind of evidence (0: none, any
    difference is evidence), and the kinds set aside (:attr:`NoiseModel.unusable`)."""

    values: tuple[float, ...] = ()
    skip: frozenset[int] = frozenset()

    def of(self, kind: int) -> float:
        return self.values[kind] if kind < len(self.values) else 0.0

    @property
    def loss(self) -> float:
        return self.of(LOSS)

    @property
    def gradients(self) -> float:
        """The largest gradient tolerance among the kinds still compared."""
        return max(
            [0.0, *(t for k, t in enumerate(self.values) if k != LOSS and k not in self.skip)]
        )


@dataclass(frozen=True, slots=True)
class Comparison:
    """How two computations of one micro-batch differ, per kind of evidence."""

    equal: tuple[bool, ...]
    """Per kind: bit for bit (a gradient tensor's two kinds share its fingerprint)."""
    rel: tuple[float, ...]
    """Per kind: the relative difference."""

    @property
    def loss_equal(self) -> bool:
        return self.equal[LOSS]

    @property
    def loss_rel(self) -> float:
        return self.rel[LOSS]

    @property
    def grads_equal(self) -> bool:
        return all(self.equal[1:])

    @property
    def grad_rel(self) -> float:
        return max(self.rel[1:], default=0.0)

    @property
    def bitwise_equal(self) -> bool:
        return all(self.equal)

    @property
    def magnitude(self) -> float:
        return max(self.rel)

    def differing(self, tolerance: Tolerance) -> frozenset[int]:
        """The kinds that are evidence at ``tolerance``: they differ by any bit while
        their tolerance is 0, by more than it otherwise (set-aside kinds never)."""
        return frozenset(
            k
            for k, (eq, rel) in enumerate(zip(self.equal, self.rel, strict=True))
            if not eq
            and k not in tolerance.skip
            and (tolerance.of(k) <= 0 or rel > tolerance.of(k))
        )

    def differs(self, tolerance: Tolerance) -> bool:
        return bool(self.differing(tolerance))


def _rel(a: float, b: float, scale: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(scale, _TINY)


def compare(a: Summary, b: Summary) -> Comparison:
    """Compare two computations of the same micro-batch, kind by kind."""
    loss_equal = a.loss_bits == b.loss_bits
    loss_rel = 0.0 if loss_equal else _rel(a.loss, b.loss, max(abs(a.loss), abs(b.loss)))
    if a.nonfinite != b.nonfinite:
        loss_rel = math.inf
    equal, rel = [loss_equal], [loss_rel]
    if len(a.stats) != len(b.stats):  # not the same model: every kind differs
        n = max(len(a.stats), len(b.stats))
        return Comparison((loss_equal, *(False,) * 2 * n), (loss_rel, *(math.inf,) * 2 * n))
    for fa, fb, (s1, q1), (s2, q2) in zip(
        a.fingerprints, b.fingerprints, a.stats, b.stats, strict=True
    ):
        same = fa == fb
        # The sum is compared on the scale the sum of squares gives it (Cauchy-Schwarz
        # bounds |sum| by sqrt(n * sumsq)); n is not needed to compare two of them.
        norm = math.sqrt(max(q1, q2, 0.0))
        equal += [same, same]
        rel += [0.0, 0.0] if same else [_rel(q1, q2, max(q1, q2)), _rel(s1, s2, norm)]
    return Comparison(tuple(equal), tuple(rel))


@dataclass(slots=True)
class NoiseModel:
    """Tolerances learned from the job's own audits, per kind (see the module docstring)."""

    cap: float
    """The loss's cap in force (see :data:`NOISE_CAPS`); the audit sets it, with
    :attr:`caps`, per audit from the dtype the computation ran in."""
    caps: tuple[float, ...] = ()
    """Per kind (:func:`kind_caps`); kinds beyond it take :attr:`cap`."""
    names: tuple[str, ...] = ()
    """The gradient tensors' names, for messages."""
    dtype: str = "float32"
    """The dtype the caps are for, for messages."""
    headroom: float = HEADROOM
    """:data:`HEADROOM`, or :data:`HEADROOM_16BIT` for the 16-bit formats."""
    job: dict[int, float] = field(default_factory=dict)
    """Tolerance per kind for the whole job."""
    per_rank: dict[int, dict[int, float]] = field(default_factory=dict)
    """Tolerance per rank, per kind."""
    unusable: dict[int, str] = field(default_factory=dict)
    """Kinds set aside, and why: their noise went beyond their cap."""
    kinds: int = 0
    """Kinds compared (0: not known yet)."""
    audits: int = 0
    """Audits recorded so far; the first one sets the baseline."""
    observed: int = 0
    """Comparisons that had any bitwise difference."""
    compared: int = 0

    def cap_of(self, kind: int) -> float:
        return self.caps[kind] if kind < len(self.caps) else self.cap

    def tolerance(self, ranks: Iterable[int]) -> Tolerance:
        """The tolerances in force for a comparison between ``ranks``."""
        ranks = list(ranks)
        n = max(
            self.kinds,
            1 + max([*self.job, *(k for r in self.per_rank.values() for k in r)], default=0),
        )
        values = tuple(
            max([self.job.get(k, 0.0), *(self.per_rank.get(r, {}).get(k, 0.0) for r in ranks)])
            for k in range(n)
        )
        return Tolerance(values, frozenset(self.unusable))

    def _largest(self, gradients: bool) -> float:
        kinds = {*self.job, *(k for r in self.per_rank.values() for k in r)} - set(self.unusable)
        kinds = {k for k in kinds if (k != LOSS) == gradients}
        every = [self.job.get(k, 0.0) for k in kinds]
        every += [r.get(k, 0.0) for r in self.per_rank.values() for k in kinds]
        return max([0.0, *every])

    @property
    def largest(self) -> float:
        """The largest gradient tolerance in force anywhere, among the kinds still
        compared (0: bit-reproducible so far)."""
        return self._largest(True)

    @property
    def largest_loss(self) -> float:
        """The largest loss tolerance in force anywhere (0: the loss is compared bit for
        bit everywhere)."""
        return self._largest(False)

    def thresholds(self) -> dict[str, float | None]:
        """The detection threshold in force per kind of evidence, for reports: the
        largest tolerance of the loss and of the gradients still compared; ``None``
        where that kind is set aside (it verifies nothing)."""
        grads = list(range(1, self.kinds))
        return {
            "loss": None if LOSS in self.unusable else self.largest_loss,
            "gradients": None if grads and all(k in self.unusable for k in grads) else self.largest,
        }

    @property
    def blind(self) -> bool:
        """The loss, or every kind, is set aside: the audit can verify nothing (a forward
        pass that does not reproduce beyond rounding makes every gradient from it
        differ for the same reason)."""
        return LOSS in self.unusable or (self.kinds > 0 and len(self.unusable) >= self.kinds)

    @property
    def bit_reproducible(self) -> bool | None:
        """True while every comparison so far was bitwise equal; ``None`` before any."""
        if self.compared == 0:
            return None
        return self.observed == 0

    def count(self, comparisons: Iterable[Comparison]) -> None:
        for c in comparisons:
            self.compared += 1
            self.observed += not c.bitwise_equal

    def within_cap(self, c: Comparison, kinds: Iterable[int] | None = None) -> bool:
        """Whether ``c`` differs in ``kinds`` (default: all) by no more than noise can."""
        kinds = range(len(c.rel)) if kinds is None else kinds
        return all(c.rel[k] <= self.cap_of(k) for k in kinds)

    def _set(self, where: dict[int, float], kind: int, value: float) -> None:
        where[kind] = max(where.get(kind, 0.0), value)

    def learn_rank(self, rank: int, c: Comparison, kinds: Iterable[int] | None = None) -> bool:
        """Take ``c``'s differences in ``kinds`` (default: every kind that differs) for
        noise of ``rank``'s process; false if any is above its cap (nothing is learned)."""
        kinds = _differ(c, kinds)
        if not self.within_cap(c, kinds):
            return False
        for k in kinds:
            self._set(self.per_rank.setdefault(rank, {}), k, self._headroom(k, c.rel[k]))
        return True

    def excuse(self, rank: int) -> None:
        """From now on, differences up to the cap in every kind are noise for ``rank``: a
        rounding-level difference the recheck could not separate from a kernel choice,
        reported once and never again, in whichever kind it shows next (a repeat rule
        would turn it into a quarantine)."""
        self.per_rank[rank] = {k: self.cap_of(k) for k in range(max(self.kinds, 1))}

    def learn_job(
        self, comparisons: Iterable[Comparison], kinds: Iterable[int] | None = None
    ) -> bool:
        """Take the differences of ``comparisons`` in ``kinds`` (default: all that
        differ) for noise of the whole job; false if any is above its cap (nothing is
        learned then)."""
        pairs = [(c, _differ(c, kinds)) for c in comparisons]
        if not all(self.within_cap(c, ks) for c, ks in pairs):
            return False
        for c, ks in pairs:
            for k in ks:
                self._set(self.job, k, self._headroom(k, c.rel[k]))
        return True

    def new_evidence(
        self, c: Comparison, ranks: Iterable[int], kinds: Iterable[int] | None = None
    ) -> bool:
        """Whether ``c`` differs in a kind (of ``kinds``) that has been bit for bit so far
        for ``ranks``: evidence of a new kind, not known noise reaching further."""
        t = self.tolerance(ranks)
        return any(t.of(k) <= 0 for k in _differ(c, kinds) if k not in t.skip)

    def widen(
        self, ranks: Sequence[int], c: Comparison, kinds: Iterable[int] | None = None
    ) -> bool:
        """Known noise reached further than seen so far (``c``, between ``ranks``, is
        within the cap in ``kinds``): raise the tolerances it was learned in (the job's,
        or the ranks'), false above the cap."""
        kinds = _differ(c, kinds)
        if not self.within_cap(c, kinds):
            return False
        for k in kinds:
            value = self._headroom(k, c.rel[k])
            if self.job.get(k, 0.0) > 0:
                self._set(self.job, k, value)
                continue
            for r in ranks:
                if self.per_rank.get(r, {}).get(k, 0.0) > 0:
                    self._set(self.per_rank[r], k, value)
        return True

    def set_aside(self, kinds: Iterable[int], measured: Mapping[int, float]) -> str:
        """Stop comparing ``kinds``: their noise (``measured``, relative) went beyond their
        cap. Returns what was set aside and why, for the report."""
        parts = []
        for k in sorted(set(kinds)):
            why = (
                f"{kind_name(k, self.names)}: differences up to {measured.get(k, math.inf):.3g} "
                f"against a cap of {self.cap_of(k):.3g} for {self.dtype}"
            )
            self.unusable.setdefault(k, why)
            parts.append(why)
        return "; ".join(parts)

    def _headroom(self, kind: int, magnitude: float) -> float:
        # A bitwise difference that moved no statistic still needs a tolerance above 0,
        # or it would be evidence every time.
        return min(self.cap_of(kind), max(self.headroom * magnitude, _TINY))

    def describe(self) -> str:
        if self.largest == 0 and self.largest_loss == 0 and not self.unusable:
            if self.bit_reproducible is None:
                return "not measured yet"
            return "bit-reproducible so far: any difference is evidence"
        grads = (
            range(1, self.kinds)
            if self.kinds
            else sorted({*self.job, *(k for r in self.per_rank.values() for k in r)} - {LOSS})
        )
        parts = [
            _describe("gradients", self._kinds_job(grads), self._kinds_ranks(grads)),
            _describe("loss", self.job.get(LOSS, 0.0), self._kinds_ranks([LOSS])),
        ]
        if self.unusable:
            parts.append(
                f"{len(self.unusable)} kind(s) of evidence set aside, too noisy to verify "
                "anything: " + "; ".join(self.unusable[k] for k in sorted(self.unusable))
            )
        return "; ".join(parts)

    def _kinds_job(self, kinds: Iterable[int]) -> float:
        return max([0.0, *(self.job.get(k, 0.0) for k in kinds if k not in self.unusable)])

    def _kinds_ranks(self, kinds: Iterable[int]) -> dict[int, float]:
        kinds = [k for k in kinds if k not in self.unusable]
        return {r: max([0.0, *(t.get(k, 0.0) for k in kinds)]) for r, t in self.per_rank.items()}


def _differ(c: Comparison, kinds: Iterable[int] | None) -> list[int]:
    kinds = range(len(c.equal)) if kinds is None else kinds
    return [k for k in kinds if not c.equal[k]]


def _describe(what: str, job: float, per_rank: Mapping[int, float]) -> str:
    ranks = {r: t for r, t in sorted(per_rank.items()) if t > job}
    if job == 0 and not ranks:
        return f"{what}: compared bit for bit"
    listed = ", ".join(f"rank {r} up to {t:.3g}" for r, t in ranks.items())
    if job == 0:
        return f"{what}: compared bit for bit, except in comparisons involving {listed}"
    text = f"{what}: relative differences up to {job:.3g} are noise"
    return text + (f" (in comparisons involving {listed})" if ranks else "")


def attribute(
    mismatched: Sequence[int], replayer_of: Mapping[int, int]
) -> tuple[set[int], list[tuple[int, int]]]:
    """Who a set of differing pairs points at: ranks in two or more of them (a process
    that computes differently in everything it does), and the pairs none of those
    explains."""
    count: dict[int, int] = {}
    for p in mismatched:
        for r in (p, replayer_of[p]):
            count[r] = count.get(r, 0) + 1
    common = {r for r, c in count.items() if c >= 2}
    rest = [(p, replayer_of[p]) for p in mismatched if not {p, replayer_of[p]} & common]
    return common, rest
