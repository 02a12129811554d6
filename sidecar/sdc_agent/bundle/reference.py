"""The reference result of a micro-batch: what a healthy GPU computed, as a bundle keeps
it (:func:`reference_of`), and the recomputation the audit and the confirmation share
(:func:`recompute`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..fingerprint import Fingerprinter, combine_fingerprints, format_fingerprint
from ..replay import Payload, loss_bits, replay_complete
from .format import GRADIENTS_OF, REFERENCE_VERSION, LossFn

__all__ = ["Recomputed", "recompute", "reference_of"]


@dataclass(frozen=True, slots=True)
class Recomputed:
    """One recomputation of a micro-batch: its loss and local gradients, in parameter order
    (``None``: the parameter got no gradient)."""

    loss: torch.Tensor
    grads: list[torch.Tensor | None]


def _combined(per: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """One fingerprint of per-parameter fingerprints, in parameter order; no gradient
    counts as the fingerprint of zeros."""
    zero = torch.zeros(2, dtype=torch.int64, device=device)
    rows = [zero if f is None else f.to(device) for f in per]
    return combine_fingerprints(torch.stack(rows)) if rows else zero


def reference_of(
    result: Recomputed,
    names: Sequence[str],
    fingerprinter: Fingerprinter | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The reference (or any candidate) result of a recomputation, as the manifest keeps
    it: loss bits, a combined gradient fingerprint, one fingerprint and one float64 L2 norm
    per parameter (``names``, in the order of ``result.grads``), and whatever ``extra``
    fields the caller adds (the audit's statistics)."""
    if len(names) != len(result.grads):
        raise ValueError(f"{len(names)} names for {len(result.grads)} gradients")
    fp = fingerprinter or Fingerprinter("eager")
    device = result.loss.device
    per = [None if g is None else fp(g) for g in result.grads]
    out: dict[str, Any] = {
        "version": REFERENCE_VERSION,
        "gradients_of": GRADIENTS_OF,
        "loss_bits": int(loss_bits(result.loss).item()),
        "loss": float(result.loss.detach().double().item()),
        "loss_dtype": str(result.loss.dtype),
        "gradient_fingerprint": format_fingerprint(_combined(per, device)),
        "per_parameter": {
            n: None if f is None else format_fingerprint(f) for n, f in zip(names, per, strict=True)
        },
        "gradient_norms": {
            n: None if g is None else float(torch.linalg.vector_norm(g.double()).item())
            for n, g in zip(names, result.grads, strict=True)
        },
    }
    out.update(extra)
    return out


def recompute(
    module: nn.Module, loss_fn: LossFn, payload: Payload, device: torch.device
) -> tuple[Recomputed, list[str]]:
    """Recompute ``payload`` on ``module`` exactly as the replay audit does
    (:func:`sdc_agent.replay.replay_complete`: ``backward`` with the payload's
    ``loss_grad``, RNG and buffers put back, the real gradients untouched); returns the
    result and the names of the parameters its gradients belong to."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    grads: list[torch.Tensor | None] = [None] * len(named)

    def sink_factory() -> Callable[[int, torch.Tensor], None]:
        grads[:] = [None] * len(named)  # a second try starts afresh

        def sink(i: int, grad: torch.Tensor) -> None:
            grads[i] = grad

        return sink

    params = [p for _, p in named]
    loss = replay_complete(module, params, loss_fn, payload, device, sink_factory, set())
    return Recomputed(loss, list(grads)), [n for n, _ in named]
