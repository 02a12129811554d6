"""What counts as evidence in the replay audit, on kernels that are not bit-reproducible.

Kinds of evidence, each judged on its own (:mod:`sdc_agent.judging`):

* the **loss** (the forward pass): compared bit for bit, and by its relative difference;
* the **gradients of each layer**: a bitwise fingerprint per tensor and, per tensor, two
  float64 statistics (the sum and the sum of squares of its elements); a layer's relative
  difference is the largest of its tensors'. Run-to-run noise moves them by a last bit or
  so and a hardware fault by its size: a whole tensor off by 2.5e-5 moves its sum of
  squares by 5e-5.

:func:`compare` measures two computations per kind; :mod:`sdc_agent.judging` learns each
kind's noise and says which kinds still separate a faulty rank. Tolerances are capped by
the dtype the computation ran in (:data:`NOISE_CAPS`): a difference above the cap is never
noise.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "HEADROOM",
    "LOSS",
    "NOISE_CAPS",
    "Comparison",
    "KindDiff",
    "Summary",
    "Tolerance",
    "attribute",
    "compare",
    "compute_dtype",
    "gradient_kind",
    "kind_differs",
    "layer_groups",
    "noise_cap",
    "tensor_stats",
]

NOISE_CAPS: dict[torch.dtype, float] = {
    torch.float64: 2e-15,
    torch.float32: 1e-6,
    torch.float16: 2.0**-10,
    torch.bfloat16: 2.0**-7,
}
"""Largest relative difference (of the loss, or of a layer's gradient statistic) ever
taken for noise, by the dtype the computation ran in (see :func:`compute_dtype`). Above it
a difference is evidence even on the first audit, and a difference at or below it that
reproduces on the suspect is one a per-process kernel choice could make too.

Derived from how the dtype rounds, and checked against the drills' measurements
(docs/agent.md, coverage). float32 and float64 reduce in the dtype itself, rounding many
times: run-to-run noise moves a statistic by about the unit roundoff (measured: 2e-8 to
2e-7 in float32, eps being 1.2e-7), and the cap is 8 eps. The 16-bit formats accumulate
in float32 and round each result once, half an ulp either way, so no statistic of results
that differ only by that rounding (±1 ulp in any share of the elements) moves by more
than one ulp, eps: bfloat16 2**-7 (7.8e-3; the emulated bf16 noise of the drills, ±1 ulp
in 1 % of a layer's outputs, moves the statistics downstream by up to about 2e-3), float16
2**-10. Noise that moves one kind of evidence beyond its cap (±4 ulp in 10 % of a
gradient) blinds that kind only."""

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
    """The relative differences taken for noise, summarized for the loss and for the
    gradients (the largest over gradient kinds): what an evidence bundle records.
    0: none; any difference is evidence."""

    loss: float = 0.0
    gradients: float = 0.0


LOSS = "loss"
"""The name of the loss's kind of evidence; gradient kinds are named ``gradients:<layer>``
(the module that owns the parameters, as ``named_parameters()`` spells it)."""


def gradient_kind(layer: str) -> str:
    return f"gradients:{layer}"


def layer_groups(names: Sequence[str]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Gradient kinds of evidence for parameters named ``names`` (in parameter order):
    one per layer (the module owning the parameter: ``0.weight`` and ``0.bias`` are layer
    ``0``), in order of first appearance, with the indices of its tensors."""
    out: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        layer = name.rsplit(".", 1)[0] if "." in name else name
        out.setdefault(gradient_kind(layer), []).append(i)
    return tuple((k, tuple(v)) for k, v in out.items())


@dataclass(frozen=True, slots=True)
class KindDiff:
    """How two computations differ in one kind of evidence."""

    equal: bool
    """Bit for bit (the loss's bits, or every fingerprint of the layer's gradients)."""
    rel: float
    """The relative difference (the loss's, or the largest of the layer's statistics)."""


@dataclass(frozen=True, slots=True)
class Comparison:
    """How two computations of one micro-batch differ, per kind of evidence: the loss
    first (``kinds[0]``), then each gradient kind (a layer), in the order of the groups
    :func:`compare` was given."""

    kinds: tuple[KindDiff, ...]

    @classmethod
    def of(
        cls, loss_equal: bool, grads_equal: bool, loss_rel: float, grad_rel: float
    ) -> Comparison:
        """One loss kind and one gradient kind (the whole model as one layer)."""
        return cls((KindDiff(loss_equal, loss_rel), KindDiff(grads_equal, grad_rel)))

    @property
    def loss_equal(self) -> bool:
        return self.kinds[0].equal

    @property
    def loss_rel(self) -> float:
        return self.kinds[0].rel

    @property
    def grads_equal(self) -> bool:
        return all(k.equal for k in self.kinds[1:])

    @property
    def grad_rel(self) -> float:
        return max([0.0, *(k.rel for k in self.kinds[1:])])

    @property
    def bitwise_equal(self) -> bool:
        return all(k.equal for k in self.kinds)

    @property
    def magnitude(self) -> float:
        return max(k.rel for k in self.kinds)

    def differs(self, tolerance: Tolerance) -> bool:
        """Evidence at ``tolerance`` (one figure for the loss, one for every gradient
        kind): a kind differs by any bit while its tolerance is 0, by more than it
        otherwise."""
        tols = [tolerance.loss] + [tolerance.gradients] * (len(self.kinds) - 1)
        return any(kind_differs(k, t) for k, t in zip(self.kinds, tols, strict=True))


def kind_differs(diff: KindDiff, tolerance: float) -> bool:
    """One kind's difference is evidence at ``tolerance`` (0: any bit is)."""
    return not diff.equal and (tolerance <= 0 or diff.rel > tolerance)


def _rel(a: float, b: float, scale: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(scale, _TINY)


def compare(a: Summary, b: Summary, groups: Sequence[Sequence[int]] | None = None) -> Comparison:
    """Compare two computations of the same micro-batch, per kind of evidence: the loss,
    then one gradient kind per group of tensor indices (``None``: all tensors, one kind)."""
    loss_equal = a.loss_bits == b.loss_bits
    loss_rel = 0.0 if loss_equal else _rel(a.loss, b.loss, max(abs(a.loss), abs(b.loss)))
    if a.nonfinite != b.nonfinite:
        loss_rel = math.inf
    if groups is None:
        groups = [range(max(len(a.stats), len(b.stats)))]
    kinds = [KindDiff(loss_equal, loss_rel)]
    mismatched_shape = len(a.stats) != len(b.stats)
    for group in groups:
        equal = not mismatched_shape and all(a.fingerprints[i] == b.fingerprints[i] for i in group)
        rel = math.inf if mismatched_shape else 0.0
        if not equal and not mismatched_shape:
            for i in group:
                (s1, q1), (s2, q2) = a.stats[i], b.stats[i]
                # The sum is compared on the scale the sum of squares gives it
                # (Cauchy-Schwarz bounds |sum| by sqrt(n * sumsq)); n is not needed to
                # compare two of them.
                norm = math.sqrt(max(q1, q2, 0.0))
                rel = max(rel, _rel(q1, q2, max(q1, q2)), _rel(s1, s2, norm))
        kinds.append(KindDiff(equal, rel))
    return Comparison(tuple(kinds))


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
