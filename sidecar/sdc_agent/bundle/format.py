"""The bundle on disk: its names, its manifest's version and how a manifest is
validated, the tolerance it records, and the nesting of tensors a micro-batch may have."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import BundleError

__all__ = [
    "BUNDLE_DIR_ENV",
    "BUNDLE_FACTORY_ENV",
    "BUNDLE_FORMAT",
    "BUNDLE_MAX_BYTES_ENV",
    "BUNDLE_VERSION",
    "DEFAULT_MAX_BYTES",
    "EVIDENCE_DIR",
    "GRADIENTS_OF",
    "MANIFEST",
    "REFERENCE_VERSION",
    "LossFn",
    "Tolerance",
    "bundle_path",
]

BUNDLE_FORMAT = "hyperpod-sdc.dev/evidence-bundle"
BUNDLE_VERSION = 1
"""The manifest's layout; a reader refuses versions it does not know."""
REFERENCE_VERSION = 1
"""The ``reference`` dict's version. It is an open dict: the audit may add fields (its
tolerant statistics), bumping this when old readers would misread it."""
GRADIENTS_OF = "backward(loss, loss_grad)"
"""What the reference gradients are: the local gradients of ``backward`` from the loss with
the gradient that reached the loss in the original backward (``Payload.loss_grad``: 1/n
under accumulation, times the loss scale with a GradScaler), as the replay audit computes
them. Recorded in the reference, so another convention is never silently compared."""
MANIFEST = "bundle.json"
EVIDENCE_DIR = "sdc-evidence"
DEFAULT_MAX_BYTES = 2 * 1024**3

BUNDLE_DIR_ENV = "HYPERPOD_SDC_BUNDLE_DIR"
BUNDLE_FACTORY_ENV = "HYPERPOD_SDC_BUNDLE_FACTORY"
BUNDLE_MAX_BYTES_ENV = "HYPERPOD_SDC_BUNDLE_MAX_BYTES"

LossFn = Callable[[nn.Module, Any], torch.Tensor]

_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_RUN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_PARTS = ("rng.pt", "batch.pt", "weights.pt", "module.pt")


@dataclass(frozen=True, kw_only=True, slots=True)
class Tolerance:
    """How results are compared: bit for bit, or gradients within a relative tolerance."""

    bit_reproducible: bool = True
    """The job recomputes bit for bit (measured by the agent): any difference counts."""
    gradient_tolerance: float = 0.0
    """Relative difference of per-parameter gradient norms above which gradients differ
    where the job is not bit-reproducible. The loss is always compared bit for bit."""

    def as_json(self) -> dict[str, Any]:
        return {
            "bit_reproducible": self.bit_reproducible,
            "gradient_tolerance": self.gradient_tolerance,
        }


def bundle_path(directory: str | os.PathLike[str], run_id: str, step: int, rank: int) -> Path:
    """``<directory>/sdc-evidence/<run_id>-<step>-r<rank>``."""
    return Path(directory) / EVIDENCE_DIR / f"{run_id}-{step}-r{rank}"


def _required(how: str) -> tuple[str, ...]:
    return ("rng.pt", "batch.pt", "weights.pt", *(("module.pt",) if how == "pickle" else ()))


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def visit(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    _map_tensors(obj, visit)
    return found


# -- validating a manifest -------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise BundleError(f"{MANIFEST}.{key}", "given twice")
        out[key] = value
    return out


def _need(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in d:
        raise BundleError(f"{where}{key}", "missing")
    value = d[key]
    bad_bool = isinstance(value, bool) and bool not in (
        kind if isinstance(kind, tuple) else (kind,)
    )
    if not isinstance(value, kind) or bad_bool:
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise BundleError(f"{where}{key}", f"must be {names}, got {value!r}")
    return value


def _parse_dtype(text: str, where: str) -> torch.dtype:
    dtype = getattr(torch, text.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise BundleError(where, f"not a torch dtype: {text!r}")
    return dtype


def _validate(manifest: Any) -> None:
    if not isinstance(manifest, dict):
        raise BundleError(MANIFEST, "must be a JSON object")
    if manifest.get("format") != BUNDLE_FORMAT:
        raise BundleError("format", f"must be {BUNDLE_FORMAT!r}, got {manifest.get('format')!r}")
    version = _need(manifest, "version", int, "")
    if version != BUNDLE_VERSION:
        raise BundleError("version", f"this reader knows version {BUNDLE_VERSION}, got {version}")
    step = _need(manifest, "step", int, "")
    if step < 1:
        raise BundleError("step", f"must be >= 1, got {step}")
    run_id = _need(manifest, "run_id", str, "")
    if not _RUN.match(run_id):
        raise BundleError("run_id", f"not a run id: {run_id!r}")
    suspect = _need(manifest, "suspect", dict, "")
    for key, kind in (("rank", int), ("node", str), ("local_rank", int)):
        _need(suspect, key, kind, "suspect.")
    for key in ("pod", "gpu_uuid"):
        if suspect.get(key) is not None and not isinstance(suspect[key], str):
            raise BundleError(f"suspect.{key}", f"must be a string or null, got {suspect[key]!r}")
    micro = _need(manifest, "micro_batch", dict, "")
    loss_grad = micro.get("loss_grad")
    if loss_grad is not None and (
        not isinstance(loss_grad, int | float) or isinstance(loss_grad, bool) or loss_grad <= 0
    ):
        raise BundleError(
            "micro_batch.loss_grad", f"must be a number > 0 or null, got {loss_grad!r}"
        )
    for dev, state in _need(micro, "autocast", dict, "micro_batch.").items():
        where = f"micro_batch.autocast.{dev}."
        if not isinstance(state, dict):
            raise BundleError(where[:-1], f"must be an object, got {state!r}")
        _need(state, "enabled", bool, where)
        _parse_dtype(_need(state, "dtype", str, where), where + "dtype")
    tolerance = _need(manifest, "tolerance", dict, "")
    _need(tolerance, "bit_reproducible", bool, "tolerance.")
    gradient_tolerance = _need(tolerance, "gradient_tolerance", (int, float), "tolerance.")
    if gradient_tolerance < 0:
        raise BundleError("tolerance.gradient_tolerance", f"must be >= 0, got {gradient_tolerance}")
    reference = _need(manifest, "reference", dict, "")
    _need(reference, "version", int, "reference.")
    _need(reference, "loss_bits", int, "reference.")
    _need(reference, "gradient_fingerprint", str, "reference.")
    _need(reference, "per_parameter", dict, "reference.")
    model = _need(manifest, "model", dict, "")
    how = _need(model, "how", str, "model.")
    if how not in ("pickle", "factory", "unavailable"):
        raise BundleError("model.how", f"must be pickle, factory or unavailable, got {how!r}")
    files = _need(manifest, "files", dict, "")
    for name, entry in files.items():
        if name not in _PARTS:
            raise BundleError(f"files.{name}", f"not a bundle file (known: {', '.join(_PARTS)})")
        if not isinstance(entry, dict):
            raise BundleError(f"files.{name}", f"must be an object, got {entry!r}")
        _need(entry, "bytes", int, f"files.{name}.")
        _need(entry, "sha256", str, f"files.{name}.")
    _need(manifest, "left_out", list, "")
    _need(manifest, "complete", bool, "")
