"""What counts as evidence in the replay audit, on kernels that are not bit-reproducible.

Kinds of evidence, each judged on its own (:mod:`sdc_agent.judging`):

* the **loss** (the forward pass): compared bit for bit, and by its relative difference;
* the **gradients of each layer**: a bitwise fingerprint per tensor and, per tensor, two
  float64 statistics (the sum and the sum of squares of its elements); a layer's relative
  difference is the largest of its tensors'. Run-to-run noise moves them by a last bit or
  so and a hardware fault by its size: a whole tensor off by 2.5e-5 moves its sum of
  squares by 5e-5;
* the **forward output of each module** (:func:`output_modules`): two float64 statistics
  of its output, the sum of absolute values and the Euclidean norm
  (:func:`output_stats`). A fault of one bf16 ulp in every element of a layer's output
  moves both by about an ulp's relative size there (every magnitude moves the same way),
  while noise that moves a share ``f`` of ``n`` elements by ±1 ulp moves them by about
  ``sqrt(2 f n) / n`` ulp (signs cancel): measured under the GPT-2's forward noise
  (docs/agent.md), 5.6e-3 against at most 3.1e-5 at the faulty module, where the loss
  and the gradients, after the network diluted the fault, cannot tell it from the noise.
  Neither statistic moves by more than one ulp when the elements differ only by
  rounding (each magnitude moves by at most its ulp), so the dtype's cap holds for them
  as for the others. The plain sum is left out: it cancels (a relative fault of every
  element moved it by 1.6e-5 against noise of 3.5e-5).

:func:`compare` measures two computations per kind; :mod:`sdc_agent.judging` learns each
kind's noise and says which kinds still separate a faulty rank. Tolerances are capped by
the dtype the computation ran in (:data:`NOISE_CAPS`): a difference above the cap is never
noise.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
    "is_output_kind",
    "output_kind",
    "output_modules",
    "output_stats",
    "output_tensor",
    "stats_scratch",
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


def tensor_stats(tensor: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``[sum, sum of squares]`` of ``tensor``'s elements in float64, on its device.

    Computed in chunks, so no float64 copy of a large tensor is ever made; the same bits
    always give the same statistics on one kind of device. ``scratch`` (from
    :func:`stats_scratch`): where each chunk is widened, instead of a new tensor per chunk
    (on a CPU each one was a fresh allocation, its pages faulted in again); the
    statistics are bit for bit the same.
    """
    return _stats(tensor, absolute=False, scratch=scratch)


def output_stats(tensor: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``[sum of absolute values, sum of squares]`` of a module's output in float64, on
    its device, in chunks as :func:`tensor_stats` (with ``scratch`` the absolute values
    are taken in it, in place: no second copy per chunk)."""
    return _stats(tensor, absolute=True, scratch=scratch)


def _stats(
    tensor: torch.Tensor, *, absolute: bool, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    out = torch.zeros(2, dtype=torch.float64, device=flat.device)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if not flat.is_floating_point():
        flat = flat.to(torch.float64)
    step = _CHUNK.get(flat.device.type, _CHUNK["cuda"])
    widen = scratch is not None and flat.dtype != torch.float64
    for start in range(0, flat.numel(), step):
        piece = flat[start : start + step]
        if widen:
            assert scratch is not None
            # Widening is exact, and the chunk starts where a fresh allocation would
            # (the scratch's aligned start): the same sums as with a fresh float64 copy.
            chunk = scratch[: piece.numel()]
            chunk.copy_(piece)
        else:
            chunk = piece.to(torch.float64)
        if absolute and widen:
            chunk.abs_()  # the scratch is ours; the squares are the same
            out[0] += chunk.sum()
        else:
            out[0] += chunk.abs().sum() if absolute else chunk.sum()
        out[1] += torch.dot(chunk, chunk)
    return out


def output_tensor(output: Any) -> torch.Tensor | None:
    """The tensor that is a module's result: the output itself, or the first
    floating-point tensor in it, depth first through tuples, lists and mappings in their
    order (a transformers ``ModelOutput`` is one: its first field, ``last_hidden_state``
    or ``logits``; GPT-2's attention gives ``(output, weights)`` and its blocks
    ``(hidden_states, ...)``). Caches and other objects are skipped; ``None`` if there
    is none."""
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    if isinstance(output, Mapping):
        items: Iterable[Any] = output.values()
    elif isinstance(output, tuple | list):
        items = output
    else:
        return None
    for item in items:
        found = output_tensor(item)
        if found is not None:
            return found
    return None


_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList)


def output_modules(module: torch.nn.Module) -> tuple[tuple[str, torch.nn.Module], ...]:
    """The modules whose forward outputs are kinds of evidence, by name, in
    ``named_modules()`` order: every module below the root that holds a trainable
    parameter in itself or below it. The gradient kinds' layers (the modules that own
    parameters) are among them, with the blocks that contain them (a transformer block,
    its MLP): a fault in the output of a block's MLP shows in that MLP's output and its
    block's, and no longer clearly past the next LayerNorm. Lists and dicts of modules
    (no forward of their own) are left out."""
    out = []
    for name, m in module.named_modules():
        if not name or isinstance(m, _CONTAINERS):
            continue
        if any(p.requires_grad for p in m.parameters()):
            out.append((name, m))
    return tuple(out)


def compiled_module(module: torch.nn.Module) -> str | None:
    """The first module of ``module``'s tree that ``torch.compile`` compiled (an
    ``OptimizedModule``, or a module compiled in place by ``Module.compile``), by name
    (``"the model"`` for the root); ``None`` if none is. Dynamo does not guard on module
    hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``): hooks added after the
    first compilation never run, and hooks present at it are baked into the graph, so
    the output kinds cannot observe such a model's forward."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # no OptimizedModule without
    optimized = getattr(eval_frame, "OptimizedModule", ())
    for name, m in module.named_modules():
        if isinstance(m, optimized) or getattr(m, "_compiled_call_impl", None) is not None:
            return name or "the model"
    return None


def stats_scratch(device: torch.device) -> torch.Tensor | None:
    """A buffer for :func:`tensor_stats` to widen its chunks in, for many calls on
    ``device``'s tensors; ``None`` off the CPU (a GPU's caching allocator hands a chunk's
    memory back at no cost, and a held 128 MiB buffer would add to the peak)."""
    if device.type != "cpu":
        return None
    return torch.empty(_CHUNK["cpu"], dtype=torch.float64)


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
    outputs: tuple[tuple[float, float], ...] = ()
    """Per module of :func:`output_modules`: ``(sum of absolute values, sum of squares)``
    of its forward output in float64, summed over its calls in the forward; empty where
    the forward was not observed (then the output kinds compare as equal)."""


@dataclass(frozen=True, slots=True)
class Tolerance:
    """The relative differences taken for noise, summarized for the loss and for the
    gradients (the largest over gradient kinds): what an evidence bundle records.
    0: none; any difference is evidence."""

    loss: float = 0.0
    gradients: float = 0.0


LOSS = "loss"
"""The name of the loss's kind of evidence; gradient kinds are named ``gradients:<layer>``
(the module that owns the parameters, as ``named_parameters()`` spells it), output kinds
``outputs:<module>`` (as ``named_modules()`` spells it)."""


def gradient_kind(layer: str) -> str:
    return f"gradients:{layer}"


def output_kind(module: str) -> str:
    return f"outputs:{module}"


def is_output_kind(name: str) -> bool:
    return name.startswith("outputs:")


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
    :func:`compare` was given, then each output kind (``outputs`` of them)."""

    kinds: tuple[KindDiff, ...]
    outputs: int = 0
    """How many of the kinds, at the end, are output kinds."""

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
    def gradient_kinds(self) -> tuple[KindDiff, ...]:
        return self.kinds[1 : len(self.kinds) - self.outputs]

    @property
    def grads_equal(self) -> bool:
        return all(k.equal for k in self.gradient_kinds)

    @property
    def grad_rel(self) -> float:
        return max([0.0, *(k.rel for k in self.gradient_kinds)])

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


def compare(
    a: Summary, b: Summary, groups: Sequence[Sequence[int]] | None = None, outputs: int = 0
) -> Comparison:
    """Compare two computations of the same micro-batch, per kind of evidence: the loss,
    then one gradient kind per group of tensor indices (``None``: all tensors, one kind),
    then ``outputs`` output kinds (equal where either side did not observe its forward)."""
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
    kinds.extend(_compare_outputs(a.outputs, b.outputs, outputs))
    return Comparison(tuple(kinds), outputs)


def _compare_outputs(
    a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]], count: int
) -> list[KindDiff]:
    if len(a) != count or len(b) != count:
        return [KindDiff(True, 0.0)] * count
    out = []
    for (l1, q1), (l2, q2) in zip(a, b, strict=True):
        # Bit for bit, and a NaN is a NaN whatever its bits: a module whose output holds
        # a NaN on both sides (masked positions later replaced) has statistics nobody can
        # tell apart, not a difference (``==`` would call two NaNs unequal: evidence in
        # every comparison). A NaN or an infinity on one side only stays evidence (inf).
        if (l1.hex(), q1.hex()) == (l2.hex(), q2.hex()):
            out.append(KindDiff(True, 0.0))
            continue
        # The norm rather than the sum of squares: a rounding difference moves it by at
        # most one ulp, as it does the sum of absolute values (so the dtype's cap holds).
        n1, n2 = math.sqrt(max(q1, 0.0)), math.sqrt(max(q2, 0.0))
        rel = max(_rel(l1, l2, max(abs(l1), abs(l2))), _rel(n1, n2, max(n1, n2)))
        out.append(KindDiff(False, rel))
    return out


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
