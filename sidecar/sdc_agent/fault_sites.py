"""Where a drill's faults enter a guarded step that are not forward faults: the gradients
before and after their collective (``grad_local``, ``grad_reduced``) and the weights after
the optimizer step (``weights``). The faults themselves, and the forward ones, are
:mod:`sdc_agent.faults`; the layout calls these sites where its gradients are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .errors import ConfigError
from .faults import FaultInjector, FaultSpec, corrupt_

__all__ = ["FaultSites"]


class FaultSites:
    """The gradient and weight fault sites of one model (see the module docstring)."""

    def __init__(self, injector: FaultInjector, module: nn.Module) -> None:
        self.injector = injector
        self.module = module
        self.optimizer: torch.optim.Optimizer | None = None
        """Where ``weights`` faults aimed at ``name:state`` (optimizer state) go."""
        params = dict(module.named_parameters())
        self._grad_targets: dict[FaultSpec, nn.Parameter] = {
            spec: params[spec.target]
            for spec in injector.specs
            if spec.site in ("grad_local", "grad_reduced") and spec.target is not None
        }

    def __bool__(self) -> bool:
        return bool(self.injector)

    def gradients(
        self,
        site: str,
        *,
        index: int,
        buffer: torch.Tensor,
        parameters: Sequence[torch.Tensor],
        gradients: Sequence[torch.Tensor],
        tensor: torch.Tensor,
    ) -> None:
        """Fire the pending faults of ``site`` into ``tensor``: the bucket ``index`` whose
        ``buffer`` holds the ``gradients`` of ``parameters`` (views of it) before the
        collective; ``tensor`` is that buffer, or the collective's result after it."""
        for spec in self.injector.pending(site):
            param = self._grad_targets.get(spec)
            if param is None:
                if index == 0 and self.injector.fire(spec):
                    corrupt_(tensor, spec)
                continue
            for p, grad in zip(parameters, gradients, strict=True):
                if p is param and self.injector.fire(spec):
                    # The gradients are views of the bucket buffer before the collective;
                    # afterwards, hit the same span of the reduced tensor.
                    start = grad.data_ptr() - buffer.data_ptr()
                    offset = start // tensor.element_size()
                    corrupt_(tensor.view(-1)[offset : offset + grad.numel()], spec)

    def weights(self, applied: torch.Tensor | bool) -> None:
        """After an applied optimizer step: fire the pending ``weights`` faults."""
        if not self.injector or not bool(applied):
            return
        for spec in self.injector.pending("weights"):
            if self.injector.fire(spec):
                corrupt_(self._weight_target(spec), spec)

    def _weight_target(self, spec: FaultSpec) -> torch.Tensor:
        params = dict(self.module.named_parameters())
        name = spec.target if spec.target is not None else next(iter(params))
        name, _, key = name.partition(":")
        tensor = params[name].data
        if key:
            state = {} if self.optimizer is None else self.optimizer.state.get(params[name], {})
            if not isinstance(state.get(key), torch.Tensor):
                raise ConfigError(
                    f"faults.target: parameter {name!r} has no optimizer state {key!r} "
                    f"(it has: {', '.join(sorted(map(str, state))) or 'none yet'})"
                )
            tensor = state[key]
        # A sharded parameter (FSDP2's DTensor): this rank's shard.
        to_local = getattr(tensor, "to_local", None)
        return to_local() if callable(to_local) else tensor
