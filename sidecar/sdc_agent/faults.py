"""Fault injection, for drills and tests: corrupt one rank's numbers on purpose.

A :class:`FaultSpec` says where (``site``), what (``kind``), on which global ``rank`` and
at which ``step``. A transient fault (the default) hits the first computation at its site
during that step and nothing else: a glitch. A ``persistent`` one hits every computation
at its site from that step on, including the rank's replays of other ranks' work: a
broken GPU. Faults
are part of the product so users can prove, on their own cluster, that a corrupted GPU is
caught. Give them to :class:`~sdc_agent.GuardConfig` as ``faults=`` or in the environment
variable ``HYPERPOD_SDC_FAULTS``::

    HYPERPOD_SDC_FAULTS="rank=5,step=100,site=forward,kind=relative,persistent=true"

Several faults are separated by ``;``.

Sites:

``grad_local``
    a local gradient, before the all-reduce (the backward pass computed it wrong);
``grad_reduced``
    the reduced gradient on that rank, after the all-reduce (the collective delivered it
    wrong);
``weights``
    a parameter, right after the optimizer step (the update was computed wrong);
``forward``
    a module's forward output (a wrong activation; autograd passes gradients through
    unchanged, as faulty hardware would).

Kinds: ``nan``, ``inf``, ``bitflip`` (flip bit ``bit`` of the element's bit pattern),
``relative`` (multiply by ``1 + relative_error``: 4.0001 instead of 4.0000 at the
default; an element the error cannot change in its dtype, such as zero or a value that
rounds back, moves by one unit in the last place instead, so the fault always bites) and
``ulp`` (move the element ``ulps`` units in the last place of its own dtype away from
zero: 8 bf16 ulp is ``kind=ulp,ulps=8``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
from torch import nn

from ._validate import require_bool, require_choice, require_int
from .errors import ConfigError
from .fingerprint import INT_OF_WIDTH

__all__ = ["FAULT_KINDS", "FAULT_SITES", "FaultInjector", "FaultSpec", "corrupt_", "parse_faults"]

Site = Literal["grad_local", "grad_reduced", "weights", "forward"]
Kind = Literal["nan", "inf", "bitflip", "relative", "ulp"]
FAULT_SITES: tuple[str, ...] = ("grad_local", "grad_reduced", "weights", "forward")
FAULT_KINDS: tuple[str, ...] = ("nan", "inf", "bitflip", "relative", "ulp")


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultSpec:
    """One injected fault. ``rank`` is a global rank; steps count from 1."""

    rank: int
    step: int
    site: Site
    kind: Kind
    persistent: bool = False
    """Corrupt every computation at the site from ``step`` on (a broken GPU), not only the
    first one at ``step`` (a glitch)."""
    index: int | None = 0
    """Flat element index in the tensor hit; ``None`` hits every element."""
    target: str | None = None
    """Parameter name (``grad_*``, ``weights``) or module name (``forward``) as given by
    ``named_parameters()`` / ``named_modules()`` of the unwrapped model; for ``weights``,
    ``name:state`` hits that parameter's optimizer state ``state`` (``0.weight:exp_avg``).
    Default: the first gradient bucket for ``grad_*`` (FSDP2: the first parameter's
    gradient for ``grad_local``, the first group's reduced shard for ``grad_reduced``),
    the first parameter for ``weights``, the first leaf module for ``forward``. On a
    sharded parameter, ``weights`` and ``index`` address this rank's shard."""
    bit: int = 30
    """Bit to flip for ``bitflip``, 0 = least significant; bit 30 of a float32 is the top
    exponent bit."""
    relative_error: float = 2.5e-5
    """Relative error for ``relative``."""
    ulps: int = 1
    """Units in the last place for ``ulp`` (in the dtype of the tensor hit)."""

    def __post_init__(self) -> None:
        require_choice("faults.site", self.site, FAULT_SITES)
        require_choice("faults.kind", self.kind, FAULT_KINDS)
        require_int("faults.rank", self.rank, minimum=0)
        require_int("faults.step", self.step, minimum=1)
        if self.index is not None:
            require_int("faults.index", self.index, minimum=0)
        require_int("faults.bit", self.bit, minimum=0, maximum=63)
        require_int("faults.ulps", self.ulps, minimum=1, maximum=1 << 20)
        require_bool("faults.persistent", self.persistent)
        if (
            not isinstance(self.relative_error, float | int)
            or isinstance(self.relative_error, bool)
            or self.relative_error == 0
        ):
            raise ConfigError(
                f"faults.relative_error: must be a non-zero number, got {self.relative_error!r}"
            )

    def active(self, step: int) -> bool:
        return step == self.step or (self.persistent and step >= self.step)


_FIELD_NAMES = tuple(f.name for f in fields(FaultSpec))


def _parse_value(name: str, raw: str) -> Any:
    if name in ("rank", "step", "bit", "ulps"):
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"faults.{name}: expected an integer, got {raw!r}") from None
    if name == "index":
        if raw.lower() in ("all", "none"):
            return None
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"faults.index: expected an integer or 'all', got {raw!r}") from None
    if name == "relative_error":
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"faults.relative_error: expected a number, got {raw!r}") from None
    if name == "persistent":
        if raw.lower() in ("1", "true", "yes"):
            return True
        if raw.lower() in ("0", "false", "no"):
            return False
        raise ConfigError(f"faults.persistent: expected true or false, got {raw!r}")
    return raw


def parse_faults(text: str) -> tuple[FaultSpec, ...]:
    """Parse ``key=value,...`` fault specs separated by ``;`` (the environment form)."""
    specs = []
    for chunk in text.split(";"):
        if not chunk.strip():
            continue
        kwargs: dict[str, Any] = {}
        for item in chunk.split(","):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or not key:
                raise ConfigError(f"faults: expected key=value, got {item.strip()!r} in {chunk!r}")
            if key not in _FIELD_NAMES:
                raise ConfigError(
                    f"faults: unknown field {key!r} in {chunk!r}; known: {', '.join(_FIELD_NAMES)}"
                )
            kwargs[key] = _parse_value(key, raw.strip())
        missing = [k for k in ("rank", "step", "site", "kind") if k not in kwargs]
        if missing:
            raise ConfigError(f"faults: {chunk!r} lacks {', '.join(missing)}")
        specs.append(FaultSpec(**kwargs))
    return tuple(specs)


def corrupt_(tensor: torch.Tensor, spec: FaultSpec) -> None:
    """Apply ``spec``'s kind to ``tensor`` in place (a contiguous floating tensor)."""
    if tensor.numel() == 0:
        return
    flat = tensor.view(-1)
    if spec.index is not None and spec.index >= flat.numel():
        raise ConfigError(
            f"faults.index: {spec.index} is out of range for a tensor of {flat.numel()} elements"
        )
    sel: slice | int = slice(None) if spec.index is None else spec.index
    with torch.no_grad():
        if spec.kind == "nan":
            flat[sel] = float("nan")
        elif spec.kind == "inf":
            flat[sel] = float("inf")
        elif spec.kind == "bitflip":
            width = flat.element_size() * 8
            if spec.bit >= width:
                raise ConfigError(
                    f"faults.bit: {spec.bit} does not exist in a {width}-bit {flat.dtype} element"
                )
            mask = 1 << spec.bit
            if mask >= 1 << (width - 1):
                mask -= 1 << width
            bits = flat.view(INT_OF_WIDTH[flat.element_size()])
            bits[sel] ^= mask
        elif spec.kind == "ulp":
            # Sign-magnitude: adding to the bits moves a value away from zero either sign.
            bits = flat.view(INT_OF_WIDTH[flat.element_size()])
            bits[sel] += spec.ulps
        else:
            old = flat[sel].clone()
            new = (old.float() * (1.0 + spec.relative_error)).to(flat.dtype)
            flat[sel] = new
            # The error must bite: nudge elements it left unchanged by one ulp.
            bits = flat.view(INT_OF_WIDTH[flat.element_size()])
            unchanged = flat[sel] == old
            bits[sel] += unchanged.to(bits.dtype)


class _CorruptForward(torch.autograd.Function):
    """Corrupts a forward output; gradients pass through unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, spec: FaultSpec) -> torch.Tensor:
        y = x.detach().clone()
        corrupt_(y, spec)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class FaultInjector:
    """Holds the faults aimed at this rank and applies them at their sites and steps."""

    def __init__(self, specs: Iterable[FaultSpec], rank: int) -> None:
        self.specs = tuple(s for s in specs if s.rank == rank)
        self.step = 0
        self._fired: set[FaultSpec] = set()
        self._handles: list[Any] = []

    def __bool__(self) -> bool:
        return bool(self.specs)

    def pending(self, site: str) -> list[FaultSpec]:
        """Faults at ``site`` that would hit a computation happening now."""
        return [
            s
            for s in self.specs
            if s.site == site and s.active(self.step) and (s.persistent or s not in self._fired)
        ]

    def fire(self, spec: FaultSpec) -> bool:
        """Claim ``spec`` for the computation happening now; false if it must not hit it.

        A transient fault fires once, at its step.
        """
        if not spec.active(self.step):
            return False
        if not spec.persistent:
            if spec in self._fired:
                return False
            self._fired.add(spec)
        return True

    def attach(self, module: nn.Module) -> None:
        """Check targets against ``module`` and hook the ``forward`` faults into it."""
        params = dict(module.named_parameters())
        modules = dict(module.named_modules())
        for spec in self.specs:
            # weights: "name:state" hits the optimizer state ``state`` of that parameter.
            name = (
                spec.target.partition(":")[0]
                if spec.site == "weights" and spec.target
                else spec.target
            )
            if spec.site != "forward" and name is not None and name not in params:
                raise ConfigError(f"faults.target: no parameter named {name!r}")
            if spec.site != "forward":
                continue
            name = spec.target if spec.target is not None else _first_leaf(module)
            if name not in modules:
                raise ConfigError(f"faults.target: no module named {name!r}")
            self._handles.append(modules[name].register_forward_hook(self._forward_hook(spec)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _forward_hook(self, spec: FaultSpec) -> Callable[..., Any]:
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> Any:
            if not self.fire(spec):
                return None
            if isinstance(output, torch.Tensor):
                return _CorruptForward.apply(output, spec)
            if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
                first = _CorruptForward.apply(output[0], spec)
                return type(output)([first, *output[1:]])
            return None

        return hook


def _first_leaf(module: nn.Module) -> str:
    for name, sub in module.named_modules():
        if name and not any(True for _ in sub.children()):
            return name
    return ""
