"""What counts as evidence in the replay audit, on kernels that are not bit-reproducible.

Two kinds of evidence, each with its own tolerance:

* the **loss** (the forward pass): compared bit for bit, and by its relative difference;
* the **gradients**: a bitwise fingerprint per tensor and, per tensor, two float64
  statistics (the sum and the sum of squares of its elements). The relative difference
  of the statistics is what run-to-run noise moves by a last bit or so and a hardware
  fault by its size: a whole tensor off by 2.5e-5 moves its sum of squares by 5e-5.

:class:`NoiseModel` learns, from the audits themselves, how far comparisons of this job
differ when nothing is wrong: a tolerance per rank (differences that one rank's process
always makes, such as a kernel it autotuned differently) and one for the whole job
(run-to-run noise everywhere, such as atomics). The loss and the gradients are learned
apart: only loss differences raise the loss tolerance, so noise in the backward (atomics
in a weight gradient, the common case) leaves the loss compared bit for bit, and a
forward error one ulp wide still shows. A comparison is evidence when either part differs
by more than its tolerance, or by anything at all while that tolerance is 0. Tolerances
are capped by the dtype the computation ran in: a difference above the cap is never
noise. Every rank updates the model from the same gathered table, so every rank holds
the same tolerances.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "HEADROOM",
    "NOISE_CAPS",
    "Comparison",
    "NoiseModel",
    "Summary",
    "Tolerance",
    "compare",
    "compute_dtype",
    "noise_cap",
    "tensor_stats",
]

NOISE_CAPS: dict[torch.dtype, float] = {
    torch.float64: 2e-15,
    torch.float32: 1e-6,
    torch.float16: 1.25e-4,
    torch.bfloat16: 1e-3,
}
"""Largest relative difference (of the loss, or of a gradient statistic) ever taken for
noise, by the dtype the computation ran in (see :func:`compute_dtype`). Above it a
difference is evidence even on the first audit, and a difference at or below it that
reproduces on the suspect is one a per-process kernel choice could make too.

Run-to-run noise (atomics, reordered or split reductions, autotuned kernels) moves
individual elements by an ulp or so; a statistic over a tensor moves by about the unit
roundoff or less (measured in the drills: 2e-8 to 2e-7 in float32, eps being 1.2e-7).
float32 and float64: 8 eps. The 16-bit formats carry their rounding in the computation
(bf16 matmuls, fp32 accumulation): bfloat16 takes Megatron-LM's tolerance for
FlashAttention's non-deterministic backward in bf16, 1e-3, and float16 the same
fraction of its eps (3 fewer mantissa bits than fp16, 8 times smaller)."""

HEADROOM = 8.0
"""The tolerance in force is this many times the largest noise seen, within the cap:
noise that was 1e-7 in the audits so far may be 4e-7 in the next."""

_TINY = 1e-300
_CHUNK = {"cpu": 1 << 18, "cuda": 1 << 24}


def noise_cap(dtype: torch.dtype) -> float:
    return NOISE_CAPS.get(dtype, NOISE_CAPS[torch.float32])


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
    """The relative differences taken for noise, per kind of evidence (0: none; any
    difference is evidence)."""

    loss: float = 0.0
    gradients: float = 0.0


@dataclass(frozen=True, slots=True)
class Comparison:
    """How two computations of one micro-batch differ."""

    loss_equal: bool
    grads_equal: bool
    loss_rel: float
    grad_rel: float

    @property
    def bitwise_equal(self) -> bool:
        return self.loss_equal and self.grads_equal

    @property
    def magnitude(self) -> float:
        return max(self.loss_rel, self.grad_rel)

    def differs(self, tolerance: Tolerance) -> bool:
        """Evidence at ``tolerance``: the loss or the gradients differ by any bit while
        their tolerance is 0, by more than it otherwise."""
        loss = not self.loss_equal and (tolerance.loss <= 0 or self.loss_rel > tolerance.loss)
        grads = not self.grads_equal and (
            tolerance.gradients <= 0 or self.grad_rel > tolerance.gradients
        )
        return loss or grads


def _rel(a: float, b: float, scale: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(scale, _TINY)


def compare(a: Summary, b: Summary) -> Comparison:
    """Compare two computations of the same micro-batch."""
    loss_equal = a.loss_bits == b.loss_bits
    loss_rel = 0.0 if loss_equal else _rel(a.loss, b.loss, max(abs(a.loss), abs(b.loss)))
    if a.nonfinite != b.nonfinite:
        loss_rel = math.inf
    grads_equal = a.fingerprints == b.fingerprints
    grad_rel = 0.0
    if not grads_equal:
        if len(a.stats) != len(b.stats):
            grad_rel = math.inf
        for (s1, q1), (s2, q2) in zip(a.stats, b.stats, strict=False):
            # The sum is compared on the scale the sum of squares gives it (Cauchy-Schwarz
            # bounds |sum| by sqrt(n * sumsq)); n is not needed to compare two of them.
            norm = math.sqrt(max(q1, q2, 0.0))
            grad_rel = max(grad_rel, _rel(q1, q2, max(q1, q2)), _rel(s1, s2, norm))
    return Comparison(loss_equal, grads_equal, loss_rel, grad_rel)


@dataclass(slots=True)
class NoiseModel:
    """Tolerances learned from the job's own audits (see the module docstring)."""

    cap: float
    """The dtype cap in force (see :data:`NOISE_CAPS`); the audit sets it per audit from
    the dtype the computation ran in."""
    per_rank: dict[int, float] = field(default_factory=dict)
    """Gradient tolerance per rank."""
    job: float = 0.0
    """Gradient tolerance for the whole job."""
    loss_per_rank: dict[int, float] = field(default_factory=dict)
    loss_job: float = 0.0
    audits: int = 0
    """Audits recorded so far; the first one sets the baseline."""
    observed: int = 0
    """Comparisons that had any bitwise difference."""
    compared: int = 0

    def tolerance(self, ranks: Iterable[int]) -> Tolerance:
        """The tolerances in force for a comparison between ``ranks``."""
        ranks = list(ranks)
        return Tolerance(
            loss=max([self.loss_job, *(self.loss_per_rank.get(r, 0.0) for r in ranks)]),
            gradients=max([self.job, *(self.per_rank.get(r, 0.0) for r in ranks)]),
        )

    @property
    def largest(self) -> float:
        """The largest gradient tolerance in force anywhere (0: bit-reproducible so far)."""
        return max([self.job, *self.per_rank.values()])

    @property
    def largest_loss(self) -> float:
        """The largest loss tolerance in force anywhere (0: the loss is compared bit for
        bit everywhere)."""
        return max([self.loss_job, *self.loss_per_rank.values()])

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

    def within_cap(self, c: Comparison) -> bool:
        """Whether ``c`` differs by no more than noise can (each part within the cap)."""
        return c.loss_rel <= self.cap and c.grad_rel <= self.cap

    def learn_rank(self, rank: int, c: Comparison) -> bool:
        """Take ``c``'s differences for noise of ``rank``'s process; false above the cap
        (nothing is learned then)."""
        if not self.within_cap(c):
            return False
        if not c.grads_equal:
            self.per_rank[rank] = max(self.per_rank.get(rank, 0.0), self._headroom(c.grad_rel))
        if not c.loss_equal:
            old = self.loss_per_rank.get(rank, 0.0)
            self.loss_per_rank[rank] = max(old, self._headroom(c.loss_rel))
        return True

    def excuse(self, rank: int, c: Comparison) -> None:
        """From now on, differences up to the cap in the parts where ``c`` differs are
        noise for ``rank``: a rounding-level difference the recheck could not separate
        from a kernel choice, reported once and never again (which a repeat rule would
        turn into a quarantine)."""
        if not c.grads_equal:
            self.per_rank[rank] = self.cap
        if not c.loss_equal:
            self.loss_per_rank[rank] = self.cap

    def learn_job(self, comparisons: Iterable[Comparison]) -> bool:
        """Take the differences of ``comparisons`` for noise of the whole job; false if
        any is above the cap (nothing is learned then)."""
        comparisons = list(comparisons)
        if not all(self.within_cap(c) for c in comparisons):
            return False
        for c in comparisons:
            if not c.grads_equal:
                self.job = max(self.job, self._headroom(c.grad_rel))
            if not c.loss_equal:
                self.loss_job = max(self.loss_job, self._headroom(c.loss_rel))
        return True

    def new_evidence(self, c: Comparison, ranks: Iterable[int]) -> bool:
        """Whether ``c`` differs in a part (loss or gradients) that has been bit for bit
        so far for ``ranks``: evidence of a new kind, not known noise reaching further."""
        t = self.tolerance(ranks)
        return (not c.loss_equal and t.loss <= 0) or (not c.grads_equal and t.gradients <= 0)

    def widen(self, ranks: Sequence[int], c: Comparison) -> bool:
        """Known noise reached further than seen so far (``c``, between ``ranks``, is
        within the cap): raise the tolerances it was learned in (the job's, or the
        ranks'), false above the cap."""
        if not self.within_cap(c):
            return False
        parts = [
            (not c.grads_equal, c.grad_rel, "job", self.per_rank),
            (not c.loss_equal, c.loss_rel, "loss_job", self.loss_per_rank),
        ]
        for differs, rel, job, per_rank in parts:
            if not differs:
                continue
            if getattr(self, job) > 0:
                setattr(self, job, max(getattr(self, job), self._headroom(rel)))
                continue
            for r in ranks:
                if per_rank.get(r, 0.0) > 0:
                    per_rank[r] = max(per_rank[r], self._headroom(rel))
        return True

    def _headroom(self, magnitude: float) -> float:
        # A bitwise difference that moved no statistic still needs a tolerance above 0,
        # or it would be evidence every time.
        return min(self.cap, max(HEADROOM * magnitude, _TINY))

    def describe(self) -> str:
        if self.largest == 0 and self.largest_loss == 0:
            if self.bit_reproducible is None:
                return "not measured yet"
            return "bit-reproducible so far: any difference is evidence"
        return "; ".join(
            [
                _describe("gradients", self.job, self.per_rank),
                _describe("loss", self.loss_job, self.loss_per_rank),
            ]
        )


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
