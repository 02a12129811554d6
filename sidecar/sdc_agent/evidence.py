"""What counts as evidence in the replay audit, on kernels that are not bit-reproducible.

Two kinds of evidence:

* the **loss** (the forward pass): compared bit for bit, and by its relative difference;
* the **gradients**: a bitwise fingerprint per tensor and, per tensor, two float64
  statistics (the sum and the sum of squares of its elements). The relative difference
  of the statistics is what run-to-run noise moves by a last bit or so and a hardware
  fault by its size: a whole tensor off by 2.5e-5 moves its sum of squares by 5e-5.

:class:`NoiseModel` learns, from the audits themselves, how far comparisons of this job
differ when nothing is wrong: a tolerance per rank (differences that one rank's process
always makes, such as a kernel it autotuned differently) and one for the whole job
(run-to-run noise everywhere, such as atomics). A comparison is evidence when it differs
by more than the tolerance in force, or by anything at all while the tolerance is 0 (the
job has been bit-reproducible so far). Tolerances are capped per dtype: a difference
above the cap is never noise. Every rank updates the model from the same gathered table,
so every rank holds the same tolerances.
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
    "compare",
    "noise_cap",
    "tensor_stats",
]

NOISE_CAPS: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 5e-3,
    torch.bfloat16: 2e-2,
}
"""Largest relative difference (of the loss, or of a gradient statistic) ever taken for
noise, by the dtype the model computes in. Above it a difference is evidence even on
the first audit. float32 noise from reordered sums is around 1e-7 (relative) on the
statistics; bfloat16 has 8 bits of mantissa."""

HEADROOM = 8.0
"""The tolerance in force is this many times the largest noise seen, within the cap:
noise that was 1e-7 in the audits so far may be 4e-7 in the next."""

_TINY = 1e-300
_CHUNK = {"cpu": 1 << 18, "cuda": 1 << 24}


def noise_cap(dtype: torch.dtype) -> float:
    return NOISE_CAPS.get(dtype, NOISE_CAPS[torch.float32])


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

    def differs(self, tolerance: float) -> bool:
        """Evidence at ``tolerance``: any bit while it is 0, more than it otherwise."""
        if self.bitwise_equal:
            return False
        if tolerance <= 0:
            return True
        return self.loss_rel > tolerance or self.grad_rel > tolerance


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
    per_rank: dict[int, float] = field(default_factory=dict)
    job: float = 0.0
    audits: int = 0
    """Audits recorded so far; the first one sets the baseline."""
    observed: int = 0
    """Comparisons that had any bitwise difference."""
    compared: int = 0

    def tolerance(self, ranks: Iterable[int]) -> float:
        """The tolerance in force for a comparison between ``ranks``."""
        return max([self.job, *(self.per_rank.get(r, 0.0) for r in ranks)])

    @property
    def largest(self) -> float:
        """The largest tolerance in force anywhere (0: bit-reproducible so far)."""
        return max([self.job, *self.per_rank.values()])

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

    def learn_rank(self, rank: int, magnitude: float) -> bool:
        """Take ``magnitude`` for noise of ``rank``'s process; false above the cap."""
        if not magnitude <= self.cap:
            return False
        self.per_rank[rank] = max(self.per_rank.get(rank, 0.0), min(self.cap, HEADROOM * magnitude))
        return True

    def learn_job(self, magnitude: float) -> bool:
        """Take ``magnitude`` for noise of the whole job; false above the cap."""
        if not magnitude <= self.cap:
            return False
        self.job = max(self.job, min(self.cap, HEADROOM * magnitude))
        return True

    def describe(self) -> str:
        if self.bit_reproducible is None:
            return "not measured yet"
        if self.largest == 0:
            return "bit-reproducible so far: any difference is evidence"
        ranks = {r: t for r, t in sorted(self.per_rank.items()) if t > self.job}
        text = f"relative differences up to {self.job:.3g} are noise"
        if ranks:
            text += "; for comparisons involving " + ", ".join(
                f"rank {r} up to {t:.3g}" for r, t in ranks.items()
            )
        return text


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
