"""Evidence bundles: what recomputes one audited micro-batch, kept next to the job's
checkpoints for the confirmation run (:mod:`sdc_agent.confirm`) and the person reviewing.

When the replay audit localizes a suspect, the healthy rank that replayed the suspect's
micro-batch holds everything needed to compute it again: the micro-batch, its RNG and
autocast state, the gradient that reached its loss, the weights it ran with and the result
a healthy GPU computed (the *reference*). A bundle keeps that, so the same micro-batch can
be recomputed later on every GPU of the suspect node and compared with the reference bits.

A bundle is a directory ``<dir>/sdc-evidence/<run>-<step>-r<rank>/`` (``rank`` is the
suspect's global rank) holding:

``bundle.json``
    the manifest: versioned JSON (:data:`BUNDLE_FORMAT`, :data:`BUNDLE_VERSION`) naming
    the step, run, suspect, the reference result, the tolerance in force, how to rebuild
    the model, the numerics settings, and every file with its size and SHA-256;
``rng.pt``
    the CPU (and CUDA) RNG state right before the micro-batch's forward;
``batch.pt``
    the micro-batch (any nesting of tensors in dicts, lists, tuples), on the CPU;
``weights.pt``
    every parameter and buffer it ran with (non-persistent buffers too), by name;
``module.pt``
    the module without its weights (pickled with its tensors on the ``meta`` device), when
    the model is rebuilt by unpickling (the default; see below).

How the model is rebuilt. The confirmation pod runs the job's image, so the training code
is there. By default the bundle records the training script (``sys.argv[0]``, absolute,
the module name where it ran with ``python -m``) and ``sys.path``, pickles the module's
structure, and records the loss function by reference (``module:qualname``). The
confirmation imports the script as a module of another name (so its
``if __name__ == "__main__"`` block does not run), aliases it as ``__main__`` while
unpickling, and loads the weights into the result. Limits: the script's top-level code
runs on import; hooks registered on the module are not kept (the fault injector's
included: the confirmation attaches its own); classes made at run time (parametrizations,
``torch.compile`` wrappers) do not pickle; the loss function must be a module-level
function. Where that does not fit, give a factory: ``bundle_factory="pkg.mod:build"`` (env
``HYPERPOD_SDC_BUNDLE_FACTORY``), a function of no arguments returning ``(module,
loss_fn)``; the weights are then loaded into the module it builds, by name.

Bounded: at most ``bundle_max_bytes`` (default 2 GiB, env
``HYPERPOD_SDC_BUNDLE_MAX_BYTES``) of ``.pt`` files; the manifest (kilobytes) comes on top.
What does not fit is left out, RNG first kept, then the micro-batch, then the weights, and
the manifest says what was left out and why (``complete: false``): a confirmation then
cannot recompute and says so. Writing never fails training: the training thread only
takes the snapshot it must (on CUDA an asynchronous copy into pinned host memory; on the
CPU a copy), a background thread (:class:`BundleWriter`) serializes it into a temporary
directory and renames it into place, so a bundle is there whole or not at all.

Reading (:func:`read_bundle`) validates the manifest and every file's size and digest and
names what is wrong (:class:`~sdc_agent.errors.BundleError`). A bundle is unpickled with
``weights_only=False``: it executes what the job's own code could, so a confirmation must
run with the job's image and privileges, never the operator's.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import datetime
import hashlib
import importlib
import importlib.util
import inspect
import json
import logging
import os
import re
import secrets
import shutil
import sys
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ._validate import require_int
from .errors import BundleError, ConfigError
from .fingerprint import Fingerprinter, combine_fingerprints, format_fingerprint
from .protocol import Suspect
from .replay import Payload, loss_bits, replay_complete

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
    "Bundle",
    "BundleSettings",
    "Recomputed",
    "BundleWriter",
    "EvidenceSnapshot",
    "Tolerance",
    "WriteResult",
    "bundle_path",
    "read_bundle",
    "recompute",
    "reference_of",
    "take_snapshot",
    "write_bundle",
]

log = logging.getLogger(__name__)

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
_PARTS = ("rng.pt", "batch.pt", "weights.pt", "module.pt")
_EXIT_WAIT_SECONDS = 120.0
"""At interpreter exit, how long a bundle still being written may hold the process."""
_CHUNK = 1 << 22  # bytes hashed and written at a time
_ALIGN = 64  # bytes: every tensor's slice of the pinned staging buffer starts aligned


# -- settings ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class BundleSettings:
    """Where bundles go and how they are bounded (keyword arguments override env)."""

    bundle_dir: str | None = None
    """Directory under which ``sdc-evidence/`` is created, normally the job's checkpoint
    directory on a volume every node mounts (env ``HYPERPOD_SDC_BUNDLE_DIR``; a path
    object is taken as its string). ``None``: the Guard uses the directory holding the
    last checkpoint given to :meth:`Guard.mark_checkpoint`, and writes no bundle until
    one was given."""

    bundle_factory: str | None = None
    """``"pkg.mod:build"``: a function of no arguments that returns ``(module, loss_fn)``,
    for models that do not pickle (env ``HYPERPOD_SDC_BUNDLE_FACTORY``). ``None``: pickle
    the module's structure and record the loss function by reference."""

    bundle_max_bytes: int = DEFAULT_MAX_BYTES
    """Most bytes of ``.pt`` files one bundle may hold (env
    ``HYPERPOD_SDC_BUNDLE_MAX_BYTES``); what does not fit is left out and the manifest
    says so. 0 keeps only the manifest (the reference bits, no data or weights)."""

    def __post_init__(self) -> None:
        if isinstance(self.bundle_dir, os.PathLike):
            object.__setattr__(self, "bundle_dir", os.fspath(self.bundle_dir))
        if self.bundle_dir is not None and (
            not isinstance(self.bundle_dir, str) or not self.bundle_dir
        ):
            raise ConfigError(f"bundle_dir: must be a non-empty path, got {self.bundle_dir!r}")
        if self.bundle_factory is not None and (
            not isinstance(self.bundle_factory, str) or not _FACTORY.match(self.bundle_factory)
        ):
            raise ConfigError(
                "bundle_factory: must be 'module:function' (e.g. 'mypkg.model:build'), "
                f"got {self.bundle_factory!r}"
            )
        require_int("bundle_max_bytes", self.bundle_max_bytes, minimum=0)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> BundleSettings:
        env = os.environ if env is None else env
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"{', '.join(unknown)}: unknown setting; known: {sorted(known)}")
        values: dict[str, Any] = {}
        if raw := env.get(BUNDLE_DIR_ENV, "").strip():
            values["bundle_dir"] = raw
        if raw := env.get(BUNDLE_FACTORY_ENV, "").strip():
            values["bundle_factory"] = raw
        if (max_bytes := env.get(BUNDLE_MAX_BYTES_ENV)) is not None:
            try:
                values["bundle_max_bytes"] = int(max_bytes.strip())
            except ValueError:
                raise ConfigError(
                    f"{BUNDLE_MAX_BYTES_ENV}: expected a number of bytes, got {max_bytes!r}"
                ) from None
        values.update(overrides)
        try:
            return cls(**values)
        except ConfigError as exc:
            name = str(exc).split(":", 1)[0]
            env_name = {
                "bundle_dir": BUNDLE_DIR_ENV,
                "bundle_factory": BUNDLE_FACTORY_ENV,
                "bundle_max_bytes": BUNDLE_MAX_BYTES_ENV,
            }.get(name)
            if env_name is not None and name not in overrides and env_name in env:
                raise ConfigError(f"{env_name}: {exc}") from None
            raise


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


# -- the reference result -------------------------------------------------------------------


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


# -- the snapshot (training thread) ---------------------------------------------------------


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


# -- writing (background thread) ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WriteResult:
    path: Path
    written: bool
    """The bundle is in place (complete or not)."""
    complete: bool = False
    bytes: int = 0
    seconds: float = 0.0
    left_out: tuple[str, ...] = ()
    error: str | None = None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _HashingFile:
    """What ``torch.save`` writes into: the file, hashed on the way (no second read of a
    large bundle), in chunks so the GIL is free between them."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "wb")  # noqa: SIM115  (closed by _save)
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _CHUNK):
            chunk = view[start : start + _CHUNK]
            self.digest.update(chunk)  # releases the GIL for large buffers
            self.file.write(chunk)
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        self.file.flush()


def _save(obj: Any, path: Path) -> tuple[int, str]:
    out = _HashingFile(path)
    try:
        torch.save(obj, out)  # type: ignore[arg-type]  # it needs write() only
        out.file.flush()
        os.fsync(out.file.fileno())
    finally:
        out.file.close()
    return out.size, out.digest.hexdigest()


def _required(how: str) -> tuple[str, ...]:
    return ("rng.pt", "batch.pt", "weights.pt", *(("module.pt",) if how == "pickle" else ()))


def write_bundle(snapshot: EvidenceSnapshot, path: str | os.PathLike[str]) -> WriteResult:
    """Write ``snapshot`` as a bundle at ``path``: into a temporary directory beside it,
    renamed into place when whole. An existing bundle at ``path`` is left as it is."""
    started = time.perf_counter()
    final = Path(path)
    try:
        snapshot.copier.wait()
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists():
            return WriteResult(final, False, error="a bundle is already there; left as it is")
        # Not tempfile.mkdtemp: its 0700 would keep the bundle from a confirmation pod
        # that runs as another user; the process's umask decides, as for the checkpoints.
        tmp = final.parent / f".{final.name}.{secrets.token_hex(6)}"
        tmp.mkdir()
    except Exception as exc:
        return WriteResult(final, False, error=f"{type(exc).__name__}: {exc}")
    try:
        manifest = copy.deepcopy(snapshot.manifest)
        model = manifest["model"]
        files: dict[str, dict[str, Any]] = {}
        left_out = list(snapshot.left_out)
        total = 0
        for part in _PARTS:
            obj = snapshot.parts.get(part)
            if obj is None:
                continue
            estimate = snapshot.estimated_bytes.get(part, 0)
            if total + estimate > snapshot.max_bytes:
                left_out.append({"file": part, "bytes": estimate, "why": "over bundle_max_bytes"})
                continue
            try:
                size, digest = _save(obj, tmp / part)
            except Exception as exc:
                if part != "module.pt":
                    raise
                # The module does not pickle (a lambda, a class made at run time): the
                # weights are there, a factory can rebuild the model.
                (tmp / part).unlink(missing_ok=True)
                model["how"] = "unavailable"
                model["reason"] = (
                    f"the module does not pickle ({type(exc).__name__}: {exc}); give a "
                    "bundle factory"
                )
                continue
            if total + size > snapshot.max_bytes:
                (tmp / part).unlink()
                left_out.append(
                    {"file": part, "bytes": size, "why": "over bundle_max_bytes once written"}
                )
                continue
            files[part] = {"bytes": size, "sha256": digest}
            total += size
        manifest["files"] = files
        manifest["left_out"] = left_out
        manifest["complete"] = model["how"] != "unavailable" and all(
            p in files for p in _required(model["how"])
        )
        manifest["bytes"] = total
        manifest["write_seconds"] = round(time.perf_counter() - started, 6)
        manifest["snapshot_seconds"] = round(snapshot.seconds, 6)
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if final.exists():  # another writer got there first
                shutil.rmtree(tmp, ignore_errors=True)
                return WriteResult(final, False, error="a bundle is already there; left as it is")
            raise
        _fsync_dir(final.parent)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return WriteResult(final, False, error=f"{type(exc).__name__}: {exc}")
    return WriteResult(
        final,
        True,
        complete=bool(manifest["complete"]),
        bytes=total,
        seconds=time.perf_counter() - started,
        left_out=tuple(str(e["file"]) for e in left_out),
    )


class BundleWriter:
    """Writes bundles on one background thread (lower CPU priority), one at a time.

    :meth:`submit` never blocks: while a bundle is being written and another is waiting,
    a third is dropped with a warning (evidence of one incident is enough to confirm it;
    training must not wait).
    """

    def __init__(self, *, max_pending: int = 1, nice: int = 10) -> None:
        self._max_pending = max_pending
        self._nice = nice
        self._pending: list[tuple[EvidenceSnapshot, Path]] = []
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.results: list[WriteResult] = []
        """Every finished write, in order."""

    def has_room(self) -> bool:
        """Whether :meth:`submit` would take another bundle now (it stays true until the
        caller submits one: the writer only ever makes room)."""
        with self._cond:
            return not self._closed and len(self._pending) < self._max_pending

    def submit(self, snapshot: EvidenceSnapshot, directory: str | os.PathLike[str]) -> Path | None:
        """Queue ``snapshot`` for ``<directory>/sdc-evidence/...``; returns where the
        bundle will be, or ``None`` when it was dropped."""
        path = bundle_path(directory, snapshot.run_id, snapshot.step, snapshot.suspect_rank)
        with self._cond:
            if self._closed:
                return None
            if len(self._pending) >= self._max_pending:
                warnings.warn(
                    f"sdc_agent: evidence bundle {path.name} dropped: the writer is still busy "
                    "with earlier ones",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return None
            self._pending.append((snapshot, path))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="sdc-bundle-writer", daemon=True
                )
                self._thread.start()
                # A process that ends without close() still finishes the bundle in hand.
                atexit.register(self.close, _EXIT_WAIT_SECONDS)
            self._cond.notify_all()
        return path

    def capture(
        self, directory: str | os.PathLike[str] | None, **snapshot_args: Any
    ) -> Path | None:
        """:func:`take_snapshot` and :meth:`submit`, never raising: a failure is a warning
        and ``None`` (training goes on whatever happens to the evidence)."""
        if directory is None:
            return None
        try:
            return self.submit(take_snapshot(**snapshot_args), directory)
        except Exception as exc:
            warnings.warn(
                f"sdc_agent: no evidence bundle ({type(exc).__name__}: {exc})",
                RuntimeWarning,
                stacklevel=2,
            )
            return None

    def _run(self) -> None:
        # Linux: a thread is a task with its own nice value; elsewhere this does nothing.
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                snapshot, path = self._pending.pop(0)
                self._busy = True
            result = write_bundle(snapshot, path)
            if result.error:
                log.warning("sdc_agent: evidence bundle %s not written: %s", path, result.error)
            elif not result.complete:
                log.warning(
                    "sdc_agent: evidence bundle %s written without %s", path, result.left_out
                )
            with self._cond:
                self.results.append(result)
                self._busy = False
                self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Until everything submitted is written; false if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = 60.0) -> bool:
        """Finish what was submitted (up to ``timeout``), then stop the thread."""
        started = time.monotonic()
        done = self.wait(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and done:
            # A writer thread still inside torch at interpreter exit aborts the process
            # ("terminate called without an active exception"): let it end first.
            left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
            thread.join(left)
        return done


# -- reading --------------------------------------------------------------------------------


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


def _check_file(path: Path, name: str, entry: Mapping[str, Any]) -> None:
    target = path / name
    if not target.is_file():
        raise BundleError(f"files.{name}", f"listed in the manifest but missing from {path}")
    size = target.stat().st_size
    if size != entry["bytes"]:
        raise BundleError(
            f"files.{name}.bytes",
            f"the manifest says {entry['bytes']} bytes, the file has {size} (truncated or changed)",
        )
    digest = hashlib.sha256()
    with open(target, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    if digest.hexdigest() != entry["sha256"]:
        raise BundleError(
            f"files.{name}.sha256", "does not match the file's contents (damaged or changed)"
        )


def read_bundle(path: str | os.PathLike[str], *, verify: bool = True) -> Bundle:
    """Open the bundle at ``path``: the manifest validated and, with ``verify``, every
    file's size and SHA-256 checked. Raises :class:`BundleError` naming what is wrong."""
    root = Path(path)
    manifest_path = root / MANIFEST
    if not root.is_dir():
        raise BundleError("bundle", f"{root} is not a directory (no bundle there)")
    if not manifest_path.is_file():
        raise BundleError(MANIFEST, f"missing from {root}")
    try:
        manifest = json.loads(manifest_path.read_text(), object_pairs_hook=_no_duplicates)
    except BundleError:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise BundleError(MANIFEST, f"not valid JSON ({exc})") from None
    _validate(manifest)
    if verify:
        for name, entry in manifest["files"].items():
            _check_file(root, name, entry)
    return Bundle(root, manifest)


@contextmanager
def _main_as(module: ModuleType) -> Iterator[None]:
    """``module`` stands in for ``__main__`` (pickles of the training script name it)."""
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        yield
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _import_script(model: Mapping[str, Any]) -> ModuleType | None:
    """The training script as a module (its ``__main__`` block does not run)."""
    for entry in reversed(model.get("sys_path") or []):
        if isinstance(entry, str) and os.path.isdir(entry) and entry not in sys.path:
            sys.path.insert(0, entry)
    main_module = model.get("main_module")
    if main_module:
        return importlib.import_module(str(main_module))
    script = model.get("script")
    if not script:
        return None
    if not os.path.isfile(script):
        raise BundleError("model.script", f"{script} does not exist here (not the job's image?)")
    # One module name per script, so two bundles of different jobs never share one.
    name = "_sdc_training_script_" + hashlib.sha256(script.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, script)
    if spec is None or spec.loader is None:
        raise BundleError("model.script", f"{script} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[name]
        raise BundleError(
            "model.script", f"importing {script} failed ({type(exc).__name__}: {exc})"
        ) from exc
    return module


def _resolve(reference: str, script: ModuleType | None, where: str) -> Any:
    module_name, _, qualname = reference.partition(":")
    if module_name == "__main__":
        if script is None:
            raise BundleError(where, f"{reference} lives in the training script, which is unknown")
        obj: Any = script
    else:
        try:
            obj = importlib.import_module(module_name)
        except Exception as exc:
            raise BundleError(where, f"cannot import {module_name} ({exc})") from exc
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise BundleError(where, f"{reference}: no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def _install_weights(
    module: nn.Module, weights: Mapping[str, torch.Tensor], device: torch.device
) -> None:
    """Put ``weights`` (by name) into ``module`` on ``device``: meta tensors (an unpickled
    skeleton) are replaced, ties kept; real ones (a factory's module) are copied into, so
    whatever else holds them (ties, weight caches) sees the same tensors."""
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    missing = sorted((set(params) | set(buffers)) - set(weights))
    unexpected = sorted(set(weights) - set(params) - set(buffers))
    if missing or unexpected:
        raise BundleError(
            "weights.pt",
            f"does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}",
        )
    replaced: dict[int, torch.Tensor] = {}
    for name, t in {**params, **buffers}.items():
        w = weights[name]
        if tuple(w.shape) != tuple(t.shape) or w.dtype != t.dtype:
            raise BundleError(
                f"weights.pt.{name}",
                f"{tuple(w.shape)} {w.dtype} does not fit the model's {tuple(t.shape)} {t.dtype}",
            )
        if not t.is_meta:
            with torch.no_grad():
                t.copy_(w)
            continue
        real = w.to(device, copy=True)
        replaced[id(t)] = nn.Parameter(real, t.requires_grad) if name in params else real
    for sub in module.modules():
        for key, p in list(sub._parameters.items()):
            if p is not None and id(p) in replaced:
                sub._parameters[key] = replaced[id(p)]  # type: ignore[assignment]
        for key, b in list(sub._buffers.items()):
            if b is not None and id(b) in replaced:
                sub._buffers[key] = replaced[id(b)]


@dataclass(frozen=True, slots=True)
class Bundle:
    """An opened, validated bundle (:func:`read_bundle`)."""

    path: Path
    manifest: dict[str, Any]
    _cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def run_id(self) -> str:
        return str(self.manifest["run_id"])

    @property
    def suspect(self) -> Suspect:
        s = self.manifest["suspect"]
        return Suspect(
            rank=s["rank"],
            node=s["node"],
            local_rank=s["local_rank"],
            pod=s.get("pod"),
            gpu_uuid=s.get("gpu_uuid"),
        )

    @property
    def tolerance(self) -> Tolerance:
        t = self.manifest["tolerance"]
        return Tolerance(
            bit_reproducible=t["bit_reproducible"],
            gradient_tolerance=float(t["gradient_tolerance"]),
        )

    @property
    def reference(self) -> dict[str, Any]:
        return dict(self.manifest["reference"])

    @property
    def complete(self) -> bool:
        return bool(self.manifest["complete"])

    def missing(self) -> list[str]:
        """Why the bundle cannot recompute its micro-batch (empty when it can)."""
        model = self.manifest["model"]
        out = [f"{e.get('file')} left out: {e.get('why')}" for e in self.manifest["left_out"]]
        for part in _required(model["how"]):
            if part not in self.manifest["files"] and not any(part in o for o in out):
                out.append(f"{part} is not in the bundle")
        if model["how"] == "unavailable":
            out.append(f"the model cannot be rebuilt from the bundle: {model.get('reason')}")
        return out

    def load(self, name: str) -> Any:
        """One of the bundle's files (``rng.pt`` ...), loaded on the CPU, cached."""
        if name not in self.manifest["files"]:
            raise BundleError(f"files.{name}", "not in this bundle")
        if name not in self._cache:
            try:
                # The job's own objects, read back by the job's own code (module docstring).
                self._cache[name] = torch.load(
                    self.path / name, map_location="cpu", weights_only=False
                )
            except Exception as exc:
                raise BundleError(name, f"cannot be loaded ({type(exc).__name__}: {exc})") from exc
        return self._cache[name]

    def payload(self) -> Payload:
        """The micro-batch with its RNG and autocast state, as the audit replays it: a fresh
        copy each time, so a model or loss function that changes its inputs in place cannot
        change the next recomputation."""
        rng = self.load("rng.pt")
        micro = self.manifest["micro_batch"]
        autocast = {
            dev: (bool(s["enabled"]), _parse_dtype(s["dtype"], f"micro_batch.autocast.{dev}"))
            for dev, s in micro["autocast"].items()
        }
        batch = _map_tensors(self.load("batch.pt"), lambda t: t.clone())
        cuda = None if rng["cuda"] is None else rng["cuda"].clone()
        loss_grad = rng.get("loss_grad")
        return Payload(
            batch,
            rng["cpu"].clone(),
            cuda,
            autocast,
            None if loss_grad is None else loss_grad.clone(),
        )

    def rebuild(
        self, device: torch.device, *, factory: str | None = None
    ) -> tuple[nn.Module, LossFn]:
        """The module with the weights the micro-batch ran with, on ``device``, and the loss
        function. ``factory`` (``module:function``) overrides how the bundle says to build
        it."""
        model = self.manifest["model"]
        factory = factory or (model.get("factory") if model["how"] == "factory" else None)
        if factory is None and model["how"] != "pickle":
            raise BundleError("model.how", f"{model['how']}: {model.get('reason')}; give a factory")
        if "weights.pt" not in self.manifest["files"]:
            raise BundleError("files.weights.pt", "the weights were left out of this bundle")
        weights = self.load("weights.pt")
        script = _import_script(model)
        if factory is not None:
            if not _FACTORY.match(factory):
                raise BundleError("factory", f"must be 'module:function', got {factory!r}")
            built = _resolve(factory, script, "factory")()
            if not (isinstance(built, tuple) and len(built) == 2):
                raise BundleError("factory", f"{factory} must return (module, loss_fn)")
            module, loss_fn = built
            if not isinstance(module, nn.Module) or not callable(loss_fn):
                raise BundleError("factory", f"{factory} must return (nn.Module, callable)")
            module = module.to(device)
        else:
            if "module.pt" not in self.manifest["files"]:
                raise BundleError("files.module.pt", "the module was left out of this bundle")
            reference = model.get("loss_fn")
            if not reference:
                raise BundleError(
                    "model.loss_fn", str(model.get("reason") or "not recorded; give a factory")
                )
            try:
                with _main_as(script) if script is not None else _noop():
                    module = torch.load(
                        self.path / "module.pt", map_location="cpu", weights_only=False
                    )
                    loss_fn = _resolve(str(reference), script, "model.loss_fn")
            except BundleError:
                raise
            except Exception as exc:
                raise BundleError(
                    "module.pt", f"cannot be unpickled here ({type(exc).__name__}: {exc})"
                ) from exc
            if not isinstance(module, nn.Module):
                raise BundleError("module.pt", f"holds a {type(module).__name__}, not a module")
        _install_weights(module, weights, device)
        eval_modules = set(model.get("eval_modules") or [])
        for name, sub in module.named_modules():
            sub.training = name not in eval_modules
        return module, loss_fn


@contextmanager
def _noop() -> Iterator[None]:
    yield
