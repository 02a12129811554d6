"""The snapshot, taken on the training thread: what a bundle needs, copied (on CUDA,
asynchronously into pinned host memory) before the weights change."""

from __future__ import annotations

import copy
import datetime
import inspect
import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._validate import require_int
from ..errors import ConfigError
from ..protocol import Suspect
from ..replay import Payload
from .format import (
    _RUN,
    BUNDLE_FORMAT,
    BUNDLE_VERSION,
    LossFn,
    Tolerance,
    _map_tensors,
    _tensors_in,
)
from .settings import BundleSettings

__all__ = ["EvidenceSnapshot", "take_snapshot"]

log = logging.getLogger("sdc_agent.bundle")

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
# What is written, in the order it is kept when the cap does not fit everything.
_ALIGN = 64  # bytes: every tensor's slice of the pinned staging buffer starts aligned


class _HostCopier:
    """Copies tensors to host memory without blocking on CUDA: one pinned staging buffer,
    asynchronous copies on the current stream, one event per device to wait on."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.events: list[Any] = []
        self._staged: dict[int, torch.Tensor] = {}
        cuda = [t for t in tensors if t.is_cuda]
        if not cuda:
            return
        sizes = [-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for t in cuda]
        try:
            buffer = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:  # no pinned memory left: copy synchronously instead
            log.warning("sdc_agent: no pinned memory for the evidence bundle (%s)", exc)
            return
        offset = 0
        for t, size in zip(cuda, sizes, strict=True):
            nbytes = t.numel() * t.element_size()
            view = buffer[offset : offset + nbytes].view(t.dtype).view(t.shape)
            view.copy_(t.detach(), non_blocking=True)
            self._staged[id(t)] = view
            offset += size
        for device in {t.device for t in cuda}:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self.events.append(event)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        staged = self._staged.get(id(t))
        if staged is not None:
            return staged
        return t.detach().to("cpu", copy=True)

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()


def _skeleton(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are ``meta`` tensors (no data is
    copied; tied tensors stay tied) and which carries no hooks."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    skeleton = copy.deepcopy(module, memo)
    for sub in skeleton.modules():
        for name in _HOOK_DICTS:
            hooks = getattr(sub, name, None)
            if isinstance(hooks, dict):
                setattr(sub, name, OrderedDict() if isinstance(hooks, OrderedDict) else {})
    return skeleton


def _function_reference(fn: Any) -> str | None:
    """``module:qualname`` of a module-level function, else ``None``."""
    if fn is None or inspect.ismethod(fn):
        return None
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        return None
    return f"{module}:{qualname}"


def _script_info() -> dict[str, Any]:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else None
    return {
        "script": script if script and os.path.isfile(script) else None,
        "main_module": spec.name if spec is not None and spec.name != "__main__" else None,
        "sys_path": [os.path.abspath(p) if p else os.getcwd() for p in sys.path],
    }


def _numerics() -> dict[str, Any]:
    """Settings that change the bits kernels produce; the confirmation applies them."""
    cuda_matmul = torch.backends.cuda.matmul
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": bool(cuda_matmul.allow_tf32),
        "cuda_matmul_allow_fp16_reduced_precision_reduction": bool(
            cuda_matmul.allow_fp16_reduced_precision_reduction
        ),
        "cuda_matmul_allow_bf16_reduced_precision_reduction": bool(
            cuda_matmul.allow_bf16_reduced_precision_reduction
        ),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        # CPU kernels split reductions by thread: another count, other gradient bits.
        "cpu_threads": torch.get_num_threads(),
    }


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(slots=True)
class EvidenceSnapshot:
    """What the training thread hands the writer: host copies (or copies under way) and
    the manifest's fields. Nothing in it is shared with training."""

    manifest: dict[str, Any]
    parts: dict[str, Any]
    """``rng.pt``, ``batch.pt``, ``weights.pt``, ``module.pt`` -> object to ``torch.save``."""
    estimated_bytes: dict[str, int]
    left_out: list[dict[str, Any]]
    max_bytes: int
    copier: _HostCopier
    seconds: float
    """How long the training thread spent taking it."""

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def run_id(self) -> str:
        return str(self.manifest["run_id"])

    @property
    def suspect_rank(self) -> int:
        return int(self.manifest["suspect"]["rank"])


def _suspect_json(s: Suspect) -> dict[str, Any]:
    return {
        "rank": s.rank,
        "node": s.node,
        "local_rank": s.local_rank,
        "pod": s.pod,
        "gpu_uuid": s.gpu_uuid,
    }


def take_snapshot(
    *,
    module: nn.Module,
    payload: Payload,
    reference: Mapping[str, Any],
    suspect: Suspect,
    step: int,
    run_id: str,
    tolerance: Tolerance,
    loss_fn: LossFn | None = None,
    settings: BundleSettings | None = None,
    work_of: int | None = None,
    recorded_by: Mapping[str, Any] | None = None,
    suspect_result: Mapping[str, Any] | None = None,
    loss_scale: float | None = None,
    evidence: Mapping[str, Any] | None = None,
    code: Mapping[str, Any] | None = None,
) -> EvidenceSnapshot:
    """Take, on the training thread, what a bundle needs (before the weights change).

    ``module`` is the unwrapped model (``ddp.module``) with the weights the micro-batch
    ran with; ``payload`` the micro-batch as the audit captured it; ``reference`` the
    healthy replayer's result (:func:`reference_of`); ``suspect_result`` what the suspect
    computed for the same micro-batch (its loss bits and gradient fingerprint), if known;
    ``work_of`` the rank whose micro-batch it is (default: the suspect's); ``code`` where
    the training code is (``script``, ``main_module``, ``sys_path``; default: this
    process's ``sys.argv[0]``, ``__main__`` and ``sys.path``). What does not fit under
    ``settings.bundle_max_bytes`` is not copied at all.
    """
    started = time.perf_counter()
    settings = settings or BundleSettings()
    if not _RUN.match(run_id):
        raise ConfigError(
            f"run_id: must be 1 to 64 letters, digits, '.', '_' or '-', got {run_id!r}"
        )
    require_int("step", step, minimum=1)
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    weights = {**params, **buffers}
    batch_tensors = _tensors_in(payload.batch)
    rng: dict[str, torch.Tensor | None] = {
        "cpu": payload.rng_cpu,
        "cuda": payload.rng_cuda,
        "loss_grad": payload.loss_grad,
    }
    budget = settings.bundle_max_bytes
    estimated = {
        "rng.pt": _nbytes([t for t in rng.values() if t is not None]),
        "batch.pt": _nbytes(batch_tensors),
        "weights.pt": _nbytes(list(weights.values())),
    }
    left_out: list[dict[str, Any]] = []
    kept: list[str] = []
    used = 0
    for part in ("rng.pt", "batch.pt", "weights.pt"):
        if used + estimated[part] > budget:
            left_out.append(
                {
                    "file": part,
                    "bytes": estimated[part],
                    "why": f"over bundle_max_bytes ({budget} bytes; {used} already kept)",
                }
            )
            continue
        kept.append(part)
        used += estimated[part]
    copied = [*batch_tensors] if "batch.pt" in kept else []
    if "weights.pt" in kept:
        copied += list(weights.values())
    copier = _HostCopier(copied)
    parts: dict[str, Any] = {}
    if "rng.pt" in kept:
        parts["rng.pt"] = {k: None if v is None else v.detach().clone() for k, v in rng.items()}
    if "batch.pt" in kept:
        parts["batch.pt"] = _map_tensors(payload.batch, copier)
    if "weights.pt" in kept:
        parts["weights.pt"] = {name: copier(t) for name, t in weights.items()}

    model: dict[str, Any] = {
        **_script_info(),
        **(code or {}),
        "how": "factory" if settings.bundle_factory else "pickle",
        "factory": settings.bundle_factory,
        "loss_fn": _function_reference(loss_fn),
        "class": f"{type(module).__module__}.{type(module).__qualname__}",
        "parameters": sum(p.numel() for p in params.values()),
        "dtypes": sorted({str(t.dtype) for t in weights.values() if t.is_floating_point()}),
        "training": module.training,
        "eval_modules": [n for n, m in module.named_modules() if not m.training],
        "reason": None,
    }
    if loss_fn is not None and model["loss_fn"] is None and not settings.bundle_factory:
        model["reason"] = (
            f"the loss function {loss_fn!r} is not a module-level function, so it cannot be "
            "recorded by reference: give a bundle factory"
        )
    if model["how"] == "pickle" and "weights.pt" in kept:
        try:
            parts["module.pt"] = _skeleton(module)
        except Exception as exc:  # deepcopy of user code: anything can fail
            model["how"] = "unavailable"
            model["reason"] = f"the module could not be copied ({type(exc).__name__}: {exc})"
    devices = sorted({str(t.device) for t in weights.values()})
    manifest: dict[str, Any] = {
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION,
        "created_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "step": step,
        "run_id": run_id,
        "work_of": suspect.rank if work_of is None else work_of,
        "suspect": _suspect_json(suspect),
        "recorded_by": dict(recorded_by or {}),
        "micro_batch": {
            # The gradient that reached the loss (1/n under accumulation, times the loss
            # scale): the tensor is in rng.pt, its value here for the reader.
            "loss_grad": None
            if payload.loss_grad is None
            else float(payload.loss_grad.detach().double().item()),
            "loss_scale": loss_scale,
            "autocast": {
                dev: {"enabled": enabled, "dtype": str(dtype)}
                for dev, (enabled, dtype) in payload.autocast.items()
            },
            "rng_cuda": payload.rng_cuda is not None,
        },
        "tolerance": tolerance.as_json(),
        "reference": dict(reference),
        "suspect_result": None if suspect_result is None else dict(suspect_result),
        "evidence": None if evidence is None else dict(evidence),
        "model": model,
        "numerics": _numerics(),
        "environment": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": sys.version.split()[0],
            "devices": devices,
            "device_name": (
                torch.cuda.get_device_name(torch.device(devices[0]))
                if devices and devices[0].startswith("cuda")
                else None
            ),
        },
        "max_bytes": budget,
    }
    return EvidenceSnapshot(
        manifest=manifest,
        parts=parts,
        estimated_bytes=estimated,
        left_out=left_out,
        max_bytes=budget,
        copier=copier,
        seconds=time.perf_counter() - started,
    )
