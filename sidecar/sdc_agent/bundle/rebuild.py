"""Rebuilding the model a bundle recorded: the training script imported as a module (its
``__main__`` block does not run), the module unpickled or built by a factory, the weights
installed."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import BundleError
from .format import _FACTORY, LossFn

if TYPE_CHECKING:
    from .reader import Bundle

__all__ = ["rebuild_model"]


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


def rebuild_model(
    bundle: Bundle, device: torch.device, *, factory: str | None = None
) -> tuple[nn.Module, LossFn]:
    """:meth:`Bundle.rebuild`."""
    model = bundle.manifest["model"]
    factory = factory or (model.get("factory") if model["how"] == "factory" else None)
    if factory is None and model["how"] != "pickle":
        raise BundleError("model.how", f"{model['how']}: {model.get('reason')}; give a factory")
    if "weights.pt" not in bundle.manifest["files"]:
        raise BundleError("files.weights.pt", "the weights were left out of this bundle")
    weights = bundle.load("weights.pt")
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
        if "module.pt" not in bundle.manifest["files"]:
            raise BundleError("files.module.pt", "the module was left out of this bundle")
        reference = model.get("loss_fn")
        if not reference:
            raise BundleError(
                "model.loss_fn", str(model.get("reason") or "not recorded; give a factory")
            )
        try:
            with _main_as(script) if script is not None else _noop():
                module = torch.load(
                    bundle.path / "module.pt", map_location="cpu", weights_only=False
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
